"""Dynamic sampling (``orchestrator.filter = "dapo"``) against none on the main task: trainer steps
(and rollouts sampled) until the 20-step mean reward reaches 0.9, per seed, through ``primerl rl``.

``python -m bench._dapo_reach`` (``PRIMERL_DAPO_SEEDS``, default "0,1,2,3"; ``PRIMERL_DAPO_SECONDS``
per run, default 900; ``PRIMERL_DAPO_ARGS``: more ``--key value`` for both modes; ``PRIMERL_DAPO_KEEP``:
a folder that keeps each run's output, ``<seed>_<filter>/``, in place of a temporary one). The reward
judged is that of every group sampled for a step (``reward/all_sampled`` with the filter: its
``reward/mean`` leaves the dropped uniform groups out, so it would understate the policy), the
same figure as ``reward/mean`` without it. One JSON line per run on stdout.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .job import run_job
from .reach import first_reached


def policy_reward(m: dict) -> float:
    return m.get("reward/all_sampled", m["reward/mean"])


def main() -> None:
    seeds = os.environ.get("PRIMERL_DAPO_SEEDS", "0,1,2,3").split(",")
    seconds = float(os.environ.get("PRIMERL_DAPO_SECONDS", 900))
    extra = tuple(os.environ.get("PRIMERL_DAPO_ARGS", "").split())
    keep = os.environ.get("PRIMERL_DAPO_KEEP")
    for seed in seeds:
        for mode in ("none", "dapo"):
            with tempfile.TemporaryDirectory() as d:
                out = Path(keep) / f"{seed}_{mode}" if keep else Path(d) / "job"
                out.parent.mkdir(parents=True, exist_ok=True)
                metrics = run_job("cpu", seconds, out,
                                  args=("--seed", seed, "--orchestrator.filter", mode, *extra),
                                  stop=lambda ms: first_reached([policy_reward(m) for m in ms], 0.9) is not None)
            step = first_reached([policy_reward(m) for m in metrics], 0.9)
            upto = metrics[: (step + 1) if step is not None else len(metrics)]
            oversampled = sum(m.get("rollouts/oversampled", 0) for m in upto)
            per_step = 32 * 8  # the example's batch_size x group_size: what the trainer gets each step
            print(json.dumps({"seed": int(seed), "filter": mode, "reached_at_step": step, "steps_run": len(metrics),
                              "rollouts_sampled": len(upto) * per_step + oversampled, "oversampled": oversampled,
                              "filtered_groups": sum(m.get("groups/filtered", 0) for m in upto),
                              "uniform_kept": sum(m.get("groups/uniform_kept", 0) for m in upto),
                              "median_step_s": sorted(m["time/step_s"] for m in metrics)[len(metrics) // 2]
                              if metrics else None}), flush=True)


if __name__ == "__main__":
    main()
