"""The stall watchdog of node agents started by hand (issue 45, ``launch.node_supervise``): the
commands ``deployment.kind = "nodes"`` prints (127.0.0.1 trainer, 127.0.0.2 orchestrator), restarts
off. A SIGSTOPped process of either role (a trainer rank; the orchestrator, which runs inside its
node's round process) is named by its node's agent with its stack (``py-spy dump``) in that
node's log once no process of the job progressed for ``deployment.stall_timeout_s``; both agents
end, the other's last line naming the stopped process, and nothing of the job is left running.
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

STALL, GRACE = 20, 3
# the process stopped, its node's heartbeat directory and name, a function of its stack py-spy shows
ROLES = {"trainer": ("node0-trainer", "trainer-rank0", "run_trainer"),
         "orchestrator": ("node1-orchestrator", "orchestrator", "orchestrator_main")}


@pytest.mark.dist
@pytest.mark.parametrize("role", ["trainer", "orchestrator"])
def test_a_stopped_process_of_a_hand_started_node_is_named_with_its_stack(tmp_path, role):
    out = tmp_path / "out"
    cfg = _cfg("--output_dir", str(out), "--max_steps", "200", "--checkpoint.interval", "0",
               "--deployment.max_restarts", "0", "--deployment.stall_timeout_s", str(STALL),
               "--deployment.grace_s", str(GRACE), "--orchestrator.weights_timeout_s", "300",
               "--trainer.batch_timeout_s", "300")
    procs = _start(tmp_path, cfg)
    logs = {r: tmp_path / f"host{i}" / "node.log" for i, r in enumerate(("trainer", "orchestrator"))}
    node_dir, name, frame = ROLES[role]
    try:
        _until(lambda: len(read_metrics(out / "metrics.jsonl")) >= 2, "2 steps", procs, logs)
        victim = json.loads((out / "heartbeats" / node_dir / f"{name}.json").read_text())["pid"]
        pids = [q for p in procs.values() for q in _descendants(p.pid)]
        os.kill(victim, signal.SIGSTOP)
        rcs = {r: _wait(procs, r, STALL + GRACE + 120) for r in procs}
        left = [pid for pid in pids if process_state(pid) not in (None, "Z", "X")]
    finally:
        _stop(procs)
    text = {r: path.read_text(errors="replace") for r, path in logs.items()}
    assert rcs == {"trainer": 1, "orchestrator": 1}, {k: v[-4000:] for k, v in text.items()}
    said = f"the {name} process (pid {victim} on "
    own = text[role]
    assert f"primerl watchdog: {name} (pid {victim}" in own and frame in own, own[-4000:]  # its stack, in its log
    assert "stopped by a signal (SIGSTOP)" in own and "deployment.stall_timeout_s = 20" in own, own[-4000:]
    for t in text.values():  # each agent's last line names the stopped process
        last = t.strip().splitlines()[-1]
        assert last.startswith("primerl node: FAILED:") and said in last, t[-3000:]
    assert not left, left
