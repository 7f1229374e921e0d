"""A pool of ``primerl inference`` servers takes weights from trainer rank 0 by the bucketed transfer
over one two-rank group per server (``inference.weight_update = "broadcast"``,
``inference.pool_broadcast.PoolBroadcastSender``):

- every server holds each version exactly (deltas too); a replaced server (new instance) gets a pair
  of its own and the next version in full while the others get a delta; a server that is gone is
  left out;
- a server killed in the middle of a version (a stand-in, and a real `primerl inference` server with
  kill -9): its pair fails at once, the others hold the version when the send returns, with the
  group timeout far beyond the test's (nothing waits on it);
- through ``primerl rl``: a server killed with SIGKILL is restarted by the pool's supervisor,
  rejoins the trainer's group and is routed to only once it holds the pool's version; every step
  exactly once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from primerl.models.config import MoETransformerConfig
from primerl.models.transformer import MoETransformer
from primerl.runtime.inference import server_metrics
from primerl.runtime.inference.engine import InferenceEngine
from primerl.runtime.inference.pool_broadcast import PoolBroadcastSender
from primerl.runtime.inference.server import EngineServer
from primerl.runtime.inference.weight_broadcast import weight_specs
from primerl.runtime.metrics import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_server_pool import _finish, _health, _kill_when_busy, _processes, _start, _wait_step, _wait_until, _workers  # noqa: E402
from test_server_pool import needs_router  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    """A free port, reserved until this process exits (no other process can take it first)."""
    from primerl.runtime.ports import held_port

    return held_port()


def _model(seed: int) -> MoETransformer:
    torch.manual_seed(seed)
    m = MoETransformer(MoETransformerConfig.tiny(vocab_size=11, max_position_embeddings=64))
    m.init_weights(seed=seed)
    return m


def _server(port: int = 0) -> EngineServer:
    return EngineServer(InferenceEngine(_model(0), max_batch_size=2), port=port, http="stdlib").start()


def _send(sender: PoolBroadcastSender, version: int, seed: int) -> dict:
    sd = {k: v.detach().clone() for k, v in _model(seed).state_dict().items()}
    sender.send_stream(version, weight_specs(sd), iter(sd.items()))
    return sd


def _holds(srv: EngineServer, sd: dict, version: int) -> bool:
    got = srv.engine.model.state_dict()
    return srv.engine.policy_version == version and all(torch.equal(got[k], t) for k, t in sd.items())


def _step(sd: dict, seed: int) -> dict:
    """``sd`` after a small update (most bytes of a float32 tensor stay: a delta compresses)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 1e-3 * torch.randn(v.shape, generator=g) * (torch.rand(v.shape, generator=g) < 0.1)
            for k, v in sd.items()}


def test_every_server_has_a_pair_and_a_replaced_server_gets_the_version_in_full_while_the_others_a_delta(
        monkeypatch):
    a, b = _server(), _server()
    urls = [a.url, b.url]
    sender = PoolBroadcastSender(lambda: urls, "127.0.0.1", _port(), timeout_s=60, health_timeout_s=2,
                                 bucket_bytes=50_000, delta=True, full_every=100)
    b2 = None
    try:
        sd = {k: v.detach().clone() for k, v in _model(1).state_dict().items()}
        modes = []
        for version in (1, 2):
            sd = _step(sd, version)
            modes.append(sender.send_stream(version, weight_specs(sd), iter(sd.items()))["mode"])
            assert _holds(a, sd, version) and _holds(b, sd, version), version  # bitwise, deltas too
        assert modes == ["full", "delta"] and (sender.formed, sender.num_receivers) == (2, 2)
        assert sender.stats.last["wire_bytes"] < 0.6 * sender.stats.last["raw_bytes"]

        port = b.port  # the supervisor restarts a server on the same port: a new process, a new instance
        b.stop()
        monkeypatch.setattr(server_metrics, "INSTANCE", "replaced")
        b2 = _server(port)
        sd = _step(sd, 3)
        assert sender.send_stream(3, weight_specs(sd), iter(sd.items()))["mode"] == "delta+full"  # a: delta, b2: full
        assert _holds(b2, sd, 3) and _holds(a, sd, 3)
        assert (sender.formed, sender.num_receivers) == (3, 2)  # a new pair for b2 alone

        b2.stop()  # gone for good: left out of the next version, the others still get every version
        sd = _step(sd, 4)
        assert sender.send_stream(4, weight_specs(sd), iter(sd.items()))["mode"] == "delta"
        assert _holds(a, sd, 4) and (sender.formed, sender.num_receivers, sender.lost) == (3, 1, 0)
    finally:
        sender.close()
        for s in (a, b2):
            if s is not None:
                s.stop()


def _member(when: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(Path(__file__).with_name("_pool_member.py")), when],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.mark.dist
def test_a_server_killed_while_joining_is_left_out_at_once_and_the_sender_exits_cleanly(caplog):
    member, real = _member("join"), _server()
    try:
        url = member.stdout.readline().strip()
        sender = PoolBroadcastSender(lambda: [real.url, url], "127.0.0.1", _port(), timeout_s=600, health_timeout_s=2)
        with caplog.at_level("WARNING", logger="primerl.weight_sync"):
            sd = _send(sender, 1, 1)
        assert member.wait(10) == -signal.SIGKILL
        # the member's pair was given up on its failed join (not its 600 s timeout); the other went on
        assert f"{url}: weight transfer pair" in caplog.text and "failed to join" in caplog.text
        assert (sender.formed, sender.num_receivers, sender.lost) == (2, 1, 0) and _holds(real, sd, 1)
        sender.close()  # the abandoned rendezvous fails with the store: no thread left waiting in it
        waiting = [t for t in threading.enumerate() if t.name.startswith("pool-group")]
        for t in waiting:
            t.join(60)
        assert not any(t.is_alive() for t in waiting)
    finally:
        if member.poll() is None:
            member.kill()
        real.stop()


@pytest.mark.dist
def test_a_server_killed_mid_send_leaves_and_the_survivor_holds_the_version_from_the_one_send():
    member = _member("send")
    real = _server()
    try:
        url = member.stdout.readline().strip()
        sender = PoolBroadcastSender(lambda: [real.url, url], "127.0.0.1", _port(), timeout_s=600, health_timeout_s=2)
        sd = _send(sender, 1, 1)  # the member kills itself after the header: its pair fails, the other's goes on
        assert member.wait(10) == -signal.SIGKILL
        assert sender.lost == 1 and (sender.formed, sender.num_receivers) == (2, 1)
        assert _holds(real, sd, 1)
        sd = _send(sender, 2, 2)  # the survivor's pair carries on
        assert sender.lost == 1 and sender.formed == 2 and _holds(real, sd, 2)
        sender.close()
    finally:
        if member.poll() is None:
            member.kill()
        real.stop()


def _real_servers(n: int, *over: str) -> list[tuple[subprocess.Popen, str]]:
    """``n`` `primerl inference` servers of ``examples/reverse_text.toml`` (+ ``over``): (process, URL)."""
    procs = [subprocess.Popen([sys.executable, "-m", "primerl.runtime.cli", "inference", "--config",
                               str(ROOT / "examples" / "reverse_text.toml"), *over, "--port", "0"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT))) for _ in range(n)]
    out = []
    for p in procs:
        line = p.stdout.readline()
        assert "serving on " in line, line
        out.append((p, line.split("serving on ")[1].strip()))
    return out


@pytest.mark.dist
def test_a_real_server_killed_mid_version_does_not_hold_up_the_others():
    """4 servers, a version of ~4.5 MB in 64 KB buckets, server 2 killed with SIGKILL while the
    buckets are on the wire. In one group that server relays rank 0's broadcast to another (a binomial
    tree over 5 ranks): the others waited for the group's timeout. Here the timeout (3600 s) is far
    beyond pytest's: the send returns only if nothing waits on it, with the 3 others on the version."""
    from primerl.rl.envs import load_environment
    from primerl.runtime.policy import build_model
    from primerl.runtime.ports import held_port
    from primerl.runtime.validate import load_config

    over = ("--model.dim", "256", "--model.n_layers", "4", "--threads", "1")
    servers = _real_servers(4, *over)
    cfg = load_config(ROOT / "examples" / "reverse_text.toml", list(over), check=False)
    model = build_model(cfg, load_environment(cfg.env.id, **cfg.env.args).vocab_size)
    urls = [u for _, u in servers]
    sender = PoolBroadcastSender(lambda: urls, "127.0.0.1", held_port(), timeout_s=3600, health_timeout_s=5,
                                 bucket_bytes=64 * 1024)
    try:
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        _send_and_check = lambda version, stream: sender.send_stream(version, weight_specs(sd), stream)  # noqa: E731
        _send_and_check(1, iter(sd.items()))
        sd = {k: v + 1 if v.is_floating_point() else v for k, v in sd.items()}
        victim = servers[2][0]

        def stream():
            for i, item in enumerate(sd.items()):
                if i == len(sd) // 2:  # half the buckets are out: the victim is receiving
                    victim.send_signal(signal.SIGKILL)
                    victim.wait(30)
                yield item

        _send_and_check(2, stream())
        assert victim.returncode == -signal.SIGKILL
        assert sender.lost == 1 and sender.num_receivers == 3
        for i, (_, url) in enumerate(servers):
            if i != 2:
                assert _health(url)["weights_version"] == 2, url
        _send_and_check(3, iter(sd.items()))  # the survivors' pairs carry on
        assert sender.num_receivers == 3 and sender.formed == 4
    finally:
        sender.close()
        for p, _ in servers:
            p.kill()
            p.wait(30)


BROADCAST = ["--inference.num_servers", "2", "--inference.weight_update", "broadcast"]


@needs_router
@pytest.mark.dist
def test_pool_by_broadcast_survives_a_killed_server_through_primerl_rl(tmp_path):
    out, steps = tmp_path / "job", 30
    proc = _start(out, steps, *BROADCAST, "--inference.broadcast_port", str(_port()))
    try:
        _wait_step(out, proc, 1)
        before = _processes(out)
        victim = before["inference-1"]
        _kill_when_busy(victim["url"], victim["pid"], signal.SIGKILL)
        router = before["router"]["url"]
        _wait_until(proc, lambda: victim["url"] not in _workers(router), "the dead server taken out of the router")
        _wait_until(proc, lambda: victim["url"] in _workers(router), "the restarted server back in the router")
        policy = read_metrics(out / "metrics.jsonl")[-1]["policy_version"]
        assert _health(victim["url"])["weights_version"] >= policy > 0  # the broadcast's version, not the init
        rows, text = _finish(proc, out, steps)
    finally:
        if proc.poll() is None:
            proc.kill()
    after = _processes(out)
    assert after["inference-1"]["restarts"] == 1 and after["inference-0"]["restarts"] == 0
    trainer = (out / "logs" / "trainer.log").read_text()
    assert f"weights version {steps} broadcast to 2 of 2 server(s)" in trainer  # the last version reached both
    assert "weight transfer pair 3:" in trainer  # the restarted server's own pair (the first two: one per server)
    assert not list((out / "transport" / "weights").glob("*/model.safetensors"))  # no weight file: broadcast only
    assert rows[-1]["inference/restarts"] == 1


@needs_router
@pytest.mark.dist
def test_a_pool_takes_deltas_and_fp8_in_transit_through_primerl_rl(tmp_path):
    """``inference.weight_transfer.delta`` / ``dtype = "fp8"`` with a pool of 2 servers: every step
    once, every version to both servers, deltas on the wire (a full version every 2, and for a server
    new to the pool), no repair; FP8 moves at most 0.3x the float32 engine's bytes (0.6x bf16's)."""
    steps, runs = 4, {}
    for name, over in (("delta", ["--inference.weight_transfer.delta", "true", "--inference.weight_transfer.full_every",
                                  "2", "--inference.weight_transfer.bucket_mb", "0.05"]),
                       ("fp8", ["--inference.weight_transfer.dtype", "fp8"])):
        out = tmp_path / name
        proc = _start(out, steps, *BROADCAST, "--inference.broadcast_port", str(_port()), *over)
        try:
            rows, _ = _finish(proc, out, steps)
        finally:
            if proc.poll() is None:
                proc.kill()
        trainer = (out / "logs" / "trainer.log").read_text()
        assert f"weights version {steps} broadcast to 2 of 2 server(s)" in trainer, trainer[-2000:]
        assert not list((out / "transport" / "weights").glob("*/model.safetensors"))  # no weight file
        runs[name] = rows, trainer
    rows, trainer = runs["delta"]
    assert "(delta)" in trainer or "(delta+full)" in trainer
    assert rows[-1]["weights/delta_versions"] >= 1 and rows[-1]["weights/repairs"] == 0
    assert min(r["weights/wire_fraction"] for r in rows) < 1
    full = [r["weights/raw_mb"] for r in rows if r["weights/wire_fraction"] == 1]  # a full version to both
    fp8_rows, _ = runs["fp8"]
    assert full and fp8_rows[-1]["weights/wire_mb"] <= 0.3 * max(full)


def test_pool_broadcast_config_and_dry_run():
    from primerl.runtime.config import ConfigError
    from primerl.runtime.placement import resolve_placement
    from primerl.runtime.validate import load_config

    root = ROOT
    cfg = load_config(root / "examples" / "reverse_text.toml", BROADCAST)
    assert resolve_placement(cfg).weight_update == "broadcast"
    with pytest.raises(ConfigError, match=r"^inference\.weight_update: external servers"):
        load_config(root / "examples" / "reverse_text.toml",
                    ["--inference.backend", "vllm", "--inference.vllm.urls", '["http://a:1"]',
                     "--inference.weight_update", "broadcast"])
