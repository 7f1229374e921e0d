"""The whole job: trainer + orchestrator processes, kill-and-resume, failures surfacing, torchrun."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from primerl.runtime.config import to_toml
from primerl.runtime.validate import load_config
from primerl.runtime.launch.machine import run_rl
from primerl.runtime.launch.threads import run_threads
from primerl.runtime.metrics import read_metrics
from primerl.runtime.trainer.checkpoint import latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--max_steps", "6", "--orchestrator.batch_size", "4", "--orchestrator.group_size", "4",
         "--orchestrator.max_async_level", "0", "--checkpoint.interval", "2", "--log.plot", "false",
         "--orchestrator.weights_timeout_s", "120", "--trainer.batch_timeout_s", "120"]


def _cfg(out, *over):
    return load_config(ROOT / "examples" / "reverse_text.toml", ["--output_dir", str(out), *SMALL, *over])


def _cli(cfg_path, *args, **kw):
    return subprocess.Popen([sys.executable, "-m", "primerl.runtime.cli", "rl", "--config", str(cfg_path), *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), **kw)


def _same_run(a, b, steps):
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(steps))
    for x, y in zip(a, b):
        assert x["reward/mean"] == y["reward/mean"], (x["step"], x["reward/mean"], y["reward/mean"])
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-6)
        assert x["mismatch_kl/mean"] == pytest.approx(y["mismatch_kl/mean"], rel=1e-3, abs=1e-7)


def _start_until_checkpoint(cfg, tmp_path, *, timeout: float):
    """``primerl rl`` on ``cfg`` in a subprocess, returned once its step-2 checkpoint exists."""
    cfg_path = tmp_path / "killed.toml"
    cfg_path.write_text(to_toml(cfg))
    proc = _cli(cfg_path)
    ckpt = Path(cfg.output_dir) / "checkpoints" / "step_000002"
    deadline = time.monotonic() + timeout
    while not ckpt.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no checkpoint within {timeout} s"
        time.sleep(0.05)
    return proc


@pytest.mark.slow
def test_kill_trainer_then_resume_matches_uninterrupted_run(tmp_path, caplog):
    full = run_threads(_cfg(tmp_path / "full"))
    cfg = _cfg(tmp_path / "killed")
    proc = _start_until_checkpoint(cfg, tmp_path, timeout=180)
    pids = dict(line.split() for line in (tmp_path / "killed" / "pids").read_text().splitlines())
    os.kill(int(pids["trainer"]), signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "trainer exited with code -9" in err, err
    killed_at = max(r["step"] for r in read_metrics(tmp_path / "killed" / "metrics.jsonl"))
    assert killed_at < 5
    ckpt = latest_checkpoint(tmp_path / "killed" / "checkpoints")[0]  # the step the resume starts at
    before = [r for r in read_metrics(tmp_path / "killed" / "metrics.jsonl") if r["step"] < ckpt]
    cfg.checkpoint.resume = True
    with caplog.at_level("INFO"):
        resumed = run_threads(cfg)
    _same_run(full, resumed, 6)
    # resumed, not restarted: the rows before the checkpoint are the killed run's own (a rerun from
    # step 0 writes them again, with other timings) and the trainer names the step it resumed from
    assert ckpt >= 2 and resumed[:ckpt] == before
    assert f"step_{ckpt:06d} (step {ckpt})" in caplog.text, caplog.text[-2000:]


@pytest.mark.slow
def test_failing_environment_stops_the_job_with_its_error(tmp_path):
    cfg = _cfg(tmp_path / "run", "--env.id", "tests.runtime._envs:AlwaysRaises", "--env.max_retries", "1")
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(to_toml(cfg))
    proc = _cli(cfg_path)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 1
    assert "orchestrator exited with code 1" in err and "grader crashed" in err and "env.max_retries = 1" in err, err


@pytest.mark.slow
def test_rl_command_trains_and_writes_metrics_and_plot(tmp_path):
    """The README command, shortened: progress lines, metrics.jsonl with the required keys, the
    plot, and a reward that has clearly left chance level."""
    steps = 30
    # the command as `python -m primerl.runtime.cli`, and at its exit whether it loaded torch
    probe = ("import atexit, runpy, sys; atexit.register(lambda: print('launcher loaded: torch' if 'torch' in "
             "sys.modules else 'launcher loaded: no torch', file=sys.stderr)); "
             "runpy.run_module('primerl.runtime.cli', run_name='__main__', alter_sys=True)")
    proc = subprocess.run([sys.executable, "-c", probe, "rl", "--config", "examples/reverse_text.toml",
                           "--output_dir", str(tmp_path), "--max_steps", str(steps), "--checkpoint.interval", "0",
                           "--trainer.entropy_coef", "0"],  # no exploration bonus: the early rise is steeper
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the launcher only supervises: torch (~2.4 CPU-s per process) loads in the job's processes, not in it
    assert proc.stderr.rstrip().endswith("launcher loaded: no torch"), proc.stderr[-3000:]
    assert proc.stdout.count(" | reward ") >= steps and "plot saved" in proc.stdout
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(steps))
    for key in ("step", "reward/mean", "mismatch_kl/mean", "off_policy/max", "tokens_per_s"):
        assert all(key in r for r in rows), key
    assert all(r["off_policy/max"] <= 1 for r in rows)
    assert (tmp_path / "metrics.png").stat().st_size > 1000
    first = sum(r["reward/mean"] for r in rows[:5]) / 5
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    assert last > first + 0.06, (first, last)


@pytest.fixture(scope="module")
def two_rank_job(tmp_path_factory):
    """One 2-rank torchrun job (FSDP2 over gloo, constant lr: the resumes change max_steps) for the two tests
    below, beside a single-process run of the same 6 steps: killed with kill -9 on one rank after its step-2
    DCP checkpoint (interval saves written asynchronously), resumed on the same 2 ranks to step 4, then in one
    process (another layout) from the 2-rank checkpoint of step 4 to step 6. The facts the tests check."""
    from primerl.runtime.trainer.dcp_checkpoint import is_dcp_checkpoint

    tmp = tmp_path_factory.mktemp("two_rank_job")
    const = ["--trainer.lr_schedule", "constant"]
    got = {"single": run_threads(_cfg(tmp / "one", *const))}
    out = tmp / "killed"
    cfg = _cfg(out, "--num_trainer_ranks", "2", "--checkpoint.async_save", "true", *const)
    proc = _start_until_checkpoint(cfg, tmp, timeout=240)
    ckpt = out / "checkpoints" / "step_000002"
    got["step2_dcp_shards"] = is_dcp_checkpoint(ckpt), len(list(ckpt.glob("*.distcp")))
    pids = dict(line.split() for line in (out / "pids").read_text().splitlines())
    ranks = subprocess.run(["pgrep", "-P", pids["trainer"]], capture_output=True, text=True).stdout.split()
    got["rank_pids"] = ranks
    if len(ranks) == 2:
        os.kill(int(ranks[-1]), signal.SIGKILL)
    else:
        proc.kill()
    proc.communicate(timeout=120)
    got["killed_rc"] = proc.returncode
    got["killed_log"] = (out / "logs" / "trainer.log").read_text()
    got["killed_rows"] = read_metrics(out / "metrics.jsonl")
    got["resume_at"] = latest_checkpoint(out / "checkpoints")[0]  # the step the same-layout resume starts at
    cfg.checkpoint.resume = True
    cfg.max_steps = 4
    got["two_ranks"] = run_rl(cfg, quiet=True)  # same layout
    cfg.max_steps, cfg.num_trainer_ranks = 6, 1
    got["one_rank"] = run_rl(cfg, quiet=True)  # one process, from the 2-rank checkpoint at step 4
    got["log"] = (out / "logs" / "trainer.log").read_text()
    return got


# the two tests share the fixture's job: one worker builds it (xdist_group)
@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.xdist_group("job_two_ranks")
def test_torchrun_trainer_with_two_gloo_ranks_trains_the_same_job(two_rank_job):
    """FSDP2 over 2 gloo ranks: same metrics as one process, through a resume from its sharded
    checkpoint on the same 2 ranks (each rank loads its slices) and one from 2 ranks to one process."""
    got = two_rank_job
    log = got["killed_log"]
    assert "trainer rank 0/2 started (gloo)" in log and "trainer rank 1/2 started (gloo)" in log, log[-2000:]
    # resumed, not restarted: the rows before the checkpoint are the killed run's own, and those of
    # the 2-rank resume stay when one process takes over
    ckpt = got["resume_at"]
    assert got["two_ranks"][:ckpt] == [r for r in got["killed_rows"] if r["step"] < ckpt]
    assert got["one_rank"][:4] == got["two_ranks"]
    _same_run(got["single"], got["one_rank"], 6)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.xdist_group("job_two_ranks")
def test_kill_two_rank_trainer_then_resume_from_dcp_checkpoint(two_rank_job):
    """A 2-rank torchrun trainer (FSDP2) killed with kill -9 on one rank after its step-2 DCP
    checkpoint (saved asynchronously); the job resumes from that sharded checkpoint, once on the same 2 ranks and
    once in one process (another layout), and metrics.jsonl ends with every step exactly once."""
    got = two_rank_job
    assert got["step2_dcp_shards"] == (True, 2)  # each rank wrote its shard
    assert len(got["rank_pids"]) == 2, got["rank_pids"]
    assert got["killed_rc"] == 1
    assert max(r["step"] for r in got["killed_rows"]) < 5
    assert [r["step"] for r in got["two_ranks"]] == list(range(4))
    assert [r["step"] for r in got["one_rank"]] == list(range(6))
    log = got["log"]
    assert "resumed from" in log and "step_000004" in log, log[-2000:]


def test_job_reports_servers_healthy_serves_orchestrator_metrics_and_saves_samples(tmp_path):
    """The two-process job with orchestrator.metrics_port and orchestrator.save_samples: the
    orchestrator's /health answers while it runs, metrics.jsonl has inference/servers_healthy = 1 on
    every step, samples/step_N.jsonl holds each step's batch."""
    import json
    import threading
    import urllib.request

    from vllm_testing import free_port

    port = free_port()
    cfg = _cfg(tmp_path, "--max_steps", "3", "--checkpoint.interval", "0", "--orchestrator.metrics_port", str(port),
               "--orchestrator.save_samples", "true")
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("rows", run_rl(cfg, quiet=True)), daemon=True)
    th.start()
    health = None
    deadline = time.monotonic() + 300
    while th.is_alive() and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                health = json.loads(r.read())
        except OSError:
            pass
        time.sleep(0.2)
    th.join(5)
    rows = out["rows"]
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["inference/servers_healthy"] == 1 for r in rows)
    assert health is not None and health["status"] == "ok" and health["servers_healthy"] in (0, 1)
    for step in range(3):
        lines = (tmp_path / "samples" / f"step_{step}.jsonl").read_text().splitlines()
        assert len(lines) == 4 * 4 and json.loads(lines[0])["servers"] == ["embedded"]
