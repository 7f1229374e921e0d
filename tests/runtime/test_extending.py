"""The runtime's doors, proven from outside the package (issue 41): a third inference backend and a
third launcher, defined in ``examples/extending/primerl_ext_demo.py`` (not under ``primerl/``),
run the main task's job through ``primerl rl`` — by ``module:Attr`` name and by entry points."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from primerl.runtime.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXT = ROOT / "examples" / "extending"
BACKEND, LAUNCHER = "primerl_ext_demo:CountingBackend", "primerl_ext_demo:TwoProcessLauncher"


def _primerl(args: list[str], *, pythonpath: list[Path], cwd: Path, timeout: float = 900):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, [*pythonpath, ROOT])), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "primerl.runtime.cli", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


@pytest.mark.dist
def test_a_backend_and_a_launcher_from_outside_the_package_run_the_main_task(tmp_path):
    out, steps = tmp_path / "run", 4
    res = _primerl(["rl", "--config", str(ROOT / "examples" / "reverse_text.toml"), "--inference.backend", BACKEND,
                    "--deployment.kind", LAUNCHER, "--max_steps", str(steps), "--output_dir", str(out),
                    "--orchestrator.batch_size", "4", "--orchestrator.group_size", "4", "--log.plot", "false",
                    "--orchestrator.max_async_level", "0"],  # on policy: mismatch_kl ~1e-14 when weights arrive
                   pythonpath=[EXT], cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(steps))  # every step exactly once
    # the third backend served every step: its client's cumulative count, one batch of samples a step
    per_step = 4 * 4  # batch_size 4 x group_size 4 samples a step
    counts = [r["ext/completions"] for r in rows]  # as each batch was written (up to one step ahead)
    assert counts == sorted(counts) and counts[0] >= per_step and counts[-1] >= steps * per_step, counts
    # the third launcher started the processes: its own log names and processes.json rows
    assert (out / "logs" / "ext-trainer.log").is_file() and (out / "logs" / "ext-orchestrator.log").is_file()
    assert not (out / "logs" / "trainer.log").exists()  # not the built-in 'local' launcher
    import json

    roles = sorted(r["role"] for r in json.loads((out / "processes.json").read_text()))
    assert roles == ["orchestrator", "trainer"]
    assert rows[-1]["mismatch_kl/mean"] < 1e-3  # weights reached the backend's engine every step


def test_entry_points_register_them_by_name(tmp_path):
    """An installed package's entry points (groups ``primerl.inference_backends`` / ``primerl.launchers``)
    make the names known; ``--dry-run`` prints what each describes."""
    site = tmp_path / "site"
    dist = site / "primerl_ext_demo-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: primerl-ext-demo\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[primerl.inference_backends]\ncounting = {BACKEND}\n\n"
                                           f"[primerl.launchers]\ntwo-process = {LAUNCHER}\n")
    args = ["rl", "--config", str(ROOT / "examples" / "reverse_text.toml"), "--output_dir", str(tmp_path / "o"),
            "--dry-run", "--inference.backend", "counting", "--deployment.kind", "two-process"]
    res = _primerl(args, pythonpath=[site, EXT], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "# deployment: two-process (primerl_ext_demo)" in res.stdout
    assert "the counting backend" in res.stdout
    # without the package the names are unknown: one line listing what is registered, exit 2
    res = _primerl(args, pythonpath=[], cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "primerl: config error: inference.backend: unknown inference backend 'counting'; registered: embedded, vllm"]


def test_the_third_backend_declares_what_it_cannot_serve(tmp_path):
    """Its own check refuses a server pool at --dry-run, naming the key, before anything is written."""
    out = tmp_path / "o"
    res = _primerl(["rl", "--config", str(ROOT / "examples" / "reverse_text.toml"), "--inference.backend", BACKEND,
                    "--inference.num_servers", "2", "--output_dir", str(out), "--dry-run"], pythonpath=[EXT],
                   cwd=tmp_path)
    assert res.returncode == 2 and "inference.num_servers:" in res.stderr and not out.exists()
