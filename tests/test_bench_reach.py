"""bench/reach.py: the first step a window mean reaches a threshold, and its per-seed rows (the
job itself replaced by recorded metrics: a real run is minutes; `python -m bench reach` does it)."""

from __future__ import annotations

import math
from types import SimpleNamespace

from bench import reach


def test_first_reached_is_the_first_full_window_at_the_threshold():
    assert reach.first_reached([1.0] * 19, 0.9) is None  # never a full window
    assert reach.first_reached([1.0] * 20, 0.9) == 19
    r = [0.0] * 10 + [1.0] * 30
    # window ending at i holds i - 9 ones (i >= 19): 18 of 20 first at i = 27
    assert reach.first_reached(r, 0.9) == 27
    assert reach.first_reached(r, 0.9, window=5) == 14
    assert reach.first_reached([1.0, 0.75] * 20, 0.875) == 19  # exactly the threshold counts


def test_rows_per_seed_and_summary(monkeypatch):
    runs = {"0": [0.5] * 30 + [1.0] * 40, "1": [0.5] * 100}
    seen = []

    def fake_run_job(device, seconds, out, *, args=(), stop=None):
        seed = args[args.index("--seed") + 1]
        seen.append((device, seconds, seed))
        metrics = []
        for r in runs[seed]:
            metrics.append({"reward/mean": r, "time/step_s": 0.1})
            if stop(metrics):
                break
        return metrics

    monkeypatch.setattr(reach, "run_job", fake_run_job)
    monkeypatch.setenv("PRIMERL_REACH_SEEDS", "0,1")
    monkeypatch.setenv("PRIMERL_REACH_SECONDS", "7")
    rows = reach.run(SimpleNamespace(device="cpu", quick=False))
    assert seen == [("cpu", 7.0, "0"), ("cpu", 7.0, "1")]
    # window ending at i >= 29 holds i - 29 ones and 49 - i halves: mean >= 0.9 first at i = 45
    assert [r.values.get("step") for r in rows[:2]] == [45, None]
    assert rows[0].values["steps"] == 46 and rows[1].values["steps"] == 100  # seed 0 stopped when it reached
    assert rows[0].median_s >= 0 and math.isnan(rows[1].median_s)
    assert rows[1].extra["reached_at_step"] == "not reached"
    assert rows[2].values == {"reached": 1, "seeds": 2}
