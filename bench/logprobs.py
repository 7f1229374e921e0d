"""Fused chunked log-probabilities vs the naive full-logits path (forward + backward).

The naive baseline is what a trainer writes without a fused op: float32 logits [T, V],
log_softmax, gather (with autograd), and the entropy of the same logits under no_grad. Both paths
compute log-probs and entropies and backpropagate ``logprobs.sum()`` into hidden and weight.

Reported: median time (ratio = naive / fused, > 1 means faster) and peak memory above the inputs.
On CPU each path runs in a fresh subprocess: peak = the process's peak resident set size
(ru_maxrss) minus its resident size just before the first step, so every allocation counts once
whatever allocator or profiler quirk (the profiler-based bench.harness.peak_memory attributes an
allocation to each enclosing operator). On CUDA: the allocator's peak.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from primerl.kernels.logprobs import fused_logprobs

from .harness import Row, peak_memory, time_fn


def _naive(hidden, weight, targets):
    logits = hidden.float() @ weight.float().t()
    logp_all = torch.log_softmax(logits, dim=-1)
    logprobs = logp_all.gather(1, targets.unsqueeze(1)).squeeze(1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, entropy


def _make(T, V, D, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(T, D, generator=g) * 0.5).to(device).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.05).to(device).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g).to(device)
    return hidden, weight, targets


def _step(path, hidden, weight, targets):
    def go():
        hidden.grad = weight.grad = None
        if path == "naive":
            lp, _ent = _naive(hidden, weight, targets)
        else:
            lp, _ent = fused_logprobs(hidden, weight, targets, backend=path)
        lp.sum().backward()
    return go


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(path: str, T: int, V: int, D: int, passes: int) -> None:
    """Run in a fresh process: prints {"peak": bytes above the pre-step RSS, "times": [...]}."""
    hidden, weight, targets = _make(T, V, D, "cpu")
    go = _step(path, hidden, weight, targets)
    base = _rss_bytes()
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        go()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    print(json.dumps({"peak": peak, "times": times}))


def _run_child(path, T, V, D, passes):
    code = f"import bench.logprobs as b; b.child({path!r}, {T}, {V}, {D}, {passes})"
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(args) -> list[Row]:
    dev = args.device
    shapes = [(1024, 16384, 256)] if args.quick else [(8192, 65536, 512)]
    if getattr(args, "shape", None):
        shapes = [tuple(int(x) for x in args.shape.split(","))]
    paths = ["naive", "torch"] + (["triton"] if dev == "cuda" else [])
    rows = []
    for T, V, D in shapes:
        shape = f"T={T} V={V} D={D}"
        res = {}
        for p in paths:
            if dev == "cuda":
                go = _step(p, *_make(T, V, D, dev))
                res[p] = (time_fn(go, device=dev), peak_memory(go, device=dev))
            else:
                # two passes (the first pays lazy initialisation); the second is the time reported
                r = _run_child(p, T, V, D, passes=2 if not args.quick else 3)
                res[p] = (min(r["times"][1:]), r["peak"])
        t_naive, m_naive = res["naive"]
        rows.append(Row("logprobs fwd+bwd", shape, "float32", "naive", t_naive,
                        extra={"peak_MiB": round(m_naive / 2**20, 1)}))
        for p in paths[1:]:
            t, m = res[p]
            rows.append(Row("logprobs fwd+bwd", shape, "float32", f"fused/{p}", t, ratio=t_naive / t,
                            baseline="naive",
                            extra={"peak_MiB": round(m / 2**20, 1), "mem_vs_naive": f"{m / m_naive:.3f}",
                                   "time_vs_naive": f"{t / t_naive:.2f}"}))
    return rows
