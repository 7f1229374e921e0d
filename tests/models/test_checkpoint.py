"""Hugging Face checkpoint I/O: bitwise round trips (unfused, fused, sharded), loading back into
transformers, tied embeddings, streaming memory, and clear errors for bad checkpoints."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from primerl.models import CheckpointError, MoETransformer, MoETransformerConfig, UnsupportedCheckpointError

from models_testing import hf_packed_logits, hf_qwen3_moe, packed_batch


def _read_all(path) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def _assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) if a[k].numel() else True, k


def test_save_round_trips_bitwise(hf_checkpoint, tmp_path):
    family, _, path = hf_checkpoint
    model = MoETransformer.from_pretrained(path)
    model.save_pretrained(tmp_path / "out")
    _assert_same_tensors(_read_all(path), _read_all(tmp_path / "out"))
    assert MoETransformerConfig.from_hf(tmp_path / "out") == model.config


@pytest.mark.parametrize("expert_format", ["fused", "unfused"])
def test_fused_and_sharded_round_trip(hf_checkpoint, tmp_path, expert_format):
    family, _, path = hf_checkpoint
    model = MoETransformer.from_pretrained(path)
    out = tmp_path / "sharded"
    model.save_pretrained(out, expert_format=expert_format, max_shard_size=20_000)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(files) > 2 and os.path.isfile(out / "model.safetensors.index.json")
    keys = set(json.load(open(out / "model.safetensors.index.json"))["weight_map"])
    assert any(k.endswith("experts.gate_up_proj") for k in keys) == (expert_format == "fused")
    again = MoETransformer.from_pretrained(out)
    assert again._expert_format == expert_format
    ref = model.state_dict()
    for k, v in again.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_transformers_loads_our_save(hf_checkpoint, tmp_path):
    """A checkpoint we write is a valid Hugging Face checkpoint (fused layout too)."""
    from transformers import AutoModelForCausalLM

    family, hf_model, path = hf_checkpoint
    model = MoETransformer.from_pretrained(path)
    model.save_pretrained(tmp_path / "fused", expert_format="fused")
    hf_again = AutoModelForCausalLM.from_pretrained(tmp_path / "fused", attn_implementation="eager").eval()
    ref = hf_model.state_dict()
    got = hf_again.state_dict()
    assert sorted(got) == sorted(ref)
    for k, v in got.items():
        assert torch.equal(v, ref[k]), k


def test_tied_embeddings(tmp_path):
    hf_model = hf_qwen3_moe(tie_word_embeddings=True)
    hf_model.save_pretrained(tmp_path / "tied")
    model = MoETransformer.from_pretrained(tmp_path / "tied")
    assert model.lm_head.weight is model.embed.weight
    ids, pos, cu = packed_batch(model.config.vocab_size)
    with torch.no_grad():
        err = (model(ids, pos, cu, return_logits=True) - hf_packed_logits(hf_model, ids, cu)).abs().max().item()
    assert err < 1e-4
    model.save_pretrained(tmp_path / "again")
    _assert_same_tensors(_read_all(tmp_path / "tied"), _read_all(tmp_path / "again"))


def test_load_dtype_keeps_router_fp32(hf_checkpoint):
    _, _, path = hf_checkpoint
    model = MoETransformer.from_pretrained(path, dtype=torch.bfloat16)
    moe = model.moe_layers[0].ffn
    assert model.embed.weight.dtype == torch.bfloat16 and moe.experts.w13.dtype == torch.bfloat16
    assert moe.gate.weight.dtype == torch.float32
    ids, pos, cu = packed_batch(model.config.vocab_size)
    with torch.no_grad():
        assert model(ids, pos, cu, return_logits=True).dtype == torch.bfloat16


_ALLOC_SCRIPT = r"""
import sys, torch
from torch.profiler import ProfilerActivity, profile
from primerl.models import MoETransformer, MoETransformerConfig

def peak_alloc(fn):
    # Memory-mapped safetensors files show up as "[memory]" events of a whole file's size: private
    # read-only mappings backed by the page cache, not copies; they are left out.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events()
                    if e.self_cpu_memory_usage and e.name != "[memory]")
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak

path = sys.argv[1]
MoETransformer.from_pretrained(path)  # warm: first-call allocations of lazily built state

def two_copies():
    model = MoETransformer(MoETransformerConfig.from_hf(path))
    model.load_state_dict(MoETransformer.from_pretrained(path).state_dict())

print(peak_alloc(lambda: MoETransformer.from_pretrained(path)), peak_alloc(two_copies))
"""


def test_loading_allocates_the_weights_once(tmp_path):
    """Meta-device construction, one allocation of the parameters, then an in-place fill tensor by
    tensor: the peak is one copy of the weights, where building a model and load_state_dict of a
    loaded state dict needs two. Measured in a fresh process: libraries imported by other tests
    (transformers) change which allocations the profiler sees."""
    import subprocess
    import sys

    path = tmp_path / "ckpt"
    hf_qwen3_moe().save_pretrained(path)  # the loader is the same for both families
    weights = sum(t.numel() * t.element_size() for t in _read_all(path).values())
    out = subprocess.run([sys.executable, "-c", _ALLOC_SCRIPT, str(path)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    peak, two = map(int, out.stdout.split()[-2:])
    assert weights <= peak < 1.1 * weights, f"peak {peak} bytes for {weights} bytes of weights"
    assert two >= 1.9 * weights  # the measure does see a second copy


# --- errors ----------------------------------------------------------------------------------------
def _copy_checkpoint(src, dst, edit_tensors=None, edit_config=None):
    os.makedirs(dst, exist_ok=True)
    tensors = _read_all(src)
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(src, "config.json")))
    if edit_config:
        edit_config(cfg)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


def test_unknown_architecture(hf_checkpoint, tmp_path):
    _, _, path = hf_checkpoint
    bad = _copy_checkpoint(path, tmp_path / "llama", edit_config=lambda c: c.update(model_type="llama",
                                                                                     architectures=["LlamaForCausalLM"]))
    with pytest.raises(UnsupportedCheckpointError, match="unknown architecture.*llama"):
        MoETransformer.from_pretrained(bad)


def test_unsupported_rope(hf_checkpoint, tmp_path):
    _, _, path = hf_checkpoint
    bad = _copy_checkpoint(path, tmp_path / "yarn", edit_config=lambda c: c.update(
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}))
    with pytest.raises(UnsupportedCheckpointError, match="yarn"):
        MoETransformer.from_pretrained(bad)


def test_missing_tensor(hf_checkpoint, tmp_path):
    _, _, path = hf_checkpoint
    bad = _copy_checkpoint(path, tmp_path / "missing",
                           edit_tensors=lambda t: t.pop("model.layers.2.mlp.experts.1.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\).*layers\.2\.mlp\.experts\.1\.up_proj"):
        MoETransformer.from_pretrained(bad)


def test_unexpected_tensor(hf_checkpoint, tmp_path):
    _, _, path = hf_checkpoint
    bad = _copy_checkpoint(path, tmp_path / "extra",
                           edit_tensors=lambda t: t.update({"model.layers.0.mlp.bogus.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \(1\).*bogus"):
        MoETransformer.from_pretrained(bad)


def test_shape_mismatch(hf_checkpoint, tmp_path):
    _, _, path = hf_checkpoint
    bad = _copy_checkpoint(path, tmp_path / "shape", edit_config=lambda c: c.update(moe_intermediate_size=8))
    with pytest.raises(CheckpointError, match=r"shape mismatch for .*experts\.0\.(gate|up|down)_proj"):
        MoETransformer.from_pretrained(bad)


def test_mtp_layers_are_skipped(hf_checkpoint, tmp_path):
    """GLM-4.5 checkpoints carry a multi-token-prediction layer after the last decoder layer."""
    _, _, path = hf_checkpoint
    cfg = json.load(open(os.path.join(path, "config.json")))
    extra = f"model.layers.{cfg['num_hidden_layers']}.eh_proj.weight"
    ok = _copy_checkpoint(path, tmp_path / "mtp", edit_tensors=lambda t: t.update({extra: torch.zeros(3, 3)}))
    model = MoETransformer.from_pretrained(ok)
    assert model._skipped_checkpoint_tensors == [extra]


def test_missing_files(hf_checkpoint, tmp_path):
    _, _, path = hf_checkpoint
    empty = tmp_path / "empty"
    os.makedirs(empty)
    with pytest.raises(FileNotFoundError, match="config.json"):
        MoETransformer.from_pretrained(empty)
    json.dump(json.load(open(os.path.join(path, "config.json"))), open(empty / "config.json", "w"))
    with pytest.raises(CheckpointError, match="no safetensors"):
        MoETransformer.from_pretrained(empty)
    (empty / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="missing"):
        MoETransformer.from_pretrained(empty)
    with pytest.raises(FileNotFoundError):
        MoETransformer.from_pretrained(tmp_path / "nope")


def test_loads_hf_sharded_save(hf_checkpoint, tmp_path):
    family, hf_model, path = hf_checkpoint
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    sharded = MoETransformer.from_pretrained(tmp_path)
    ref = MoETransformer.from_pretrained(path).state_dict()
    for k, v in sharded.state_dict().items():
        assert torch.equal(v, ref[k]), k
