"""The orchestrator (with its embedded engine) on a node of its own: rollout batches go to the
trainer over ZeroMQ and weights come back by a gloo broadcast from trainer rank 0, its group's
store on the orchestrator's node, the "new version" signal from the receiver; nothing crosses
through output_dir. Nodes are 127.0.0.1 (trainer) and 127.0.0.2 (orchestrator), each `primerl
node` in its own working directory with its own relative output_dir, as on two hosts.

- the job reaches max_steps with rc 0 on both nodes and ends (bounded), with no weights file or
  marker on the orchestrator's node and no rollout file on the trainer's;
- kill -9 of the orchestrator node's process mid-run stops the trainer node within a bounded time
  with a message naming the orchestrator's node and role;
- a trainer rank waiting for a batch learns at once that the orchestrator's process is gone;
- ``inference.weight_update = "filesystem"`` is refused for such a plan, "auto" picks broadcast.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from primerl.runtime.config import ConfigError, to_toml
from primerl.runtime.validate import load_config
from primerl.runtime.metrics import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_multinode import _descendants  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    """A free port, reserved until this process exits (no other process can take it first)."""
    from primerl.runtime.ports import held_port

    return held_port()


def _env(**extra):
    # faulthandler: a process that hangs is sent SIGABRT and leaves every thread's stack in its log
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", **extra)


PLAN = ["--device", "cpu", "--deployment.kind", "nodes", "--deployment.trainer_nodes", "1",
        "--deployment.orchestrator", "own", "--deployment.hosts", "127.0.0.1,127.0.0.2"]


def _cfg(*over):
    return load_config(ROOT / "examples" / "reverse_text.toml", [
        "--output_dir", "out", "--orchestrator.batch_size", "4", "--orchestrator.group_size", "4",
        "--log.plot", "false", "--orchestrator.weights_timeout_s", "60", "--trainer.batch_timeout_s", "60", *PLAN,
        "--deployment.rdzv_endpoint", f"127.0.0.1:{_free_port()}", "--deployment.rdzv_timeout_s", "60",
        "--orchestrator.batch_transport", "zmq", "--orchestrator.zmq_port", str(_free_port()),
        "--inference.broadcast_port", str(_free_port()), *over])


def _start(tmp_path, cfg, nodes=((0, "trainer"), (1, "orchestrator"))) -> dict[str, subprocess.Popen]:
    procs = {}
    for i, role in nodes:
        wd = tmp_path / f"host{i}"
        wd.mkdir()
        (wd / "cfg.toml").write_text(to_toml(cfg))  # each host its own copy of the config
        procs[role] = subprocess.Popen(
            [sys.executable, "-m", "primerl.runtime.cli", "node", "--config", "cfg.toml", "--role", role,
             "--node-rank", str(i)], cwd=wd, env=_env(), stdout=open(wd / "node.log", "wb"), stderr=subprocess.STDOUT,
            start_new_session=True)
    return procs


def _signal_all(procs, sig) -> None:
    """``sig`` to every process of the nodes (torchrun runs in a session of its own)."""
    pids = [q for p in procs.values() for q in _descendants(p.pid)]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait(procs, role, timeout):
    """The role's exit code; on a hang, every process's stack goes to its log first (SIGABRT)."""
    try:
        return procs[role].wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_all(procs, signal.SIGABRT)
        time.sleep(3)
        return None


def _stop(procs):
    _signal_all(procs, signal.SIGKILL)
    for p in procs.values():
        p.wait()


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


@pytest.mark.dist
def test_orchestrator_on_its_own_node_gets_weights_over_the_network_only(tmp_path):
    cfg = _cfg("--max_steps", "6", "--orchestrator.max_async_level", "0")  # on policy: mismatch_kl shows the weights
    procs = _start(tmp_path, cfg)
    try:
        rcs = {role: _wait(procs, role, 150) for role in procs}  # the end must not hang
    finally:
        _stop(procs)
    logs = {role: (tmp_path / f"host{i}" / "node.log").read_text(errors="replace")
            for i, role in enumerate(("trainer", "orchestrator"))}
    assert rcs == {"trainer": 0, "orchestrator": 0}, {k: v[-3000:] for k, v in logs.items()}
    trainer_out, orch_out = tmp_path / "host0" / "out", tmp_path / "host1" / "out"
    rows = read_metrics(trainer_out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6))
    # the broadcast weights were loaded, not only their version recorded: on policy, the sampler's
    # log-probs are the trainer's (a dropped broadcast gave mismatch_kl 0.13-0.20 here; loaded, ~1e-14)
    assert all(r["policy_version"] == r["step"] for r in rows), [r["policy_version"] for r in rows]
    assert max(r["mismatch_kl/mean"] for r in rows) < 1e-3, [r["mismatch_kl/mean"] for r in rows]
    assert "weights by broadcast" in logs["orchestrator"]
    assert "the trainer ended its updates after version 6" in logs["orchestrator"]
    # the orchestrator's node holds no weights, marker, metrics or checkpoint; the trainer's no rollout
    assert not (orch_out / "transport" / "weights").exists() or not _files(orch_out / "transport" / "weights")
    assert not [f for f in _files(orch_out) if f.startswith(("checkpoints", "metrics"))], _files(orch_out)
    assert not _files(trainer_out / "transport" / "rollouts"), _files(trainer_out)
    assert (trainer_out / "checkpoints" / "step_000006").is_dir()


@pytest.mark.dist
def test_killing_the_orchestrator_node_stops_the_trainer_naming_it(tmp_path):
    cfg = _cfg("--max_steps", "200", "--orchestrator.weights_timeout_s", "120", "--trainer.batch_timeout_s", "120")
    procs = _start(tmp_path, cfg)
    metrics = tmp_path / "host0" / "out" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while len(read_metrics(metrics)) < 3:
            assert all(p.poll() is None for p in procs.values()), (tmp_path / "host0" / "node.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no 3 steps in 120 s"
            time.sleep(0.1)
        os.killpg(procs["orchestrator"].pid, signal.SIGKILL)
        rc = _wait(procs, "trainer", 60)  # well inside batch_timeout_s / weights_timeout_s (120 s)
    finally:
        _stop(procs)
    log = (tmp_path / "host0" / "node.log").read_text(errors="replace")
    assert rc == 1, log[-3000:]
    assert "the orchestrator on node 1 (127.0.0.2)" in log, log[-3000:]
    assert log.strip().splitlines()[-1].startswith("primerl node: FAILED: node 0 (127.0.0.1, trainer ranks 0-0)"), \
        log[-3000:]
    # no wall-clock bound on 2 shared cores: the cause in the log says it was the peer's death, and the
    # wait above ends before either timeout (120 s) could have fired
    assert "timed out" not in log.lower().split("primerl node: failed")[-1], log[-3000:]
    assert len(read_metrics(metrics)) < 200


def test_a_trainer_rank_waiting_for_a_batch_learns_the_orchestrator_is_gone(tmp_path, monkeypatch):
    from primerl.runtime.transport import ORCHESTRATOR_NODE_ENV, ProducerDied
    from primerl.runtime.zmq_transport import LOST_AFTER_S, ZmqTransport

    port = _free_port()
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); "
            "from primerl.runtime.zmq_transport import ZmqTransport; "
            f"t = ZmqTransport(sys.argv[2], side='orchestrator', port={port}); t.put_batch(0, 0, {{'x': 1}}); "
            "time.sleep(600)")
    orch = subprocess.Popen([sys.executable, "-c", code, str(ROOT), str(tmp_path / "orch")], env=_env())
    monkeypatch.setenv(ORCHESTRATOR_NODE_ENV, "the orchestrator on node 1 (127.0.0.2)")
    tr = ZmqTransport(tmp_path / "trainer", side="trainer", port=port)
    try:
        assert tr.get_batch(0, 0, timeout=60) == {"x": 1}
        orch.kill()
        orch.wait()
        # ProducerDied, not TransportTimeout: the lost peer is named before the batch timeout runs out
        with pytest.raises(ProducerDied, match=r"step 1 \(rank 0\): the orchestrator on node 1 \(127\.0\.0\.2\) at "
                                               rf"tcp://127\.0\.0\.1:{port} closed the connection"):
            tr.get_batch(1, 0, timeout=max(60, 6 * LOST_AFTER_S))
    finally:
        tr.close()
        if orch.poll() is None:
            orch.kill()


def test_filesystem_weights_are_refused_for_an_orchestrator_node_and_auto_broadcasts():
    from primerl.runtime.placement import resolve_placement

    with pytest.raises(ConfigError, match=r"^inference.weight_update: 'filesystem' needs output_dir shared by the "
                                          r"trainer and the orchestrator"):
        load_config(None, [*PLAN, "--inference.weight_update", "filesystem"])
    assert resolve_placement(load_config(None, PLAN)).weight_update == "broadcast"
    beside = load_config(None, [*PLAN[:-4], "--deployment.hosts", "127.0.0.1"])  # beside the trainer: unchanged
    assert beside.deployment.orchestrator == "trainer" and resolve_placement(beside).weight_update == "filesystem"


def test_dry_run_names_the_key_in_one_line(tmp_path, capsys, monkeypatch):
    from primerl.runtime.cli import main  # the command's own entry point, in this process (no torch import)

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    rc = main(["rl", "--dry-run", *PLAN, "--inference.weight_update", "filesystem"])
    err = capsys.readouterr().err
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "inference.weight_update: 'filesystem' needs output_dir shared" in lines[0], err


def test_filesystem_weights_are_refused_for_inference_nodes():
    base = ["--device", "cpu", "--deployment.kind", "nodes", "--deployment.inference_nodes", "1",
            "--deployment.hosts", "127.0.0.1,127.0.0.2", "--inference.backend", "vllm"]
    with pytest.raises(ConfigError, match=r"^inference.vllm.weight_update: 'filesystem' has the inference nodes' "
                                          r"servers load the trainer's files"):
        load_config(None, base)
    cfg = load_config(None, [*base, "--inference.vllm.weight_update", "broadcast"])
    assert cfg.deployment.inference_nodes == 1


@pytest.mark.parametrize("http", ["stdlib", "aiohttp"])
def test_primerl_inference_takes_weights_by_broadcast_with_no_file(http):
    """An inference node's ``primerl inference`` server answers trainer rank 0's broadcast RPCs as
    vLLM's worker extension does (``init_broadcast``, ``update_weights_from_broadcast``): two
    versions arrive over gloo in the Hugging Face layout and the engine holds them exactly."""
    import torch

    from primerl.models.config import MoETransformerConfig
    from primerl.models.transformer import MoETransformer
    from primerl.runtime.inference.engine import InferenceEngine
    from primerl.runtime.inference.hf_weights import hf_weights
    from primerl.runtime.inference.server import EngineServer, http_frontends
    from primerl.runtime.inference.vllm_client import http_json
    from primerl.runtime.inference.weight_sync import BroadcastWeightSender

    if http not in http_frontends():
        pytest.skip(f"{http} front end not installed")

    def model(seed):
        m = MoETransformer(MoETransformerConfig.tiny(vocab_size=11, max_position_embeddings=64))
        m.init_weights(seed=seed)
        return m

    srv = EngineServer(InferenceEngine(model(0), max_batch_size=2), http=http).start()
    sender = BroadcastWeightSender("127.0.0.1", _free_port(), 1, timeout_s=60, rpc_url=srv.url, backend="gloo",
                                   peer="the inference server")
    try:
        for version, seed in ((3, 1), (4, 2)):
            new = model(seed)
            sender.send(version, hf_weights(new))  # the server's answer must report the version (checked inside)
            got = srv.engine.model.state_dict()
            for name, t in new.state_dict().items():
                assert torch.equal(got[name], t), name
            got = http_json(srv.url + "/collective_rpc", {"method": "weights_version"}, 10)
            assert got["results"] == [{"version": version}]
    finally:
        sender.close()
        srv.stop()


@pytest.mark.dist
def test_three_nodes_trainer_inference_server_orchestrator_share_no_file(tmp_path):
    """Trainer on 127.0.0.1, a ``primerl inference`` server on 127.0.0.2 (the vLLM protocol),
    the orchestrator on 127.0.0.3: weights go by gloo broadcast from trainer rank 0 to the server
    (``inference.vllm.weight_update = "broadcast"``), the orchestrator learns versions from the
    server (``weights_version``), batches go over ZeroMQ; every node in its own directory."""
    vport = _free_port()
    cfg = load_config(ROOT / "examples" / "reverse_text.toml", [
        "--output_dir", "out", "--max_steps", "6", "--orchestrator.batch_size", "4", "--orchestrator.group_size", "4",
        "--orchestrator.max_async_level", "0",  # on policy: mismatch_kl shows whether the weights were loaded
        "--log.plot", "false", "--orchestrator.weights_timeout_s", "60", "--trainer.batch_timeout_s", "60",
        "--device", "cpu", "--deployment.kind", "nodes", "--deployment.trainer_nodes", "1",
        "--deployment.inference_nodes", "1", "--deployment.orchestrator", "own",
        "--deployment.hosts", "127.0.0.1,127.0.0.2,127.0.0.3",
        "--deployment.rdzv_endpoint", f"127.0.0.1:{_free_port()}",
        "--deployment.rdzv_timeout_s", "60", "--orchestrator.batch_transport", "zmq",
        "--orchestrator.zmq_port", str(_free_port()), "--inference.backend", "vllm",
        "--inference.vllm.url", f"http://127.0.0.2:{vport}", "--inference.vllm.port", str(vport),
        "--inference.vllm.weight_update", "broadcast", "--inference.vllm.broadcast_host", "127.0.0.1",
        "--inference.vllm.broadcast_port", str(_free_port()), "--inference.vllm.broadcast_timeout_s", "60"])
    procs = _start(tmp_path, cfg, ((1, "inference"), (0, "trainer"), (2, "orchestrator")))
    try:
        rcs = {role: _wait(procs, role, 150) for role in ("trainer", "orchestrator")}
        # the serving node's agent (hand-started: it supervises its role) ends it with the job, rc 0
        rc_inf = _wait(procs, "inference", max(cfg.deployment.grace_s, 30) + 60)
    finally:
        _stop(procs)
    logs = {i: (tmp_path / f"host{i}" / "node.log").read_text(errors="replace") for i in range(3)}
    assert rcs == {"trainer": 0, "orchestrator": 0}, {k: v[-3000:] for k, v in logs.items()}
    assert rc_inf == 0, logs[1][-3000:]
    # a normal end, said so (issue 45): the serving node's round, ended by its agent once the job was done, used to
    # log `primerl node: FAILED: ... got SIGTERM` (and post an abort) although the job had ended well
    for i, log in logs.items():
        assert "FAILED" not in log and "got SIGTERM" not in log, (i, log[-3000:])
    assert "node 1 (127.0.0.2) inference: the job is done (trainer node 0 finished); ending this node" in logs[1], \
        logs[1][-3000:]
    rows = read_metrics(tmp_path / "host0" / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6))
    assert "weights version 6 broadcast to 1 receiver(s)" in logs[0]
    assert max(r["policy_version"] for r in rows) >= 1  # sampled with weights that came by broadcast
    # ... and loaded by the server, not only their version recorded (that gave mismatch_kl 0.13-0.20)
    assert all(r["policy_version"] == r["step"] for r in rows), [r["policy_version"] for r in rows]
    assert max(r["mismatch_kl/mean"] for r in rows) < 1e-3, [r["mismatch_kl/mean"] for r in rows]
    for i in (1, 2):  # neither the server's nor the orchestrator's node holds a weights file or marker
        assert not [f for f in _files(tmp_path / f"host{i}") if "weights" in f or f.endswith("STABLE")], i
    assert not _files(tmp_path / "host0" / "out" / "transport" / "rollouts")


def test_the_orchestrator_waits_until_every_batch_is_acknowledged(tmp_path):
    """``wait_taken``: a batch put but not yet received by its rank keeps the orchestrator (it
    would be lost in the socket at exit); each rank's receipt releases it."""
    from primerl.runtime.transport import TransportTimeout
    from primerl.runtime.zmq_transport import ZmqTransport

    port = _free_port()
    orch = ZmqTransport(tmp_path / "o", side="orchestrator", port=port)
    ranks = [ZmqTransport(tmp_path / f"t{r}", side="trainer", port=port) for r in range(2)]
    try:
        for r in range(2):
            orch.put_batch(0, r, {"rank": r})
        assert ranks[0].get_batch(0, 0, timeout=30) == {"rank": 0}
        with pytest.raises(TransportTimeout, match=r"take the rollout batches \(step, rank\) \[\(0, 1\)\]"):
            orch.wait_taken(0.5)
        assert ranks[1].get_batch(0, 1, timeout=30) == {"rank": 1}
        orch.wait_taken(10)
    finally:
        for t in (orch, *ranks):
            t.close()
