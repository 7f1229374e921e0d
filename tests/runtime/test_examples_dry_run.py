"""Every example config passes ``primerl rl --dry-run`` on this machine, or is refused in one line
naming the key for what this machine lacks (a GPU, verifiers) — never a traceback."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from primerl.runtime.cli import main
from primerl.runtime.config import load_config
from primerl.runtime.config.data import env_key, policy_env_index

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.toml"))


@pytest.mark.fixed_ports  # the examples' own ports (P/D 8100/8090, zmq 29620, ...): the dry run checks they are free
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_passes_the_dry_run(path, tmp_path, capsys):
    rc = main(["rl", "--config", str(path), "--dry-run", "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    gpu = "device = \"cuda\"" in path.read_text() and not torch.cuda.is_available()
    vf = 'id = "verifiers"' in path.read_text() and importlib.util.find_spec("verifiers") is None
    cfg = load_config(path, check=False)
    v = cfg.inference.vllm
    vllm = bool(v.launch and v.python) and not Path(v.python).is_file()  # relative to the cwd, like the job's
    # a distillation example's teacher is the main command's output_dir: refused until that has run
    teacher = re.search(r'^teacher = "(.+)"', path.read_text(), re.M)
    no_teacher = teacher is not None and not Path(teacher.group(1)).is_dir()
    if gpu or vf or vllm or no_teacher:
        assert rc == 2 and err.startswith("primerl: config error: ") and len(err.strip().splitlines()) == 1, err
        vf_key = f"{env_key(cfg, policy_env_index(cfg))}.id:"  # env.id, or env[i].id of a mix's verifiers entry
        key = ("device:" if gpu else vf_key if vf else "inference.vllm.python:" if vllm
               else "distill.teacher:")
        assert key in err, err
    else:
        assert rc == 0, err
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
