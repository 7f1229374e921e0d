"""Fused chunked log-probabilities vs the naive full-logits path (forward + backward).

CUDA (issue 24's table): bf16 hidden [T, D] and LM head [V, D] at (T, D, V) = (16384, 4096,
151936) and (32768, 6144, 154880); forward + backward of log p(target) by
  naive    log_softmax((h @ W.T).float()) and gather, autograd;
  liger    Liger-Kernel's fused linear cross-entropy, reduction="none" (imported lazily: a row says
           so when it is missing);
  primerl  fused_logprobs without and with the entropy (its gradient flows too).
Every backward gets the same random upstream gradient (per token; the entropy its own). Reported:
do_bench median, TFLOP/s counted as 6 T D V for every path (the three GEMMs of one forward and
one backward; the fused paths also recompute the logits in backward: 8 T D V done), peak extra
memory (allocator peak minus what is allocated before the step, inputs and their previous
gradients included, which the step releases first), ratios vs Liger and naive, and the fused
path's entropy-on / off time.

CPU: the naive baseline is what a trainer writes without a fused op: float32 logits [T, V],
log_softmax, gather (with autograd), and the entropy of the same logits under no_grad. Both paths
compute log-probs and entropies and backpropagate ``logprobs.sum()`` into hidden and weight.
Reported: median time (ratio = naive / fused, > 1 means faster) and peak memory above the inputs.
Each path runs in a fresh subprocess: peak = the process's peak resident set size (ru_maxrss)
minus its resident size just before the first step, so every allocation counts once whatever
allocator or profiler quirk (the profiler-based bench.harness.peak_memory attributes an
allocation to each enclosing operator).
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

from primerl.kernels.logprobs import chunked, fused_logprobs

from .harness import Row


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


CUDA_SHAPES = [(16384, 4096, 151936), (32768, 6144, 154880)]  # (T, D, V)
CUDA_QUICK_SHAPES = [(4096, 2048, 32000)]
CUDA_PATHS = ["naive", "liger", "primerl", "primerl+entropy"]


def _liger_flce():
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy


def _cuda_step(path, hidden, weight, targets, g_lp, g_ent):
    """One forward + backward with the given upstream gradients; the previous gradients released first."""
    if path == "liger":
        flce = _liger_flce()

    def go():
        hidden.grad = weight.grad = None
        if path == "naive":
            logp = torch.log_softmax((hidden @ weight.t()).float(), dim=-1)
            lp = logp.gather(1, targets.unsqueeze(1)).squeeze(1)
            torch.autograd.backward(lp, g_lp)
        elif path == "liger":
            loss = flce(hidden, weight, targets, reduction="none")  # -log p(target), [T] float32
            torch.autograd.backward(loss, g_lp)
        elif path == "primerl":
            lp, _ = fused_logprobs(hidden, weight, targets, return_entropy=False)
            torch.autograd.backward(lp, g_lp)
        else:
            lp, ent = fused_logprobs(hidden, weight, targets)
            torch.autograd.backward((lp, ent), (g_lp, g_ent))
    return go


def _cuda_measure(go, repeats: int = 3):
    """(median seconds by do_bench, peak extra bytes of one step after warm-up)."""
    from triton.testing import do_bench

    go()  # compiles, allocates the gradients, finds cuBLAS heuristics
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    go()  # the peak-memory step, and do_bench's time budget
    torch.cuda.synchronize()
    est_ms = (time.perf_counter() - t0) * 1e3
    peak = torch.cuda.max_memory_allocated() - base
    median = do_bench(go, warmup=1, rep=max(50.0, repeats * est_ms), return_mode="median") / 1e3
    return median, peak


def _run_cuda(args) -> list[Row]:
    shapes = CUDA_QUICK_SHAPES if args.quick else CUDA_SHAPES
    rows = []
    for T, D, V in shapes:
        shape = f"T={T} D={D} V={V}"
        gen = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(T, D, device="cuda", generator=gen).bfloat16().requires_grad_()
        weight = (torch.randn(V, D, device="cuda", generator=gen) * (2.0 / D**0.5)).bfloat16().requires_grad_()
        targets = torch.randint(0, V, (T,), device="cuda", generator=gen)
        g_lp, g_ent = torch.randn(T, device="cuda", generator=gen), torch.randn(T, device="cuda", generator=gen)
        res = {}
        for path in CUDA_PATHS:
            if path.startswith("primerl") and not chunked.native_low_precision(hidden, weight):
                # the float32-GEMM fallback takes ~1.6 s / 5 s a step here: not worth the module's minute
                res[path] = "not timed: no torch.mm(..., out_dtype=torch.float32) on this device"
                continue
            try:
                res[path] = _cuda_measure(_cuda_step(path, hidden, weight, targets, g_lp, g_ent))
            except ImportError as exc:
                res[path] = f"not installed ({exc})"
            except Exception as exc:  # noqa: BLE001 - a failing path is a row, the others still run
                res[path] = f"{type(exc).__name__}: {str(exc)[:160]}"
            hidden.grad = weight.grad = None
            torch.cuda.empty_cache()
            # one line as soon as a path is measured: a module cut off by its time limit still reports
            got = res[path]
            print(f"# {shape} {path}: " + (f"{got[0] * 1e3:.1f} ms, peak extra {got[1] / 1e9:.2f} GB"
                                           if isinstance(got, tuple) else got), flush=True)
        flops = 6 * T * D * V
        ok = {p: v for p, v in res.items() if isinstance(v, tuple)}
        for path in CUDA_PATHS:
            if path not in ok:
                rows.append(Row("logprobs fwd+bwd", shape, "bf16", path, float("nan"), extra={"error": res[path]}))
                continue
            t, mem = ok[path]
            extra = {"peak_extra_GB": f"{mem / 1e9:.2f}"}
            for base in ("liger", "naive"):
                if base in ok and base != path:
                    extra[f"time_vs_{base}"] = f"{t / ok[base][0]:.2f}"
                    extra[f"mem_vs_{base}"] = f"{mem / max(ok[base][1], 1):.2f}"
            if path == "primerl+entropy" and "primerl" in ok:
                extra["entropy_on/off"] = f"{t / ok['primerl'][0]:.2f}"
            ref = "liger" if "liger" in ok and path != "liger" else ""
            rows.append(Row("logprobs fwd+bwd", shape, "bf16", path, t, tflops=flops / t / 1e12,
                            ratio=ok[ref][0] / t if ref else None, baseline=ref, extra=extra,
                            values={"peak_extra_bytes": mem}))
        del hidden, weight, targets, g_lp, g_ent
        torch.cuda.empty_cache()
    return rows


def run(args) -> list[Row]:
    dev = args.device
    if dev == "cuda":
        return _run_cuda(args)
    shapes = [(1024, 16384, 256)] if args.quick else [(8192, 65536, 512)]
    if getattr(args, "shape", None):
        shapes = [tuple(int(x) for x in args.shape.split(","))]
    paths = ["naive", "torch"]
    rows = []
    for T, V, D in shapes:
        shape = f"T={T} V={V} D={D}"
        res = {}
        for p in paths:
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
