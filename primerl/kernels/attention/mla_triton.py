"""Triton kernels of dense attention with value heads of another width than the query/key heads
(MLA: 192/128, 256/256), forward with lse and a recomputing backward, on the varlen contract and
mask rule of :mod:`primerl.kernels.attention.reference` (``AttentionSpec``: same sequence,
``k_pos >= 0``, causal ``k_pos <= q_pos``).

The query/key width is split into a power-of-two main part and a tail (192 = 128 + 64: MLA's nope
and rope parts), so no tile is padded to 256; the value width is its own power of two. Grids as
the square kernels (``triton.py``): forward and dQ ``(cdiv(max_seqlen_q, BLOCK_M), B, Hq)``, dK/dV
``(cdiv(max_seqlen_k, BLOCK_N), B, Hkv)`` looping over the G query heads of its group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_POS_BIG = tl.constexpr(2**30)  # "no valid key" sentinel for the block-skip test


def _dot_precision(dtype: torch.dtype):
    return "ieee" if dtype == torch.float32 else "tf32"  # float32: IEEE products, as the square kernels


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _pos_args(spec):
    if spec.q_positions is None:
        return spec.cu_seqlens_q, spec.cu_seqlens_q, False  # dummies, never read
    return spec.q_positions, spec.k_positions, True


@triton.jit
def _load_positions(Pos, base, offs, n_valid, HAS_POS: tl.constexpr, shift):
    """Positions of tokens ``offs`` of one sequence; -1 (masked) beyond ``n_valid``."""
    valid = offs < n_valid
    if HAS_POS:
        return tl.load(Pos + base + offs, mask=valid, other=-1)
    return tl.where(valid, offs + shift, -1)


def split_width(d: int) -> tuple[int, int]:
    """(main, tail): main the largest power of two <= d, tail the rest (0 for a power of two)."""
    main = 1 << (d.bit_length() - 1)
    return main, d - main


def _p2(n: int) -> int:
    return max(16, triton.next_power_of_2(max(n, 1)))


@triton.jit
def _qk(q1, q2, K, rows, valid, hk, stride_kt, stride_kh, offs_d1, offs_d2, D1: tl.constexpr, D2: tl.constexpr,
        DOT_PREC: tl.constexpr):
    """q [BM, D1 (+ D2)] against key rows [BN] -> [BM, BN] (unscaled)."""
    k1 = tl.load(K + rows[:, None] * stride_kt + hk * stride_kh + offs_d1[None, :],
                 mask=valid[:, None] & (offs_d1 < D1)[None, :], other=0.0)
    s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC)
    if D2 > 0:
        k2 = tl.load(K + rows[:, None] * stride_kt + hk * stride_kh + D1 + offs_d2[None, :],
                     mask=valid[:, None] & (offs_d2 < D2)[None, :], other=0.0)
        s += tl.dot(q2, tl.trans(k2), input_precision=DOT_PREC)
    return s


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
    q_start = tl.load(CuQ + b)
    len_q = tl.load(CuQ + b + 1) - q_start
    k_start = tl.load(CuK + b)
    len_k = tl.load(CuK + b + 1) - k_start
    m0 = pid_m * BLOCK_M
    if m0 >= len_q:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_d2 = tl.arange(0, BLOCK_D2)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < len_q
    q_rows = q_start + offs_m
    q1 = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d1[None, :],
                 mask=m_ok[:, None] & (offs_d1 < D1)[None, :], other=0.0)
    q2 = q1
    if D2 > 0:
        q2 = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + D1 + offs_d2[None, :],
                     mask=m_ok[:, None] & (offs_d2 < D2)[None, :], other=0.0)
    q_pos = _load_positions(QPos, q_start, offs_m, len_q, HAS_POS, len_k - len_q)
    q_pos_max = tl.max(q_pos, axis=0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    n_end = len_k
    if CAUSAL and not HAS_POS:
        n_end = tl.minimum(len_k, m0 + BLOCK_M + len_k - len_q)
    for n0 in range(0, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k_pos = _load_positions(KPos, k_start, offs_n, len_k, HAS_POS, 0)
        if CAUSAL:
            run = tl.min(tl.where(k_pos >= 0, k_pos, _POS_BIG), axis=0) <= q_pos_max
        else:
            run = tl.max(k_pos, axis=0) >= 0
        if run:
            n_ok = offs_n < len_k
            rows = (k_start + offs_n).to(tl.int64)
            s = _qk(q1, q2, K, rows, n_ok, hk, stride_kt, stride_kh, offs_d1, offs_d2, D1, D2, DOT_PREC) * qk_scale_log2
            visible = (k_pos >= 0)[None, :]
            if CAUSAL:
                visible = visible & (k_pos[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(V + rows[:, None] * stride_vt + hk * stride_vh + offs_dv[None, :],
                        mask=n_ok[:, None] & (offs_dv < DV)[None, :], other=0.0)
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
    Q, K, V, DO, Lse, Delta, DK, DV_, CuQ, CuK, QPos, KPos,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, sm_scale, qk_scale_log2,
    GROUP: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_POS: tl.constexpr, DOT_PREC: tl.constexpr, PART: tl.constexpr,
):
    """PART 0: dV (from P alone); PART 1: dK's main columns, PART 2: its tail (P and dP). Separate
    launches, each recomputing P, so that no program holds more than one float32 accumulator
    (together at 192/128 they spill on sm_90a and sm_100a: AOT; split this way none does)."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    hk = tl.program_id(2)
    q_start = tl.load(CuQ + b)
    len_q = tl.load(CuQ + b + 1) - q_start
    k_start = tl.load(CuK + b)
    len_k = tl.load(CuK + b + 1) - k_start
    n0 = pid_n * BLOCK_N
    if n0 >= len_k:
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_d2 = tl.arange(0, BLOCK_D2)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_ok = offs_n < len_k
    k_rows = (k_start + offs_n).to(tl.int64)
    k_pos = _load_positions(KPos, k_start, offs_n, len_k, HAS_POS, 0)
    k_pos_min = tl.min(tl.where(k_pos >= 0, k_pos, _POS_BIG), axis=0)
    any_key = tl.max(k_pos, axis=0) >= 0
    dk1 = tl.zeros([BLOCK_N, BLOCK_D1], tl.float32)
    dk2 = tl.zeros([BLOCK_N, BLOCK_D2], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    m_begin = 0
    if CAUSAL and not HAS_POS:
        m_begin = tl.maximum(0, n0 - (len_k - len_q)) // BLOCK_M * BLOCK_M
    if any_key:
        for g in range(GROUP):
            h = hk * GROUP + g
            for m0 in range(m_begin, len_q, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                q_pos = _load_positions(QPos, q_start, offs_m, len_q, HAS_POS, len_k - len_q)
                run = True
                if CAUSAL:
                    run = k_pos_min <= tl.max(q_pos, axis=0)
                if run:
                    m_ok = offs_m < len_q
                    q_rows = q_start + offs_m
                    q1 = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d1[None, :],
                                 mask=m_ok[:, None] & (offs_d1 < D1)[None, :], other=0.0)
                    q2 = q1
                    if D2 > 0:
                        q2 = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + D1 + offs_d2[None, :],
                                     mask=m_ok[:, None] & (offs_d2 < D2)[None, :], other=0.0)
                    # the key block is re-read each step (cache hits) rather than held: at 192/128 the
                    # held K and V tiles spill beside the three float32 accumulators (AOT, sm_90a)
                    s = _qk(q1, q2, K, k_rows, n_ok, hk, stride_kt, stride_kh, offs_d1, offs_d2, D1, D2, DOT_PREC)
                    do = tl.load(DO + q_rows[:, None] * stride_dot + h * stride_doh + offs_dv[None, :],
                                 mask=m_ok[:, None] & (offs_dv < DV)[None, :], other=0.0)
                    lse = tl.load(Lse + h * stride_lh + q_rows, mask=m_ok, other=float("inf"))
                    lse = tl.where(lse == float("-inf"), float("inf"), lse)  # rows that saw no key: P = 0
                    delta = tl.load(Delta + h * stride_lh + q_rows, mask=m_ok, other=0.0)
                    p = tl.math.exp2(s * qk_scale_log2 - (lse * 1.4426950408889634)[:, None])
                    visible = (k_pos >= 0)[None, :]
                    if CAUSAL:
                        visible = visible & (k_pos[None, :] <= q_pos[:, None])
                    p = tl.where(visible, p, 0.0)
                    if PART == 0:
                        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PREC)
                    else:
                        v = tl.load(V + k_rows[:, None] * stride_vt + hk * stride_vh + offs_dv[None, :],
                                    mask=n_ok[:, None] & (offs_dv < DV)[None, :], other=0.0)
                        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
                        ds = (p * (dp - delta[:, None])).to(q1.dtype)
                        if PART == 1:
                            dk1 += tl.dot(tl.trans(ds), q1, input_precision=DOT_PREC)
                        else:
                            dk2 += tl.dot(tl.trans(ds), q2, input_precision=DOT_PREC)
    if PART == 1:
        tl.store(DK + k_rows[:, None] * stride_dkt + hk * stride_dkh + offs_d1[None, :], dk1 * sm_scale,
                 mask=n_ok[:, None] & (offs_d1 < D1)[None, :])
    elif PART == 2:
        tl.store(DK + k_rows[:, None] * stride_dkt + hk * stride_dkh + D1 + offs_d2[None, :], dk2 * sm_scale,
                 mask=n_ok[:, None] & (offs_d2 < D2)[None, :])
    else:
        tl.store(DV_ + k_rows[:, None] * stride_dvt + hk * stride_dvh + offs_dv[None, :], dv,
                 mask=n_ok[:, None] & (offs_dv < DV)[None, :])


@triton.jit
def _mla_bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, CuQ, CuK, QPos, KPos,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lh,
    stride_dqt, stride_dqh, sm_scale, qk_scale_log2,
    GROUP: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_POS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    hk = h // GROUP
    q_start = tl.load(CuQ + b)
    len_q = tl.load(CuQ + b + 1) - q_start
    k_start = tl.load(CuK + b)
    len_k = tl.load(CuK + b + 1) - k_start
    m0 = pid_m * BLOCK_M
    if m0 >= len_q:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_d2 = tl.arange(0, BLOCK_D2)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < len_q
    q_rows = q_start + offs_m
    q1 = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d1[None, :],
                 mask=m_ok[:, None] & (offs_d1 < D1)[None, :], other=0.0)
    q2 = q1
    if D2 > 0:
        q2 = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + D1 + offs_d2[None, :],
                     mask=m_ok[:, None] & (offs_d2 < D2)[None, :], other=0.0)
    do = tl.load(DO + q_rows[:, None] * stride_dot + h * stride_doh + offs_dv[None, :],
                 mask=m_ok[:, None] & (offs_dv < DV)[None, :], other=0.0)
    lse = tl.load(Lse + h * stride_lh + q_rows, mask=m_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = tl.load(Delta + h * stride_lh + q_rows, mask=m_ok, other=0.0)
    q_pos = _load_positions(QPos, q_start, offs_m, len_q, HAS_POS, len_k - len_q)
    q_pos_max = tl.max(q_pos, axis=0)
    dq1 = tl.zeros([BLOCK_M, BLOCK_D1], tl.float32)
    dq2 = tl.zeros([BLOCK_M, BLOCK_D2], tl.float32)
    n_end = len_k
    if CAUSAL and not HAS_POS:
        n_end = tl.minimum(len_k, m0 + BLOCK_M + len_k - len_q)
    for n0 in range(0, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k_pos = _load_positions(KPos, k_start, offs_n, len_k, HAS_POS, 0)
        if CAUSAL:
            run = tl.min(tl.where(k_pos >= 0, k_pos, _POS_BIG), axis=0) <= q_pos_max
        else:
            run = tl.max(k_pos, axis=0) >= 0
        if run:
            n_ok = offs_n < len_k
            rows = (k_start + offs_n).to(tl.int64)
            s = _qk(q1, q2, K, rows, n_ok, hk, stride_kt, stride_kh, offs_d1, offs_d2, D1, D2, DOT_PREC)
            p = tl.math.exp2(s * qk_scale_log2 - lse2[:, None])
            visible = (k_pos >= 0)[None, :]
            if CAUSAL:
                visible = visible & (k_pos[None, :] <= q_pos[:, None])
            p = tl.where(visible, p, 0.0)
            v = tl.load(V + rows[:, None] * stride_vt + hk * stride_vh + offs_dv[None, :],
                        mask=n_ok[:, None] & (offs_dv < DV)[None, :], other=0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
            ds = (p * (dp - delta[:, None])).to(q1.dtype)
            k1 = tl.load(K + rows[:, None] * stride_kt + hk * stride_kh + offs_d1[None, :],
                         mask=n_ok[:, None] & (offs_d1 < D1)[None, :], other=0.0)
            dq1 += tl.dot(ds, k1, input_precision=DOT_PREC)
            if D2 > 0:
                k2 = tl.load(K + rows[:, None] * stride_kt + hk * stride_kh + D1 + offs_d2[None, :],
                             mask=n_ok[:, None] & (offs_d2 < D2)[None, :], other=0.0)
                dq2 += tl.dot(ds, k2, input_precision=DOT_PREC)
    tl.store(DQ + q_rows[:, None] * stride_dqt + h * stride_dqh + offs_d1[None, :], dq1 * sm_scale,
             mask=m_ok[:, None] & (offs_d1 < D1)[None, :])
    if D2 > 0:
        tl.store(DQ + q_rows[:, None] * stride_dqt + h * stride_dqh + D1 + offs_d2[None, :], dq2 * sm_scale,
                 mask=m_ok[:, None] & (offs_d2 < D2)[None, :])


def _blocks(device, kernel: str) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps) of ``kernel`` ("fwd", "dq", "dkdv<part>"); interpreter: 16 x 16 so small
    tests cover several blocks. GPU choices AOT-measured at 192/128 (primerl.kernels.aot): every
    kernel spill-free on sm_90a and sm_100a with the tensor-core MMA (the square kernels at a padded
    192 spill 148-152 local loads-stores in dK/dV)."""
    if device.type != "cuda":
        return 16, 16, 4
    return (64, 32, 4) if kernel in ("fwd", "dq") else (128, 64, 8)


def _meta(q, v, spec, blocks):
    d1, d2 = split_width(q.shape[2])
    bm, bn, warps = blocks
    q_pos, k_pos, has_pos = _pos_args(spec)
    return (q_pos, k_pos), dict(
        GROUP=q.shape[1] // v.shape[1], D1=d1, D2=d2, DV=v.shape[2], BLOCK_M=bm, BLOCK_N=bn, BLOCK_D1=_p2(d1),
        BLOCK_D2=_p2(d2), BLOCK_DV=_p2(v.shape[2]), CAUSAL=spec.causal, HAS_POS=has_pos,
        DOT_PREC=_dot_precision(q.dtype), num_warps=warps)


def forward(q, k, v, spec, out_dtype: torch.dtype):
    """q, k ``[T(k), H(kv), Dqk]``, v ``[Tk, Hkv, Dv]`` -> out ``[T, Hq, Dv]`` (out_dtype), lse ``[Hq, T]``."""
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    T, Hq, _ = q.shape
    out = torch.empty(T, Hq, v.shape[2], dtype=out_dtype, device=q.device)
    lse = torch.empty(Hq, T, dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    blocks = _blocks(q.device, "fwd")
    pos, meta = _meta(q, v, spec, blocks)
    grid = (triton.cdiv(max(spec.max_seqlen_q, 1), blocks[0]), spec.cu_seqlens_q.numel() - 1, Hq)
    _mla_fwd_kernel[grid](
        q, k, v, out, lse, spec.cu_seqlens_q, spec.cu_seqlens_k, *pos,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        lse.stride(0), spec.softmax_scale * LOG2E, **meta)
    return out, lse


def backward(dout, q, k, v, out, lse, dlse, spec):
    """dq ``[T, Hq, Dqk]``, dk ``[Tk, Hkv, Dqk]``, dv ``[Tk, Hkv, Dv]``, all float32."""
    q, k, v, dout = (_last_dim_contiguous(t) for t in (q, k, v, dout))
    T, Hq, D = q.shape
    Tk, Hkv, Dv = v.shape
    delta = (dout.float() * out.float()).sum(-1).transpose(0, 1).contiguous()
    if dlse is not None:
        delta = delta - dlse.float()
    lse = lse.contiguous()
    dq = torch.empty(T, Hq, D, dtype=torch.float32, device=q.device)
    dk = torch.empty(Tk, Hkv, D, dtype=torch.float32, device=q.device)
    dv = torch.empty(Tk, Hkv, Dv, dtype=torch.float32, device=q.device)
    if T == 0 or Tk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    batch = spec.cu_seqlens_q.numel() - 1
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dout.stride(0),
               dout.stride(1), lse.stride(0))
    scales = (spec.softmax_scale, spec.softmax_scale * LOG2E)
    for part in ((0, 1, 2) if split_width(D)[1] else (0, 1)):
        blocks = _blocks(q.device, f"dkdv{part}")
        pos, meta = _meta(q, v, spec, blocks)
        _mla_bwd_dkdv_kernel[(triton.cdiv(max(spec.max_seqlen_k, 1), blocks[1]), batch, Hkv)](
            q, k, v, dout, lse, delta, dk, dv, spec.cu_seqlens_q, spec.cu_seqlens_k, *pos, *strides,
            dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), *scales, PART=part, **meta)
    blocks = _blocks(q.device, "dq")
    pos, meta = _meta(q, v, spec, blocks)
    _mla_bwd_dq_kernel[(triton.cdiv(max(spec.max_seqlen_q, 1), blocks[0]), batch, Hq)](
        q, k, v, dout, lse, delta, dq, spec.cu_seqlens_q, spec.cu_seqlens_k, *pos, *strides,
        dq.stride(0), dq.stride(1), *scales, **meta)
    return dq, dk, dv
