"""Step time of the job's trainer (examples/reverse_text.toml: its model, loss and optimizer) with and
without ``trainer.compile`` on this machine's CPU.

    PYTHONPATH=. python -m bench.trainer_compile [--steps N]

Each step is one rollout batch as the job packs it: 32 prompts x 8 samples of 10 tokens (4 prompt, 6
completion) in one micro-batch; every step draws a new batch with 240-256 samples, so the token count
(and with it every shape) changes from step to step, as in the job. Reported: the first step (with
trainer.compile: tracing and compiling the forward and backward), then the median of the next N steps,
and the compiled/eager ratio of the medians (< 1: compile is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from primerl.rl.packing import Sample, pack
from primerl.runtime.validate import load_config
from primerl.runtime.trainer import Trainer

V = 12


def _payload(step: int):
    g = torch.Generator().manual_seed(step)
    n = 256 - int(torch.randint(0, 17, (1,), generator=g))
    samples = []
    for _ in range(n):
        ids = torch.randint(0, V, (10,), generator=g)
        mask = torch.tensor([False] * 4 + [True] * 6)
        lp = torch.where(mask, -torch.rand(10, generator=g), torch.zeros(10))
        replay = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(10)])[:, None, :].expand(10, 2, 2)
        samples.append(Sample(ids, mask, float(torch.randn(1, generator=g)), lp, 1.0, replay.contiguous()))
    return {"micro_batches": pack(samples, 4096, 1, pad_to_seq_len=False)[0], "metrics": {}}


def measure(compile_: bool, steps: int):
    cfg = load_config("examples/reverse_text.toml", ["--trainer.compile", str(compile_).lower()])
    torch.set_num_threads(cfg.threads)
    torch._dynamo.reset()
    t = Trainer(cfg, V)
    times = []
    for i in range(steps + 1):
        payload = _payload(i)
        t0 = time.perf_counter()
        t.train_step(payload)
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[1:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    rows = {c: measure(c, args.steps) for c in (False, True)}
    print("| trainer.compile | first step (s) | median step (s), next %d steps |" % args.steps)
    print("|---|---|---|")
    for c, (first, med) in rows.items():
        print(f"| {str(c).lower()} | {first:.2f} | {med:.3f} |")
    print(f"compiled / eager median step time: {rows[True][1] / rows[False][1]:.2f}")


if __name__ == "__main__":
    main()
