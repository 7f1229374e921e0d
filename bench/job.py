"""The RL job end to end: ``examples/reverse_text_gpu.toml`` on CUDA (``reverse_text.toml`` on
the CPU) run as ``primerl rl`` for a fixed wall time, then read from its ``metrics.jsonl``.

``python -m bench job [--device cuda] [--quick]`` (``PRIMERL_JOB_SECONDS`` overrides the time:
40 s, 20 with --quick, start-up included: under the GPU check's 60 s per module)

One row, the job's steady state (its first 3 steps, start-up and Triton compiles, left out):
steps/s (1 / median ``time/step_s``), trainer tokens/s (tokens / ``time/train_s``, the trainer's
own compute), engine tokens/s (generated tokens per second between batch hand-overs, the
engine's in-job decode rate, waits on weights included), peak GPU memory of the trainer and of
the engine (``torch.cuda.max_memory_allocated`` in each process), and the reward: the first
step's and the mean of the last 10 steps reached. There is no baseline in the same run: the
figures are absolute, quoted with the device and date in RESULTS.md.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from .harness import Row

ROOT = Path(__file__).resolve().parents[1]
SKIP = 3  # start-up steps: process start, the first weight load, Triton compiles


def run_job(device: str, seconds: float, out: Path, *, args: tuple[str, ...] = (),
            stop: Callable[[list[dict]], bool] | None = None, example: str | None = None) -> list[dict]:
    """``primerl rl`` on the example for ``device`` (or ``examples/<example>``; more command-line
    ``args`` appended) until ``seconds`` pass, it ends, or ``stop(rows so far)`` says so: its metric rows."""
    from primerl.runtime.metrics import read_metrics

    if example is None:
        example = "reverse_text_gpu.toml" if device == "cuda" else "reverse_text.toml"
    cmd = [sys.executable, "-m", "primerl.runtime.cli", "rl", "--config", str(ROOT / "examples" / example),
           "--output_dir", str(out), "--overwrite", "true", "--checkpoint.interval", "0", "--log.plot", "false",
           "--log.progress", "false", "--device", device, *args]
    log = out.parent / "job.log"  # a file, not a pipe nobody reads: a full pipe (64 KB) would stall the job
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)
    deadline = time.monotonic() + seconds
    killed = False
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            if stop is not None and stop(read_metrics(out / "metrics.jsonl")):
                break
    finally:  # also when this bench is stopped (SIGTERM): no job left running on the GPU
        if proc.poll() is None:
            killed = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if not killed and proc.returncode != 0:
        raise RuntimeError(f"primerl rl failed (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
    return read_metrics(out / "metrics.jsonl")


def summarize(rows: list[dict]) -> dict:
    steady = rows[SKIP:] if len(rows) > SKIP + 2 else rows
    out = {
        "steps": len(rows),
        "steps_per_s": 1.0 / statistics.median(r["time/step_s"] for r in steady),
        "trainer_tok_per_s": sum(r["tokens"] for r in steady) / sum(r["time/train_s"] for r in steady),
        "engine_tok_per_s": statistics.median(r["inference/tokens_per_s"] for r in steady),
        "reward_first": rows[0]["reward/mean"],
        "reward_last10": statistics.mean(r["reward/mean"] for r in rows[-10:]),
    }
    for key in ("memory/trainer_peak_gb", "memory/engine_peak_gb"):
        vals = [r[key] for r in rows if key in r]
        if vals:
            out[key.split("/")[1]] = max(vals)
    return out


def run(args) -> list[Row]:
    seconds = float(os.environ.get("PRIMERL_JOB_SECONDS", 20 if args.quick else 40))
    with tempfile.TemporaryDirectory() as d:
        try:
            rows = run_job(args.device, seconds, Path(d) / "job")
        except Exception as e:  # noqa: BLE001 - one failed row, not a crashed bench
            return [Row("rl_job", "reverse-text", "-", args.device, float("nan"), extra={"error": str(e)[-400:]})]
    if not rows:
        return [Row("rl_job", "reverse-text", "-", args.device, float("nan"),
                    extra={"error": f"no step finished within {seconds:g} s"})]
    s = summarize(rows)
    extra = {"steps": s["steps"], "steps/s": f"{s['steps_per_s']:.2f}",
             "trainer_tok/s": f"{s['trainer_tok_per_s']:.0f}", "engine_tok/s": f"{s['engine_tok_per_s']:.0f}",
             "reward": f"{s['reward_first']:.3f}->{s['reward_last10']:.3f}"}
    for key in ("trainer_peak_gb", "engine_peak_gb"):
        if key in s:
            extra[key] = f"{s[key]:.3f}"
    dtype = "bf16 mixed" if args.device == "cuda" else "fp32"
    return [Row("rl_job", f"reverse-text 32x8, {seconds:g} s", dtype, args.device, 1.0 / s["steps_per_s"], extra=extra,
                values=s)]
