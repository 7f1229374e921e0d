"""How reliably the RL job's example learns: ``examples/reverse_text.toml`` (``reverse_text_gpu.toml``
on CUDA) run once per seed until the mean reward of its last 20 steps reaches 0.9, or a time limit.

``python -m bench reach [--device cpu] [--quick]``; ``PRIMERL_REACH_SEEDS`` (default "0,1,2,3";
"0" with --quick), ``PRIMERL_REACH_SECONDS`` per seed (default 240: about what the README's 5-minute
promise leaves after a 70 s set-up; 60 with --quick), ``PRIMERL_REACH_THRESHOLD`` (0.9).

One row per seed: the step at which the 20-step mean first reached the threshold and the seconds
from the job's start (``median_s``; nan: not reached), steps run, mean reward of the last 50 steps,
median step time; then one summary row: seeds reached / seeds run. The async job differs from run
to run even at one seed (bench/RESULTS.md), so several seeds are the measurement, not one.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from .harness import Row
from .job import run_job

WINDOW = 20


def first_reached(rewards: list[float], threshold: float, window: int = WINDOW) -> int | None:
    """The first step index at which the mean of the last ``window`` rewards is >= threshold."""
    total = 0.0
    for i, r in enumerate(rewards):
        total += r
        if i >= window:
            total -= rewards[i - window]
        if i >= window - 1 and total / window >= threshold:
            return i
    return None


def stop_at_reach(threshold: float, hit: dict):
    """A ``run_job`` ``stop`` callback: True once the job's rewards first reach ``threshold`` (20-step
    mean), recording the seconds since this call in ``hit["seconds"]``."""
    t0 = time.monotonic()

    def stop(metrics: list[dict]) -> bool:
        if first_reached([m["reward/mean"] for m in metrics], threshold) is None:
            return False
        hit["seconds"] = time.monotonic() - t0
        return True

    return stop


def run(args) -> list[Row]:
    seeds = os.environ.get("PRIMERL_REACH_SEEDS", "0" if args.quick else "0,1,2,3").split(",")
    seconds = float(os.environ.get("PRIMERL_REACH_SECONDS", 60 if args.quick else 240))
    threshold = float(os.environ.get("PRIMERL_REACH_THRESHOLD", 0.9))
    rows, reached = [], 0
    for seed in seeds:
        hit: dict = {}  # seconds from the start to the first time the job's metrics showed it
        stop = stop_at_reach(threshold, hit)

        with tempfile.TemporaryDirectory() as d:
            try:
                metrics = run_job(args.device, seconds, Path(d) / "job", args=("--seed", seed.strip()), stop=stop)
            except Exception as e:  # noqa: BLE001 - one failed row, not a crashed bench
                rows.append(Row("rl_reach", f"seed {seed}", "-", args.device, float("nan"),
                                extra={"error": str(e)[-400:]}))
                continue
        rewards = [m["reward/mean"] for m in metrics]
        step = first_reached(rewards, threshold)  # also when the job ended between two looks
        reached += step is not None
        extra = {"reached_at_step": "not reached" if step is None else step, "steps": len(rewards),
                 "last50": f"{statistics.mean(rewards[-50:]):.3f}" if rewards else "-",
                 "s/step": f"{statistics.median(m['time/step_s'] for m in metrics):.3f}" if metrics else "-"}
        values = {"steps": len(rewards), **({} if step is None else {"step": step, **hit})}
        rows.append(Row("rl_reach", f"seed {seed}, 20-step mean >= {threshold:g}", "-", args.device,
                        hit.get("seconds", float("nan")), extra=extra, values=values))
    rows.append(Row("rl_reach", f"{len(seeds)} seeds, {seconds:g} s each", "-", args.device, float("nan"),
                    extra={"reached": f"{reached}/{len(seeds)}"}, values={"reached": reached, "seeds": len(seeds)}))
    return rows
