"""On-policy distillation against RL alone (issue 44): ``examples/reverse_text_distill.toml``'s small
student (2 layers, d=64) run once per seed and mode until the mean reward of its last 20 steps
reaches 0.9, or a time limit.

``python -m bench distill [--quick]``; the teacher is ``PRIMERL_DISTILL_TEACHER`` (default the
example's: ``outputs/reverse_text``, what ``primerl rl --config examples/reverse_text.toml`` leaves),
``PRIMERL_DISTILL_SEEDS`` (default "0,1,2,3"; "0" with --quick), ``PRIMERL_DISTILL_MODES`` (default
"rl,opd,opd_reward"), ``PRIMERL_DISTILL_SECONDS`` per run (default 600; 90 with --quick). Runs go seed by seed, the
modes interleaved (so a bench cut short has as many seeds of each mode); ``PRIMERL_DISTILL_RUNS``
("rl:0,opd:0,...") lists the runs instead.

Modes: ``rl`` (``--distill.teacher "" --distill.only false --distill.topk 0``: RL alone, the reward
advantage, with the example's optimiser; ``PRIMERL_DISTILL_ARGS``: more ``--key value`` for every
mode), ``opd`` (the example: ``distill.only = true``, the per-token reverse-KL advantage and the
teacher's top-4 term), ``opd_reward`` (``--distill.only false``: the reward advantage added) and
``opd_sampled`` (``--distill.topk 0``: the sampled tokens' reverse-KL advantage alone, no top-k). One row per
run: the step at which the 20-step mean first reached 0.9 and the seconds from the job's start
(nan: not reached), the median teacher scoring time per step (``distill/score_s``), the median wait
of a batch on the teacher (``distill/wait_s``) and the median time the trainer waited for its batch
(``time/wait_s``, the first 3 steps left out: whether the teacher's latency reached the step); then
one row per mode: the median steps over every run (a run that did not reach counts as more steps
than any that did: "not reached" where that is the median), the median seconds over the runs that
reached, seeds reached / run.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

from .harness import Row
from .job import ROOT, run_job
from .reach import first_reached, stop_at_reach

MODES = {"rl": ("--distill.teacher", "", "--distill.only", "false", "--distill.topk", "0"), "opd": (),
         "opd_reward": ("--distill.only", "false"), "opd_sampled": ("--distill.topk", "0")}


def run(args) -> list[Row]:
    seeds = os.environ.get("PRIMERL_DISTILL_SEEDS", "0" if args.quick else "0,1,2,3").split(",")
    modes = os.environ.get("PRIMERL_DISTILL_MODES", "rl,opd,opd_reward").split(",")
    seconds = float(os.environ.get("PRIMERL_DISTILL_SECONDS", 90 if args.quick else 600))
    teacher = os.environ.get("PRIMERL_DISTILL_TEACHER", str(ROOT / "outputs" / "reverse_text"))
    threshold = 0.9
    runs = [(m, sd) for sd in seeds for m in modes]
    if os.environ.get("PRIMERL_DISTILL_RUNS"):
        runs = [tuple(r.split(":")) for r in os.environ["PRIMERL_DISTILL_RUNS"].split(",")]
    rows = []
    reached: dict = {m: ([], [], []) for m, _ in runs}  # mode -> (steps, seconds, seeds run)
    for mode, seed in runs:
        hit: dict = {}
        stop = stop_at_reach(threshold, hit)

        extra_args = ("--seed", seed.strip(), "--distill.teacher", teacher, *MODES[mode],
                      *os.environ.get("PRIMERL_DISTILL_ARGS", "").split())
        reached[mode][2].append(seed)
        with tempfile.TemporaryDirectory() as d:
            try:
                metrics = run_job(args.device, seconds, Path(d) / "job", args=extra_args, stop=stop,
                                  example="reverse_text_distill.toml")
            except Exception as e:  # noqa: BLE001 - one failed row, not a crashed bench
                rows.append(Row("distill_reach", f"{mode} seed {seed}", "-", args.device, float("nan"),
                                extra={"error": str(e)[-400:]}))
                continue
        rewards = [m["reward/mean"] for m in metrics]
        step = first_reached(rewards, threshold)
        score = [m["distill/score_s"] for m in metrics if "distill/score_s" in m]
        wait = [m["distill/wait_s"] for m in metrics if "distill/wait_s" in m]
        trainer_wait = [m["time/wait_s"] for m in metrics[3:]]
        extra = {"reached_at_step": "not reached" if step is None else step, "steps": len(rewards),
                 "s/step": f"{statistics.median(m['time/step_s'] for m in metrics):.3f}" if metrics else "-",
                 "score_s/step": f"{statistics.median(score):.4f}" if score else "-",
                 "wait_s/step": f"{statistics.median(wait):.4f}" if wait else "-",
                 "trainer_wait_s/step": f"{statistics.median(trainer_wait):.4f}" if trainer_wait else "-"}
        if step is not None:
            reached[mode][0].append(step)
            reached[mode][1].append(hit.get("seconds", float("nan")))
        values = {"steps": len(rewards), **({} if step is None else {"step": step, **hit})}
        rows.append(Row("distill_reach", f"{mode} seed {seed}, 20-step mean >= {threshold:g}", "-", args.device,
                        hit.get("seconds", float("nan")), extra=extra, values=values))
    for mode, (steps, secs, ran) in reached.items():
        median = statistics.median(steps + [float("inf")] * (len(ran) - len(steps))) if ran else float("nan")
        summary = {"reached": f"{len(steps)}/{len(ran)}",
                   "median_step": "not reached" if median == float("inf") else median,
                   "median_s": f"{statistics.median(secs):.0f}" if secs else "-"}
        rows.append(Row("distill_reach", f"{mode}: {len(ran)} seeds, {seconds:g} s each", "-", args.device,
                        float("nan"), extra=summary, values={"reached": len(steps), "seeds": len(ran)}))
    return rows
