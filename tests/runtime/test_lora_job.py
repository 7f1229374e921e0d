"""``[trainer.lora]`` through the job: checks at --dry-run naming the key, adapter-only updates
(each version a PEFT directory the engine applies), AdamW over the adapters alone, checkpoints that
name the base and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from primerl.runtime.config import ConfigError
from primerl.runtime.launch.threads import run_threads
from primerl.runtime.validate import load_config

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--max_steps", "4", "--orchestrator.batch_size", "4", "--orchestrator.group_size", "4",
         "--orchestrator.max_async_level", "0", "--checkpoint.interval", "2", "--log.plot", "false",
         "--orchestrator.weights_timeout_s", "120", "--trainer.batch_timeout_s", "120", "--log.progress", "false"]
LORA = ["--trainer.lora.rank", "4", "--trainer.lora.alpha", "8", "--trainer.lora.targets", "attention,experts"]


def _cfg(out, *over):
    return load_config(ROOT / "examples" / "reverse_text.toml", ["--output_dir", str(out), *SMALL, *LORA, *over])


def test_config_targets_are_the_models():
    from primerl.models.lora import TARGETS
    from primerl.runtime.config.trainer import LORA_TARGETS

    assert tuple(LORA_TARGETS) == tuple(TARGETS)


@pytest.mark.parametrize("over, key", [
    (["--trainer.lora.rank", "-1"], "trainer.lora.rank: must be an integer >= 1"),
    (["--trainer.lora.alpha", "0"], "trainer.lora.alpha: must be > 0"),
    (["--trainer.lora.targets", "q_proj,qkv"], "trainer.lora.targets: unknown target 'qkv'"),
    (["--trainer.lora.targets", "kv_b_proj"], "trainer.lora.targets: target 'kv_b_proj' matches no module"),
    (["--trainer.lora.engine", "both"], "trainer.lora.engine: must be merge or forward"),
    (["--inference.weight_update", "broadcast"], "inference.weight_update: with trainer.lora the adapters go as files"),
    (["--inference.backend", "vllm"], "trainer.lora.targets: routed experts cannot be served by vLLM"),  # docs/lora.md
])
def test_bad_lora_config_is_refused_naming_the_key(tmp_path, over, key):
    with pytest.raises(ConfigError, match=key.replace("(", r"\(")):
        _cfg(tmp_path / "run", *over)


def test_dry_run_refuses_in_one_line(tmp_path, capsys):
    from primerl.runtime.cli import main  # the command's own entry point, in this process (no torch import)

    capsys.readouterr()
    rc = main(["rl", "--config", str(ROOT / "examples" / "reverse_text.toml"), "--output_dir", str(tmp_path / "o"),
               "--trainer.lora.rank", "4", "--trainer.lora.targets", "experts,mlp_in", "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "trainer.lora.targets: unknown target 'mlp_in'" in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_trainer_optimizes_the_adapters_alone(tmp_path):
    from primerl.runtime.trainer.trainer import Trainer

    trainer = Trainer(_cfg(tmp_path / "run"), 16)
    opt = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    adapters = {n: p for n, p in trainer.model.named_parameters() if ".lora_" in n}
    assert adapters and {id(p) for p in opt} == {id(p) for p in adapters.values()}
    assert all(p.requires_grad == (n in adapters) for n, p in trainer.model.named_parameters())
    assert trainer.lora_meta()["lora"]["base"] == "random init of [model] (seed 0)"


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["merge", "forward"])
def test_lora_job_moves_only_adapters_and_resumes(tmp_path, engine):
    from safetensors.torch import load_file

    from primerl.models import load_lora
    from primerl.runtime.policy import build_model

    from primerl.rl.envs import load_environment

    cfg = _cfg(tmp_path / "run", "--trainer.lora.engine", engine)
    vocab = load_environment(cfg.env.id, **cfg.env.args).vocab_size
    rows = run_threads(cfg)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    versions = sorted((tmp_path / "run" / "transport" / "weights").glob("step_*"))
    assert versions and all(not (d / "model.safetensors").exists() and (d / "adapter_model.safetensors").exists()
                            for d in versions)
    adapter_bytes = sum(t.numel() * t.element_size()
                        for t in load_file(versions[-1] / "adapter_model.safetensors").values())
    base = build_model(cfg, vocab)
    full_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    for r in rows:  # each update moved the adapters' bytes, a small part of the model
        assert r["weights/update_bytes"] == adapter_bytes < full_bytes / 4
        # the sampler ran the trainer's policy: the engine applied every version's adapters
        assert r["mismatch_kl/mean"] < 1e-5, r
    # the final adapters in PEFT's format name the base; they moved the policy
    lora_dir = tmp_path / "run" / "lora"
    assert json.loads((lora_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "random init of [model] (seed 0)"
    model = load_lora(build_model(cfg, vocab), lora_dir)
    ids = torch.arange(10) % vocab
    pos, cu = torch.arange(10), torch.tensor([0, 10], dtype=torch.int32)
    with torch.no_grad():
        assert (model(ids, pos, cu, return_logits=True) - base(ids, pos, cu, return_logits=True)).abs().max() > 1e-3
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_000004" / "meta.json").read_text())
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "targets": ["attention", "experts"],
                            "base": "random init of [model] (seed 0)"}
    # resume continues the adapters; another rank is refused
    resumed = run_threads(_cfg(tmp_path / "run", "--max_steps", "5", "--checkpoint.resume", "true",
                               "--trainer.lora.engine", engine))
    assert [r["step"] for r in resumed][-1] == 4
    other = _cfg(tmp_path / "run", "--max_steps", "6", "--checkpoint.resume", "true", "--trainer.lora.rank", "2")
    # refused by whichever side meets the rank-4 adapters first: the trainer's checkpoint check (naming
    # trainer.lora) or the orchestrator's engine loading the last version's adapters (naming the tensor)
    with pytest.raises(Exception, match=r"its trainer.lora is|has shape \(16, 128\), this model's adapter expects"):
        run_threads(other)


def test_full_weight_stream_of_a_lora_model_is_the_merged_policy():
    """A channel that sends full weights (files, broadcast, vLLM's) gets W + scale * B @ A under the
    base names and no adapter tensor; the model itself stays unmerged."""
    from primerl.models import MoETransformer, MoETransformerConfig, apply_lora, merge_lora
    from primerl.runtime.trainer.publish import iter_full_weights, weight_specs

    model = apply_lora(MoETransformer(MoETransformerConfig.tiny(vocab_size=40)), 2, 4.0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    specs = weight_specs(model)
    got = dict(iter_full_weights(model))
    assert [n for n, _, _ in specs] == list(got) and not any(".lora_" in n for n in got)
    assert all(not m.lora_merged for m in model.modules() if hasattr(m, "lora_merged"))
    merged = {k: v for k, v in merge_lora(model).state_dict().items() if ".lora_" not in k}
    assert list(merged) == list(got)
    for k, v in merged.items():
        assert torch.allclose(got[k], v, atol=1e-6), k
    from primerl.models import unmerge_lora

    base = unmerge_lora(model).layers[0].attention.q_proj.weight
    assert (got["layers.0.attention.q_proj.weight"] - base).abs().max() > 1e-3  # the adapters are in it


def test_plan_counts_the_adapters_alone_as_trained(tmp_path):
    from primerl.models import MoETransformer
    from primerl.models.lora import lora_parameters
    from primerl.runtime.memory_plan import plan_for_config
    from primerl.runtime.policy import build_model

    full = plan_for_config(load_config(ROOT / "examples" / "reverse_text.toml", ["--output_dir", str(tmp_path / "a")]),
                           device_memory=80 * 2**30)
    cfg = _cfg(tmp_path / "b")
    lora = plan_for_config(cfg, device_memory=80 * 2**30)
    model = build_model(cfg, 11)
    n_all = sum(p.numel() for p in model.parameters())
    from primerl.models import apply_lora

    n_lora = sum(p.numel() for p in lora_parameters(apply_lora(model, 4, 8.0, ["attention", "experts"])).values())
    assert isinstance(model, MoETransformer)
    pb = lora.trainer.layout.param_bytes
    assert lora.trainer.rows["gradients"] == n_lora * pb and lora.trainer.rows["optimizer"] == 2 * n_lora * pb
    assert full.trainer.rows["gradients"] == n_all * pb
    assert lora.trainer.rows["parameters"] == (n_all + n_lora) * pb


@pytest.mark.slow
def test_rl_warm_start_trains_the_base_the_lora_run_adapts(tmp_path):
    """``[warm_start] rl_steps``: the job first runs itself (full fine-tuning, env.args updated) and
    the LoRA run starts from the policy it wrote."""
    from primerl.models import MoETransformer

    cfg = _cfg(tmp_path / "run", "--max_steps", "2", "--warm_start.rl_steps", "2", "--warm_start.rl_env_args",
               '{"min_length": 3, "max_length": 5}')
    rows = run_threads(cfg)
    assert [r["step"] for r in rows] == [0, 1]
    sub = tmp_path / "run" / "warm_start_rl"
    sub_cfg = (sub / "config.toml").read_text()
    assert "max_length = 5" in sub_cfg and "rank = 0" in sub_cfg and "max_steps = 2" in sub_cfg
    base = MoETransformer.from_pretrained(sub / "hf")  # the warm start's final policy ...
    assert not any(".lora_" in n for n, _ in base.named_parameters())
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_000002" / "meta.json").read_text())
    assert meta["lora"]["base"] == str(sub / "hf")  # ... is the base the LoRA run adapted
    record = json.loads((tmp_path / "run" / "warm_start_rl.json").read_text())
    assert record["steps"] == 2
