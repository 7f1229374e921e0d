"""Restarts inside a SLURM allocation (issue 45): the sbatch script restarts every step from the
last checkpoint when one fails (``deployment.max_restarts``), run under the stand-ins of
tests/runtime/slurm_standins (each srun step a local process on hosts 127.0.0.1 / 127.0.0.2).

The orchestrator's step is killed (-9) after the step-2 checkpoint: the script names it, restarts
every step with ``--checkpoint.resume true``, and the job ends rc 0 with every step once in
``metrics.jsonl`` and ``job/restarts`` = 1 from the restart on. The same job is the sbatch
script's end-to-end run (every step once, each (node, role) in its own log): it was a job of its own
in test_multinode.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from primerl.runtime.config import to_toml
from primerl.runtime.metrics import read_metrics
from primerl.runtime.validate import load_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_multinode import ROOT, SMALL, _env, _free_port  # noqa: E402


def _pids_with(*parts: str) -> list[int]:
    """Processes whose command line holds every one of ``parts``."""
    out = []
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmd.read_bytes().split(b"\0")
        except OSError:
            continue
        text = [a.decode(errors="replace") for a in args]
        if all(p in text for p in parts):
            out.append(int(cmd.parent.name))
    return out


@pytest.fixture(scope="module")
def restarted_job(tmp_path_factory):
    """``primerl rl`` with kind = "slurm" under the stand-ins, its orchestrator step killed (-9) after the
    step-2 checkpoint: (output_dir, returncode, stdout, stderr). One job for the two tests below."""
    tmp_path = tmp_path_factory.mktemp("slurm_job")
    out = tmp_path / "out"
    cfg = load_config(ROOT / "examples" / "reverse_text.toml",
                      ["--output_dir", str(out), *SMALL, "--max_steps", "6", "--checkpoint.interval", "2",
                       "--deployment.kind", "slurm", "--deployment.max_restarts", "1",
                       "--deployment.rdzv_endpoint", f"127.0.0.1:{_free_port()}",
                       "--orchestrator.zmq_port", str(_free_port())])  # not the default: a previous job may linger
    (tmp_path / "cfg.toml").write_text(to_toml(cfg))
    standins = Path(__file__).resolve().parent / "slurm_standins"
    proc = subprocess.Popen([sys.executable, "-m", "primerl.runtime.cli", "rl", "--config", str(tmp_path / "cfg.toml")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(PATH=f"{standins}{os.pathsep}{os.environ['PATH']}",
                                     PRIMERL_TEST_NODELIST="127.0.0.1,127.0.0.2"))
    try:
        deadline = time.monotonic() + 300
        while not ((out / "checkpoints" / "step_000002").is_dir() and len(read_metrics(out / "metrics.jsonl")) >= 3):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no step-2 checkpoint and 3 metrics rows in 300 s"
            time.sleep(0.1)
        victims = _pids_with("node", "--role", "orchestrator", str(out / "config.toml"))
        assert len(victims) == 1, victims
        os.kill(victims[0], 9)
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return out, proc.returncode, stdout, stderr


# the two tests share the module's one job (restarted_job): one xdist worker builds it
@pytest.mark.dist
@pytest.mark.xdist_group("slurm_restarted_job")
def test_the_sbatch_script_restarts_its_steps_from_the_checkpoint(restarted_job):
    out, returncode, stdout, stderr = restarted_job
    slurm_out = next((out / "logs").glob("slurm-*.out"))
    text = slurm_out.read_text(errors="replace")
    assert returncode == 0, stderr[-3000:]
    assert Path(f"{slurm_out}.rc").read_text().strip() == "0", text[-4000:]
    restarts = [ln for ln in text.splitlines() if "RESTART" in ln]
    assert len(restarts) == 1 and "RESTART 1 of at most 1" in restarts[0], text[-4000:]
    assert "node 0 (127.0.0.1) orchestrator failed (exit 137)" in restarts[0], restarts
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6)), [r["step"] for r in rows]  # every step exactly once
    counts = [r["job/restarts"] for r in rows]
    assert counts == sorted(counts) and counts[-1] == 1 and counts.count(0) >= 2, counts  # resumed, not rerun
    assert "every trainer node finished" in text


@pytest.mark.dist
@pytest.mark.xdist_group("slurm_restarted_job")
def test_the_sbatch_script_runs_end_to_end_under_slurm_standins(restarted_job):
    """``primerl rl`` with kind = "slurm" renders the script, and sbatch / srun / scontrol stand-ins
    (tests/runtime/slurm_standins: each srun step a local process with its SLURM_* variables) run
    it on hosts 127.0.0.1 and 127.0.0.2 to max_steps: each (node, role) in its own log (appended
    across the restart). The job of the test above (its restarted round runs the script's steps
    to their normal end; every step once is asserted there)."""
    out, returncode, stdout, stderr = restarted_job
    assert returncode == 0, stderr[-3000:]
    assert "Submitted batch job" in stdout
    slurm_out = next((out / "logs").glob("slurm-*.out"))
    logs = {p.name: p.read_text(errors="replace") for p in (out / "logs").glob("node*.log")}
    assert Path(f"{slurm_out}.rc").read_text().strip() == "0", slurm_out.read_text()[-3000:] + str(
        {k: v[-1500:] for k, v in logs.items()})
    assert sorted(logs) == ["node0-orchestrator.log", "node0-trainer.log", "node1-trainer.log"]
    assert "every trainer node finished" in slurm_out.read_text()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(6))
    assert "trainer rank 1/2 started" in logs["node1-trainer.log"]  # rank 1 lives on node 1
    assert (out / "primerl.sbatch").read_text().startswith("#!/bin/bash")


FAKE_PYTHON = """#!/bin/bash
# stands in for python: trainer node 0's step fails at once (naming its arguments and round), the others serve
echo "args: $* round=$PRIMERL_JOB_RESTARTS supervised=$PRIMERL_NODE_SUPERVISED"
case " $* " in
  *" --role trainer --node-rank 0 "*)
    echo "primerl node: FAILED: node $PRIMERL_JOB_RESTARTS torchrun exited with code 1" >&2; exit 3 ;;
  *) exec sleep 60 ;;
esac
"""


def test_past_max_restarts_the_sbatch_script_fails_naming_every_round(tmp_path):
    """The script alone, its steps a stand-in python whose trainer step fails at once: the steps
    restart twice (round 1 on with --checkpoint.resume true), then the script fails with the
    trainer step's exit code, listing each round's step and failure line."""
    from primerl.runtime.launch.slurm import render_sbatch

    out = tmp_path / "out"
    cfg = load_config(ROOT / "examples" / "reverse_text.toml",
                      ["--output_dir", str(out), *SMALL, "--deployment.kind", "slurm", "--deployment.max_restarts", "2",
                       "--deployment.grace_s", "2"])
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(cfg, str(tmp_path / "cfg.toml"), python=str(fake)))
    standins = Path(__file__).resolve().parent / "slurm_standins"
    res = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120,
                         env=_env(PATH=f"{standins}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID="7",
                                  SLURM_JOB_NODELIST="127.0.0.1,127.0.0.2"))
    assert res.returncode == 3, res.stderr
    err = res.stderr
    assert "RESTART 1 of at most 2" in err and "RESTART 2 of at most 2" in err, err
    assert "primerl: FAILED: the job failed 3 times (deployment.max_restarts = 2); the causes:" in err, err
    for i in range(3):
        assert (f"{i + 1}. node 0 (127.0.0.1) trainer failed (exit 3): node {i} torchrun exited with code 1"
                in err.splitlines()), err
    log = (out / "logs" / "node0-trainer.log").read_text()  # appended across rounds
    rounds = [ln for ln in log.splitlines() if ln.startswith("args: ")]
    assert [ln.endswith(f"round={i} supervised=launcher") for i, ln in enumerate(rounds)] == [True] * 3, rounds
    assert ["--checkpoint.resume true" in ln for ln in rounds] == [False, True, True], rounds
