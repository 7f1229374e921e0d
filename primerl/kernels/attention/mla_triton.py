"""Triton kernels of dense attention with value heads of another width than the query/key heads
(MLA: 192/128, 256/256), forward with lse and a recomputing backward, on the varlen contract and
mask rule of :mod:`primerl.kernels.attention.reference` (``AttentionSpec``: same sequence,
``k_pos >= 0``, causal ``k_pos <= q_pos``). The square op's Triton backend runs these kernels for
head dims above 128 (:func:`primerl.kernels.attention.triton.forward`).

Each width is split into two column parts (:func:`split_width`: 192 = 128 + 64, MLA's nope and
rope parts; 256 = 128 + 128), so no tile is padded to 256 and no float32 tile is wider than 128
columns. Grids as the square kernels (``triton.py``): forward and dQ ``(cdiv(max_seqlen_q,
BLOCK_M), B, Hq)``, dK/dV ``(cdiv(max_seqlen_k, BLOCK_N), B, Hkv)`` looping over the G query heads
of its group. The backward launches the dK/dV kernel once per column part of dV and of dK (and the
dQ kernel once per part of dQ where one program cannot hold both), each recomputing P.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import (LOG2E, _block_runs, _dot_precision, _first_query_block, _key_block_summary,
                            _key_loop_bounds, _last_dim_contiguous, _load_positions, _pos_args, _query_block_sees,
                            _seq_bounds, _visible, backward_inputs)


def split_width(d: int) -> tuple[int, int]:
    """(main, tail): main the largest power of two <= d, tail the rest (0 for a power of two);
    up to 256 the main part is at most 128 (two 128-column parts at 256: its 256-wide float32
    accumulators spill, AOT-measured)."""
    main = 1 << (d.bit_length() - 1)
    if d <= 256:
        main = min(main, 128)
    return main, d - main


def _p2(n: int) -> int:
    return max(16, triton.next_power_of_2(max(n, 1)))


@triton.jit
def dot_rows(a1, a2, X, rows, valid, h, stride_xt, stride_xh, offs_1, offs_2, D1: tl.constexpr, D2: tl.constexpr,
             DOT_PREC: tl.constexpr):
    """a ``[BM, D1 (+ D2)]`` held as two column parts, times the rows ``rows`` of X's head h
    (``[BN, D1 + D2]``, loaded here) transposed -> ``[BM, BN]`` float32 (q . k, or dO . v)."""
    x1 = tl.load(X + rows[:, None] * stride_xt + h * stride_xh + offs_1[None, :],
                 mask=valid[:, None] & (offs_1 < D1)[None, :], other=0.0)
    s = tl.dot(a1, tl.trans(x1), input_precision=DOT_PREC)
    if D2 > 0:
        x2 = tl.load(X + rows[:, None] * stride_xt + h * stride_xh + D1 + offs_2[None, :],
                     mask=valid[:, None] & (offs_2 < D2)[None, :], other=0.0)
        s += tl.dot(a2, tl.trans(x2), input_precision=DOT_PREC)
    return s


@triton.jit
def _load_cols(X, rows, valid, h, stride_xt, stride_xh, col0, offs, width):
    """X[rows, h, col0 + offs], zero beyond ``width`` columns or outside ``valid`` rows."""
    return tl.load(X + rows[:, None] * stride_xt + h * stride_xh + col0 + offs[None, :],
                   mask=valid[:, None] & (offs < width)[None, :], other=0.0)


@triton.jit
def _load_parts(X, rows, valid, h, stride_xt, stride_xh, offs_1, offs_2, D1: tl.constexpr, D2: tl.constexpr):
    """Rows of X's head h as two column parts ``[.., D1]``, ``[.., D2]`` (the second is the first when D2 == 0)."""
    x1 = _load_cols(X, rows, valid, h, stride_xt, stride_xh, 0, offs_1, D1)
    x2 = x1
    if D2 > 0:
        x2 = _load_cols(X, rows, valid, h, stride_xt, stride_xh, D1, offs_2, D2)
    return x1, x2


@triton.jit
def _load_lse2(Lse, h, stride_lh, q_rows, m_ok):
    """lse of the rows in base 2; +inf for rows that saw no key (so that P = 0 there)."""
    lse = tl.load(Lse + h * stride_lh + q_rows, mask=m_ok, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634


@triton.jit
def _mla_fwd_kernel(
    Q, K, V, Out, Lse, CuQ, CuK, QPos, KPos,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
    qk_scale_log2,
    GROUP: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_POS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    hk = h // GROUP
    q_start, len_q, k_start, len_k = _seq_bounds(CuQ, CuK, b)
    m0 = pid_m * BLOCK_M
    if m0 >= len_q:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_d2 = tl.arange(0, BLOCK_D2)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < len_q
    q_rows = q_start + offs_m
    q1, q2 = _load_parts(Q, q_rows, m_ok, h, stride_qt, stride_qh, offs_d1, offs_d2, D1, D2)
    q_pos = _load_positions(QPos, q_start, offs_m, len_q, HAS_POS, len_k - len_q)
    q_pos_max = tl.max(q_pos, axis=0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    _, n_end = _key_loop_bounds(m0, len_q, len_k, BLOCK_M, BLOCK_N, CAUSAL, HAS_POS)  # no unmasked loop here
    for n0 in range(0, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k_pos = _load_positions(KPos, k_start, offs_n, len_k, HAS_POS, 0)
        if _block_runs(k_pos, q_pos_max, CAUSAL):
            n_ok = offs_n < len_k
            rows = (k_start + offs_n).to(tl.int64)
            s = dot_rows(q1, q2, K, rows, n_ok, hk, stride_kt, stride_kh, offs_d1, offs_d2, D1, D2, DOT_PREC)
            s = s * qk_scale_log2
            s = tl.where(_visible(k_pos, q_pos, CAUSAL), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = _load_cols(V, rows, n_ok, hk, stride_vt, stride_vh, 0, offs_dv, DV)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    tl.store(Out + q_rows[:, None] * stride_ot + h * stride_oh + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=m_ok[:, None] & (offs_dv < DV)[None, :])
    tl.store(Lse + h * stride_lh + q_rows, lse, mask=m_ok)


@triton.jit
def _mla_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, Grad, CuQ, CuK, QPos, KPos,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lh,
    stride_gt, stride_gh, sm_scale, qk_scale_log2,
    GROUP: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV1: tl.constexpr, DV2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_DV1: tl.constexpr, BLOCK_DV2: tl.constexpr, BLOCK_C: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_POS: tl.constexpr, DOT_PREC: tl.constexpr, PART: tl.constexpr,
):
    """One column part of dV or dK into Grad: PART 0 / 1 dV's main / tail columns (from P alone),
    2 / 3 dK's (from P and dP). Separate launches, each recomputing P, so that no program holds
    more than one float32 accumulator (two together spill at 192/128 on sm_90a and sm_100a: AOT)."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    hk = tl.program_id(2)
    q_start, len_q, k_start, len_k = _seq_bounds(CuQ, CuK, b)
    n0 = pid_n * BLOCK_N
    if n0 >= len_k:
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_d2 = tl.arange(0, BLOCK_D2)
    offs_dv1 = tl.arange(0, BLOCK_DV1)
    offs_dv2 = tl.arange(0, BLOCK_DV2)
    offs_c = tl.arange(0, BLOCK_C)
    n_ok = offs_n < len_k
    k_rows = (k_start + offs_n).to(tl.int64)
    k_pos = _load_positions(KPos, k_start, offs_n, len_k, HAS_POS, 0)
    k_pos_min, any_key = _key_block_summary(k_pos)
    acc = tl.zeros([BLOCK_N, BLOCK_C], tl.float32)
    m_begin = _first_query_block(n0, len_q, len_k, BLOCK_M, CAUSAL, HAS_POS)
    if any_key:
        for g in range(GROUP):
            h = hk * GROUP + g
            for m0 in range(m_begin, len_q, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                q_pos = _load_positions(QPos, q_start, offs_m, len_q, HAS_POS, len_k - len_q)
                if _query_block_sees(k_pos_min, q_pos, CAUSAL):
                    m_ok = offs_m < len_q
                    q_rows = q_start + offs_m
                    if PART >= 2:  # dP first: the dO tiles are dead before the q tiles are loaded
                        do1, do2 = _load_parts(DO, q_rows, m_ok, h, stride_dot, stride_doh, offs_dv1, offs_dv2,
                                               DV1, DV2)
                        dp = dot_rows(do1, do2, V, k_rows, n_ok, hk, stride_vt, stride_vh, offs_dv1, offs_dv2,
                                      DV1, DV2, DOT_PREC)
                    q1, q2 = _load_parts(Q, q_rows, m_ok, h, stride_qt, stride_qh, offs_d1, offs_d2, D1, D2)
                    # the key block is re-read each step (cache hits) rather than held: at 192/128 the
                    # held K and V tiles spill beside the float32 accumulators (AOT, sm_90a)
                    if PART == 3:  # the tail's product first: q2, used last, then stays live alone (AOT, sm_90a)
                        s = tl.dot(q2, tl.trans(_load_cols(K, k_rows, n_ok, hk, stride_kt, stride_kh, D1, offs_d2, D2)),
                                   input_precision=DOT_PREC)
                        s += tl.dot(q1, tl.trans(_load_cols(K, k_rows, n_ok, hk, stride_kt, stride_kh, 0, offs_d1, D1)),
                                    input_precision=DOT_PREC)
                    else:
                        s = dot_rows(q1, q2, K, k_rows, n_ok, hk, stride_kt, stride_kh, offs_d1, offs_d2, D1, D2,
                                     DOT_PREC)
                    p = tl.math.exp2(s * qk_scale_log2 - _load_lse2(Lse, h, stride_lh, q_rows, m_ok)[:, None])
                    p = tl.where(_visible(k_pos, q_pos, CAUSAL), p, 0.0)
                    if PART < 2:
                        do = _load_cols(DO, q_rows, m_ok, h, stride_dot, stride_doh, DV1 * PART, offs_c,
                                        DV2 if PART == 1 else DV1)
                        acc += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PREC)
                    else:
                        delta = tl.load(Delta + h * stride_lh + q_rows, mask=m_ok, other=0.0)
                        ds = (p * (dp - delta[:, None])).to(q1.dtype)
                        if PART == 2:
                            acc += tl.dot(tl.trans(ds), q1, input_precision=DOT_PREC)
                        else:
                            acc += tl.dot(tl.trans(ds), q2, input_precision=DOT_PREC)
    if PART >= 2:
        acc = acc * sm_scale
    col0 = (PART % 2) * (D1 if PART >= 2 else DV1)
    width = (D2 if PART == 3 else D1) if PART >= 2 else (DV2 if PART == 1 else DV1)
    tl.store(Grad + k_rows[:, None] * stride_gt + hk * stride_gh + col0 + offs_c[None, :], acc,
             mask=n_ok[:, None] & (offs_c < width)[None, :])


@triton.jit
def _mla_bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, CuQ, CuK, QPos, KPos,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lh,
    stride_dqt, stride_dqh, sm_scale, qk_scale_log2,
    GROUP: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV1: tl.constexpr, DV2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_DV1: tl.constexpr, BLOCK_DV2: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_POS: tl.constexpr, DOT_PREC: tl.constexpr, PART: tl.constexpr,
):
    """dQ's columns: PART 0 both parts in one program, 1 the main part only, 2 the tail only."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    hk = h // GROUP
    q_start, len_q, k_start, len_k = _seq_bounds(CuQ, CuK, b)
    m0 = pid_m * BLOCK_M
    if m0 >= len_q:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_d2 = tl.arange(0, BLOCK_D2)
    offs_dv1 = tl.arange(0, BLOCK_DV1)
    offs_dv2 = tl.arange(0, BLOCK_DV2)
    m_ok = offs_m < len_q
    q_rows = q_start + offs_m
    q1, q2 = _load_parts(Q, q_rows, m_ok, h, stride_qt, stride_qh, offs_d1, offs_d2, D1, D2)
    do1, do2 = _load_parts(DO, q_rows, m_ok, h, stride_dot, stride_doh, offs_dv1, offs_dv2, DV1, DV2)
    lse2 = _load_lse2(Lse, h, stride_lh, q_rows, m_ok)
    delta = tl.load(Delta + h * stride_lh + q_rows, mask=m_ok, other=0.0)
    q_pos = _load_positions(QPos, q_start, offs_m, len_q, HAS_POS, len_k - len_q)
    q_pos_max = tl.max(q_pos, axis=0)
    dq1 = tl.zeros([BLOCK_M, BLOCK_D1], tl.float32)
    dq2 = tl.zeros([BLOCK_M, BLOCK_D2], tl.float32)
    _, n_end = _key_loop_bounds(m0, len_q, len_k, BLOCK_M, BLOCK_N, CAUSAL, HAS_POS)  # no unmasked loop here
    for n0 in range(0, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k_pos = _load_positions(KPos, k_start, offs_n, len_k, HAS_POS, 0)
        if _block_runs(k_pos, q_pos_max, CAUSAL):
            n_ok = offs_n < len_k
            rows = (k_start + offs_n).to(tl.int64)
            s = dot_rows(q1, q2, K, rows, n_ok, hk, stride_kt, stride_kh, offs_d1, offs_d2, D1, D2, DOT_PREC)
            p = tl.math.exp2(s * qk_scale_log2 - lse2[:, None])
            p = tl.where(_visible(k_pos, q_pos, CAUSAL), p, 0.0)
            dp = dot_rows(do1, do2, V, rows, n_ok, hk, stride_vt, stride_vh, offs_dv1, offs_dv2, DV1, DV2, DOT_PREC)
            ds = (p * (dp - delta[:, None])).to(q1.dtype)
            if PART != 2:
                k1 = _load_cols(K, rows, n_ok, hk, stride_kt, stride_kh, 0, offs_d1, D1)
                dq1 += tl.dot(ds, k1, input_precision=DOT_PREC)
            if (D2 > 0) and (PART != 1):
                k2 = _load_cols(K, rows, n_ok, hk, stride_kt, stride_kh, D1, offs_d2, D2)
                dq2 += tl.dot(ds, k2, input_precision=DOT_PREC)
    if PART != 2:
        tl.store(DQ + q_rows[:, None] * stride_dqt + h * stride_dqh + offs_d1[None, :], dq1 * sm_scale,
                 mask=m_ok[:, None] & (offs_d1 < D1)[None, :])
    if (D2 > 0) and (PART != 1):
        tl.store(DQ + q_rows[:, None] * stride_dqt + h * stride_dqh + D1 + offs_d2[None, :], dq2 * sm_scale,
                 mask=m_ok[:, None] & (offs_d2 < D2)[None, :])


def _blocks(device, kernel: str) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) of ``kernel`` ("fwd", "dq", "dkdv"); interpreter: 16 x 16 so small
    tests cover several blocks. GPU choices AOT-measured at 192/128 and 256/256
    (primerl.kernels.aot): every kernel spill-free on sm_90a and sm_100a with the tensor-core MMA."""
    if device.type != "cuda":
        return 16, 16, 4, 1
    return (64, 32, 4, 3) if kernel in ("fwd", "dq") else (128, 64, 8, 3)


def _dq_parts(d: int, dv: int, device) -> tuple[int, ...]:
    """dQ in one program (PART 0), or its two column parts in two (1, 2) where the held q, dO
    and both accumulators would spill (256/256 on sm_100a: AOT)."""
    if device.type == "cuda" and split_width(d)[1] and d + dv > 320:
        return (1, 2)
    return (0,)


def _meta(q, v, spec, blocks):
    d1, d2 = split_width(q.shape[2])
    dv1, dv2 = split_width(v.shape[2])
    bm, bn, warps, stages = blocks
    q_pos, k_pos, has_pos = _pos_args(spec)
    return (q_pos, k_pos), dict(
        GROUP=q.shape[1] // v.shape[1], D1=d1, D2=d2, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D1=_p2(d1), BLOCK_D2=_p2(d2),
        CAUSAL=spec.causal, HAS_POS=has_pos, DOT_PREC=_dot_precision(q.dtype), num_warps=warps,
        num_stages=stages), (dv1, dv2)


def forward(q, k, v, spec, out_dtype: torch.dtype):
    """q, k ``[T(k), H(kv), Dqk]``, v ``[Tk, Hkv, Dv]`` -> out ``[T, Hq, Dv]`` (out_dtype), lse ``[Hq, T]``."""
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    T, Hq, _ = q.shape
    out = torch.empty(T, Hq, v.shape[2], dtype=out_dtype, device=q.device)
    lse = torch.empty(Hq, T, dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    blocks = _blocks(q.device, "fwd")
    pos, meta, _ = _meta(q, v, spec, blocks)
    grid = (triton.cdiv(max(spec.max_seqlen_q, 1), blocks[0]), spec.cu_seqlens_q.numel() - 1, Hq)
    _mla_fwd_kernel[grid](
        q, k, v, out, lse, spec.cu_seqlens_q, spec.cu_seqlens_k, *pos,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        lse.stride(0), spec.softmax_scale * LOG2E, DV=v.shape[2], BLOCK_DV=_p2(v.shape[2]), **meta)
    return out, lse


def backward(dout, q, k, v, out, lse, dlse, spec):
    """dq ``[T, Hq, Dqk]``, dk ``[Tk, Hkv, Dqk]``, dv ``[Tk, Hkv, Dv]``, all float32."""
    q, k, v, dout, lse, delta = backward_inputs(dout, q, k, v, out, lse, dlse)
    T, Hq, D = q.shape
    Tk, Hkv, Dv = v.shape
    dq = torch.empty(T, Hq, D, dtype=torch.float32, device=q.device)
    dk = torch.empty(Tk, Hkv, D, dtype=torch.float32, device=q.device)
    dv = torch.empty(Tk, Hkv, Dv, dtype=torch.float32, device=q.device)
    if T == 0 or Tk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    batch = spec.cu_seqlens_q.numel() - 1
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dout.stride(0),
               dout.stride(1), lse.stride(0))
    scales = (spec.softmax_scale, spec.softmax_scale * LOG2E)
    blocks = _blocks(q.device, "dkdv")
    pos, meta, (dv1, dv2) = _meta(q, v, spec, blocks)
    meta.update(DV1=dv1, DV2=dv2, BLOCK_DV1=_p2(dv1), BLOCK_DV2=_p2(dv2))
    widths = {0: dv1, 1: dv2, 2: meta["D1"], 3: meta["D2"]}
    for part, width in widths.items():
        if width == 0:
            continue
        grad = dv if part < 2 else dk
        _mla_bwd_dkdv_kernel[(triton.cdiv(max(spec.max_seqlen_k, 1), blocks[1]), batch, Hkv)](
            q, k, v, dout, lse, delta, grad, spec.cu_seqlens_q, spec.cu_seqlens_k, *pos, *strides,
            grad.stride(0), grad.stride(1), *scales, BLOCK_C=_p2(width), PART=part, **meta)
    blocks = _blocks(q.device, "dq")
    pos, meta, _ = _meta(q, v, spec, blocks)
    meta.update(DV1=dv1, DV2=dv2, BLOCK_DV1=_p2(dv1), BLOCK_DV2=_p2(dv2))
    for part in _dq_parts(D, Dv, q.device):
        _mla_bwd_dq_kernel[(triton.cdiv(max(spec.max_seqlen_q, 1), blocks[0]), batch, Hq)](
            q, k, v, dout, lse, delta, dq, spec.cu_seqlens_q, spec.cu_seqlens_k, *pos, *strides,
            dq.stride(0), dq.stride(1), *scales, PART=part, **meta)
    return dq, dk, dv
