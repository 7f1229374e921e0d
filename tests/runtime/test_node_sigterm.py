"""SIGTERM to a ``primerl node`` agent started by hand ends every process of the job within
``deployment.grace_s`` + 15 s, each agent's failure line naming the node that got it (issue 45:
the trainer agent's handler used to deadlock in ``Popen.wait``, and the other nodes waited out
their timeouts)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from primerl.runtime.metrics import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_multinode import _descendants  # noqa: E402
from test_orchestrator_node import _cfg, _start, _stop  # noqa: E402

GRACE = 5


def _running(pid: int) -> bool:
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:4]
    except OSError:
        return False


@pytest.mark.dist
@pytest.mark.parametrize("target,index,other", [("trainer", 0, "orchestrator"), ("orchestrator", 1, "trainer")])
def test_sigterm_to_one_node_agent_ends_every_process_naming_it(tmp_path, target, index, other):
    cfg = _cfg("--max_steps", "200", "--deployment.grace_s", str(GRACE), "--checkpoint.interval", "0")
    procs = _start(tmp_path, cfg)
    metrics = tmp_path / "host0" / "out" / "metrics.jsonl"
    logs = {role: tmp_path / f"host{i}" / "node.log" for i, role in enumerate(("trainer", "orchestrator"))}
    try:
        deadline = time.monotonic() + 150
        while len(read_metrics(metrics)) < 2:  # the job runs: torchrun, its rank, the orchestrator
            assert all(p.poll() is None for p in procs.values()), logs["trainer"].read_text()[-3000:]
            assert time.monotonic() < deadline, "no 2 steps in 150 s"
            time.sleep(0.2)
        pids = [q for p in procs.values() for q in _descendants(p.pid)]
        assert len(pids) >= 4  # two agents, torchrun, a trainer rank
        procs[target].send_signal(signal.SIGTERM)  # the agent only, as a scheduler or a user would
        t0 = time.monotonic()
        rcs = {}
        for role, p in procs.items():
            try:
                rcs[role] = p.wait(timeout=GRACE + 15 - (time.monotonic() - t0))
            except subprocess.TimeoutExpired:
                rcs[role] = None
        left = [pid for pid in pids if _running(pid)]
        if left:  # a few seconds more before calling it a hang: the agents' exit may reap their children late
            time.sleep(1)
            left = [pid for pid in pids if _running(pid)]
    finally:
        _stop(procs)
    text = {role: path.read_text(errors="replace") for role, path in logs.items()}
    assert rcs == {target: 143, other: 1}, {k: v[-3000:] for k, v in text.items()}
    assert not left, (left, {k: v[-2000:] for k, v in text.items()})
    host = f"127.0.0.{index + 1}"
    said = f"node {index} ({host}) {target}: got SIGTERM"
    errors = {role: [ln for ln in t.splitlines() if " ERROR " in ln or ln.startswith("primerl node: FAILED")]
              for role, t in text.items()}
    assert said in errors[target][0], errors[target]  # its first failure line names it
    assert said in errors[other][0], errors[other]  # and so does the other node's first
    assert errors[other][-1].startswith("primerl node: FAILED:") and said in errors[other][-1], errors[other]
