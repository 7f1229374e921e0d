"""MoE forward+backward. CUDA: the routed experts (issue 23's table); CPU: the whole MoE block.

CUDA rows per (T, D, I, E), top-8, the local experts of one EP rank (``EXPERT_SHAPES``): the
torchtitan-style baseline a user would write (sort the T*k slots by expert, pad each expert's rows
to 16 as torchtitan does so that ``_grouped_mm``'s weight gradient takes them, two
``torch._grouped_mm`` with SwiGLU between, weighted ``index_add_``), primerl ``fused_experts`` in
bf16, with the FP8 ``"blockwise"`` recipe and with the FP8 ``"rowwise"`` recipe: TFLOP/s
(18 * T*k * D*I per step), ``ratio`` against the baseline, peak memory of one step and its ratio to
primerl bf16's. A case that fails prints an error row and the module goes on.

CPU (below): primerl's MoE block against Hugging Face's Qwen3-MoE block (its default
experts implementation and its eager per-expert loop) and a dense matmul pair of the same FLOPs.

Rows per (T, D, I, E, k): the baselines, then primerl with ``ratio`` against each baseline
(> 1 = primerl faster). FLOPs counted: 3 x forward = 3 * T*k * 6*D*I (the router is left out).
Goals: ratio >= 1 vs hf_default, >= 3 vs hf_eager_loop, >= 0.7 vs dense_same_flops.

On CPU ``faulted_MB`` is the memory the OS mapped in during one step. glibc's malloc returns
every freed block of 32 MB or more to the OS, so each step faults its large tensors in again; the
block writes E times the dense baseline's weight gradients (all experts' w13 and w2), which at
the large shape is most of its extra time. Run with ``MALLOC_MMAP_MAX_=0
MALLOC_TRIM_THRESHOLD_=100000000000`` (glibc keeps freed memory, as jemalloc / tcmalloc do) to
time the arithmetic alone; the header names the allocator settings of the run.
"""

from __future__ import annotations

import torch

from .harness import Row, first_touch_mb, time_fn, time_interleaved

SHAPES = [(2048, 512, 256, 64, 8), (4096, 1024, 512, 128, 8)]
QUICK_SHAPES = [(256, 128, 64, 16, 4)]


def _hf_block(d, i, e, k, impl, dtype, device):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=d, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=k,
                         norm_topk_prob=True)
    cfg._experts_implementation = impl
    return Qwen3MoeSparseMoeBlock(cfg).to(device=device, dtype=dtype)


def _init(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5).to(p.dtype))


def _fwd_bwd(module, x, gy):
    def step():
        xx = x.detach().requires_grad_()
        module(xx).backward(gy)
        module.zero_grad(set_to_none=True)

    return step


def _with_backend(module, backend):
    """``module`` with its experts' backend set to ``backend`` whenever the returned wrapper runs."""

    def run(x):
        module.experts.backend = backend
        return module(x)

    run.zero_grad = module.zero_grad
    return run


def _dense_step(x_rows, w1, w2, gy_rows):
    def step():
        a = x_rows.detach().requires_grad_()
        y = (a @ w1.T)[:, : w2.shape[1]] @ w2.T  # 2*D*2I + 2*I*D flops per row, like an expert
        y.backward(gy_rows)
        w1.grad = w2.grad = None

    return step


EXPERT_SHAPES = [(8192, 5120, 1536, 20), (16384, 6144, 2048, 32), (4096, 2048, 768, 64)]  # T, D, I, E
TOP_K = 8


def _torchtitan_experts(x, w13, w2, ids, weights):
    """The baseline: x [T, D], w13 [E, 2I, D], w2 [E, D, I], ids / weights [T, k] -> y [T, D]."""
    t, k = ids.shape
    e = w13.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=e)
    ends = torch.cumsum(counts, 0)
    padded = (counts + 15) // 16 * 16
    ends_pad = torch.cumsum(padded, 0)
    group = flat[order].long()
    rank = torch.arange(order.numel(), device=x.device) - (ends - counts)[group]
    dest = (ends_pad - padded)[group] + rank
    rows = order.numel() + e * 15
    tok = order // k
    xp = x.new_zeros(rows, x.shape[1]).index_copy(0, dest, x[tok])
    offs = ends_pad.to(torch.int32)
    gu = torch._grouped_mm(xp, w13.transpose(-2, -1), offs=offs)
    gate, up = gu.chunk(2, dim=-1)
    h = torch.nn.functional.silu(gate) * up
    yp = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
    y = yp.index_select(0, dest) * weights.reshape(-1)[order, None].to(x.dtype)
    return x.new_zeros(x.shape).index_add_(0, tok, y)


def _experts_step(fn, x, w13, w2, ids, weights, gy):
    def step():
        leaves = [v.detach().requires_grad_() for v in (x, w13, w2, weights)]
        y = fn(leaves[0], leaves[1], leaves[2], ids, leaves[3])
        y.backward(gy)

    return step


def _run_cuda_experts() -> list[Row]:
    import math

    from primerl.kernels.moe import fused_experts

    from .harness import peak_memory

    dev, dtype = "cuda", torch.bfloat16
    variants = {
        "torchtitan_baseline": _torchtitan_experts,
        "primerl_bf16": lambda *a: fused_experts(*a),
        "primerl_fp8_blockwise": lambda *a: fused_experts(*a, fp8_recipe="blockwise"),
        "primerl_fp8_rowwise": lambda *a: fused_experts(*a, fp8_recipe="rowwise"),
    }
    rows: list[Row] = []
    for t, d, i, e in EXPERT_SHAPES:
        shape = f"T={t} D={d} I={i} E={e} k={TOP_K}"
        flops = 18 * t * TOP_K * d * i
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(t, d, device=dev, dtype=dtype, generator=g)
        w13 = torch.randn(e, 2 * i, d, device=dev, dtype=dtype, generator=g) / d ** 0.5
        w2 = torch.randn(e, d, i, device=dev, dtype=dtype, generator=g) / i ** 0.5
        ids = torch.rand(t, e, device=dev, generator=g).topk(TOP_K, dim=1).indices.to(torch.int32)
        weights = torch.rand(t, TOP_K, device=dev, generator=g)
        gy = torch.randn(t, d, device=dev, dtype=dtype, generator=g)
        measured = {}
        for name, fn in variants.items():
            step = _experts_step(fn, x, w13, w2, ids, weights, gy)
            try:
                step()
                peak = peak_memory(step, dev)
                measured[name] = (time_fn(step, device=dev), peak)
            except Exception as exc:  # noqa: BLE001 - print the failure, go on with the other rows
                torch.cuda.synchronize()
                msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}" if str(exc) else type(exc).__name__
                rows.append(Row("moe_experts_fwd_bwd", shape, "bf16", name, math.nan, extra={"error": msg}))
        base = measured.get("torchtitan_baseline", (None, None))[0]
        bf16_peak = measured.get("primerl_bf16", (None, None))[1]
        for name, (s, peak) in measured.items():
            extra = {"peak_GB": f"{peak / 1e9:.2f}"}
            if bf16_peak:
                extra["peak_vs_bf16"] = f"{peak / bf16_peak:.2f}x ({(peak - bf16_peak) / 1e9:+.2f} GB)"
            rows.append(Row("moe_experts_fwd_bwd", shape, "bf16", name, s, tflops=flops / s / 1e12,
                            ratio=None if base is None or name == "torchtitan_baseline" else base / s,
                            baseline="torchtitan_baseline" if name != "torchtitan_baseline" else "", extra=extra,
                            values={"peak_bytes": peak}))
    return rows


def run(args) -> list[Row]:
    from primerl.models.moe import MoE

    if args.device == "cuda":
        return _run_cuda_experts()
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = QUICK_SHAPES if args.quick else SHAPES
    repeats = 7 if device == "cpu" else 20
    rows: list[Row] = []
    for t, d, i, e, k in shapes:
        shape = f"T={t} D={d} I={i} E={e} k={k}"
        flops = 3 * t * k * 6 * d * i
        x = torch.randn(1, t, d, device=device, dtype=dtype)
        gy = torch.randn(1, t, d, device=device, dtype=dtype)
        ours = MoE(d, i, e, k, route_norm=True, device=device, dtype=dtype)
        _init(ours, 0)
        fns = {}
        for impl in ("grouped_mm", "eager"):
            hf = _hf_block(d, i, e, k, impl, dtype, device)
            with torch.no_grad():
                hf.gate.weight.copy_(ours.gate.weight)
                hf.experts.gate_up_proj.copy_(ours.experts.w13)
                hf.experts.down_proj.copy_(ours.experts.w2)
            fns["hf_default" if impl == "grouped_mm" else "hf_eager_loop"] = _fwd_bwd(hf, x, gy)
        w1 = torch.randn(2 * i, d, device=device, dtype=dtype, requires_grad=True)
        w2 = torch.randn(d, i, device=device, dtype=dtype, requires_grad=True)
        x_rows = torch.randn(t * k, d, device=device, dtype=dtype)
        gy_rows = torch.randn(t * k, d, device=device, dtype=dtype)
        fns["dense_same_flops"] = _dense_step(x_rows, w1, w2, gy_rows)
        baseline_names = list(fns)
        backends = ["torch"] if device == "cpu" else ["triton", "torch"]
        for be in backends:
            fns[be] = _fwd_bwd(_with_backend(ours, be), x, gy)
        # the block and its baselines run in turn within each repeat (CPU), so their ratios compare
        # the same machine state; the per-expert loop (7-16x slower) is timed on its own, 3 times
        eager = fns.pop("hf_eager_loop")
        measured = time_interleaved(fns, device=device, repeats=repeats)
        measured["hf_eager_loop"] = time_fn(eager, device=device, warmup=1, repeats=min(repeats, 3))
        touched = {name: first_touch_mb(fn) for name, fn in fns.items()} if device == "cpu" else {}
        baselines = {name: measured[name] for name in baseline_names}
        timings = {be: measured[be] for be in backends}
        if device == "cuda" and d % 128 == 0 and i % 128 == 0:  # FP8 is a GPU figure (CPU runs the reference)
            ours.experts.backend = "triton"
            ours.experts.enable_fp8("blockwise")
            timings["triton,fp8"] = time_fn(_fwd_bwd(ours, x, gy), device=device, warmup=1, repeats=repeats)
            ours.experts.enable_fp8(None)
        dt = str(dtype).replace("torch.", "")

        def extra(name, s):
            out = {"tok/s": f"{t / s:.0f}"}
            if name in touched:
                out["faulted_MB"] = f"{touched[name]:.0f}"
            return out

        for name, s in baselines.items():
            rows.append(Row("moe_block_fwd_bwd", shape, dt, name, s, tflops=flops / s / 1e12, extra=extra(name, s)))
        for be, s in timings.items():
            for name, base in baselines.items():
                rows.append(Row("moe_block_fwd_bwd", shape, dt, f"primerl[{be}]", s, tflops=flops / s / 1e12,
                                ratio=base / s, baseline=name, extra=extra(be, s)))
    return rows
