"""The stall watchdog of node agents started by hand (issue 45, ``launch.node_supervise``): the
commands ``deployment.kind = "nodes"`` prints (127.0.0.1 trainer, 127.0.0.2 orchestrator), restarts
off. A SIGSTOPped process (a trainer rank; the orchestrator, which runs inside its node's round
process; trainer node 0's round agent, which waits on torchrun) is named by its node's agent with
its stack (``py-spy dump``) in that node's log within ``deployment.stall_timeout_s`` (plus a
poll); both agents end, each last line naming the stopped process, and nothing of the job is
left running. The start-up has its own allowance (``deployment.stall_startup_s``, tested alone below).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from primerl.runtime.heartbeat import read_heartbeats
from primerl.runtime.launch.watchdog import process_state
from primerl.runtime.metrics import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_multinode import _descendants  # noqa: E402
from test_node_restarts import _until  # noqa: E402
from test_orchestrator_node import _cfg, _start, _stop, _wait  # noqa: E402

# STALL: the job's quiet after its start-up (steps of ~0.04 s) and how long the victim stays stopped (the agent case:
# while the rest of the job runs on); STARTUP: the start-up's allowance (deployment.stall_startup_s), above its
# longest quiet on a loaded 2-core machine (STALL was 40 s for it before the start-up had its own)
STALL, STARTUP, GRACE = 15, 120, 3
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
               "--deployment.stall_startup_s", str(STARTUP),
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
    assert f"stall watchdog {STALL} s ({STARTUP} s in the start-up)" in text["trainer"]  # the agent's first line
    for t in text.values():  # each agent's last line names the stopped process
        last = t.strip().splitlines()[-1]
        assert last.startswith("primerl node: FAILED:") and said in last, t[-3000:]
    assert not left, left


class _Store:
    """The rendezvous store's few calls JobProgress makes (TCPStore: values come back as bytes)."""

    def __init__(self):
        self.d = {}

    def set(self, k, v):
        self.d[k] = v.encode() if isinstance(v, str) else v

    def get(self, k):
        return self.d[k]

    def check(self, keys):
        return all(k in self.d for k in keys)

    def add(self, k, n):
        self.d[k] = int(self.d.get(k, 0)) + n
        return self.d[k]


def _beat_file(d: Path, name: str, progress: int, t: float) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.json").write_text(json.dumps({"name": name, "pid": os.getpid(), "host": "h", "progress": progress,
                                                "what": "started" if progress == 1 else "step", "time": t}))


def test_the_job_s_start_up_may_stay_quiet_for_stall_startup_s(tmp_path, monkeypatch):
    """``deployment.stall_startup_s``: while a process of the job has not made progress past its start
    (its "started" beat), a quiet job is no stall before max(stall_timeout_s, stall_startup_s); once
    every process did, stall_timeout_s holds. Both watchdogs: the launcher's (StallWatchdog.check) and
    the hand-started agents' shared count (JobProgress: each node's count ends in "+" once it started up)."""
    from types import SimpleNamespace

    from primerl.runtime.launch import node_stall
    from primerl.runtime.launch.node_stall import REPORT_DELAY_S, JobProgress
    from primerl.runtime.launch.watchdog import StallWatchdog

    now = time.time()
    beats = tmp_path / "beats"
    _beat_file(beats, "trainer-rank0", 1, now - 100)  # started only (loading, compiling)
    _beat_file(beats, "orchestrator", 7, now - 100)
    dog = StallWatchdog(beats, 10.0, lambda n: tmp_path / f"{n}.log", startup_s=300.0)
    dog.report = lambda rows, t, alone=False: "stalled"  # no stacks to dump: the rows' pid is this process
    assert dog.check(now) is None and dog.check(now + 199) is None
    assert dog.check(now + 201) == "stalled"  # 301 s without progress: past stall_startup_s
    assert StallWatchdog(beats, 10.0, dog.log_for).limit(read_heartbeats(beats)) == 10.0  # 0: stall_timeout_s
    _beat_file(beats, "trainer-rank0", 2, now - 100)  # its first step: the start-up is over
    assert dog.check(now) == "stalled"

    clock = [1000.0]
    monkeypatch.setattr(node_stall.time, "monotonic", lambda: clock[0])
    store = _Store()
    plan = SimpleNamespace(nodes=[SimpleNamespace(index=0, roles=("trainer",)),
                                  SimpleNamespace(index=1, roles=("orchestrator",))])
    agents = []
    for i, role, progress in ((0, "trainer", 1), (1, "orchestrator", 7)):
        d = tmp_path / f"node{i}"
        _beat_file(d, role, progress, now)
        w = StallWatchdog(d, 10.0, lambda n: None, startup_s=300.0)
        w.report = lambda rows, t, alone=False: "stalled"
        sup = SimpleNamespace(node=plan.nodes[i], role=role, plan=plan, store=store, child=None, stall_s=10.0,
                              watchdog=w, where=f"node {i}")
        agents.append(JobProgress(sup, 0))

    def stalled_at(t):
        clock[0] = 1000.0 + t
        return [a.stalled() for a in agents]

    assert stalled_at(0) == [False, False] and stalled_at(1) == [False, False]  # every count posted
    assert store.d["primerl/r0/progress/1/orchestrator"].endswith(b"+")  # node 1 started up, node 0 did not
    assert not store.d["primerl/r0/progress/0/trainer"].endswith(b"+")
    assert stalled_at(250) == [False, False]  # quiet, but in the start-up
    assert stalled_at(300 + REPORT_DELAY_S + 2) == [True, True]  # past stall_startup_s (+ the others' delay)
    for a in agents:  # a new round: the trainer made its first step
        a.seen = a.posted = None
    _beat_file(tmp_path / "node0", "trainer", 2, now)
    assert stalled_at(400) == [False, False] and stalled_at(401) == [False, False]
    assert all(v.endswith(b"+") for k, v in store.d.items() if "/progress/" in k)
    assert stalled_at(401 + 10 + REPORT_DELAY_S + 1) == [True, True]  # stall_timeout_s holds now


def test_the_dry_run_and_the_config_name_stall_startup_s():
    from primerl.runtime.cli import _describe_supervision
    from primerl.runtime.config import ConfigError
    from primerl.runtime.validate import load_config

    line = _describe_supervision(load_config(None, ["--deployment.stall_timeout_s", "15",
                                                    "--deployment.stall_startup_s", "120"]))
    assert line.rstrip().endswith("stall watchdog 15 s without progress (120 s in the start-up: "
                                  "deployment.stall_startup_s)"), line
    assert _describe_supervision(load_config(None, ["--deployment.stall_timeout_s", "15"])).rstrip().endswith(
        "stall watchdog 15 s without progress")
    from primerl.runtime.trainer.main import collective_timeout  # the watchdog names a stall before a collective fails

    assert collective_timeout(load_config(None, ["--deployment.stall_timeout_s", "15",
                                                 "--deployment.stall_startup_s", "120"])).total_seconds() == 240
    assert collective_timeout(load_config(None, ["--deployment.stall_timeout_s", "15"])).total_seconds() == 30
    with pytest.raises(ConfigError, match="deployment.stall_startup_s"):
        load_config(None, ["--deployment.stall_startup_s", "-1"])
