"""python -m bench mla_attention [--quick]: MLA attention (Dqk != Dv) and DeepSeek sparse attention.

CUDA (bf16, causal):
- MLA dense, DeepSeek-V3's 192/128 heads over 2 x 4096 tokens: primerl's Triton kernels for two
  widths (kernels.attention.mla_triton) against SDPA on the same tensors (baseline).
- GLM-5 sparse attention in the absorbed form (64 heads over one 576-wide latent key, 512-wide
  values, 2048 keys per query) at T = 4096 and 16384: Triton forward and forward+backward against
  SDPA running the dense causal attention it replaces (GLM-5's 64 heads at 256/256, flash/efficient).
- The indexer (32 heads x 128, top-2048) at T = 4096: Triton scores + the stable top-k sort against
  the plain-torch reference.
CPU: the reference sparse attention against the reference dense attention (what the sparse form
saves as T grows past K).
"""

from __future__ import annotations

import torch

from .harness import Row, time_fn


def _cu(lens, device):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _causal_selection(T, K, device, seed=0):
    """indices [T, K]: query t keeps min(K, t + 1) random causal keys, -1 padded."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    scores = torch.rand(T, T, generator=g).tril_().to(device) + torch.ones(T, T, device=device).tril_()
    scores = scores.masked_fill(scores == 0, float("-inf"))
    vals, idx = scores.topk(min(K, T), dim=1)
    out = torch.where(vals == float("-inf"), -1, idx).to(torch.int32)
    return torch.nn.functional.pad(out, (0, K - out.shape[1]), value=-1)


def _fwd_bwd(fn, inputs, grad):
    leaves = [t.detach().requires_grad_() for t in inputs]
    fn(*leaves).backward(grad)


def _once(fn, device):
    """Wall time of one call after one warm-up call (do_bench would run a multi-second call ~7 times)."""
    import time

    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _timed(rows, op, shape, dtype, impls, fwd_flops, baseline, bwd_once=False):
    times = {}
    for name, (fn, inputs, grad, device) in impls.items():
        try:
            with torch.no_grad():
                tf = time_fn(lambda: fn(*inputs), device=device)
            step = lambda: _fwd_bwd(fn, inputs, grad)  # noqa: E731
            tb = None if grad is None else (_once(step, device) if bwd_once else time_fn(step, device=device))
        except Exception as exc:  # noqa: BLE001 - a backend refusing a shape or OOM: report, go on
            print(f"# {op} {name} {shape}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        times[name] = (tf, tb)
    base = times.get(baseline)
    for name, (tf, tb) in times.items():
        # a line per result as it lands: the GPU check kills a module at its time limit, table unprinted
        print(f"# {op} {shape} {name}: fwd {tf * 1e3:.3f} ms" + (f", fwd+bwd {tb * 1e3:.3f} ms" if tb else ""),
              flush=True)
        flops = fwd_flops.get(name, fwd_flops.get("*"))
        rows.append(Row(f"{op} fwd", shape, dtype, name, tf, tflops=flops / tf / 1e12 if flops else None,
                        ratio=base[0] / tf if base else None, baseline=baseline if base else ""))
        if tb is not None:
            rows.append(Row(f"{op} fwd+bwd", shape, dtype, name, tb, tflops=3.5 * flops / tb / 1e12 if flops else None,
                            ratio=base[1] / tb if base and base[1] else None, baseline=baseline if base else ""))


def _sdpa(q, k, v, B, L):
    import torch.nn.functional as F

    qb, kb, vb = (t.view(B, L, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True).transpose(1, 2).reshape(B * L, q.shape[1], -1)


def _cuda_rows(args) -> list[Row]:
    from primerl.kernels.attention.mla import mla_attention
    from primerl.kernels.sparse_attention import indexer_topk, sparse_attention

    dev, bf16, rows = "cuda", torch.bfloat16, []
    # MLA dense, DeepSeek-V3 heads
    B, L, H = (2, 1024, 8) if args.quick else (2, 4096, 16)
    q, k = (torch.randn(B * L, H, 192, device=dev, dtype=bf16) for _ in range(2))
    v = torch.randn(B * L, H, 128, device=dev, dtype=bf16)
    g = torch.randn(B * L, H, 128, device=dev, dtype=bf16)
    cu = _cu([L] * B, dev)
    flops = B * 2 * H * (192 + 128) * L * (L + 1) / 2
    _timed(rows, "mla attention", f"B={B} L={L} H={H} Dqk=192 Dv=128", "bfloat16",
           {"sdpa": (lambda a, b, c: _sdpa(a, b, c, B, L), (q, k, v), g, dev),
            "triton": (lambda a, b, c: mla_attention(a, b, c, cu_seqlens=cu, backend="triton"), (q, k, v), g, dev)},
           {"*": flops}, "sdpa")
    # GLM-5 sparse attention, absorbed form
    # (the backward adds dK/dV with float32 atomics, T x K x 1088 of them: timed once, and only at
    # T = 4096, so the module stays inside its minute)
    K = 2048
    for T in ([2048] if args.quick else [4096, 16384]):
        idx = _causal_selection(T, K, dev)
        qa = torch.randn(T, 64, 576, device=dev, dtype=bf16)
        kv = torch.randn(T, 1, 576, device=dev, dtype=bf16)
        with_bwd = T <= 4096
        ga = torch.randn(T, 64, 512, device=dev, dtype=bf16) if with_bwd else None
        qd, kd, vd = (torch.randn(T, 64, 256, device=dev, dtype=bf16) for _ in range(3))
        sel = float((idx >= 0).sum())
        impls = {"sdpa dense causal (256/256)": (lambda a, b, c: _sdpa(a, b, c, 1, T), (qd, kd, vd),
                                                 qd.clone() if with_bwd else None, dev),
                 "triton sparse": (lambda a, b: sparse_attention(a, b, b[..., :512], idx, backend="triton"),
                                   (qa, kv), ga, dev)}
        flops = {"sdpa dense causal (256/256)": 2 * 64 * 512 * T * (T + 1) / 2,
                 "triton sparse": 2 * 64 * (576 + 512) * sel}
        _timed(rows, "dsa attention", f"T={T} K={K} H=64 absorbed 576/512", "bfloat16", impls, flops,
               "sdpa dense causal (256/256)", bwd_once=True)
    # the indexer
    for T in ([2048] if args.quick else [4096]):
        qi = torch.randn(T, 32, 128, device=dev, dtype=bf16)
        ki = torch.randn(T, 128, device=dev, dtype=bf16)
        w = torch.randn(T, 32, device=dev)
        cu1 = _cu([T], dev)
        impls = {"triton": (lambda a, b, c: indexer_topk(a, b, c, cu_seqlens=cu1, topk=K, backend="triton"),
                            (qi, ki, w), None, dev)}
        if T <= 4096:
            impls["torch reference"] = (lambda a, b, c: indexer_topk(a, b, c, cu_seqlens=cu1, topk=K, backend="torch"),
                                        (qi, ki, w), None, dev)
        _timed(rows, "dsa indexer top-k", f"T={T} Hi=32 Di=128 K={K}", "bfloat16", impls,
               {"*": 2 * 32 * 128 * T * (T + 1) / 2}, "torch reference")
    return rows


def _cpu_rows(args) -> list[Row]:
    from primerl.kernels.attention import attention
    from primerl.kernels.sparse_attention import sparse_attention

    rows = []
    K, H, D = 64, 8, 64
    for T in ([256] if args.quick else [512, 2048]):
        idx = _causal_selection(T, K, "cpu")
        q, k, v = (torch.randn(T, H, D) for _ in range(3))
        cu = _cu([T], "cpu")
        _timed(rows, "dsa attention", f"T={T} K={K} H={H} D={D}", "float32",
               {"torch dense causal": (lambda a, b, c: attention(a, b, c, cu_seqlens=cu, backend="torch"),
                                       (q, k, v), q.clone(), "cpu"),
                "torch sparse": (lambda a, b, c: sparse_attention(a, b, c, idx, backend="torch"),
                                 (q, k, v), q.clone(), "cpu")},
               {"torch dense causal": 4 * H * D * T * (T + 1) / 2, "torch sparse": 4 * H * D * float((idx >= 0).sum())},
               "torch dense causal")
    return rows


def run(args) -> list[Row]:
    if args.device == "cuda":
        return _cuda_rows(args)
    return _cpu_rows(args)
