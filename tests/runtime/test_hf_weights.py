"""Weights published for vLLM use the Hugging Face layout: they round-trip into
MoETransformer.from_pretrained and transformers with equal tensors, FP8 transfer re-quantizes the
experts only, and the engine's HTTP server (the vLLM stand-in) loads them."""

import json

import pytest
import torch
from safetensors.torch import load_file

from primerl.kernels.fp8 import dequant
from primerl.models.config import MoETransformerConfig
from primerl.models.transformer import MoETransformer
from primerl.runtime.validate import load_config
from primerl.runtime.inference.engine import InferenceEngine, Request, SamplingParams
from primerl.runtime.inference.hf_weights import hf_weights, primerl_weights, publish_hf
from primerl.runtime.inference.server import EngineServer
from primerl.runtime.transport import FileTransport
from primerl.runtime.inference.vllm_client import VLLMClient
from primerl.runtime.inference.backend import get_backend
from primerl.runtime.trainer.publish import WeightStream

V = 13


def _model(seed, family="qwen3_moe"):
    torch.manual_seed(seed)
    m = MoETransformer(MoETransformerConfig.tiny(vocab_size=V, family=family))
    m.init_weights(seed=seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.add_(0.5 * torch.randn_like(p))  # norms and biases away from their init too
        for name, b in m.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return m


def _assert_state_equal(a: dict, b: dict):
    """Every checkpointed tensor equal (load counters such as tokens_per_expert are not weights)."""
    assert sorted(a) == sorted(b)
    for k in a:
        if k.endswith("tokens_per_expert"):
            continue
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_published_update_round_trips_into_from_pretrained(tmp_path, family):
    model = _model(1, family)
    d = publish_hf(FileTransport(tmp_path), 7, model)
    assert (d / "STABLE").read_text() == "7" and json.loads((d / "config.json").read_text())["model_type"] == family
    names = set(load_file(str(d / "model.safetensors")))
    assert "model.embed_tokens.weight" in names and any(".mlp.experts.0.gate_proj.weight" in n for n in names)
    assert not any(n.startswith("layers.") for n in names)  # no primerl names
    again = MoETransformer.from_pretrained(d)
    _assert_state_equal(again.state_dict(), model.state_dict())
    # and back through the inverse mapping used by the embedded server
    _assert_state_equal(primerl_weights(model, load_file(str(d / "model.safetensors"))), model.state_dict())


def test_transformers_loads_a_published_update(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _model(2)
    d = publish_hf(FileTransport(tmp_path), 1, model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager")
    got = hf.state_dict()
    want = hf_weights(model, expert_format="fused")  # transformers holds experts fused
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_fp8_transfer_quantizes_experts_only(tmp_path):
    model = _model(3)
    d = publish_hf(FileTransport(tmp_path), 2, model, fp8=True)
    t = load_file(str(d / "model.safetensors"))
    ref = hf_weights(model)
    experts = [k for k in ref if ".experts." in k]
    assert experts
    for k, v in ref.items():
        if k in experts:
            assert t[k].dtype == torch.float8_e4m3fn and t[k + "_scale_inv"].dtype == torch.float32, k
            back = dequant(t[k], t[k + "_scale_inv"], group_shape=(128, 128), out_dtype=torch.float32)
            assert (back - v).abs().max() <= 0.07 * v.abs().max(), k
        else:
            assert torch.equal(t[k], v) and k + "_scale_inv" not in t, k
    sd = primerl_weights(model, t)
    w13 = "layers.0.ffn.experts.w13"
    assert (sd[w13] - model.state_dict()[w13]).abs().max() <= 0.07 * model.state_dict()[w13].abs().max()
    assert torch.equal(sd["embed.weight"], model.state_dict()["embed.weight"])


def test_primerl_weights_rejects_a_foreign_layout():
    model = _model(0)
    t = hf_weights(model)
    t.pop("model.norm.weight")
    t["model.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\].*unexpected \['model.extra.weight'\]"):
        primerl_weights(model, t)


def _reqs(n):
    return [Request(i, [1, 3 + i % 5, 4, 2], SamplingParams(max_new_tokens=3, seed=11 + i)) for i in range(n)]


@pytest.mark.parametrize("backend", ["embedded", "vllm"])
def test_trainer_publisher_layout_and_server_update(tmp_path, backend):
    """The trainer's publisher writes primerl names for the embedded engine and the HF layout for
    vLLM; the vLLM-protocol server loads the HF layout and then samples like the new policy."""
    cfg = load_config(None, ["--inference.backend", backend])
    tr = FileTransport(tmp_path)
    new = _model(5)
    get_backend(cfg).weight_channel(cfg, model=new, transport=tr, rank=0).publish(4, WeightStream(new))
    names = set(load_file(str(tr.weights_dir(4) / "model.safetensors")))
    assert ("model.embed_tokens.weight" in names) == (backend == "vllm")
    assert (tr.weights_dir(4) / "config.json").exists() == (backend == "vllm")
    if backend == "embedded":
        return
    srv = EngineServer(InferenceEngine(_model(0), max_batch_size=8)).start()
    try:
        client = VLLMClient(cfg.inference.vllm.__class__(url=srv.url), timeout_s=30)
        client.update_weights(4, tr)
        assert srv.engine.policy_version == 4
        _assert_state_equal(srv.engine.model.state_dict(), new.state_dict())
        got = client.generate(_reqs(3))
        want = InferenceEngine(_model(5)).generate(_reqs(3))
        assert [c.tokens for c in got] == [c.tokens for c in want]
    finally:
        srv.stop()
