"""vLLM backend without vLLM: the client against a local HTTP server speaking the same protocol
(``primerl inference``'s engine server, and a scripted fake for vLLM's other payload shapes),
routed-experts decoding, FP8 transfer layout, weight updates and the launcher's command line."""

import base64
import json
import shlex
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from primerl.kernels.fp8 import dequant
from primerl.models.config import MoETransformerConfig
from primerl.models.transformer import MoETransformer
from primerl.runtime.config import load_config
from primerl.runtime.engine import InferenceEngine, Request, SamplingParams
from primerl.runtime.server import EngineServer
from primerl.runtime.transport import FileTransport
from primerl.runtime.vllm import (InferenceServerError, VLLMClient, decode_routed_experts, quantize_for_transfer,
                                  vllm_env, vllm_serve_command)

from orchestrator_testing import run_orchestrator_with_stub_trainer

V = 11


def _model(seed):
    torch.manual_seed(seed)
    m = MoETransformer(MoETransformerConfig.tiny(vocab_size=V))
    m.init_weights(seed=seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim >= 2:
                p.mul_(8.0)
    return m


@pytest.fixture
def server():
    srv = EngineServer(InferenceEngine(_model(0), max_batch_size=8)).start()
    yield srv
    srv.stop()


def _client(url, **kw):
    cfg = load_config(None, ["--inference.vllm.url", url])
    return VLLMClient(cfg.inference.vllm, timeout_s=30, **kw)


def _reqs(n):
    return [Request(i, [1, 3 + i % 5, 4, 2], SamplingParams(max_new_tokens=2 + i % 3, seed=7 + i)) for i in range(n)]


def test_client_matches_the_embedded_engine(server):
    client = _client(server.url)
    assert client.health()
    got = client.generate(_reqs(6))
    want = InferenceEngine(_model(0), max_batch_size=8).generate(_reqs(6))
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-6
        assert torch.equal(g.routing, w.routing)


def test_filesystem_weight_update_changes_the_policy(server, tmp_path):
    client = _client(server.url)
    before = client.generate(_reqs(4))
    tr = FileTransport(tmp_path)
    tr.publish_weights(5, _model(1).state_dict())
    client.update_weights(5, tr)
    assert server.engine.policy_version == 5 and client.version == 5
    after = client.generate(_reqs(4))
    ref = InferenceEngine(_model(1)).generate(_reqs(4))
    assert [c.tokens for c in after] == [c.tokens for c in ref] and after[0].policy_version == 5
    assert [c.logprobs for c in after] != [c.logprobs for c in before]


def test_dead_server_and_timeouts_are_clear_errors(server):
    url = server.url
    server.stop()
    client = _client(url)
    client.timeout_s = 2
    assert not client.health()
    with pytest.raises(InferenceServerError, match=url):
        client.generate(_reqs(1))
    with pytest.raises(InferenceServerError, match="healthy"):
        client.wait_healthy(timeout=0.5)


def test_bad_request_is_reported(server):
    client = _client(server.url)
    with pytest.raises(InferenceServerError, match="HTTP 400"):
        client.complete(Request(0, [1, V + 5], SamplingParams()))


class _Scripted(BaseHTTPRequestHandler):
    """vLLM-shaped answers: ids as 'token_id:N' strings, routed experts in the configured format."""

    fmt = "nested"

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n, P = body["max_tokens"], len(body["prompt"])
        r = (torch.arange((P + n - 1) * 3 * 2) % 7).view(P + n - 1, 3, 2)
        if self.fmt == "nested":
            routed = r.tolist()
        elif self.fmt == "b64":
            routed = base64.b64encode(r.to(torch.int32).numpy().tobytes()).decode()
        else:
            routed = {"shape": list(r.shape), "data": base64.b64encode(r.to(torch.int32).numpy().tobytes()).decode()}
        choice = {"finish_reason": "length", "routed_experts": routed,
                  "logprobs": {"tokens": [f"token_id:{5 + i}" for i in range(n)], "token_logprobs": [-0.1 * i for i in range(n)]}}
        out = json.dumps({"choices": [choice]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@pytest.mark.parametrize("fmt", ["nested", "b64", "shaped"])
def test_vllm_payload_shapes_are_decoded(fmt):
    handler = type("H", (_Scripted,), {"fmt": fmt})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = _client(f"http://127.0.0.1:{httpd.server_address[1]}", num_layers=3, top_k=2)
        c = client.complete(Request(0, [1, 2, 3], SamplingParams(max_new_tokens=4)))
        assert c.tokens == [5, 6, 7, 8] and c.logprobs == pytest.approx([0, -0.1, -0.2, -0.3])
        assert c.routing.shape == (3 + 4 - 1, 3, 2) and c.routing.dtype == torch.uint8
        assert torch.equal(c.routing.long(), (torch.arange(36) % 7).view(6, 3, 2))
    finally:
        httpd.shutdown()


def test_decode_errors():
    with pytest.raises(ValueError, match="num_layers"):
        decode_routed_experts("AAAA")
    with pytest.raises(ValueError, match="nesting"):
        decode_routed_experts([1, 2, 3])
    with pytest.raises(ValueError, match="negative"):
        decode_routed_experts([[[-1, 2]]])


def test_fp8_transfer_layout():
    sd = _model(2).state_dict()
    q = quantize_for_transfer(sd)
    name = "layers.0.ffn.experts.w13"
    assert q[name].dtype == torch.float8_e4m3fn and q[name + "_scale_inv"].dtype == torch.float32
    E, N, K = sd[name].shape
    assert q[name + "_scale_inv"].shape == (E, -(-N // 128), -(-K // 128))
    back = dequant(q[name], q[name + "_scale_inv"], group_shape=(128, 128), out_dtype=torch.float32)
    assert (back - sd[name]).abs().max() <= 0.07 * sd[name].abs().max()
    assert torch.equal(q["embed.weight"], sd["embed.weight"])


def test_launcher_command_line():
    cfg = load_config(None, ["--model.path", "/ckpt/qwen3-moe", "--inference.vllm.data_parallel", "4",
                             "--inference.vllm.tensor_parallel", "2", "--inference.vllm.expert_parallel", "true",
                             "--inference.vllm.fp8", "true", "--inference.vllm.all2all_backend", "deepep_low_latency",
                             "--inference.vllm.disaggregation", "decode", "--inference.vllm.port", "9001",
                             "--inference.vllm.max_model_len", "32768", "--inference.vllm.extra_args", '["--enforce-eager"]'])
    cmd = vllm_serve_command(cfg.inference.vllm, cfg.model)
    line = shlex.join(cmd)
    assert cmd[:3] == ["vllm", "serve", "/ckpt/qwen3-moe"]
    for frag in ("--data-parallel-size 4", "--tensor-parallel-size 2", "--enable-expert-parallel", "--quantization fp8",
                 "--all2all-backend deepep_low_latency", "--port 9001", "--max-model-len 32768",
                 "--enable-return-routed-experts", "--worker-extension-cls primerl.runtime.vllm_worker.WeightUpdateExtension"):
        assert frag in line, frag
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "NixlConnector", "kv_role": "kv_both"} and cmd[-1] == "--enforce-eager"
    assert vllm_env(cfg.inference.vllm) == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALL2ALL_BACKEND": "deepep_low_latency"}
    plain = vllm_serve_command(load_config(None, ["--inference.vllm.model", "m"]).inference.vllm, cfg.model)
    assert "--enable-expert-parallel" not in plain and "--quantization" not in plain
    with pytest.raises(ValueError, match="expert_parallel"):
        vllm_serve_command(load_config(None, ["--inference.vllm.model", "m", "--inference.vllm.all2all_backend",
                                              "naive"]).inference.vllm, cfg.model)


def test_broadcast_weight_transfer_between_trainer_and_worker():
    """The broadcast path's two ends (trainer rank 0 and a worker) over a gloo group, without vLLM."""
    import socket

    from primerl.runtime.vllm_worker import new_group, receive_weights, send_weights, weight_specs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sd = quantize_for_transfer(_model(3).state_dict())
    got = {}

    def worker():
        g = new_group("127.0.0.1", port, 1, 2)
        got.update(receive_weights(g, weight_specs(sd)))

    th = threading.Thread(target=worker)
    th.start()
    send_weights(new_group("127.0.0.1", port, 0, 2), sd)
    th.join(30)
    assert set(got) == set(sd)
    assert all(got[k].dtype == sd[k].dtype and torch.equal(got[k].view(torch.uint8) if got[k].element_size() == 1 else got[k],
                                                           sd[k].view(torch.uint8) if sd[k].element_size() == 1 else sd[k])
               for k in sd)


def test_orchestrator_runs_on_the_http_backend(tmp_path):
    """The orchestrator with inference.backend = vllm, against the engine's HTTP server: batches are
    produced, weights are pushed by the filesystem update, routing comes back for replay."""
    from primerl.rl.envs import ReverseText

    env = ReverseText(num_symbols=4, min_length=2, max_length=4)
    model = MoETransformer(MoETransformerConfig.tiny(vocab_size=env.vocab_size))
    srv = EngineServer(InferenceEngine(MoETransformer(MoETransformerConfig.tiny(vocab_size=env.vocab_size)))).start()
    try:
        cfg = load_config(None, ["--output_dir", str(tmp_path), "--inference.backend", "vllm", "--inference.vllm.url",
                                 srv.url, "--max_steps", "2", "--orchestrator.batch_size", "2", "--orchestrator.group_size",
                                 "3", "--orchestrator.max_async_level", "0", "--model.dim", "64", "--model.n_heads", "4",
                                 "--model.n_kv_heads", "2", "--model.moe_dim", "32"])
        tr = FileTransport(tmp_path)
        seen = run_orchestrator_with_stub_trainer(cfg, env, model, tr)
        assert [p["step"] for p in seen] == [0, 1] and srv.engine.policy_version == 1
        assert all(p["micro_batches"][0].replay_ids is not None for p in seen)
    finally:
        srv.stop()
