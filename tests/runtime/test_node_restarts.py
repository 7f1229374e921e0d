"""Supervised restarts of a job whose ``primerl node`` agents were started by hand (issue 45,
``launch.node_supervise``): the commands ``deployment.kind = "nodes"`` prints, one per host
(127.0.0.1 trainer, 127.0.0.2 orchestrator), a shared output_dir.

- a killed trainer rank, then a killed orchestrator process: the agents rejoin through the
  rendezvous twice and the job ends rc 0 on both nodes, every step once in ``metrics.jsonl``,
  ``job/restarts`` counting the restarts, resumed from the checkpoints (not from step 0);
- past ``deployment.max_restarts`` both agents fail, naming the process and cause of each restart.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from primerl.runtime.metrics import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_orchestrator_node import _cfg, _start, _stop, _wait  # noqa: E402


def _beat_pid(out: Path, node_dir: str, name: str) -> int | None:
    try:
        return json.loads((out / "heartbeats" / node_dir / f"{name}.json").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def _until(cond, what, procs, logs, timeout=240):
    deadline = time.monotonic() + timeout
    while not cond():
        assert all(p.poll() is None for p in procs.values()), {k: v.read_text()[-3000:] for k, v in logs.items()}
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.1)


def _kill(pid: int | None) -> None:
    assert pid is not None
    os.kill(pid, 9)


def _job(tmp_path, *over):
    out = tmp_path / "out"
    cfg = _cfg("--output_dir", str(out), "--checkpoint.interval", "2", "--deployment.grace_s", "5", *over)
    procs = _start(tmp_path, cfg)
    logs = {role: tmp_path / f"host{i}" / "node.log" for i, role in enumerate(("trainer", "orchestrator"))}
    return out, procs, logs


def _rank_pid(out):
    return _beat_pid(out, "node0-trainer", "trainer-rank0")


def _orch_pid(out):
    return _beat_pid(out, "node1-orchestrator", "orchestrator")


@pytest.mark.dist
def test_hand_started_agents_restart_the_job_from_the_checkpoint_every_step_once(tmp_path):
    out, procs, logs = _job(tmp_path, "--max_steps", "6", "--deployment.max_restarts", "2")
    metrics = out / "metrics.jsonl"
    try:
        # round 0: past the step-2 checkpoint, then its trainer rank is killed
        _until(lambda: (out / "checkpoints" / "step_000002").is_dir() and len(read_metrics(metrics)) >= 3,
               "the step-2 checkpoint and 3 metrics rows", procs, logs)
        _kill(_rank_pid(out))
        # round 1: its first step, then the orchestrator's process is killed
        _until(lambda: any(r.get("job/restarts") == 1 for r in read_metrics(metrics)) and _orch_pid(out),
               "a step of round 1", procs, logs)
        _kill(_orch_pid(out))
        rcs = {role: _wait(procs, role, 300) for role in procs}
    finally:
        _stop(procs)
    text = {role: path.read_text(errors="replace") for role, path in logs.items()}
    assert rcs == {"trainer": 0, "orchestrator": 0}, {k: v[-4000:] for k, v in text.items()}
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == list(range(6)), [r["step"] for r in rows]  # every step exactly once
    restarts = [r["job/restarts"] for r in rows]
    assert restarts == sorted(restarts) and restarts[0] == 0 and restarts[-1] == 2, restarts
    assert restarts.count(0) >= 2  # round 1 resumed from a checkpoint: the rows before it are round 0's
    for t in text.values():  # every agent rejoined twice, each time naming the cause
        restart_lines = [ln for ln in t.splitlines() if ": RESTART " in ln]
        assert len(restart_lines) == 2, restart_lines
        assert _names_the_killed_rank(restart_lines[0]), restart_lines
        assert "node 1 (127.0.0.2) orchestrator: its process" in restart_lines[1], restart_lines
        assert "code -9" in restart_lines[1], restart_lines
    assert "step_000002 (step 2)" in text["trainer"] or "(step 2)" in text["trainer"]


def _names_the_killed_rank(cause: str) -> bool:
    """Round 0's cause (trainer rank 0 killed -9) names that rank: seen ending by its node's agent, or by
    torchrun, or, where the orchestrator's report of the closed link is posted first, as that link's
    other end. Never the orchestrator's own end (its death follows its report in the same poll)."""
    return ("node 0 (127.0.0.1) trainer: the trainer-rank0 process" in cause
            or "node 0 (127.0.0.1, trainer ranks 0-0): torchrun exited" in cause  # the rank's exit, seen by torchrun
            or ("from the trainer on node 0 (127.0.0.1) (rank 0)" in cause and "Connection closed by peer" in cause))


@pytest.mark.dist
def test_past_max_restarts_every_agent_fails_naming_each_cause(tmp_path):
    out, procs, logs = _job(tmp_path, "--max_steps", "200", "--deployment.max_restarts", "1")
    try:
        # round 0's trainer rank, once it made a step (its agent has seen it alive)
        _until(lambda: read_metrics(out / "metrics.jsonl"), "a step of round 0", procs, logs)
        _kill(_rank_pid(out))
        _until(lambda: "RESTART 1" in logs["orchestrator"].read_text() and _orch_pid(out) is not None,
               "round 1's orchestrator", procs, logs)
        _kill(_orch_pid(out))
        rcs = {role: _wait(procs, role, 200) for role in procs}
    finally:
        _stop(procs)
    text = {role: path.read_text(errors="replace") for role, path in logs.items()}
    assert rcs == {"trainer": 1, "orchestrator": 1}, {k: v[-4000:] for k, v in text.items()}
    for t in text.values():
        final = t[t.index("primerl node: FAILED: "):]
        assert "the job failed 2 times (deployment.max_restarts = 1)" in final, final
        first = final[final.index("\n1. "):final.index("\n2. ")]
        assert _names_the_killed_rank(first), final
        assert "2. node 1 (127.0.0.2) orchestrator: its process" in final and "code -9" in final, final
