"""The stall watchdog of node agents started by hand (issue 45, ``launch.node_supervise``): the
commands ``deployment.kind = "nodes"`` prints (127.0.0.1 trainer, 127.0.0.2 orchestrator), restarts
off. A SIGSTOPped process (a trainer rank; the orchestrator, which runs inside its node's round
process; trainer node 0's round agent, which waits on torchrun) is named by its node's agent with
its stack (``py-spy dump``) in that node's log within ``deployment.stall_timeout_s`` (plus a
poll); both agents end, each last line naming the stopped process, and nothing of the job is
left running.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from primerl.runtime.launch.watchdog import process_state
from primerl.runtime.metrics import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_multinode import _descendants  # noqa: E402
from test_node_restarts import _until  # noqa: E402
from test_orchestrator_node import _cfg, _start, _stop, _wait  # noqa: E402

STALL, GRACE = 40, 3  # above the job's start-up without progress on a loaded 2-core machine
# the process stopped, its node's heartbeat directory and name, a function of its stack py-spy shows
ROLES = {"trainer": ("node0-trainer", "trainer-rank0", "run_trainer"),
         "orchestrator": ("node1-orchestrator", "orchestrator", "orchestrator_main"),
         "agent": (None, "node0-trainer agent", "_run_trainer")}  # trainer node 0's round agent (waits on torchrun)


def _child(pid: int) -> int:
    """The one child process of ``pid`` (a supervising agent's round agent)."""
    kids = [int(st.parent.name) for st in Path("/proc").glob("[0-9]*/stat")
            if _ppid(st) == pid]
    assert len(kids) == 1, kids
    return kids[0]


def _ppid(stat: Path) -> int | None:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


@pytest.mark.dist
@pytest.mark.parametrize("role", ["trainer", "orchestrator", "agent"])
def test_a_stopped_process_of_a_hand_started_node_is_named_with_its_stack(tmp_path, role):
    out = tmp_path / "out"
    # far more steps than fit in STALL (~0.04 s a step): a stopped agent leaves its torchrun running, and
    # a job that finished before the stall was seen would end rc 0 (seen in CI)
    cfg = _cfg("--output_dir", str(out), "--max_steps", "100000", "--checkpoint.interval", "0",
               "--deployment.max_restarts", "0", "--deployment.stall_timeout_s", str(STALL),
               "--deployment.grace_s", str(GRACE), "--orchestrator.weights_timeout_s", "300",
               "--trainer.batch_timeout_s", "300")
    procs = _start(tmp_path, cfg)
    logs = {r: tmp_path / f"host{i}" / "node.log" for i, r in enumerate(("trainer", "orchestrator"))}
    node_dir, name, frame = ROLES[role]
    try:
        _until(lambda: len(read_metrics(out / "metrics.jsonl")) >= 2, "2 steps", procs, logs)
        victim = (_child(procs["trainer"].pid) if node_dir is None else
                  json.loads((out / "heartbeats" / node_dir / f"{name}.json").read_text())["pid"])
        pids = [q for p in procs.values() for q in _descendants(p.pid)]
        os.kill(victim, signal.SIGSTOP)
        rcs = {r: _wait(procs, r, STALL + GRACE + 120) for r in procs}
        left = [pid for pid in pids if process_state(pid) not in (None, "Z", "X")]
    finally:
        _stop(procs)
    text = {r: path.read_text(errors="replace") for r, path in logs.items()}
    assert rcs == {"trainer": 1, "orchestrator": 1}, {k: v[-4000:] for k, v in text.items()}
    said = f"the {name} process (pid {victim} on "
    own = text["trainer" if role == "agent" else role]
    assert f"primerl watchdog: {name} (pid {victim}" in own and frame in own, own[-4000:]  # its stack, in its log
    assert "stopped by a signal (SIGSTOP)" in own and f"deployment.stall_timeout_s = {STALL}" in own, own[-4000:]
    for t in text.values():  # each agent's last line names the stopped process
        last = t.strip().splitlines()[-1]
        assert last.startswith("primerl node: FAILED:") and said in last, t[-3000:]
    assert not left, left
