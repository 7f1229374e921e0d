"""python -m bench attention [--quick]: varlen attention kernels and ring attention.

CPU: the ring's per-rank work balance (max/min visible attention pairs per rank, i.e. FLOPs,
zigzag vs contiguous) and the wall time of ring attention forward+backward on 4 gloo ranks (one
thread each) against one process running the whole batch on one thread (the baseline).
CUDA: TFLOP/s of primerl's Triton kernel forward and forward+backward against SDPA's flash
backend (and flash-attn's varlen kernel when installed), causal, bf16.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch

from .harness import Row, time_fn

WORLD = 4


def _cu(lens, device="cpu"):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _causal_flops(lens, hq, d):
    """Forward FLOPs of causal attention (2 matmuls over the visible half)."""
    return sum(4 * hq * d * L * (L + 1) / 2 for L in lens)


def _shapes(quick):
    if quick:
        return [([384, 200, 57, 1], 4, 2, 32)]
    return [([2048, 1024, 700, 300, 1], 8, 2, 64), ([4096], 8, 2, 64)]


def _fwd_bwd(fn, q, k, v, g):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(g)


def _ring_worker(rank, world, init_file, out_file, lens, hq, hkv, d, layout, repeats):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from primerl.parallel.context import ContextShardPlan, ring_attention

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(0)
    T = sum(lens)
    q, k, v, g = (torch.randn(T, h, d, generator=gen) for h in (hq, hkv, hkv, hq))
    plan = ContextShardPlan(_cu(lens), None, layout=layout)
    ql, kl, vl, gl = (plan.shard(t) for t in (q, k, v, g))
    fn = lambda a, b, c: ring_attention(a, b, c, plan, backend="torch")  # noqa: E731
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        _fwd_bwd(fn, ql, kl, vl, gl)
        dist.barrier()
        if i:  # first run is warm-up
            times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(sorted(times)[len(times) // 2], f)
    dist.destroy_process_group()


def _cpu_rows(args) -> list[Row]:
    import torch.multiprocessing as mp

    from primerl.kernels.attention import attention
    from primerl.parallel.context import LAYOUTS, ContextShardPlan

    rows = []
    repeats = 1 if args.quick else 3
    for lens, hq, hkv, d in _shapes(args.quick):
        shape = f"lens={lens} H={hq}/{hkv} D={d}"
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        gen = torch.Generator().manual_seed(0)
        T = sum(lens)
        q, k, v, g = (torch.randn(T, h, d, generator=gen) for h in (hq, hkv, hkv, hq))
        base = time_fn(lambda: _fwd_bwd(lambda a, b, c: attention(a, b, c, cu_seqlens=_cu(lens), backend="torch"), q, k, v, g),
                       warmup=1, repeats=repeats)
        fused = time_fn(lambda: _fwd_bwd(lambda a, b, c: attention(a, b, c, cu_seqlens=_cu(lens), backend="sdpa"), q, k, v, g),
                        warmup=1, repeats=repeats)
        torch.set_num_threads(threads)
        flops = 3.5 * _causal_flops(lens, hq, d)  # fwd + bwd (2.5x fwd)
        rows.append(Row("attention fwd+bwd", shape, "float32", "torch, 1 process", base, tflops=flops / base / 1e12))
        rows.append(Row("attention fwd+bwd", shape, "float32", "sdpa, 1 process", fused, tflops=flops / fused / 1e12,
                        ratio=base / fused, baseline="torch, 1 process"))
        for layout in LAYOUTS:
            pairs = [ContextShardPlan(_cu(lens), layout=layout, world_size=WORLD, rank=r).attention_pairs(r) for r in range(WORLD)]
            with tempfile.TemporaryDirectory() as tmp:
                out_file = os.path.join(tmp, "t.json")
                mp.spawn(_ring_worker, args=(WORLD, os.path.join(tmp, "store"), out_file, lens, hq, hkv, d, layout, repeats),
                         nprocs=WORLD, join=True)
                with open(out_file) as f:
                    t = json.load(f)
            rows.append(Row("ring attention fwd+bwd", shape, "float32", f"torch, {layout}, {WORLD} gloo ranks", t,
                            tflops=flops / t / 1e12, ratio=base / t, baseline="1 process",
                            extra={"flops_max/min": f"{max(pairs) / min(pairs):.2f}"}))
    return rows


def _cuda_rows(args) -> list[Row]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from primerl.kernels.attention import attention

    rows = []
    configs = [(4, 1024, 16, 4, 128)] if args.quick else [(8, 2048, 32, 8, 128), (2, 8192, 32, 8, 128), (16, 1024, 32, 8, 64)]
    for B, L, hq, hkv, d in configs:
        shape = f"B={B} L={L} H={hq}/{hkv} D={d} causal"
        q, k, v = (torch.randn(B * L, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
        g = torch.randn_like(q)
        cu = _cu([L] * B, "cuda")
        fwd_flops = _causal_flops([L] * B, hq, d)
        qb, kb, vb = (t.view(B, L, -1, d).transpose(1, 2) for t in (q, k, v))

        def sdpa(a, b, c):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)

        impls = {"sdpa flash": (lambda a, b, c: sdpa(a, b, c), (qb, kb, vb), g.view(B, L, hq, d).transpose(1, 2)),
                 "triton": (lambda a, b, c: attention(a, b, c, cu_seqlens=cu, backend="triton"), (q, k, v), g),
                 "primerl sdpa": (lambda a, b, c: attention(a, b, c, cu_seqlens=cu, backend="sdpa"), (q, k, v), g)}
        try:
            import flash_attn  # noqa: F401

            impls["flash_attn"] = (lambda a, b, c: attention(a, b, c, cu_seqlens=cu, backend="flash_attn"), (q, k, v), g)
        except ImportError:
            pass
        times = {}
        for name, (fn, inputs, grad) in impls.items():
            try:
                with torch.no_grad():
                    tf = time_fn(lambda: fn(*inputs), device="cuda")
                tb = time_fn(lambda: _fwd_bwd(fn, *inputs, grad), device="cuda")
            except Exception as exc:  # noqa: BLE001 - e.g. SDPA flash refusing a shape: report, go on
                print(f"# {name} {shape}: {type(exc).__name__}: {exc}")
                continue
            times[name] = (tf, tb)
        base = times.get("sdpa flash")
        for name, (tf, tb) in times.items():
            rows.append(Row("attention fwd", shape, "bfloat16", name, tf, tflops=fwd_flops / tf / 1e12,
                            ratio=base[0] / tf if base else None, baseline="sdpa flash" if base else ""))
            rows.append(Row("attention fwd+bwd", shape, "bfloat16", name, tb, tflops=3.5 * fwd_flops / tb / 1e12,
                            ratio=base[1] / tb if base else None, baseline="sdpa flash" if base else ""))
    return rows


def run(args) -> list[Row]:
    if args.device == "cuda":
        return _cuda_rows(args)
    return _cpu_rows(args)
