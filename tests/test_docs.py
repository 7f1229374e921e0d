"""What README.md and docs/*.md show must work (conventions: docs/testing.md, "The docs' examples").

- Every ```python block runs, each in a fresh interpreter with the repository root as its working
  directory and a user's environment (no TRITON_INTERPRET / PRIMERL_DEBUG_CHECKS from this harness);
  a ``/tmp/`` path in the block is replaced by this test's temporary folder.
- Every ``primerl ...`` command of a ```bash block exits 0 with ``--dry-run`` (and a temporary
  ``--output_dir`` plus ``--overwrite true`` where the command names none). A command run as
  ``.venv-vf/bin/primerl`` runs in the verifiers interpreter (``PRIMERL_VF_PYTHON``, else
  ``<repo>/.venv-vf/bin/python``; skipped without one, failing with ``PRIMERL_REQUIRE_VERIFIERS=1``).
  Other commands (set-up, ``python -m bench``, ``pytest``) are not run.
- The line before a block's opening fence may mark it: ``<!-- docs-test: gpu -->`` (needs CUDA; the
  ``gpu`` marker skips it without one) or ``<!-- docs-test: not-run: REASON -->`` (never run).
- Every relative link between the pages resolves; README.md stays under 200 lines.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from venv_ready import venv_python

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->$")
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int        # 1-based line of the opening fence
    lang: str
    text: str
    mark: str | None  # "gpu", "not-run: REASON" or None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def parse_blocks(page: Path) -> list[Block]:
    """Fenced blocks of one page, each with the docs-test mark on the line before its fence."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        if i == len(lines):
            raise AssertionError(f"{page.relative_to(REPO)}:{start + 1}: fence never closed")
        prev = lines[start - 1].strip() if start else ""
        mark = _MARK.match(prev)
        blocks.append(Block(page, start + 1, m.group(1), "\n".join(lines[start + 1:i]) + "\n",
                            mark.group(1) if mark else None))
        i += 1
    return blocks


def check_mark(block: Block) -> None:
    if block.mark is None or block.mark == "gpu":
        return
    if block.mark.startswith("not-run:") and block.mark[len("not-run:"):].strip():
        return
    raise AssertionError(f"{block.where}: unknown docs-test mark {block.mark!r}; "
                         "use 'gpu' or 'not-run: REASON' (a reason is required)")


def shell_commands(text: str) -> list[list[str]]:
    """The simple commands of a bash block: continuation lines joined, comments dropped, split at
    ``&&``, ``||``, ``;`` and ``|``."""
    cmds = []
    for line in text.replace("\\\n", " ").splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        cur: list[str] = []
        for tok in lex:
            if tok in ("&&", "||", ";", "|", "&"):
                if cur:
                    cmds.append(cur)
                cur = []
            else:
                cur.append(tok)
        if cur:
            cmds.append(cur)
    return cmds


def is_primerl(argv: list[str]) -> bool:
    return argv[0] == "primerl" or argv[0].endswith("/primerl")


ALL_BLOCKS = [b for page in PAGES for b in parse_blocks(page)]


def _cases(kind: str):
    out = []
    for b in ALL_BLOCKS:
        marks = [pytest.mark.gpu] if b.mark == "gpu" else []
        if b.mark and b.mark.startswith("not-run:"):
            marks = [pytest.mark.skip(reason=f"{b.where}: not run: {b.mark[len('not-run:'):].strip()}")]
        if kind == "python" and b.lang == "python":
            out.append(pytest.param(b, id=b.where, marks=marks))
        if kind == "primerl" and b.lang == "bash":
            for n, argv in enumerate(c for c in shell_commands(b.text) if is_primerl(c)):
                # run in the verifiers venv: scheduled and waited for as tests/conftest.py says
                vf = [pytest.mark.verifiers] if argv[0] == ".venv-vf/bin/primerl" else []
                out.append(pytest.param(b, argv, id=f"{b.where}#{n}", marks=marks + vf))
    return out


def _user_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PRIMERL_DEBUG_CHECKS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def test_pages_parse_and_marks_are_known():
    assert len(PAGES) > 10, PAGES
    for b in ALL_BLOCKS:
        check_mark(b)
    langs = {b.lang for b in ALL_BLOCKS}
    assert {"python", "bash"} <= langs, langs
    assert all(b.lang for b in ALL_BLOCKS), [b.where for b in ALL_BLOCKS if not b.lang]


def test_shell_commands_are_split_as_bash_would():
    text = ("python3 -m venv .venv && . .venv/bin/activate && pip install -e . \\\n  && primerl rl --config a.toml\n"
            "primerl rl --x '{eps_low = 0.1}'   # a comment; not a command\n")
    assert shell_commands(text) == [["python3", "-m", "venv", ".venv"], [".", ".venv/bin/activate"],
                                    ["pip", "install", "-e", "."], ["primerl", "rl", "--config", "a.toml"],
                                    ["primerl", "rl", "--x", "{eps_low = 0.1}"]]


def test_readme_is_an_entry():
    n = len((REPO / "README.md").read_text().splitlines())
    assert n < 200, f"README.md has {n} lines; move the depth to docs/<topic>.md"


def test_links_between_pages_resolve():
    broken = []
    for page in PAGES:
        for target in _LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (page.parent / target).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken


@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", _cases("python"))
def test_python_block_runs(block: Block, tmp_path: Path):
    code = block.text.replace("/tmp/", f"{tmp_path}/")
    script = tmp_path / "block.py"
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], cwd=REPO, env=_user_env(), capture_output=True, text=True,
                       timeout=540)
    assert r.returncode == 0, f"{block.where} failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


def _vf_python() -> str | None:
    cand = venv_python("vf")  # in CI: once .ci/run has installed it (tests/venv_ready.py)
    return cand if Path(cand).exists() else None


def _dry_run_args(args: list[str], out: Path) -> list[str]:
    args = list(args)
    if "--dry-run" not in args:
        args.append("--dry-run")
    if "--output_dir" not in args:
        args += ["--output_dir", str(out)]
        if "--overwrite" not in args:
            args += ["--overwrite", "true"]
    return args


@pytest.mark.fixed_ports  # the examples' ports (P/D 8100/8090, zmq 29620, ...): the dry run checks they are free
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("block", "argv"), _cases("primerl"))
def test_primerl_command_passes_dry_run(block: Block, argv: list[str], tmp_path: Path, capsys):
    args = _dry_run_args(argv[1:], tmp_path / "out")
    if argv[0] == "primerl":
        from primerl.runtime.cli import main

        rc = main(args)
        captured = capsys.readouterr()
        if rc == 2 and "inference.vllm.python:" in captured.err and os.environ.get("PRIMERL_REQUIRE_VLLM") != "1":
            pytest.skip(f"{block.where}: the vLLM venv the block names is not here ({captured.err.strip()})")
        assert rc == 0, f"{block.where}: {shlex.join(argv)} --dry-run exited {rc}:\n{captured.err[-3000:]}"
        return
    if argv[0] != ".venv-vf/bin/primerl":
        raise AssertionError(f"{block.where}: {argv[0]}: a primerl command runs as `primerl` (the main venv) or "
                             "`.venv-vf/bin/primerl` (the verifiers venv)")
    py = _vf_python()
    if py is None:
        msg = "no verifiers interpreter: set PRIMERL_VF_PYTHON or create .venv-vf as .ci/run does"
        if os.environ.get("PRIMERL_REQUIRE_VERIFIERS") == "1":
            pytest.fail("PRIMERL_REQUIRE_VERIFIERS=1 but " + msg)
        pytest.skip(msg)
    r = subprocess.run([py, "-m", "primerl.runtime.cli", *args], cwd=REPO, env=_user_env(), capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, f"{block.where}: {shlex.join(argv)} --dry-run exited {r.returncode}:\n{r.stderr[-3000:]}"
