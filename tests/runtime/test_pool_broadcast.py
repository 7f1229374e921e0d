"""A pool of ``primerl inference`` servers takes weights by one broadcast from trainer rank 0
(``inference.weight_update = "broadcast"``, ``inference.pool_broadcast.PoolBroadcastSender``):

- every server of the pool is a rank of one group and holds each version exactly; a replaced
  server (new instance) makes the sender form a new group, where it gets the version in full; a
  server that is gone is left out;
- a server killed in the middle of a send: the group is re-formed with the servers that answer
  and the same version sent again (from the copy rank 0 keeps while a version is in flight);
- through ``primerl rl``: a server killed with SIGKILL is restarted by the pool's supervisor,
  rejoins the trainer's group and is routed to only once it holds the pool's version; every step
  exactly once.
"""

from __future__ import annotations

import os
import signal
import socket
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def test_every_server_is_a_rank_and_a_replaced_server_rejoins_with_the_version_in_full(monkeypatch):
    a, b = _server(), _server()
    urls = [a.url, b.url]
    sender = PoolBroadcastSender(lambda: urls, "127.0.0.1", _port(), timeout_s=60, health_timeout_s=2)
    b2 = None
    try:
        for version, seed in ((1, 1), (2, 2)):
            sd = _send(sender, version, seed)
            assert _holds(a, sd, version) and _holds(b, sd, version), version
        assert (sender.generation, sender.num_receivers) == (1, 2)  # one group for both versions

        port = b.port  # the supervisor restarts a server on the same port: a new process, a new instance
        b.stop()
        monkeypatch.setattr(server_metrics, "INSTANCE", "replaced")
        b2 = _server(port)
        sd = _send(sender, 3, 3)
        assert _holds(b2, sd, 3) and _holds(a, sd, 3)
        assert b2.engine.policy_version == 3 and (sender.generation, sender.num_receivers) == (2, 2)

        b2.stop()  # gone for good: left out of the next group, the others still get every version
        sd = _send(sender, 4, 4)
        assert _holds(a, sd, 4) and (sender.generation, sender.num_receivers) == (3, 1)
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
        # the formation with the member was given up on its failed join (not its 600 s timeout), the next
        # formed without it; nothing had been sent, so nothing is sent twice
        assert f"[{url!r}] failed to join" in caplog.text
        assert (sender.generation, sender.num_receivers, sender.resent) == (2, 1, 0) and _holds(real, sd, 1)
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
def test_a_server_killed_mid_send_leaves_and_the_survivors_get_the_version_again():
    member = _member("send")
    real = _server()
    try:
        url = member.stdout.readline().strip()
        sender = PoolBroadcastSender(lambda: [real.url, url], "127.0.0.1", _port(), timeout_s=60, health_timeout_s=2)
        sd = _send(sender, 1, 1)  # the member kills itself after the header: one failed send, then the survivor
        assert member.wait(10) == -signal.SIGKILL
        assert sender.resent == 1 and (sender.generation, sender.num_receivers) == (2, 1)
        assert _holds(real, sd, 1)
        sd = _send(sender, 2, 2)  # the re-formed group carries on
        assert sender.resent == 1 and _holds(real, sd, 2)
        sender.close()
    finally:
        if member.poll() is None:
            member.kill()
        real.stop()


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
    assert "weight broadcast group 2" in trainer or "weight broadcast group 3" in trainer  # re-formed
    assert not list((out / "transport" / "weights").glob("*/model.safetensors"))  # no weight file: broadcast only
    assert rows[-1]["inference/restarts"] == 1


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
