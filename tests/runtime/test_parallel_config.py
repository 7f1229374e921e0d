"""[trainer.parallel]: checked at config time against num_trainer_ranks, the model and the loss;
--dry-run prints the trainer mesh's named view sizes."""

import subprocess
import sys
from pathlib import Path

import pytest

from primerl.runtime.config import ConfigError, parallel_dims
from primerl.runtime.validate import load_config

ROOT = Path(__file__).resolve().parents[2]


def _cfg(*over):
    return load_config(ROOT / "examples" / "reverse_text_4rank.toml", list(over))


def test_the_4rank_example_resolves_to_its_mesh():
    dims = parallel_dims(_cfg())
    assert dims.view_sizes() == {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "dp_shard_cp": 4, "ep": 2, "efsdp": 2,
                                 "batch": 2, "loss": 4}
    assert parallel_dims(_cfg("--num_trainer_ranks", "8")).dp_shard == 4  # -1 takes the rest


@pytest.mark.parametrize("recipe", ["blockwise", "blockwise_fp8_wgrad", "rowwise", "off"])
def test_fp8_recipes_are_accepted(recipe):
    assert _cfg("--trainer.parallel.fp8", recipe).trainer.parallel.fp8 == recipe


def test_fp8_error_lists_the_rowwise_recipe():
    with pytest.raises(ConfigError, match="rowwise"):
        _cfg("--trainer.parallel.fp8", "tensorwise")


@pytest.mark.parametrize("over,key,words", [
    (["--trainer.parallel.cp", "3"], "trainer.parallel", "num_trainer_ranks = 4"),
    (["--trainer.parallel.ep", "8", "--num_trainer_ranks", "8"], "trainer.parallel.ep", "num_experts = 4"),
    (["--model.moe_dim", "64"], "trainer.parallel.fp8", "'moe_dim': 64"),
    (["--trainer.parallel.fp8", "fp4"], "trainer.parallel.fp8", "'fp4'"),
    (["--trainer.parallel.activation_checkpointing", "some"], "trainer.parallel.activation_checkpointing", "'some'"),
    (["--trainer.parallel.cp_layout", "striped"], "trainer.parallel.cp_layout", "'striped'"),
    (["--trainer.attention", "padded"], "trainer.attention", "cp = 2"),
    (["--trainer.loss.aggregation", "seq_mean_token_mean"], "trainer.parallel.cp", "seq_mean_token_mean"),
    (["--trainer.fsdp", "false"], "trainer.fsdp", "cp"),
])
def test_bad_layouts_fail_naming_the_key(over, key, words):
    with pytest.raises(ConfigError) as e:
        _cfg(*over)
    assert str(e.value).startswith(key) and words in str(e.value), str(e.value)


def test_dry_run_prints_the_mesh():
    out = subprocess.run([sys.executable, "-m", "primerl.runtime.cli", "rl", "--config",
                          "examples/reverse_text_4rank.toml", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "# trainer mesh over 4 rank(s): dp_replicate=1 dp_shard=2 cp=2 dp_shard_cp=4 ep=2 efsdp=2 batch=2" \
        in out.stdout
    assert "seq_len / cp = 1024 tokens" in out.stdout
    assert "[trainer.parallel]" in out.stdout and 'fp8 = "blockwise"' in out.stdout
