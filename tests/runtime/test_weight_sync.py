"""Broadcast weight sync wired into the trainer loop: a real gloo receiver process gets every
published version (tensors and version numbers), the vLLM worker extension's RPC path, timeouts
for a missing or dead receiver, and the config keys."""

import json
import os
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from primerl.rl.packing import Sample, pack
from primerl.runtime.config import ConfigError
from primerl.runtime.validate import load_config
from primerl.runtime.inference.hf_weights import hf_weights
from primerl.runtime.policy import build_model
from primerl.runtime.trainer import run_trainer
from primerl.runtime.transport import FileTransport
from primerl.runtime.inference.vllm_client import VLLMClient
from primerl.runtime.inference.vllm_worker import WeightUpdateExtension
from primerl.runtime.inference.weight_sync import BroadcastWeightSender, WeightSyncError

V = 12
REPO = Path(__file__).resolve().parents[2]


def _port() -> int:
    """A free port, reserved until this process exits (no other process can take it first)."""
    from primerl.runtime.ports import held_port

    return held_port()


def _cfg(tmp_path, port, *over):
    return load_config(None, ["--output_dir", str(tmp_path), "--max_steps", "1", "--model.n_layers", "1",
                              "--model.dim", "32", "--model.moe_dim", "16", "--log.progress", "false",
                              "--inference.backend", "vllm", "--inference.vllm.weight_update", "broadcast",
                              "--inference.vllm.broadcast_port", str(port), "--inference.vllm.broadcast_receivers", "1",
                              "--inference.vllm.broadcast_timeout_s", "60", *over])


def _payload(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        P, C = 3 + i % 2, 3
        ids = torch.randint(0, V, (P + C,), generator=g)
        mask = torch.tensor([False] * P + [True] * C)
        lp = torch.where(mask, -torch.rand(P + C, generator=g), torch.zeros(P + C))
        replay = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(P + C)])[:, None, :]
        samples.append(Sample(ids, mask, float(i % 2) - 0.5, lp, 1.0, replay.contiguous()))
    return {"micro_batches": pack(samples, 64, 1, pad_to_seq_len=False)[0],
            "metrics": {"reward/mean": 0.0, "off_policy/max": 0}}


_RECEIVER = textwrap.dedent("""
    import sys, torch
    from primerl.runtime.inference.weight_broadcast import new_group, receive_update
    port, n, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    g = new_group("127.0.0.1", port, 1, 2, timeout_s=60)
    torch.save([receive_update(g) for _ in range(n)], out)
    del g  # torn down before interpreter shutdown: gloo's threads otherwise abort the process at exit
""")


def _start_receiver(port, n, out):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", _RECEIVER, str(port), str(n), str(out)], env=env, cwd=REPO)


@pytest.mark.dist
def test_trainer_broadcasts_each_version_to_a_receiver_process(tmp_path):
    port = _port()
    cfg = _cfg(tmp_path, port, "--inference.vllm.broadcast_rpc", "false")
    FileTransport(tmp_path / "transport").put_batch(0, 0, _payload())
    out = tmp_path / "received.pt"
    proc = _start_receiver(port, 2, out)
    try:
        trainer = run_trainer(cfg, V)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    got = torch.load(out)
    assert [v for v, _ in got] == [0, 1]
    initial, final = hf_weights(build_model(cfg, V)), hf_weights(trainer.model)
    for (version, tensors), want in zip(got, [initial, final]):
        tensors = dict(tensors)
        assert sorted(tensors) == sorted(want), version
        for k in want:
            assert tensors[k].dtype == want[k].dtype and torch.equal(tensors[k], want[k]), (version, k)
    assert any(not torch.equal(initial[k], final[k]) for k in initial)  # the update moved the weights
    tr = FileTransport(tmp_path / "transport")
    assert tr.weight_versions() == [0, 1]  # markers for the orchestrator; the weights went by broadcast
    assert not (tr.weights_dir(1) / "model.safetensors").exists()
    with pytest.raises(FileNotFoundError, match="marker only"):
        tr.load_weights(1)
    client = VLLMClient(cfg.inference.vllm)
    client.update_weights(1, tr)  # records the version, loads nothing (no server is running)
    assert client.version == 1


class _FakeRunnerModel:
    def __init__(self):
        self.loaded = []

    def load_weights(self, weights):
        self.loaded.append(dict(weights))


class _FakeWorker(WeightUpdateExtension):
    """What vLLM mixes the extension into: a worker with ``model_runner.model`` and ``device``."""

    def __init__(self):
        self.device = "cpu"
        self.model_runner = type("R", (), {})()
        self.model_runner.model = _FakeRunnerModel()


def test_rpc_driven_broadcast_reaches_the_worker_extension():
    """broadcast_rpc = true: the sender asks the server (POST /collective_rpc) to join and to receive
    each version while it broadcasts, then resets the prefix cache."""
    worker, calls = _FakeWorker(), []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            calls.append(self.path if self.path != "/collective_rpc" else body["method"])
            if self.path == "/collective_rpc":
                data = json.dumps({"results": [getattr(worker, body["method"])(*body["args"])]}).encode()
            else:
                data = json.dumps({"success": True}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        sender = BroadcastWeightSender("127.0.0.1", _port(), 1, timeout_s=30,
                                       rpc_url=f"http://127.0.0.1:{httpd.server_address[1]}")
        sender.connect()
        sd = {"a.weight": torch.randn(3, 5), "b": torch.arange(4),
              "c.weight": torch.randn(2, 2).to(torch.float8_e4m3fn)}
        for v in (3, 4):
            sender.send(v, {k: (t + v if k == "a.weight" else t) for k, t in sd.items()})
        sender.close()
    finally:
        httpd.shutdown()
    reset = "/reset_prefix_cache?reset_running_requests=true"
    assert calls == ["init_broadcast", "update_weights_from_broadcast", reset, "update_weights_from_broadcast", reset]
    assert worker.weights_version() == 4
    first, second = worker.model_runner.model.loaded
    assert torch.equal(second["a.weight"], sd["a.weight"] + 4) and torch.equal(first["a.weight"], sd["a.weight"] + 3)
    assert torch.equal(second["b"], sd["b"])
    assert second["c.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(second["c.weight"].view(torch.uint8), sd["c.weight"].view(torch.uint8))


def test_missing_receiver_or_server_times_out_clearly():
    sender = BroadcastWeightSender("127.0.0.1", _port(), 1, timeout_s=1)
    with pytest.raises(WeightSyncError, match="did not join within 1"):
        sender.connect()
    url = f"http://127.0.0.1:{_port()}"  # nothing listens there
    with pytest.raises(WeightSyncError, match=f"inference server at {url}"):
        BroadcastWeightSender("127.0.0.1", _port(), 1, timeout_s=1, rpc_url=url).connect()


@pytest.mark.dist
def test_dead_receiver_makes_the_send_raise(tmp_path):
    port = _port()
    proc = _start_receiver(port, 1, tmp_path / "one.pt")  # receives one version, then exits
    try:
        sender = BroadcastWeightSender("127.0.0.1", port, 1, timeout_s=20).connect()
        sender.send(0, {"w": torch.ones(4)})
        assert proc.wait(60) == 0
        with pytest.raises(WeightSyncError, match="version 1"):
            sender.send(1, {"w": torch.ones(4)})
    finally:
        if proc.poll() is None:
            proc.kill()


def test_config_keys(tmp_path):
    with pytest.raises(ConfigError, match="inference.vllm.weight_update"):
        load_config(None, ["--inference.backend", "vllm", "--inference.vllm.weight_update", "nccl"])
    with pytest.raises(ConfigError, match="inference.vllm.weight_update.*backend"):
        load_config(None, ["--inference.vllm.weight_update", "broadcast"])
    with pytest.raises(ConfigError, match="inference.vllm.broadcast_timeout_s"):
        _cfg(tmp_path, 1234, "--inference.vllm.broadcast_timeout_s", "0")
    with pytest.raises(ConfigError, match="unknown config key inference.vllm.broadcast_prot"):
        _cfg(tmp_path, 1234, "--inference.vllm.broadcast_prot", "1")
    v = load_config(None, ["--inference.backend", "vllm", "--inference.vllm.weight_update", "broadcast",
                           "--inference.vllm.data_parallel", "2", "--inference.vllm.tensor_parallel", "2"])
    v = v.inference.vllm
    assert BroadcastWeightSender.from_config(v).num_receivers == 4
