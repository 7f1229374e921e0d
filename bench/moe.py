"""MoE block forward+backward: primerl's MoE against Hugging Face's Qwen3-MoE block (its default
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

    cfg = Qwen3MoeConfig(hidden_size=d, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=k, norm_topk_prob=True)
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


def run(args) -> list[Row]:
    from primerl.models.moe import MoE

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
