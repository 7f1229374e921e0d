"""python -m bench attention [--quick]: varlen attention kernels and ring attention.

CPU: the ring's per-rank work balance (max/min visible attention pairs per rank, i.e. FLOPs,
zigzag vs contiguous) and the wall time of ring attention forward+backward on 4 gloo ranks (one
thread each) against one process running the whole batch on one thread (the baseline).
CUDA (the issue's table): TFLOP/s of forward and forward+backward, causal GQA, head_dim 128, bf16,
SDPA over equal-length sequences ``[B, H, S, D]`` (``enable_gqa=True``, torch's default kernel:
cuDNN on Hopper) against primerl on the same tokens packed varlen, with ``backend=None`` and each
CUDA backend named (triton, varlen_flash, cudnn; flash_attn when installed), ratio vs SDPA; then a
ring step (4096 queries against 8192 keys, positions and default mask) per useful FLOP against the
same backend's square kernel. A backend that fails prints an error row and the rest goes on.
Then the MLA and sparse-attention rows of ``bench mla_attention`` (GLM-5 / DeepSeek-V3 shapes).
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
        def fwd_bwd(backend):
            return _fwd_bwd(lambda a, b, c: attention(a, b, c, cu_seqlens=_cu(lens), backend=backend), q, k, v, g)

        base = time_fn(lambda: fwd_bwd("torch"), warmup=1, repeats=repeats)
        fused = time_fn(lambda: fwd_bwd("sdpa"), warmup=1, repeats=repeats)
        torch.set_num_threads(threads)
        flops = 3.5 * _causal_flops(lens, hq, d)  # fwd + bwd (2.5x fwd)
        rows.append(Row("attention fwd+bwd", shape, "float32", "torch, 1 process", base, tflops=flops / base / 1e12))
        rows.append(Row("attention fwd+bwd", shape, "float32", "sdpa, 1 process", fused, tflops=flops / fused / 1e12,
                        ratio=base / fused, baseline="torch, 1 process"))
        for layout in LAYOUTS:
            pairs = [ContextShardPlan(_cu(lens), layout=layout, world_size=WORLD, rank=r).attention_pairs(r)
                     for r in range(WORLD)]
            with tempfile.TemporaryDirectory() as tmp:
                out_file = os.path.join(tmp, "t.json")
                mp.spawn(_ring_worker,
                         args=(WORLD, os.path.join(tmp, "store"), out_file, lens, hq, hkv, d, layout, repeats),
                         nprocs=WORLD, join=True)
                with open(out_file) as f:
                    t = json.load(f)
            rows.append(Row("ring attention fwd+bwd", shape, "float32", f"torch, {layout}, {WORLD} gloo ranks", t,
                            tflops=flops / t / 1e12, ratio=base / t, baseline="1 process",
                            extra={"flops_max/min": f"{max(pairs) / min(pairs):.2f}"}))
    return rows


_CUDA_BACKENDS = (None, "triton", "varlen_flash", "cudnn")


def _time_fwd_and_fwd_bwd(fn, inputs, grad):
    with torch.no_grad():
        tf = time_fn(lambda: fn(*inputs), device="cuda")
    tb = time_fn(lambda: _fwd_bwd(fn, *inputs, grad), device="cuda")
    return tf, tb


def _error_row(op, shape, name, exc) -> Row:
    return Row(op, shape, "bfloat16", name, float("nan"), extra={"error": f"{type(exc).__name__}: {str(exc)[:160]}"})


def _cuda_square_rows(args) -> list[Row]:
    """SDPA (equal-length [B, H, S, D], enable_gqa, causal: torch's default kernel choice) against
    primerl's backends on the same tokens packed varlen."""
    import torch.nn.functional as F

    from primerl.kernels.attention import attention

    rows = []
    if args.quick:
        configs = [(4, 1024, 16, 4, 128)]
    else:
        configs = [(8, 4096, 32, 8, 128), (1, 32768, 32, 8, 128), (16, 2048, 64, 8, 128)]
    for B, L, hq, hkv, d in configs:
        shape = f"{B}x{L} H={hq}/{hkv} D={d} causal"
        q, k, v = (torch.randn(B * L, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
        g = torch.randn_like(q)
        cu = _cu([L] * B, "cuda")
        fwd_flops = _causal_flops([L] * B, hq, d)
        qb, kb, vb = (t.view(B, L, -1, d).transpose(1, 2) for t in (q, k, v))
        impls = {"sdpa": (lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True),
                          (qb, kb, vb), g.view(B, L, hq, d).transpose(1, 2))}
        for be in _CUDA_BACKENDS + (("flash_attn",) if _has_flash_attn() else ()):
            impls[f"primerl {be}"] = (lambda a, b, c, be=be: attention(a, b, c, cu_seqlens=cu, backend=be),
                                      (q, k, v), g)
        times = {}
        for name, (fn, inputs, grad) in impls.items():
            try:
                times[name] = _time_fwd_and_fwd_bwd(fn, inputs, grad)
            except Exception as exc:  # noqa: BLE001 - a backend failing on this GPU/torch: report, go on
                rows += [_error_row("attention fwd", shape, name, exc)]
        base = times.get("sdpa")
        for name, (tf, tb) in times.items():
            rows.append(Row("attention fwd", shape, "bfloat16", name, tf, tflops=fwd_flops / tf / 1e12,
                            ratio=base[0] / tf if base else None, baseline="sdpa" if base else ""))
            rows.append(Row("attention fwd+bwd", shape, "bfloat16", name, tb, tflops=3.5 * fwd_flops / tb / 1e12,
                            ratio=base[1] / tb if base else None, baseline="sdpa" if base else ""))
        del q, k, v, g, qb, kb, vb
        torch.cuda.empty_cache()
    return rows


def _cuda_ragged_rows(args) -> list[Row]:
    """A ragged packed batch (what RL micro-batches are): no SDPA baseline exists for it, so the
    ratio is against varlen_flash. cuDNN runs one call per run of equal lengths here (9 calls);
    backend=None takes varlen_flash for more than cudnn.MAX_RUNS runs: these rows say whether
    per-sequence cuDNN calls would pay at these lengths."""
    from primerl.kernels.attention import attention

    lens = [700, 300, 150, 90] if args.quick else [4096, 2048, 3000, 1000, 6000, 512, 7000, 4096, 5120]
    hq, hkv, d = 32, 8, 128
    shape = f"ragged {len(lens)} seqs, {sum(lens)} tokens H={hq}/{hkv} D={d} causal"
    q, k, v = (torch.randn(sum(lens), h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    g = torch.randn_like(q)
    cu = _cu(lens, "cuda")
    fwd_flops = _causal_flops(lens, hq, d)
    times, rows = {}, []
    for be in ("varlen_flash", None, "cudnn", "triton"):
        try:
            times[be] = _time_fwd_and_fwd_bwd(lambda a, b, c, be=be: attention(a, b, c, cu_seqlens=cu, backend=be),
                                              (q, k, v), g)
        except Exception as exc:  # noqa: BLE001
            rows.append(_error_row("attention fwd", shape, f"primerl {be}", exc))
    base = times.get("varlen_flash")
    for be, (tf, tb) in times.items():
        rows.append(Row("attention fwd", shape, "bfloat16", f"primerl {be}", tf, tflops=fwd_flops / tf / 1e12,
                        ratio=base[0] / tf if base else None, baseline="primerl varlen_flash" if base else ""))
        rows.append(Row("attention fwd+bwd", shape, "bfloat16", f"primerl {be}", tb, tflops=3.5 * fwd_flops / tb / 1e12,
                        ratio=base[1] / tb if base else None, baseline="primerl varlen_flash" if base else ""))
    return rows


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _cuda_ring_step_rows(args) -> list[Row]:
    """One ring step's shape: a query block (the last Lq tokens of a sequence) against a key block
    of Lk tokens, causal, as explicit positions (what ring attention passes) and as the default
    bottom-right mask. TF/s counts the visible (useful) pairs only; the ratio is against the same
    backend's square causal kernel over Lk tokens (per FLOP; 1.0 = as efficient)."""
    from primerl.kernels.attention import attention

    lq, lk, hq, hkv, d = (512, 1024, 16, 4, 128) if args.quick else (4096, 8192, 32, 8, 128)
    shape = f"{lq} q x {lk} k H={hq}/{hkv} D={d} causal"
    q, k, v = (torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16) for n, h in ((lq, hq), (lk, hkv), (lk, hkv)))
    g = torch.randn_like(q)
    cu_q, cu_k = _cu([lq], "cuda"), _cu([lk], "cuda")
    q_pos = torch.arange(lk - lq, lk, device="cuda", dtype=torch.int32)
    k_pos = torch.arange(lk, device="cuda", dtype=torch.int32)
    step_flops = sum(4 * hq * d * (p + 1) for p in range(lk - lq, lk))
    square_flops = _causal_flops([lk], hq, d)
    qs = torch.randn(lk, hq, d, device="cuda", dtype=torch.bfloat16)
    gs = torch.randn(lk, hq, d, device="cuda", dtype=torch.bfloat16)
    cu_s = _cu([lk], "cuda")
    rows = []
    cases = [("triton, positions", "triton", dict(q_positions=q_pos, k_positions=k_pos)),
             ("None, positions", None, dict(q_positions=q_pos, k_positions=k_pos)),
             ("triton, default mask", "triton", {}), ("None, default mask", None, {}),
             ("varlen_flash, default mask", "varlen_flash", {})]
    squares = {}
    for name, be, pos in cases:
        try:
            step = _time_fwd_and_fwd_bwd(lambda a, b, c, be=be, pos=pos: attention(
                a, b, c, cu_seqlens=cu_q, cu_seqlens_k=cu_k, backend=be, **pos), (q, k, v), g)
            if be not in squares:
                squares[be] = _time_fwd_and_fwd_bwd(
                    lambda a, b, c, be=be: attention(a, b, c, cu_seqlens=cu_s, backend=be), (qs, k, v), gs)
        except Exception as exc:  # noqa: BLE001
            rows.append(_error_row("ring step fwd", shape, name, exc))
            continue
        sq = squares[be]
        for i, op in enumerate(("ring step fwd", "ring step fwd+bwd")):
            mult = 1.0 if i == 0 else 3.5
            tflops = mult * step_flops / step[i] / 1e12
            sq_tflops = mult * square_flops / sq[i] / 1e12
            rows.append(Row(op, shape, "bfloat16", name, step[i], tflops=tflops, ratio=tflops / sq_tflops,
                            baseline=f"square {lk} causal, same backend ({sq_tflops:.0f} TF/s)"))
    return rows


def _cuda_zigzag_step_rows(args) -> list[Row]:
    """The steps of one rank of a zigzag ring (one sequence over W = 4 ranks) as ring attention runs
    them: ``backend=None`` on the plan's pseudo-sequences (ContextShardPlan.ring_block) against the
    Triton kernel with the global positions (what the ring ran before). Forward + block backward
    (attention_forward + attention_backward), TF/s per visible pair."""
    from primerl.kernels.attention import attention_backward, attention_forward
    from primerl.parallel.context import ContextShardPlan

    L, world, hq, hkv, d = (4096, 4, 16, 4, 128) if args.quick else (32768, 4, 32, 8, 128)
    plans = [ContextShardPlan(_cu([L], "cuda"), layout="zigzag", world_size=world, rank=r) for r in range(world)]
    plan = plans[1]
    t = plan.local_num_tokens
    q, dout = (torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rows = []
    for src in (1, 0, 2):
        kind = "own chunks, causal" if src == 1 else ("earlier chunk, full" if src == 0 else "later keys, full")
        shape = f"zigzag W={world} L={L} rank 1 <- {src} ({kind}) H={hq}/{hkv} D={d}"
        k_pos = plans[src].key_positions_of(src)
        real_k = torch.sort(k_pos[k_pos >= 0]).values
        pairs = int(torch.searchsorted(real_k, plan.positions[~plan.padding_mask], right=True).sum())
        cu_q, cu_k, causal = plan.ring_block(src, True)
        variants = {"None, plan blocks": dict(cu_seqlens=cu_q, cu_seqlens_k=cu_k, causal=causal),
                    "triton, positions": dict(cu_seqlens=plan.local_cu_seqlens, q_positions=plan.positions,
                                              k_positions=k_pos, causal=True, backend="triton")}
        times = {}
        for name, kw in variants.items():
            try:
                fwd = lambda kw=kw: attention_forward(q, k, v, **kw)  # noqa: E731
                out, lse = fwd()
                out = out.to(q.dtype)
                tf = time_fn(fwd, device="cuda")
                tb = time_fn(lambda kw=kw, out=out, lse=lse: (fwd(kw),
                                                                  attention_backward(dout, q, k, v, out, lse, **kw)),
                             device="cuda")
                times[name] = (tf, tb)
            except Exception as exc:  # noqa: BLE001
                rows.append(_error_row("ring step fwd", shape, name, exc))
        base = times.get("triton, positions")
        for name, (tf, tb) in times.items():
            for op, tm, mult, bt in (("ring step fwd", tf, 1.0, base and base[0]),
                                     ("ring step fwd+bwd", tb, 3.5, base and base[1])):
                rows.append(Row(op, shape, "bfloat16", name, tm, tflops=mult * 4 * hq * d * pairs / tm / 1e12,
                                ratio=bt / tm if bt else None, baseline="triton, positions" if bt else ""))
    return rows


CUDA_BUDGET_S = 45  # gpu_check.sh gives a module 60 s and prints nothing of one it kills


def _cuda_rows(args) -> list[Row]:
    rows, start = [], time.perf_counter()
    for section in (_cuda_square_rows, _cuda_ragged_rows, _cuda_ring_step_rows, _cuda_zigzag_step_rows):
        if time.perf_counter() - start > CUDA_BUDGET_S:
            skipped = TimeoutError(f"skipped: {CUDA_BUDGET_S} s budget spent")
            rows.append(_error_row(section.__name__, "-", "-", skipped))
            continue
        try:
            rows += section(args)
        except Exception as exc:  # noqa: BLE001 - one section failing on this GPU/torch must not hide the others
            rows.append(_error_row(section.__name__, "-", "-", exc))
        torch.cuda.empty_cache()
    return rows


def run(args) -> list[Row]:
    from . import mla_attention

    rows = _cuda_rows(args) if args.device == "cuda" else _cpu_rows(args)
    try:
        return rows + mla_attention.run(args)
    except Exception as exc:  # noqa: BLE001 - the MLA rows failing must not hide the attention rows
        return rows + [_error_row("mla_attention", "-", "-", exc)]
