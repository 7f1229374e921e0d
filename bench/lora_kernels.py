"""LoRA on routed experts: ``grouped_lora`` against a per-expert loop of ``lora_linear``, same run.

Rows per (M routed rows, d, n, E experts, r), rows split raggedly over the experts (a seeded
multinomial), forward + backward (gradients to x and the adapters; the base frozen):

* ``loop_lora_linear`` (baseline): what a model without grouped LoRA runs, one ``lora_linear``
  per expert over its rows with that expert's base weight ``W_e [n, d]`` and adapters.
* ``grouped``: ``grouped_gemm_nt`` (the base, as the fused experts run it) + ``grouped_lora``;
  ``ratio`` = loop time / grouped time (> 1: grouped faster).
* ``loop_delta`` / ``grouped_lora``: the low-rank path alone (the per-expert loop of the LoRA
  delta, :func:`primerl.kernels.lora.reference.grouped_lora_loop`, against ``grouped_lora``).

TFLOP/s count 3 x forward: base ``2*M*n*d``, LoRA ``2*M*r*(d + n)``. CPU: the torch backend on one
intra-op thread (on the shared 2-core machine, load ~25, a second OpenMP thread mostly spins: the
same quick case gave ratios from 0.65x to 5.8x between runs at 2 threads), timed interleaved
(``--quick``: the smallest shape only); the last column adds the process's CPU time per
step (``cpu_ms``) and its ratio (``cpu_ratio``), steadier than wall time on a shared, oversubscribed
machine (other tenants' load stretches wall time, not the CPU time this process spends). CUDA: the
torch and the Triton backends, each against its own loop.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from .harness import Row, time_interleaved

# (M, d, n, E, r): a small MoE layer's expert projection, then Qwen3-30B-A3B-like (d 2048,
# expert width 768: the down projection's n = d) at 8k tokens x top-8 over 128 experts
QUICK_SHAPES = [(512, 128, 128, 8, 8)]
CPU_SHAPES = QUICK_SHAPES + [(2048, 256, 256, 16, 16)]
CUDA_SHAPES = [(8192, 1024, 512, 32, 16), (65536, 2048, 768, 128, 16), (65536, 2048, 768, 128, 64)]


def _inputs(m, d, n, e, r, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.bincount(torch.multinomial(torch.ones(e), m, replacement=True, generator=g), minlength=e)
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(device)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    x = randn(m, d)
    w = randn(e, n, d, scale=d ** -0.5)
    a = randn(e, r, d, scale=d ** -0.5).requires_grad_()
    b = randn(e, n, r, scale=0.1).requires_grad_()
    gy = randn(m, n)
    return x, w, a, b, offsets, gy


def _steps(x, w, a, b, offsets, gy, backend):
    from primerl.kernels.gemm import grouped_gemm_nt
    from primerl.kernels.lora import grouped_lora, lora_linear
    from primerl.kernels.lora.reference import grouped_lora_loop

    bounds = [0] + offsets.tolist()  # the loop needs the host offsets: read once, outside the timing
    scale = 2.0

    def backward(y, xx):
        y.backward(gy)
        a.grad = b.grad = xx.grad = None

    def loop_lora_linear():
        xx = x.detach().requires_grad_()
        y = torch.cat([lora_linear(xx[s:t], w[i], a[i], b[i], scale, backend=backend)
                       for i, (s, t) in enumerate(zip(bounds[:-1], bounds[1:]))])
        backward(y, xx)

    def grouped():
        xx = x.detach().requires_grad_()
        y = grouped_gemm_nt(xx, w, offsets, layout="offsets", backend=backend) \
            + grouped_lora(xx, a, b, scale, offsets=offsets, backend=backend)
        backward(y, xx)

    def loop_delta():
        xx = x.detach().requires_grad_()
        if backend == "torch":
            y = grouped_lora_loop(xx, a, b, scale, offsets)
        else:  # the same loop over the backend's lora_linear with a zero base
            zero = torch.zeros(w.shape[1], w.shape[2], dtype=w.dtype, device=w.device)
            y = torch.cat([lora_linear(xx[s:t], zero, a[i], b[i], scale, backend=backend)
                           for i, (s, t) in enumerate(zip(bounds[:-1], bounds[1:]))])
        backward(y, xx)

    def grouped_delta():
        xx = x.detach().requires_grad_()
        backward(grouped_lora(xx, a, b, scale, offsets=offsets, backend=backend), xx)

    return dict(loop_lora_linear=loop_lora_linear, grouped=grouped, loop_delta=loop_delta,
                grouped_lora=grouped_delta)


def _cpu_times(fns, repeats) -> dict[str, float]:
    """Median process CPU time of each function, run in turn within each repeat (after one warm-up)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.process_time()
            fn()
            times[name].append(time.process_time() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _rows(shape, dtype, device, backend, repeats) -> list[Row]:
    m, d, n, e, r = shape
    fns = _steps(*_inputs(m, d, n, e, r, dtype, device), backend)
    times = time_interleaved(fns, device=device, warmup=1, repeats=repeats)
    cpu = _cpu_times(fns, repeats) if device == "cpu" else None
    lora_flops = 3 * 2 * m * r * (d + n)
    full_flops = 3 * 2 * m * n * d + lora_flops
    label = f"M={m} d={d} n={n} E={e} r={r}"
    dt = str(dtype).replace("torch.", "")

    def row(op, flops, base):
        s = times[op]
        extra = {}
        if cpu is not None:
            extra["cpu_ms"] = f"{cpu[op] * 1e3:.1f}"
            if base is not None:
                extra["cpu_ratio"] = f"{cpu[base] / cpu[op]:.2f}x"
        return Row(op=op, shape=label, dtype=dt, backend=backend, median_s=s, tflops=flops / s / 1e12,
                   ratio=None if base is None else times[base] / s, baseline=base or "", extra=extra)

    return [row("loop_lora_linear", full_flops, None), row("grouped", full_flops, "loop_lora_linear"),
            row("loop_delta", lora_flops, None), row("grouped_lora", lora_flops, "loop_delta")]


def run(args) -> list[Row]:
    device = args.device
    rows: list[Row] = []
    if device == "cuda":
        from primerl.kernels import backend_status

        backends = ["torch"] + (["triton"] if backend_status("triton").available else [])
        for shape in CUDA_SHAPES[:1] if args.quick else CUDA_SHAPES:
            for backend in backends:
                try:
                    rows += _rows(shape, torch.bfloat16, device, backend, repeats=1)
                except Exception as exc:  # noqa: BLE001 - one failing case prints an error row, the rest runs
                    rows.append(Row("grouped_lora", str(shape), "bfloat16", backend, math.nan,
                                    extra={"error": f"{type(exc).__name__}: {str(exc)[:200]}"}))
        return rows
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for shape in QUICK_SHAPES if args.quick else CPU_SHAPES:
            rows += _rows(shape, torch.float32, device, "torch", repeats=9)
    finally:
        torch.set_num_threads(threads)
    return rows
