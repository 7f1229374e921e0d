"""``primerl plan`` plans for hardware it is not running on: every example (GPU configs included)
on a machine with no GPU and without verifiers, the vocabulary of a verifiers config taken from its
tokenizer; where neither the environment nor a tokenizer gives it, one line asks for
``model.vocab_size``. ``--dry-run`` still checks this machine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from primerl.runtime.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))


@pytest.fixture
def bare_machine(monkeypatch):
    """No GPU, no verifiers (whatever this machine has)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for m in ("verifiers", "verifiers.v1", "renderers"):
        monkeypatch.setitem(sys.modules, m, None)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_plan_prints_a_plan_for_every_example_on_a_bare_cpu_machine(path, bare_machine, capsys):
    rc = main(["plan", "--config", str(path)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "# memory plan:" in cap.out and "# verdict:" in cap.out, cap.out


def test_a_verifiers_plan_takes_the_vocabulary_from_its_tokenizer(bare_machine, capsys):
    from primerl.rl.envs.vf_tokenizer import QWEN3_TINY_VOCAB

    cfg = str(ROOT / "examples" / "vf_reverse_text.toml")
    assert main(["plan", "--config", cfg]) == 0
    with_tokenizer = capsys.readouterr().out
    assert main(["plan", "--config", cfg, "--model.vocab_size", str(QWEN3_TINY_VOCAB)]) == 0
    assert capsys.readouterr().out == with_tokenizer  # the same model as with the vocabulary given


def test_a_plan_without_any_vocabulary_asks_for_it_in_one_line(bare_machine, capsys):
    cfg = str(ROOT / "examples" / "vf_reverse_text.toml")
    assert main(["plan", "--config", cfg, "--env.args.tokenizer", "/nonexistent/tokenizer"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.vocab_size" in err[0] and "--model.vocab_size" in err[0], err


def test_the_dry_run_still_checks_this_machine(bare_machine, capsys, tmp_path):
    rc = main(["rl", "--config", str(ROOT / "examples" / "reverse_text_gpu.toml"), "--dry-run",
               "--output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "device" in err[0], err
