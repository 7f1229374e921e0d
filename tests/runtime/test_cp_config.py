"""trainer.parallel cp_kind / cp_ulysses / activation_offload / cpu_offload: impossible splits are
ConfigErrors naming the key (and ``--dry-run`` fails on them with that line); KV heads fewer than the
Ulysses degree are replicated, not an error; ``--dry-run`` prints the kind and the degrees."""

import subprocess
import sys
from pathlib import Path

import pytest

from primerl.runtime.config import ConfigError, cp_degrees, describe_parallel, parallel_dims
from primerl.runtime.validate import load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "reverse_text_4rank.toml"  # 4 ranks, 8 query / 4 KV heads


def _cfg(*over):
    return load_config(EXAMPLE, ["--trainer.parallel.ep", "1", *over])


@pytest.mark.parametrize("over,degrees", [
    (["--trainer.parallel.cp_kind", "ulysses"], (2, 1)),
    (["--trainer.parallel.cp_kind", "ulysses", "--trainer.parallel.cp", "4"], (4, 1)),
    (["--trainer.parallel.cp_kind", "ulysses_ring", "--trainer.parallel.cp", "4", "--trainer.parallel.cp_ulysses", "2"],
     (2, 2)),
    (["--trainer.parallel.cp", "4"], (1, 4)),
    # 1 KV head < Ulysses degree 4: replicated
    (["--trainer.parallel.cp_kind", "ulysses", "--trainer.parallel.cp", "4", "--model.n_kv_heads", "1"], (4, 1)),
])
def test_good_splits_resolve(over, degrees):
    cfg = _cfg(*over)
    assert cp_degrees(cfg.trainer.parallel, parallel_dims(cfg).cp) == degrees


@pytest.mark.parametrize("over,key,words", [
    (["--trainer.parallel.cp_kind", "ulysses", "--trainer.parallel.cp", "4", "--model.n_heads", "6",
      "--model.n_kv_heads", "2"], "trainer.parallel.cp", "6 attention heads"),
    (["--trainer.parallel.cp_kind", "ulysses_ring", "--trainer.parallel.cp", "4", "--trainer.parallel.cp_ulysses", "2",
      "--model.n_heads", "3", "--model.n_kv_heads", "1"], "trainer.parallel.cp_ulysses", "3 attention heads"),
    (["--trainer.parallel.cp_kind", "ulysses", "--trainer.parallel.cp", "4", "--model.n_heads", "12",
      "--model.n_kv_heads", "3"], "trainer.parallel.cp", "3 KV heads"),
    (["--trainer.parallel.cp_kind", "ulysses_ring", "--trainer.parallel.cp", "4", "--trainer.parallel.cp_ulysses", "3"],
     "trainer.parallel.cp_ulysses", "must divide"),
    (["--trainer.parallel.cp_kind", "ulysses_ring", "--trainer.parallel.cp", "4"], "trainer.parallel.cp_ulysses",
     "must be set"),
    (["--trainer.parallel.cp_kind", "ulysses_ring", "--trainer.parallel.cp_ulysses", "2"],
     "trainer.parallel.cp_ulysses", "ring degree"),
    (["--trainer.parallel.cp_kind", "ulysses", "--trainer.parallel.cp", "4", "--trainer.parallel.cp_ulysses", "2"],
     "trainer.parallel.cp_ulysses", "ulysses_ring"),
    (["--trainer.parallel.cp_ulysses", "2"], "trainer.parallel.cp_ulysses", "cp_kind = 'ring'"),
    (["--trainer.parallel.cp_kind", "tree"], "trainer.parallel.cp_kind", "'tree'"),
    (["--trainer.parallel.activation_offload", "true"], "trainer.parallel.activation_offload",
     "activation_checkpointing"),
])
def test_bad_splits_fail_naming_the_key(over, key, words):
    with pytest.raises(ConfigError) as e:
        _cfg(*over)
    assert str(e.value).startswith(key) and words in str(e.value), str(e.value)


def test_describe_prints_kind_and_degrees():
    text = describe_parallel(_cfg("--trainer.parallel.cp_kind", "ulysses_ring", "--trainer.parallel.cp", "4",
                                  "--trainer.parallel.cp_ulysses", "2", "--trainer.parallel.activation_checkpointing",
                                  "full", "--trainer.parallel.activation_offload", "true"))
    assert "cp_kind = ulysses_ring, ulysses = 2 x ring = 2, layout = zigzag" in text
    assert "activation_offload = true" in text


def test_dry_run_fails_on_a_bad_split_with_one_line():
    r = subprocess.run([sys.executable, "-m", "primerl.runtime.cli", "rl", "--config", str(EXAMPLE), "--dry-run",
                        "--trainer.parallel.ep", "1", "--trainer.parallel.cp", "4", "--trainer.parallel.cp_kind",
                        "ulysses", "--model.n_heads", "6", "--model.n_kv_heads", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "trainer.parallel.cp" in r.stderr and "6 attention heads" in r.stderr


def test_long_context_example_resolves_to_ulysses_cp4_on_16k_samples():
    from primerl.rl.envs.reverse_text import PAD, ReverseText

    cfg = load_config(ROOT / "examples" / "long_context_4rank.toml")
    assert cp_degrees(cfg.trainer.parallel, parallel_dims(cfg).cp) == (4, 1)
    assert "cp_kind = ulysses, ulysses = 4 x ring = 1" in describe_parallel(cfg)
    env = ReverseText(**cfg.env.args)
    p = env.prompt(0)
    assert len(p.tokens) + p.max_new_tokens == cfg.orchestrator.seq_len == 16384
    assert set(p.tokens[:cfg.env.args["prefix_padding"]]) == {PAD}
    with pytest.raises(ValueError, match="prefix_padding"):
        ReverseText(prefix_padding=-1)


def test_cpu_offload_on_one_rank_without_fsdp_is_refused():
    """One CPU rank in float32 runs without FSDP2, so there is no CPUOffloadPolicy to apply: an error
    naming the key, not a run that silently keeps everything where it was."""
    from primerl.runtime.trainer import Trainer

    cfg = load_config(None, ["--model.n_layers", "1", "--model.dim", "32", "--model.moe_dim", "16",
                             "--trainer.parallel.cpu_offload", "true"])
    with pytest.raises(ValueError, match="trainer.parallel.cpu_offload"):
        Trainer(cfg, 12)
