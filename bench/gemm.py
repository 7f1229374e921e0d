"""FP8 block-scaled GEMMs (dense, m-grouped contiguous / masked, k-grouped) against torch baselines.

GPU: DeepGEMM's shapes; TFLOP/s of the Triton kernels (and DeepGEMM when importable), ratio to
``torch._scaled_mm`` (rowwise FP8, dense) or bf16 ``torch._grouped_mm`` / ``bmm`` (grouped).
CPU: the Triton-free torch paths against each other (the FP8 reference = dequantize + fp32 GEMM,
``torch._scaled_mm`` rowwise, bf16 GEMMs) on a subset of the shapes: N and K divided by 4
(by 8 under --quick) and M capped, because the full set takes minutes on a 2-core machine; the
Triton interpreter is not timed.
"""

from __future__ import annotations

import torch

from primerl.kernels import backend_status
from primerl.kernels import gemm as G
from primerl.kernels.fp8 import quant_per_block, quant_per_token_group, quant_rowwise

from .harness import Row, time_fn

DENSE_MN_K = [(2112, 7168), (24576, 1536), (7168, 2048)]
DENSE_M = [128, 4096]
CONTIGUOUS = [(4, 8192), (8, 4096)]  # (groups, rows per group), N=4096, K=7168
MASKED = [(1, 1024), (4, 256)]  # (groups, rows per group), N=4096, K=7168
GROUPED_NK = (4096, 7168)


def _row(op, shape, backend, seconds, flops, base_s=None, base_name=""):
    dtype = "bf16" if op.startswith("bf16") else ("fp8e4m3->fp32" if op.startswith("k_grouped") else "fp8e4m3->bf16")
    return Row(op=op, shape=shape, dtype=dtype, backend=backend, median_s=seconds,
               tflops=flops / seconds / 1e12, ratio=None if base_s is None else base_s / seconds, baseline=base_name)


def _scaled_mm_rowwise(x, w):
    xq, xs = quant_rowwise(x)
    wq, ws = quant_rowwise(w)
    return lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)


def _fp8_backends(device: str) -> list[str]:
    if device != "cuda":
        return ["torch"]
    return ["triton"] + (["deep_gemm"] if backend_status("deep_gemm").available else [])


def run(args) -> list[Row]:
    dev = args.device
    cpu = dev != "cuda"
    div = (8 if args.quick else 4) if cpu else 1
    rep = dict(device=dev, warmup=1, repeats=3 if cpu else 7)
    rows: list[Row] = []
    torch.manual_seed(0)

    dense_m = [min(m, 256) for m in DENSE_M[:1]] if cpu else DENSE_M
    for m in dense_m:
        for n, k in DENSE_MN_K:
            n_, k_ = n // div, max(128, k // div // 128 * 128)
            x = torch.randn(m, k_, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n_, k_, device=dev, dtype=torch.bfloat16) * 0.02
            a, b = quant_per_token_group(x, 128), quant_per_block(w)
            flops = 2 * m * n_ * k_
            shape = f"{m}x{n_}x{k_}"
            base = time_fn(_scaled_mm_rowwise(x, w), **rep)
            rows.append(_row("scaled_mm_rowwise", shape, "torch", base, flops))
            bf16 = time_fn(lambda: x @ w.t(), **rep)
            rows.append(_row("bf16_mm", shape, "torch", bf16, flops, base, "scaled_mm"))
            for be in _fp8_backends(dev):
                s = time_fn(lambda: G.fp8_gemm_nt(a, b, backend=be), **rep)
                rows.append(_row("fp8_gemm_nt", shape, be, s, flops, base, "scaled_mm"))

    n, k = GROUPED_NK
    n_, k_ = n // div, k // div // 128 * 128
    for groups, m in CONTIGUOUS:
        m_ = min(m, 512) if cpu else m
        counts = torch.full((groups,), m_, dtype=torch.int32, device=dev)
        offs = G.counts_to_offsets(counts)
        x = torch.randn(groups * m_, k_, device=dev, dtype=torch.bfloat16)
        w = torch.randn(groups, n_, k_, device=dev, dtype=torch.bfloat16) * 0.02
        xp, m_idx, _ = G.pad_to_contiguous(x, offs)
        a, b = quant_per_token_group(xp, 128), quant_per_block(w)
        flops = 2 * groups * m_ * n_ * k_
        shape = f"{groups}x{m_}x{n_}x{k_}"
        base = time_fn(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), **rep)
        rows.append(_row("bf16_grouped_mm", shape, "torch", base, flops))
        for be in _fp8_backends(dev):
            s = time_fn(lambda: G.m_grouped_fp8_gemm_nt_contiguous(a, b, m_idx, backend=be), **rep)
            rows.append(_row("m_grouped_fp8_contiguous", shape, be, s, flops, base, "bf16 _grouped_mm"))
        if not cpu:  # the bf16 twin the MoE bf16 path uses
            s = time_fn(lambda: G.grouped_gemm_nt(x, w, offs, backend="triton"), **rep)
            rows.append(_row("bf16_grouped_gemm_nt", shape, "triton", s, flops, base, "bf16 _grouped_mm"))
        # weight gradient of the same experts: dW[g] = dY_g^T X_g
        dy = torch.randn(groups * m_, n_, device=dev, dtype=torch.bfloat16)
        qa, qb = G.quant_per_group_colwise(dy, offs), G.quant_per_group_colwise(x, offs)
        base_k = time_fn(lambda: torch._grouped_mm(dy.t(), x, offs=offs), **rep)
        rows.append(_row("bf16_k_grouped_mm", shape, "torch", base_k, flops))
        for be in (["torch"] if cpu else ["triton"]):
            s = time_fn(lambda: G.k_grouped_fp8_gemm_tn_contiguous(qa, qb, offs, backend=be), **rep)
            rows.append(_row("k_grouped_fp8_tn", shape, be, s, flops, base_k, "bf16 k-grouped _grouped_mm"))

    for groups, m in MASKED:
        m_ = min(m, 256) if cpu else m
        x = torch.randn(groups, m_, k_, device=dev, dtype=torch.bfloat16)
        w = torch.randn(groups, n_, k_, device=dev, dtype=torch.bfloat16) * 0.02
        masked_m = torch.full((groups,), m_, dtype=torch.int32, device=dev)
        a, b = quant_per_token_group(x, 128), quant_per_block(w)
        flops = 2 * groups * m_ * n_ * k_
        shape = f"{groups}x{m_}x{n_}x{k_}"
        base = time_fn(lambda: torch.bmm(x, w.transpose(-2, -1)), **rep)
        rows.append(_row("bf16_bmm", shape, "torch", base, flops))
        for be in _fp8_backends(dev):
            s = time_fn(lambda: G.m_grouped_fp8_gemm_nt_masked(a, b, masked_m, m_, backend=be), **rep)
            rows.append(_row("m_grouped_fp8_masked", shape, be, s, flops, base, "bf16 bmm"))
    return rows
