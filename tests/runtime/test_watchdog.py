"""The stall watchdog (issue 45): heartbeats that advance with work, a stall named with its stacks.

- heartbeat rows: written on a beat, named by role (and rank under torchrun), faulthandler on SIGUSR1;
- ``StallWatchdog``: no stall while any live process beats; past ``stall_timeout_s`` the stopped
  (SIGSTOP) process is named and every stalled process's stack (py-spy reads a stopped one) is in its log;
- through ``primerl rl``: a SIGSTOPped trainer rank with restarts off fails the job within
  ``stall_timeout_s`` + ``grace_s``, the failure naming that rank and its log holding its stack.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from primerl.runtime.heartbeat import read_heartbeats
from primerl.runtime.launch.watchdog import StallWatchdog, process_state
from primerl.runtime.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")

CHILD = textwrap.dedent("""
    import sys, threading, time
    from primerl.runtime.heartbeat import beat, install
    install(sys.argv[1])
    def stuck_in_a_side_thread():
        threading.Event().wait()
    threading.Thread(target=stuck_in_a_side_thread, daemon=True).start()
    def work_loop():
        for i in range(int(sys.argv[2])):
            beat(f"step {i}")
            time.sleep(0.3)
        print("ready", flush=True)
        time.sleep(600)
    work_loop()
""")


def _child(tmp_path, name, steps, *, env=None):
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, "-c", CHILD, name, str(steps)], stdout=log, stderr=subprocess.STDOUT,
                            env=dict(ENV, PRIMERL_HEARTBEAT_DIR=str(tmp_path / "beats"), **(env or {})))


def _wait_for(cond, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_heartbeats_advance_with_work_and_faulthandler_answers_sigusr1(tmp_path):
    p = _child(tmp_path, "orchestrator", 3)
    try:
        _wait_for(lambda: "ready" in (tmp_path / "orchestrator.log").read_text(), "the child's work")
        rows = read_heartbeats(tmp_path / "beats")
        assert [(r["name"], r["pid"]) for r in rows] == [("orchestrator", p.pid)]
        assert rows[0]["what"] == "step 2" and rows[0]["progress"] == 4  # started + 3 steps
        t = rows[0]["time"]
        time.sleep(0.5)
        assert read_heartbeats(tmp_path / "beats")[0]["time"] == t  # no work, no beat: not a timer
        os.kill(p.pid, signal.SIGUSR1)  # faulthandler: every thread's stack to the process's log
        _wait_for(lambda: "stuck_in_a_side_thread" in (tmp_path / "orchestrator.log").read_text(), "the stacks")
        assert "work_loop" in (tmp_path / "orchestrator.log").read_text() and p.poll() is None
    finally:
        p.kill()
        p.wait()


def test_the_watchdog_names_the_stopped_process_and_dumps_its_stack(tmp_path):
    quiet = _child(tmp_path, "orchestrator", 1)  # waits on its peer: quiet, but not the cause
    victim = _child(tmp_path, "trainer", 3, env={"TORCHELASTIC_RUN_ID": "x", "RANK": "1"})
    try:
        for name in ("orchestrator", "trainer"):
            _wait_for(lambda: "ready" in (tmp_path / f"{name}.log").read_text(), f"{name} ready")
        os.kill(victim.pid, signal.SIGSTOP)
        _wait_for(lambda: process_state(victim.pid) == "T", "stopped")
        logs = {"trainer-rank1": tmp_path / "trainer.log", "orchestrator": tmp_path / "orchestrator.log"}
        dog = StallWatchdog(tmp_path / "beats", 5.0, logs.__getitem__)
        newest = max(r["time"] for r in read_heartbeats(tmp_path / "beats"))
        assert dog.check(now=newest + 4.0) is None  # inside the timeout: no stall
        line = dog.check(now=newest + 6.0)
        assert line is not None and line.startswith(f"the trainer-rank1 process (pid {victim.pid} on "), line
        assert "stopped by a signal (SIGSTOP)" in line and "its last progress: step 2 at " in line
        assert "deployment.stall_timeout_s = 5" in line and str(tmp_path / "trainer.log") in line
        text = (tmp_path / "trainer.log").read_text()
        assert "primerl watchdog: trainer-rank1" in text
        assert "stuck_in_a_side_thread" in text and "work_loop" in text  # every thread, read from a stopped process
        assert "(py-spy dump)" in line
    finally:
        for p in (quiet, victim):
            p.kill()
            p.wait()


def test_a_beating_process_keeps_the_job_from_stalling(tmp_path):
    d = tmp_path / "beats"
    d.mkdir()
    now = time.time()
    for name, pid, t in (("trainer", os.getpid(), now - 100), ("orchestrator", os.getppid(), now - 1)):
        (d / f"{name}.json").write_text(json.dumps({"name": name, "pid": pid, "host": "h", "progress": 1,
                                                    "what": "x", "time": t}))
    assert StallWatchdog(d, 10.0, lambda n: tmp_path / f"{n}.log").check() is None
    assert StallWatchdog(d, 0.0, lambda n: tmp_path / f"{n}.log").check(now=now + 1000) is None  # 0: off


@pytest.mark.dist
def test_a_stopped_trainer_rank_fails_the_job_with_its_stack(tmp_path):
    out = tmp_path / "job"
    stall, grace = 8, 3
    proc = subprocess.Popen(
        [sys.executable, "-m", "primerl.runtime.cli", "rl", "--config", str(ROOT / "examples" / "reverse_text.toml"),
         "--output_dir", str(out), "--max_steps", "200", "--orchestrator.batch_size", "4",
         "--orchestrator.group_size", "4", "--num_trainer_ranks", "2", "--checkpoint.interval", "0",
         "--log.plot", "false", "--deployment.max_restarts", "0", "--deployment.stall_timeout_s", str(stall),
         "--deployment.grace_s", str(grace), "--trainer.batch_timeout_s", "300",
         "--orchestrator.weights_timeout_s", "300"],
        cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(lambda: len(read_metrics(out / "metrics.jsonl")) >= 2 or proc.poll() is not None, "2 steps", 300)
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        rank1 = next(r for r in read_heartbeats(out / "heartbeats") if r["name"] == "trainer-rank1")
        os.kill(rank1["pid"], signal.SIGSTOP)
        t0 = time.monotonic()
        text, _ = proc.communicate(timeout=stall + grace + 60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, text[-3000:]
    failed = [ln for ln in text.splitlines() if ln.startswith("primerl rl: FAILED:")]
    assert failed and failed[0].startswith(f"primerl rl: FAILED: the trainer-rank1 process (pid {rank1['pid']} on "), \
        text[-3000:]
    assert "stopped by a signal (SIGSTOP)" in failed[0]
    log = (out / "logs" / "trainer.log").read_text(errors="replace")
    assert f"primerl watchdog: trainer-rank1 (pid {rank1['pid']}" in log and "train_step" in log, log[-3000:]
    assert took < stall + grace + 30, took  # the stall seen after stall_timeout_s, the rest stopped in grace_s
    assert process_state(rank1["pid"]) in (None, "Z"), "the stopped rank (own session under torchrun) was left behind"


class _FlakyLauncher:
    """A launcher whose job fails ``fails`` times (JobFailed), then ends; records each start's resume step."""

    name = "flaky"

    def __init__(self, fails: int):
        from primerl.runtime.launch.kinds import LauncherCapabilities

        self.capabilities = LauncherCapabilities(spans_nodes=False, server_pool=False, restarts=True)
        self.fails, self.starts, self.stops = fails, [], 0

    def start(self, job):
        self.starts.append((job.cfg.checkpoint.resume, os.environ.get("PRIMERL_JOB_RESTARTS")))

    def wait(self, job):
        from primerl.runtime.launch.common import JobFailed

        if len(self.starts) <= self.fails:
            raise JobFailed(f"the trainer exited with code -9 (start {len(self.starts)})\nend of its log: ...")
        return [{"step": 0}]

    def stop(self, job):
        self.stops += 1


def _small_cfg(tmp_path, *over):
    from primerl.runtime.validate import load_config

    return load_config(ROOT / "examples" / "reverse_text.toml", ["--output_dir", str(tmp_path / "out"), *over])


def test_run_job_restarts_from_the_checkpoint_then_names_every_cause(tmp_path):
    from primerl.runtime.launch.common import JobFailed
    from primerl.runtime.launch.launcher import run_job

    flaky = _FlakyLauncher(fails=2)
    assert run_job(_small_cfg(tmp_path, "--deployment.max_restarts", "2"), quiet=True, launcher=flaky) == [{"step": 0}]
    assert flaky.starts == [(False, "0"), (True, "1"), (True, "2")] and flaky.stops == 3  # resumed, counted
    flaky = _FlakyLauncher(fails=5)
    with pytest.raises(JobFailed) as e:
        run_job(_small_cfg(tmp_path, "--deployment.max_restarts", "2"), quiet=True, launcher=flaky)
    msg = str(e.value)
    assert msg.startswith("the job failed 3 times (deployment.max_restarts = 2); the causes:\n"
                          "1. the trainer exited with code -9 (start 1)\n2. the trainer exited with code -9 (start 2)\n"
                          "3. the trainer exited with code -9 (start 3)"), msg
    flaky = _FlakyLauncher(fails=1)  # 0: today's behaviour, the first failure as it is
    with pytest.raises(JobFailed, match=r"^the trainer exited with code -9 \(start 1\)"):
        run_job(_small_cfg(tmp_path, "--deployment.max_restarts", "0"), quiet=True, launcher=flaky)
    assert len(flaky.starts) == 1


def test_auto_restarts_and_the_dry_run_plan_line(tmp_path, capsys):
    from primerl.runtime import cli
    from primerl.runtime.config.deployment import effective_max_restarts

    assert effective_max_restarts(_small_cfg(tmp_path)) == 3  # the example: 1200 steps, a checkpoint every 100
    assert effective_max_restarts(_small_cfg(tmp_path, "--max_steps", "50")) == 0
    assert effective_max_restarts(_small_cfg(tmp_path, "--checkpoint.interval", "0")) == 0
    rc = cli.main(["rl", "--config", str(ROOT / "examples" / "reverse_text.toml"), "--output_dir", str(tmp_path / "o"),
                   "--checkpoint.interval", "20", "--deployment.max_restarts", "2", "--deployment.stall_timeout_s",
                   "300", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0
    assert ("# supervision: checkpoints every 20 steps; restarts up to 2 (deployment.max_restarts), each from the last "
            "complete checkpoint, the rest stopped within grace_s 30 s; stall watchdog 300 s without progress") in out
    rc = cli.main(["rl", "--config", str(ROOT / "examples" / "reverse_text.toml"), "--output_dir", str(tmp_path / "o"),
                   "--deployment.stall_timeout_s", "-1", "--dry-run"])
    assert rc == 2 and "deployment.stall_timeout_s: must be >= 0" in capsys.readouterr().err
