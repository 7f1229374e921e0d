"""vLLM backend without vLLM: the client against a local HTTP server speaking the same protocol
(``primerl inference``'s engine server, and a scripted fake for vLLM's other payload shapes),
routed-experts decoding, FP8 transfer layout, weight updates and the launcher's command line."""

import base64
import json
import shlex
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from primerl.kernels.fp8 import dequant
from primerl.models.config import MoETransformerConfig
from primerl.models.transformer import MoETransformer
from primerl.runtime.config import ConfigError
from primerl.runtime.validate import load_config
from primerl.runtime.inference.engine import InferenceEngine, Request, SamplingParams
from primerl.runtime.inference.server import EngineServer
from primerl.runtime.transport import FileTransport
from primerl.runtime.inference.vllm_client import (InferenceServerError, VLLMClient, decode_routed_experts,
                                                   encode_routed_experts, quantize_for_transfer)
from primerl.runtime.inference.vllm_launch import serve_command_line, vllm_env, vllm_serve_command

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


def _npy_b64(t, dtype):
    import io

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, t.numpy().astype(dtype), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


class _Scripted(BaseHTTPRequestHandler):
    """vLLM-shaped answers: ids as 'token_id:N' strings, routed experts in the configured format;
    records every request (path, body) and answers /reset_prefix_cache and /collective_rpc from
    class-level scripts."""

    fmt = "nested"
    requests: list = []
    reset_answers: list = []  # successive {"success": ...} of /reset_prefix_cache (then True)
    rpc_answers: list = []  # successive (status, body) of /collective_rpc (then the asked version)

    def log_message(self, *a):
        pass

    def _send(self, code, obj):
        out = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        self.requests.append((self.path, body))
        if self.path.startswith("/reset_prefix_cache"):
            return self._send(200, {"success": self.reset_answers.pop(0) if self.reset_answers else True})
        if self.path == "/collective_rpc":
            if self.rpc_answers:
                return self._send(*self.rpc_answers.pop(0))
            return self._send(200, {"results": [str(int(body["args"][0].rsplit("_", 1)[1]))]})
        n, P = body["max_tokens"], len(body["prompt"])
        r = (torch.arange((P + n - 1) * 3 * 2) % 7).view(P + n - 1, 3, 2)
        routed = {"nested": lambda: r.tolist(), "none": lambda: None,
                  "raw_int32": lambda: base64.b64encode(r.to(torch.int32).numpy().tobytes()).decode(),
                  }.get(self.fmt, lambda: _npy_b64(r, self.fmt))()
        choice = {"finish_reason": "length", "routed_experts": routed,
                  "logprobs": {"tokens": [f"token_id:{5 + i}" for i in range(n)],
                               "token_logprobs": [-0.1 * i for i in range(n)]}}
        self._send(200, {"choices": [choice]})


@pytest.fixture
def scripted():
    """A started scripted server factory: scripted(fmt=..., reset_answers=[...], rpc_answers=[...])."""
    started = []

    def make(**attrs):
        handler = type("H", (_Scripted,), {"requests": [], "reset_answers": [], "rpc_answers": [], **attrs})
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        started.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}", handler

    yield make
    for httpd in started:
        httpd.shutdown()


@pytest.mark.parametrize("fmt", ["nested", "uint8", "uint16", "int32"])
def test_vllm_payload_shapes_are_decoded(scripted, fmt):
    url, _ = scripted(fmt=fmt)
    client = _client(url, num_layers=3, top_k=2)
    c = client.complete(Request(0, [1, 2, 3], SamplingParams(max_new_tokens=4)))
    assert c.tokens == [5, 6, 7, 8] and c.logprobs == pytest.approx([0, -0.1, -0.2, -0.3])
    assert c.routing.shape == (3 + 4 - 1, 3, 2) and c.routing.dtype == torch.uint8
    assert torch.equal(c.routing.long(), (torch.arange(36) % 7).view(6, 3, 2))


def test_payload_names_the_model_only_when_configured(scripted):
    """vLLM answers 404 to a model name it does not serve: without inference.vllm.model the request
    has no "model" (the server's own); never a made-up name; no non-vLLM request fields."""
    url, h = scripted()
    _client(url).complete(Request(0, [1, 2], SamplingParams(max_new_tokens=1)))
    cfg = load_config(None, ["--inference.vllm.url", url, "--inference.vllm.model", "policy"])
    VLLMClient(cfg.inference.vllm, timeout_s=30).complete(Request(1, [1, 2], SamplingParams(max_new_tokens=1)))
    (_, first), (_, second) = h.requests
    assert "model" not in first and second["model"] == "policy"
    assert "return_routed_experts" not in first and first["logprobs"] == 0 and first["return_token_ids"] is True


def test_wrong_routing_payloads_are_errors(scripted):
    url, _ = scripted(fmt="raw_int32")  # bytes without the .npy header: refused, never reinterpreted
    with pytest.raises(InferenceServerError, match="not an .npy array"):
        _client(url, num_layers=3, top_k=2).complete(Request(0, [1, 2, 3], SamplingParams(max_new_tokens=2)))
    url, _ = scripted(fmt="uint8")
    with pytest.raises(InferenceServerError, match="MoE layers"):
        _client(url, num_layers=4, top_k=2).complete(Request(0, [1, 2, 3], SamplingParams(max_new_tokens=2)))
    url, _ = scripted(fmt="none")
    with pytest.raises(InferenceServerError, match="enable-return-routed-experts"):
        _client(url, expect_routing=True).complete(Request(0, [1, 2, 3], SamplingParams(max_new_tokens=2)))
    assert _client(url).complete(Request(0, [1, 2, 3], SamplingParams(max_new_tokens=2))).routing is None


def test_update_is_verified_retried_and_the_prefix_cache_reset_checked(scripted, tmp_path):
    tr = FileTransport(tmp_path)
    tr.publish_weights(3, {"w": torch.ones(2)})
    # a failed load (HTTP 500), then a worker answering another version: retried, then it stops
    url, h = scripted(rpc_answers=[(500, {"error": "Attempted to load weight"}), (200, {"results": ["2"]})])
    client = _client(url)
    with pytest.raises(InferenceServerError, match=r"version 3 could not be loaded .* 2 attempts.*versions \[2\]"):
        client.update_weights(3, tr)
    assert client.version == -1 and not any(p.startswith("/reset_prefix_cache") for p, _ in h.requests)
    # one failure, then success: retried; the reset preempts running requests and is retried until it succeeds
    url, h = scripted(rpc_answers=[(500, {"error": "boom"})], reset_answers=[False, False])
    client = _client(url)
    client.reset_wait_s = 0.01
    client.update_weights(3, tr)
    paths = [p for p, _ in h.requests]
    assert client.version == 3
    assert paths == ["/collective_rpc"] * 2 + ["/reset_prefix_cache?reset_running_requests=true"] * 3
    # a reset that never succeeds is an error
    url, _ = scripted(reset_answers=[False] * 10)
    client = _client(url)
    client.reset_wait_s = 0.01
    with pytest.raises(InferenceServerError, match="success=false"):
        client.update_weights(3, tr)


class _Pausable(_Scripted):
    """A server with vLLM's /pause, /resume and /is_paused (VLLM_SERVER_DEV_MODE=1)."""

    def do_GET(self):
        self.requests.append((self.path, None))
        if self.path == "/is_paused":
            return self._send(200, {"is_paused": False})
        return self._send(404, {"error": "no route"})

    def do_POST(self):
        if self.path.startswith("/pause") or self.path == "/resume":
            self.rfile.read(int(self.headers["Content-Length"]))
            self.requests.append((self.path, None))
            return self._send(200, {"status": "ok"})
        return _Scripted.do_POST(self)


def test_update_in_flight_pauses_keeping_requests_and_resumes(scripted, tmp_path):
    """Where the server has /pause: keep mode without the cache clearing (which in vLLM 0.32 would
    preempt the kept requests), load, a reset that preempts nobody (retried briefly), resume; the
    resume is sent even when the load fails."""
    tr = FileTransport(tmp_path)
    tr.publish_weights(3, {"w": torch.ones(2)})
    url, h = scripted(reset_answers=[False])
    h.do_GET, h.do_POST = _Pausable.do_GET, _Pausable.do_POST
    client = _client(url)
    client.update_weights(3, tr)
    assert client.version == 3 and [p for p, _ in h.requests] == [
        "/is_paused", "/pause?mode=keep&clear_cache=false", "/collective_rpc", "/reset_prefix_cache",
        "/reset_prefix_cache", "/resume"]
    url, h = scripted(rpc_answers=[(500, {"error": "boom"})] * 2)
    h.do_GET, h.do_POST = _Pausable.do_GET, _Pausable.do_POST
    client = _client(url)
    with pytest.raises(InferenceServerError, match="could not be loaded"):
        client.update_weights(3, tr)
    assert [p for p, _ in h.requests][-1] == "/resume" and client.version == -1


def test_decode_errors():
    with pytest.raises(ValueError, match="not an .npy"):
        decode_routed_experts("AAAA")
    with pytest.raises(ValueError, match=r"\[tokens, layers, top_k\]"):
        decode_routed_experts([1, 2, 3])
    with pytest.raises(ValueError, match="negative"):
        decode_routed_experts([[[-1, 2]]])
    with pytest.raises(ValueError, match="integers"):
        decode_routed_experts(_npy_b64(torch.zeros(1, 1, 1), "float32"))
    r = torch.randint(0, 300, (5, 2, 3))
    assert torch.equal(decode_routed_experts(encode_routed_experts(r)), r.to(torch.int32))
    assert decode_routed_experts(encode_routed_experts(r % 7)).dtype == torch.uint8


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


def test_launcher_command_line(tmp_path):
    cfg = load_config(None, ["--inference.vllm.model", "Qwen/Qwen3-30B-A3B", "--inference.vllm.data_parallel", "4",
                             "--inference.vllm.tensor_parallel", "2", "--inference.vllm.expert_parallel", "true",
                             "--inference.vllm.fp8", "true", "--inference.vllm.all2all_backend", "deepep_low_latency",
                             "--inference.vllm.disaggregation", "decode", "--inference.vllm.port", "9001",
                             "--inference.vllm.python", "/opt/vllm/bin/python", "--model.dtype", "bfloat16",
                             "--inference.vllm.max_model_len", "32768",
                             "--inference.vllm.extra_args", '["--enforce-eager"]'])
    cmd = vllm_serve_command(cfg.inference.vllm, cfg.model)
    line = shlex.join(cmd)
    assert cmd[:5] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model",
                       "Qwen/Qwen3-30B-A3B"]
    for frag in ("--data-parallel-size 4", "--tensor-parallel-size 2", "--enable-expert-parallel", "--quantization fp8",
                 "--all2all-backend deepep_low_latency", "--port 9001", "--max-model-len 32768", "--dtype bfloat16",
                 "--logprobs-mode processed_logprobs", "--enable-return-routed-experts",
                 "--worker-extension-cls primerl.runtime.inference.vllm_worker.WeightUpdateExtension"):
        assert frag in line, frag
    assert "--skip-tokenizer-init" not in cmd  # not a local directory: the hub name has its tokenizer
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "NixlConnector", "kv_role": "kv_both"} and cmd[-1] == "--enforce-eager"
    assert vllm_env(cfg.inference.vllm) == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                                            "VLLM_ALL2ALL_BACKEND": "deepep_low_latency"}
    line = serve_command_line(cfg)
    assert line.startswith("VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_ALL2ALL_BACKEND=deepep_low_latency "
                           "/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server")
    # a trainer-written checkpoint (no tokenizer files), float32 kept, no routing capture asked
    _model(0).save_pretrained(tmp_path / "ckpt")
    plain = vllm_serve_command(load_config(None, []).inference.vllm, cfg.model.__class__(),
                               checkpoint=str(tmp_path / "ckpt"), routing=False)
    assert plain[:2] == [sys.executable, "-m"] and plain[plain.index("--dtype") + 1] == "float32"
    assert "--skip-tokenizer-init" in plain and "--enable-return-routed-experts" not in plain
    assert "--enable-expert-parallel" not in plain and "--quantization" not in plain
    with pytest.raises(ValueError, match="expert_parallel"):
        vllm_serve_command(load_config(None, ["--inference.vllm.model", "m", "--inference.vllm.all2all_backend",
                                              "naive"]).inference.vllm, cfg.model)


def test_launch_refuses_what_cannot_work_before_starting(tmp_path):
    """Routing capture on a machine without CUDA (vLLM captures on GPU only), a url that is not the
    launched host:port, a port already taken, a missing interpreter: clear errors, nothing started."""
    import socket

    from primerl.runtime.inference.vllm_launch import VLLMLauncher, launch_for_job

    base = ["--output_dir", str(tmp_path), "--inference.backend", "vllm", "--inference.vllm.launch", "true"]
    if not torch.cuda.is_available():
        with pytest.raises(InferenceServerError, match="inference.capture_routing = false"):
            launch_for_job(load_config(None, base), 11)
    with pytest.raises(InferenceServerError, match="inference.vllm.url"):
        launch_for_job(load_config(None, [*base, "--inference.vllm.port", "8001"]), 11)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        cfg = load_config(None, [*base, "--inference.vllm.port", str(s.getsockname()[1]),
                                 "--inference.vllm.model", "m"])
        with pytest.raises(InferenceServerError, match="already in use"):
            VLLMLauncher(cfg.inference.vllm, cfg.model, log_path=tmp_path / "v.log").start()
    missing = [*base, "--inference.vllm.port", str(_free_port()), "--inference.vllm.model", "m",
               "--inference.vllm.python", str(tmp_path / "no-python")]
    with pytest.raises(ConfigError, match="inference.vllm.python"):  # the config's check, before anything starts
        load_config(None, missing)
    cfg = load_config(None, missing, check=False)  # and the launcher's own, for a caller that skipped it
    with pytest.raises(InferenceServerError, match="inference.vllm.python"):
        VLLMLauncher(cfg.inference.vllm, cfg.model, log_path=tmp_path / "v.log").start()
    with pytest.raises(ConfigError, match="inference.vllm.launch"):
        load_config(None, ["--inference.vllm.launch", "true"])
    for key in ("launch_timeout_s", "cpu_kv_cache_gb"):
        with pytest.raises(ConfigError, match=f"inference.vllm.{key}"):
            load_config(None, [f"--inference.vllm.{key}", "0"])


def test_launcher_stops_the_whole_process_group(tmp_path):
    """A stand-in server (a /health endpoint in a child that forks a grandchild, as vLLM's API server
    starts its engine core): start waits for /health, stop leaves no process of the group."""
    from primerl.runtime.inference.vllm_launch import VLLMLauncher, _group_alive

    port = _free_port()
    script = ("import http.server, os, sys, time\n"
              "if os.fork() == 0:\n    time.sleep(600)\n    sys.exit(0)\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        self.send_response(200); self.send_header('Content-Length', '0'); self.end_headers()\n"
              "    def log_message(self, *a): pass\n"
              f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    cfg = load_config(None, ["--inference.vllm.port", str(port), "--inference.vllm.model", "m"])
    launcher = VLLMLauncher(cfg.inference.vllm, cfg.model, log_path=tmp_path / "v.log",
                            command=[sys.executable, "-c", script]).start(timeout=60)
    assert _group_alive(launcher.proc.pid)
    launcher.stop(grace=5)
    assert not _group_alive(launcher.proc.pid) and launcher.proc.returncode is not None
    bad = VLLMLauncher(cfg.inference.vllm, cfg.model, log_path=tmp_path / "bad.log",
                       command=[sys.executable, "-c", "print('no such model'); raise SystemExit(3)"])
    with pytest.raises(InferenceServerError, match=r"exited with code 3[\s\S]*no such model"):
        bad.start(timeout=60)


def _free_port():
    """A free port, reserved until this process exits (no other process can take it first)."""
    from primerl.runtime.ports import held_port

    return held_port()


def test_broadcast_weight_transfer_between_trainer_and_worker():
    """The broadcast path's two ends (trainer rank 0 and a worker) over a gloo group, without vLLM."""

    from primerl.runtime.inference.weight_broadcast import new_group, receive_weights, send_weights, weight_specs

    from primerl.runtime.ports import held_port

    port = held_port()
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
    bits = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # FP8: compare the bytes
    assert all(got[k].dtype == sd[k].dtype and torch.equal(bits(got[k]), bits(sd[k])) for k in sd)


def test_orchestrator_runs_on_the_http_backend(tmp_path):
    """The orchestrator with inference.backend = vllm, against the engine's HTTP server: batches are
    produced, weights are pushed by the filesystem update, routing comes back for replay."""
    from primerl.rl.envs import ReverseText

    env = ReverseText(num_symbols=4, min_length=2, max_length=4)
    model = MoETransformer(MoETransformerConfig.tiny(vocab_size=env.vocab_size))
    srv = EngineServer(InferenceEngine(MoETransformer(MoETransformerConfig.tiny(vocab_size=env.vocab_size)))).start()
    try:
        cfg = load_config(None, ["--output_dir", str(tmp_path), "--inference.backend", "vllm", "--inference.vllm.url",
                                 srv.url, "--max_steps", "2", "--orchestrator.batch_size", "2",
                                 "--orchestrator.group_size", "3", "--orchestrator.max_async_level", "0",
                                 "--model.dim", "64", "--model.n_heads", "4",
                                 "--model.n_kv_heads", "2", "--model.moe_dim", "32"])
        tr = FileTransport(tmp_path)
        seen = run_orchestrator_with_stub_trainer(cfg, env, model, tr)
        assert [p["step"] for p in seen] == [0, 1] and srv.engine.policy_version == 1
        assert all(p["micro_batches"][0].replay_ids is not None for p in seen)
    finally:
        srv.stop()
