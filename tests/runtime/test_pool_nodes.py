"""A server pool across nodes (``examples/reverse_text_2node_pool.toml``): a trainer node, two
inference nodes of two ``primerl inference`` servers each, the orchestrator's own node with
vllm-router, all as 127.x "nodes" of this machine started by ``primerl rl``.

- the job runs to ``max_steps`` with every step exactly once while a server on EACH inference
  node is killed with SIGKILL: the node restarts it on its port, it rejoins trainer rank 0's
  broadcast group and is routed to again only holding the pool's version;
- ``--dry-run`` names every node, server and port, and the plan fills in the servers' URLs;
- what still cannot work is refused at ``--dry-run`` in one line naming the key.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from primerl.runtime.config import ConfigError
from primerl.runtime.metrics import read_metrics
from primerl.runtime.validate import load_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_server_pool import _health, _kill_when_busy, _wait_step, _wait_until, _workers, needs_router  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "reverse_text_2node_pool.toml"


def _port() -> int:
    """A free port, reserved until this process exits (no other process can take it first)."""
    from primerl.runtime.ports import held_port

    return held_port()


def _ports(n: int) -> int:
    """A base port with ``n`` free ports after it on 127.0.0.2 and 127.0.0.3 (the servers' ports)."""
    for _ in range(50):
        base = _port()
        try:
            for host in ("127.0.0.2", "127.0.0.3"):
                for j in range(n):
                    with socket.socket() as s:
                        s.bind((host, base + j))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


def _over(out: Path, steps: int) -> list[str]:
    return ["--output_dir", str(out), "--max_steps", str(steps), "--orchestrator.batch_size", "4",
            "--orchestrator.group_size", "4", "--inference.max_batch_size", "1", "--inference.health_timeout_s", "3",
            "--log.plot", "false", "--orchestrator.weights_timeout_s", "120", "--trainer.batch_timeout_s", "120",
            "--deployment.rdzv_endpoint", f"127.0.0.1:{_port()}", "--deployment.grace_s", "5",
            "--inference.vllm.port", str(_ports(2)), "--inference.broadcast_port", str(_port()),
            "--orchestrator.zmq_port", str(_port())]


def _rows(out: Path, node: int) -> dict[str, dict]:
    """``processes-node<i>.json`` by URL (the servers of inference node ``node``)."""
    return {r["url"]: r for r in json.loads((out / f"processes-node{node}.json").read_text())}


def _router(out: Path) -> str:
    return next(r["url"] for r in json.loads((out / "processes-node3.json").read_text()) if r["role"] == "router")


@needs_router
@pytest.mark.dist
def test_pool_on_two_inference_nodes_survives_a_killed_server_on_each(tmp_path):
    out, steps = tmp_path / "job", 60  # the killed servers must be back before the job ends, under CI's load
    proc = subprocess.Popen([sys.executable, "-m", "primerl.runtime.cli", "rl", "--config", str(EXAMPLE),
                             *_over(out, steps)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        _wait_step(out, proc, 1)
        router = _router(out)
        victims = []
        for node in (1, 2):  # a server on each inference node, each while it has requests in flight
            url, row = sorted(_rows(out, node).items())[1]
            _kill_when_busy(url, row["pid"], signal.SIGKILL)
            _wait_until(proc, lambda u=url: u not in _workers(router), f"{url} taken out of the router")
            victims.append((node, url, row["pid"]))
        for node, url, pid in victims:
            _wait_until(proc, lambda n=node, u=url, p=pid: _rows(out, n)[u]["pid"] != p, f"{url} restarted")
            _wait_until(proc, lambda u=url: u in _workers(router), f"{url} back in the router")
            policy = read_metrics(out / "metrics.jsonl")[-1]["policy_version"]
            assert _health(url)["weights_version"] >= policy > 0, url  # the broadcast's version, not the init
        text, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, text[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(steps)), "every step exactly once"
    for node, url, _ in victims:
        assert _rows(out, node)[url]["restarts"] == 1
        others = [r["restarts"] for u, r in _rows(out, node).items() if u != url]
        assert others == [0], (node, others)
    assert rows[-1]["inference/servers_replaced"] == 2
    assert sum(r["inference/redispatched"] for r in rows) >= 1  # the killed servers' requests went elsewhere
    trainer = (out / "logs" / "node0-trainer.log").read_text()
    assert f"weights version {steps} broadcast to 4 of 4 server(s)" in trainer  # the last version reached all 4
    for i in range(4):  # no weight file anywhere: every server took every version by broadcast
        assert "update_weights_from_path" not in (out / "logs" / f"inference-{i}.log").read_text()


def _dry_run(capsys, *over: str) -> tuple[int, str, str]:
    """``primerl rl --config EXAMPLE --dry-run *over`` (the command's own entry point): rc, stdout, stderr."""
    from primerl.runtime.cli import main

    capsys.readouterr()
    rc = main(["rl", "--config", str(EXAMPLE), "--dry-run", *over])
    got = capsys.readouterr()
    return rc, got.out, got.err


@pytest.mark.fixed_ports  # the example's own ports (servers 8200, 8201, zmq, rendezvous): the dry run checks them
def test_dry_run_names_every_node_server_and_port(capsys):
    rc, out, err = _dry_run(capsys)
    assert rc == 0, err
    for host in ("127.0.0.2", "127.0.0.3"):
        assert f"2 primerl inference server(s) on {host}:8200, {host}:8201, supervised by the node" in out
    assert "# node 0 127.0.0.1: trainer ranks 0-0" in out
    assert "# node 3 127.0.0.4: orchestrator + vllm-router on 127.0.0.4:<a free port>" in out
    assert ("# inference pool: 4 server(s) http://127.0.0.2:8200, http://127.0.0.2:8201, http://127.0.0.3:8200, "
            "http://127.0.0.3:8201; weights by broadcast from trainer rank 0") in out
    for i, role in ((0, "trainer"), (1, "inference"), (2, "inference"), (3, "orchestrator")):
        assert f"--role {role} --node-rank {i}" in out


@pytest.mark.parametrize("over, key", [
    (["--inference.weight_update", "filesystem"], "inference.weight_update"),
    (["--inference.vllm.port", "65535"], "inference.vllm.port"),
    (["--inference.pd.prefill", "1", "--inference.pd.decode", "1", "--inference.num_servers", "1"], "inference.pd"),
    (["--deployment.inference_nodes", "0", "--deployment.hosts", '["127.0.0.1", "127.0.0.4"]'],
     "inference.num_servers"),
])
def test_what_cannot_work_is_refused_naming_the_key(over, key):
    with pytest.raises(ConfigError, match="^" + key.replace(".", r"\.")):
        load_config(EXAMPLE, over)


def test_dry_run_refuses_in_one_line(capsys):
    rc, _, err = _dry_run(capsys, "--inference.weight_update", "filesystem")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "inference.weight_update: 'filesystem' has the servers load the trainer's files" in err


def test_the_plan_fills_in_the_pools_urls_and_the_trainers_host():
    from primerl.runtime.launch.deployment import node_plan, pool_server_urls
    from primerl.runtime.launch.node import _pool_env
    from primerl.runtime.transport import INFERENCE_POOL_ENV, TRAINER_HOST_ENV

    cfg = load_config(EXAMPLE, ["--deployment.hosts", '["10.0.0.5", "10.0.0.6", "10.0.0.7", "10.0.0.8"]'])
    plan = node_plan(cfg)
    urls = ["http://10.0.0.6:8200", "http://10.0.0.6:8201", "http://10.0.0.7:8200", "http://10.0.0.7:8201"]
    assert pool_server_urls(cfg, plan) == urls
    env = _pool_env(cfg, plan, plan.nodes[0])
    assert env[TRAINER_HOST_ENV] == "10.0.0.5" and json.loads(env[INFERENCE_POOL_ENV]) == {"servers": urls}
