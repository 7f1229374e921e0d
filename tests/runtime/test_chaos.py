"""The chaos test (issue 45): the main task with a short checkpoint interval while, at random
moments, the trainer (its one rank) is killed (-9), the orchestrator stopped (SIGSTOP), an inference server of
the pool killed (-9) and the router stopped (SIGSTOP), once each. The job ends rc 0 with every step
exactly once in ``metrics.jsonl``, the restarts counted in the metrics (``job/restarts``: the trainer
and the stalled orchestrator; ``inference/restarts``: the server and the router), and a final
reward within 0.05 of an undisturbed run of the same length (run beside it)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from primerl.runtime.heartbeat import read_heartbeats
from primerl.runtime.launch.servers import router_executable
from primerl.runtime.metrics import read_metrics
from primerl.runtime.ports import held_port

ROOT = Path(__file__).resolve().parents[2]
STEPS = 16  # the job's last start must outlast a server's restart on a loaded machine (CI: 2 cores)
JOB = ["--max_steps", str(STEPS), "--orchestrator.batch_size", "4", "--orchestrator.group_size", "2",
       "--orchestrator.max_async_level", "0", "--checkpoint.interval", "2",
       "--inference.num_servers", "2", "--inference.router_policy", "round_robin", "--inference.health_timeout_s", "2",
       "--log.plot", "false", "--orchestrator.weights_timeout_s", "300", "--trainer.batch_timeout_s", "300",
       "--deployment.max_restarts", "3", "--deployment.stall_timeout_s", "15", "--deployment.grace_s", "3"]


def _start(out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "primerl.runtime.cli", "rl", "--config",
                             str(ROOT / "examples" / "reverse_text.toml"), "--output_dir", str(out), *JOB,
                             "--inference.broadcast_port", str(held_port())],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))


def _steps(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out / "metrics.jsonl")]


def _wait(proc, cond, what: str, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"the job ended before {what}: " + proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.1)


def _beat(out: Path, name: str) -> dict | None:
    return next((r for r in read_heartbeats(out / "heartbeats") if r["name"] == name), None)


def _pool(out: Path) -> dict[str, dict]:
    rows = json.loads((out / "processes.json").read_text())
    seen, names = {}, {}
    for r in rows:
        i = seen[r["role"]] = seen.get(r["role"], -1) + 1
        names[f"{r['role']}-{i}" if r["role"] == "inference" else r["role"]] = r
    return names


def _final(rows: list[dict]) -> float:
    last = rows[-4:]
    return sum(r["reward/mean"] for r in last) / len(last)


@pytest.mark.timeout(900)
@pytest.mark.skipif(not router_executable().exists(), reason="vllm-router is not installed (requirements-ci.txt)")
def test_chaos_every_role_killed_or_stopped_once_the_job_heals(tmp_path):
    seed = int(os.environ.get("PRIMERL_CHAOS_SEED", time.time_ns() % 10**6))
    rng = random.Random(seed)
    print(f"chaos seed {seed} (PRIMERL_CHAOS_SEED)")
    calm, chaos = tmp_path / "calm", tmp_path / "chaos"
    ref = _start(calm)  # the undisturbed run of the same length, beside it
    proc = _start(chaos)
    done = []
    try:
        # 1. the trainer, -9, after a random step (a checkpoint exists from step 2 on)
        at = rng.randint(1, 3)
        _wait(proc, lambda: len(_steps(chaos)) > at, f"step {at}")
        victim, orch0 = _beat(chaos, "trainer"), _beat(chaos, "orchestrator")["pid"]
        os.kill(victim["pid"], signal.SIGKILL)
        done.append(f"{victim['name']} -9 after step {at}")
        # 2. the orchestrator of the restarted job, SIGSTOP (a stall: the watchdog restarts the job)
        _wait(proc, lambda: (_beat(chaos, "orchestrator") or {}).get("pid") not in (None, orch0) and
              any(r.get("job/restarts") == 1 for r in read_metrics(chaos / "metrics.jsonl")), "the first restart")
        at = max(_steps(chaos)) + rng.randint(0, 1)
        _wait(proc, lambda: max(_steps(chaos)) >= at, f"step {at}")
        orch = _beat(chaos, "orchestrator")
        os.kill(orch["pid"], signal.SIGSTOP)
        done.append(f"orchestrator SIGSTOP after step {at}")
        # 3. the router, SIGSTOP, and 4. an inference server of the pool, -9, at the first step of the job's
        # last start: the stopped router holds every request, so no step passes until the pool has replaced
        # it, and the server's restart is under way long before the remaining steps are done
        _wait(proc, lambda: any(r.get("job/restarts") == 2 for r in read_metrics(chaos / "metrics.jsonl")),
              "the second restart")
        pool = _pool(chaos)
        os.kill(pool["router"]["pid"], signal.SIGSTOP)
        done.append("router SIGSTOP")
        server = pool[f"inference-{rng.randint(0, 1)}"]
        os.kill(server["pid"], signal.SIGKILL)
        done.append(f"{server['url']} -9")
        _wait(proc, lambda: sum(r.get("restarts", 0) for r in _pool(chaos).values()) == 2,
              "the router and the server restarted")
        text, _ = proc.communicate(timeout=400)
        ref_text, _ = ref.communicate(timeout=300)
    finally:
        for p in (proc, ref):
            if p.poll() is None:
                p.kill()
    assert ref.returncode == 0, ref_text[-3000:]
    assert proc.returncode == 0, (done, text[-4000:])
    rows = read_metrics(chaos / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS)), "every step exactly once"
    assert rows[-1]["job/restarts"] == 2, (done, text[-3000:])  # the trainer rank, the stalled orchestrator
    assert rows[-1]["inference/restarts"] == 2, (done, text[-3000:])  # the server and the hung router
    assert "RESTART 1 of at most 3" in text and "RESTART 2 of at most 3" in text
    assert "the orchestrator process (pid" in text and "stopped by a signal (SIGSTOP)" in text  # the stall, named
    assert "router (" in text and "did not answer /health" in text  # the hung router, named by the pool
    calm_rows = read_metrics(calm / "metrics.jsonl")
    assert [r["step"] for r in calm_rows] == list(range(STEPS))
    assert abs(_final(rows) - _final(calm_rows)) <= 0.05, (done, _final(rows), _final(calm_rows), seed)
