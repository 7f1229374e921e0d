"""FP8 GEMMs (dense, m-grouped contiguous / masked, k-grouped) against the torch / cuBLAS baselines.

CUDA (issue 23's table, FP8 operands pre-quantized, bf16 inputs): per dense M x N x K the
baseline cuBLAS bf16 ``torch.mm``, then primerl ``fp8_gemm_nt`` with ``backend=None`` (what a user
gets: cuBLAS blockwise where it applies; A's scales MN-major as cuBLAS reads them, and once more
K-major, which costs one small scale copy per call), primerl Triton FP8 (1x128 / 128x128), DeepGEMM when
importable, ``torch._scaled_mm`` rowwise FP8 and cuBLAS blockwise ``F.scaled_mm`` called directly
(scales already in its layout); ``ratio`` is against bf16 and ``vs_blockwise`` against cuBLAS
blockwise. Grouped: bf16 ``torch._grouped_mm`` (baseline), primerl Triton FP8,
``torch._scaled_grouped_mm`` rowwise FP8, primerl Triton bf16; the k-grouped weight gradient
(dW = dY^T X) against the bf16 ``_grouped_mm`` wgrad; masked against ``bmm``. A case that fails
on the device (or whose inputs fail to build) prints an ``error`` row and the module goes on;
past ``CUDA_BUDGET_S`` the rest print as skipped (bench/gpu_check.sh gives this module
``GPU_CHECK_GEMM_S`` = 150 s including Triton compiles, and prints nothing of a module it kills).
The grouped cases (the issue's missed targets: k-grouped, m-grouped contiguous, masked) run
first, the dense ones after.

CPU: the Triton-free torch paths against each other (the FP8 reference = dequantize + fp32 GEMM,
``torch._scaled_mm`` rowwise, bf16 GEMMs) on a subset of the shapes: N and K divided by 4
(by 8 under --quick) and M capped, because the full set takes minutes on a 2-core machine; the
Triton interpreter is not timed.
"""

from __future__ import annotations

import math
import time

import torch

from primerl.kernels import backend_status
from primerl.kernels import gemm as G
from primerl.kernels.fp8 import quant_per_block, quant_per_token_group, quant_rowwise

from .harness import Row, time_fn

# issue 23's shapes
DENSE_CUDA = [(4096, 7168, 16384), (4096, 4096, 7168), (4096, 2112, 7168), (4096, 24576, 1536),
              (4096, 7168, 2048), (128, 7168, 2048)]
CONTIGUOUS_CUDA = [(4, 8192, 4096, 7168), (8, 4096, 7168, 2048), (32, 256, 4096, 7168)]  # G, rows/group, N, K
K_GROUPED_CUDA = [(4, 8192, 4096, 7168)]
MASKED_CUDA = [(1, 1024, 4096, 7168), (4, 256, 4096, 7168)]
CUDA_BUDGET_S = 110.0

# CPU subset (unchanged from before issue 23)
DENSE_MN_K = [(2112, 7168), (24576, 1536), (7168, 2048)]
DENSE_M = [128, 4096]
CONTIGUOUS = [(4, 8192), (8, 4096)]  # (groups, rows per group), N=4096, K=7168
MASKED = [(1, 1024), (4, 256)]  # (groups, rows per group), N=4096, K=7168
GROUPED_NK = (4096, 7168)


def _row(op, shape, backend, seconds, flops, base_s=None, base_name="", dtype=None):
    if dtype is None:
        if op.startswith("bf16"):
            dtype = "bf16"
        else:
            dtype = "fp8e4m3->fp32" if op.startswith("k_grouped") else "fp8e4m3->bf16"
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


# ------------------------------------------------------------------------------ CUDA


class _Cases:
    """Times named cases on CUDA; a case that raises becomes an error row, a case past the budget a
    skipped row."""

    def __init__(self):
        self.rows: list[Row] = []
        self.start = time.perf_counter()

    def time(self, op, shape, backend, fn, flops, base_s=None, base_name="", dtype=None) -> float | None:
        if time.perf_counter() - self.start > CUDA_BUDGET_S:
            self.rows.append(Row(op, shape, dtype or "-", backend, math.nan, baseline=base_name,
                                 extra={"skipped": f"module budget {CUDA_BUDGET_S:.0f}s spent"}))
            return None
        try:
            fn()
            torch.cuda.synchronize()
            s = _do_bench(fn)
        except Exception as exc:  # noqa: BLE001 - print the failure and go on with the other rows
            _sync_quietly()
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}" if str(exc) else type(exc).__name__
            self.rows.append(Row(op, shape, dtype or "-", backend, math.nan, baseline=base_name, extra={"error": msg}))
            return None
        self.rows.append(_row(op, shape, backend, s, flops, base_s, base_name, dtype))
        return s

    def shape(self, section: str, shape: str, run, *args) -> None:
        """Run one shape's cases; inputs that fail to build give an error row for the section."""
        try:
            run(self, *args)
        except Exception as exc:  # noqa: BLE001 - print the failure and go on with the other shapes
            _sync_quietly()
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}" if str(exc) else type(exc).__name__
            self.rows.append(Row(section, shape, "-", "-", math.nan, extra={"error": msg}))


def _sync_quietly() -> None:
    """Wait for the device after a failed case; a device left in an error state raises again here
    (every later case then prints its own error row)."""
    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        pass


def _do_bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=40, return_mode="median") / 1e3


def _blockwise_direct(a, b):
    """cuBLAS blockwise ``F.scaled_mm`` on operands whose scales are already in its layout."""
    from primerl.kernels.gemm import cublas

    why = cublas.api_reason()
    if why is not None:
        raise RuntimeError(why)
    f = torch.nn.functional
    sa, sb = cublas.scale_a_layout(a[1]), cublas.scale_b_layout(b[1])
    return lambda: f.scaled_mm(a[0], b[0].t(), sa, f.ScalingType.BlockWise1x128, sb, f.ScalingType.BlockWise128x128,
                               output_dtype=torch.bfloat16)


def _none_mn_major_scales(a, b):
    """``fp8_gemm_nt(backend=None)`` with A's scales stored MN-major (DeepGEMM's TMA-aligned layout)."""
    a_mn = (a[0], G.get_mn_major_tma_aligned_tensor(a[1]))
    return lambda: G.fp8_gemm_nt(a_mn, b)


def _rowwise_grouped(x, w, offs):
    """``torch._scaled_grouped_mm`` rowwise: x [M, K], w [G, N, K] -> [M, N] (m-grouped)."""
    xq, xs = quant_rowwise(x)
    wq, ws = quant_rowwise(w)
    xs, ws = xs.reshape(-1), ws.reshape(w.shape[0], w.shape[1])
    return lambda: torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), xs, ws, offs=offs, out_dtype=torch.bfloat16)


def _rowwise_k_grouped(dy, x, offs):
    """``torch._scaled_grouped_mm`` rowwise 2D x 2D: dW[g] = dY_g^T X_g, one scale per (group, row)."""
    groups = offs.numel()
    aq, as_ = quant_rowwise(dy.t().contiguous())  # [N, T]
    bq, bs = quant_rowwise(x.t().contiguous())  # [K, T]
    as_, bs = as_.reshape(1, -1).expand(groups, -1).reshape(-1), bs.reshape(1, -1).expand(groups, -1).reshape(-1)
    return lambda: torch._scaled_grouped_mm(aq, bq.t(), as_.contiguous(), bs.contiguous(), offs=offs,
                                            out_dtype=torch.bfloat16)


def _run_cuda() -> list[Row]:
    cases = _Cases()
    torch.manual_seed(0)
    fp8_be = _fp8_backends("cuda")
    for groups, rows_g, n, k in K_GROUPED_CUDA:
        cases.shape("k_grouped", f"{groups}x{rows_g} N{n} K{k}", _k_grouped_case, groups, rows_g, n, k)
    for groups, rows_g, n, k in CONTIGUOUS_CUDA:
        cases.shape("m_grouped_contiguous", f"{groups}x{rows_g} N{n} K{k}", _contiguous_case, fp8_be,
                    groups, rows_g, n, k)
    for groups, rows_g, n, k in MASKED_CUDA:
        cases.shape("m_grouped_masked", f"{groups}x{rows_g} N{n} K{k}", _masked_case, fp8_be, groups, rows_g, n, k)
    for m, n, k in DENSE_CUDA:
        cases.shape("dense", f"{m}x{n}x{k}", _dense_case, fp8_be, m, n, k)
    return cases.rows


def _dense_case(cases: _Cases, fp8_be, m, n, k):
    dev = "cuda"
    shape, flops = f"{m}x{n}x{k}", 2 * m * n * k
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    a, b = quant_per_token_group(x, 128), quant_per_block(w)
    base = cases.time("bf16_mm", shape, "cublas", lambda: torch.mm(x, w.t()), flops)
    first = len(cases.rows)
    # backend=None is cuBLAS blockwise on an H200, which reads A's scales MN-major: given them so (as
    # the direct cuBLAS baseline gets its scales, and as DeepGEMM's users pass them) there is no
    # per-call copy; the K-major row shows that copy's cost (what quant_per_token_group writes)
    cases.time("fp8_gemm_nt", shape, "None", _lazy(_none_mn_major_scales, a, b), flops, base, "bf16 mm")
    # the targets' pair first (the module's time budget is checked row by row)
    blk = cases.time("scaled_mm_blockwise", shape, "cublas", _lazy(_blockwise_direct, a, b), flops, base, "bf16 mm")
    cases.time("fp8_gemm_nt", shape, "None K-major sf", lambda: G.fp8_gemm_nt(a, b), flops, base, "bf16 mm")
    for be in fp8_be:
        cases.time("fp8_gemm_nt", shape, be, lambda: G.fp8_gemm_nt(a, b, backend=be), flops, base, "bf16 mm")
    cases.time("scaled_mm_rowwise", shape, "cublas", _lazy(_scaled_mm_rowwise, x, w), flops, base, "bf16 mm")
    if blk is not None:
        for r in cases.rows[first:]:
            if r.op == "fp8_gemm_nt" and not math.isnan(r.median_s):
                r.extra["vs_blockwise"] = f"{blk / r.median_s:.2f}x"


def _contiguous_case(cases: _Cases, fp8_be, groups, rows_g, n, k):
    dev = "cuda"
    shape, flops = f"{groups}x{rows_g} N{n} K{k}", 2 * groups * rows_g * n * k
    offs = G.counts_to_offsets(torch.full((groups,), rows_g, dtype=torch.int32, device=dev))
    x = torch.randn(groups * rows_g, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(groups, n, k, device=dev, dtype=torch.bfloat16) * 0.02
    xp, m_idx, _ = G.pad_to_contiguous(x, offs)
    a, b = quant_per_token_group(xp, 128), quant_per_block(w)
    wt = w.transpose(-2, -1)
    base = cases.time("bf16_grouped_mm", shape, "torch", lambda: torch._grouped_mm(x, wt, offs=offs), flops)
    for be in fp8_be:
        cases.time("m_grouped_fp8_contiguous", shape, be,
                   lambda: G.m_grouped_fp8_gemm_nt_contiguous(a, b, m_idx, backend=be), flops, base, "bf16 _grouped_mm")
    cases.time("scaled_grouped_mm_rowwise", shape, "torch", _lazy(_rowwise_grouped, x, w, offs), flops, base,
               "bf16 _grouped_mm")
    cases.time("bf16_grouped_gemm_nt", shape, "triton", lambda: G.grouped_gemm_nt(x, w, offs, backend="triton"),
               flops, base, "bf16 _grouped_mm")


def _k_grouped_case(cases: _Cases, groups, rows_g, n, k):
    dev = "cuda"
    shape, flops = f"{groups}x{rows_g} N{n} K{k}", 2 * groups * rows_g * n * k
    offs = G.counts_to_offsets(torch.full((groups,), rows_g, dtype=torch.int32, device=dev))
    x = torch.randn(groups * rows_g, k, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(groups * rows_g, n, device=dev, dtype=torch.bfloat16)
    qa, qb = (G.quant_per_group_colwise(t, offs, layout="blocks") for t in (dy, x))
    dyt = dy.t()
    base = cases.time("bf16_k_grouped_mm", shape, "torch", lambda: torch._grouped_mm(dyt, x, offs=offs), flops)
    cases.time("k_grouped_fp8_tn", shape, "triton",
               lambda: G.k_grouped_fp8_gemm_tn_contiguous(qa, qb, offs, backend="triton"), flops, base,
               "bf16 wgrad _grouped_mm")
    cases.time("scaled_grouped_mm_rowwise_wgrad", shape, "torch", _lazy(_rowwise_k_grouped, dy, x, offs), flops,
               base, "bf16 wgrad _grouped_mm", dtype="fp8e4m3->bf16")


def _masked_case(cases: _Cases, fp8_be, groups, rows_g, n, k):
    dev = "cuda"
    shape, flops = f"{groups}x{rows_g} N{n} K{k}", 2 * groups * rows_g * n * k
    x = torch.randn(groups, rows_g, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(groups, n, k, device=dev, dtype=torch.bfloat16) * 0.02
    masked_m = torch.full((groups,), rows_g, dtype=torch.int32, device=dev)
    a, b = quant_per_token_group(x, 128), quant_per_block(w)
    wt = w.transpose(-2, -1)
    base = cases.time("bf16_bmm", shape, "torch", lambda: torch.bmm(x, wt), flops)
    for be in fp8_be:
        cases.time("m_grouped_fp8_masked", shape, be,
                   lambda: G.m_grouped_fp8_gemm_nt_masked(a, b, masked_m, rows_g, backend=be), flops, base, "bf16 bmm")


def _lazy(build, *args):
    """A timed function built on first call, so that a build failure lands in the case's error row."""
    box = {}

    def fn():
        if "f" not in box:
            box["f"] = build(*args)
        return box["f"]()

    return fn


# ------------------------------------------------------------------------------ CPU


def run(args) -> list[Row]:
    if args.device == "cuda":
        return _run_cuda()
    return _run_cpu(args)


def _run_cpu(args) -> list[Row]:
    dev = args.device
    div = 8 if args.quick else 4
    rep = dict(device=dev, warmup=1, repeats=3)
    rows: list[Row] = []
    torch.manual_seed(0)

    for m in [min(m, 256) for m in DENSE_M[:1]]:
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
            s = time_fn(lambda: G.fp8_gemm_nt(a, b, backend="torch"), **rep)
            rows.append(_row("fp8_gemm_nt", shape, "torch", s, flops, base, "scaled_mm"))

    n, k = GROUPED_NK
    n_, k_ = n // div, k // div // 128 * 128
    for groups, m in CONTIGUOUS:
        m_ = min(m, 512)
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
        s = time_fn(lambda: G.m_grouped_fp8_gemm_nt_contiguous(a, b, m_idx, backend="torch"), **rep)
        rows.append(_row("m_grouped_fp8_contiguous", shape, "torch", s, flops, base, "bf16 _grouped_mm"))
        dy = torch.randn(groups * m_, n_, device=dev, dtype=torch.bfloat16)
        qa, qb = G.quant_per_group_colwise(dy, offs), G.quant_per_group_colwise(x, offs)
        base_k = time_fn(lambda: torch._grouped_mm(dy.t(), x, offs=offs), **rep)
        rows.append(_row("bf16_k_grouped_mm", shape, "torch", base_k, flops))
        s = time_fn(lambda: G.k_grouped_fp8_gemm_tn_contiguous(qa, qb, offs, backend="torch"), **rep)
        rows.append(_row("k_grouped_fp8_tn", shape, "torch", s, flops, base_k, "bf16 k-grouped _grouped_mm"))

    for groups, m in MASKED:
        m_ = min(m, 256)
        x = torch.randn(groups, m_, k_, device=dev, dtype=torch.bfloat16)
        w = torch.randn(groups, n_, k_, device=dev, dtype=torch.bfloat16) * 0.02
        masked_m = torch.full((groups,), m_, dtype=torch.int32, device=dev)
        a, b = quant_per_token_group(x, 128), quant_per_block(w)
        flops = 2 * groups * m_ * n_ * k_
        shape = f"{groups}x{m_}x{n_}x{k_}"
        base = time_fn(lambda: torch.bmm(x, w.transpose(-2, -1)), **rep)
        rows.append(_row("bf16_bmm", shape, "torch", base, flops))
        s = time_fn(lambda: G.m_grouped_fp8_gemm_nt_masked(a, b, masked_m, m_, backend="torch"), **rep)
        rows.append(_row("m_grouped_fp8_masked", shape, "torch", s, flops, base, "bf16 bmm"))
    return rows
