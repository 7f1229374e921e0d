"""Triton kernels: flash-attention-2 style varlen forward (online softmax, returns lse), a
recomputing backward (one kernel for dK/dV per key block, one for dQ per query block, no
atomics), and the merge of two partial results.

With the default positions the forward runs the key blocks every query of its block sees in full
(below the causal diagonal, no tail) in a loop without masks, and only the rest masked.

Grids: forward and dQ ``(cdiv(max_seqlen_q, BLOCK_M), B, Hq)``, dK/dV ``(cdiv(max_seqlen_k,
BLOCK_N), B, Hkv)`` looping over the G query heads of its group. Masking follows the reference
(same sequence, ``k_pos >= 0``, causal ``k_pos <= q_pos``); a key block that no query of the
current block can see is skipped, which is what makes a causal ring step cost only its visible
part. Softmax runs in base 2 with the scale folded in (``LOG2E``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import mla_triton
from .triton_common import (LOG2E, _block_runs, _dot_precision, _first_query_block, _key_block_summary,
                            _key_loop_bounds, _last_dim_contiguous, _load_positions, _pos_args, _query_block_sees,
                            _seq_bounds, _visible, backward_inputs)

# Blocks under the CPU interpreter, where per-op overhead dominates; tests shrink them to 16 to
# cover several blocks per sequence at tiny lengths.
INTERPRETER_BLOCK = 32


def _blocks(head_dim: int, device: torch.device) -> tuple[int, int, int]:
    block_d = max(16, triton.next_power_of_2(head_dim))
    if device.type != "cuda":
        return INTERPRETER_BLOCK, INTERPRETER_BLOCK, block_d
    if block_d <= 64:
        return 64, 64, block_d
    return 64, 32, block_d


def _fwd_blocks(head_dim: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D) of the forward. At head_dim 128, 64 x 64 tiles ran 3% faster than
    64 x 32 on the H200 (256 vs 249 TF/s at 8 x 4096 tokens, 32/8 heads; 240 vs 235 at 16 x 2048,
    64/8; 128 x 64 at 8 warps was slower, 241 / 221)."""
    block_m, block_n, block_d = _blocks(head_dim, device)
    if device.type == "cuda" and block_d == 128:
        return 64, 64, block_d
    return block_m, block_n, block_d


def _dkdv_blocks(head_dim: int, device: torch.device, causal: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) of the dK/dV kernel. Its dots with the key block as the M
    side need 64+ key rows for wgmma / tcgen05 (at 32, ptxas falls back to mma.sync); at head_dim
    128, 64 x 64 tiles spill on sm_90a at 4 and 8 warps, 128 x 64 at 8 warps does not. Non-causal,
    the loop has no block-skip branch and Triton pipelines it: at 3 stages it needs 242 KB of
    shared memory and spills (the H200 refused the launch), at 2 it still spills on sm_90a and
    sm_100a; 1 stage is clean (AOT-measured, primerl.kernels.aot)."""
    block_m, block_n, block_d = _blocks(head_dim, device)
    if device.type == "cuda" and block_d > 64:
        return 128, 64, 8, (3 if causal else 1)
    return block_m, block_n, 4, 3


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, CuQ, CuK, QPos, KPos,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
    qk_scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_POS: tl.constexpr, DOT_PREC: tl.constexpr,
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
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < len_q
    d_valid = offs_d < HEAD_DIM
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    q_pos = _load_positions(QPos, q_start, offs_m, len_q, HAS_POS, len_k - len_q)
    q_pos_max = tl.max(q_pos, axis=0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_full, n_end = _key_loop_bounds(m0, len_q, len_k, BLOCK_M, BLOCK_N, CAUSAL, HAS_POS)
    for n0 in range(0, n_full, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(K + (k_start + offs_n)[:, None] * stride_kt + hk * stride_kh + offs_d[None, :],
                    mask=d_valid[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale_log2
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V + (k_start + offs_n)[:, None] * stride_vt + hk * stride_vh + offs_d[None, :],
                    mask=d_valid[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    for n0 in range(n_full, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k_pos = _load_positions(KPos, k_start, offs_n, len_k, HAS_POS, 0)
        if _block_runs(k_pos, q_pos_max, CAUSAL):
            n_valid = offs_n < len_k
            kv_mask = n_valid[:, None] & d_valid[None, :]
            k = tl.load(K + (k_start + offs_n)[:, None] * stride_kt + hk * stride_kh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale_log2
            s = tl.where(_visible(k_pos, q_pos, CAUSAL), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            p = tl.math.exp2(s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(V + (k_start + offs_n)[:, None] * stride_vt + hk * stride_vh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])
    tl.store(Lse + h * stride_lh + q_start + offs_m, lse, mask=m_valid)


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, CuQ, CuK, QPos, KPos,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_lh, stride_dkt, stride_dkh,
    sm_scale, qk_scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_POS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    hk = tl.program_id(2)
    q_start, len_q, k_start, len_k = _seq_bounds(CuQ, CuK, b)
    n0 = pid_n * BLOCK_N
    if n0 >= len_k:
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_valid = offs_n < len_k
    d_valid = offs_d < HEAD_DIM
    kv_mask = n_valid[:, None] & d_valid[None, :]
    k = tl.load(K + (k_start + offs_n)[:, None] * stride_kt + hk * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + (k_start + offs_n)[:, None] * stride_vt + hk * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    k_pos = _load_positions(KPos, k_start, offs_n, len_k, HAS_POS, 0)
    k_pos_min, any_key = _key_block_summary(k_pos)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    m_begin = _first_query_block(n0, len_q, len_k, BLOCK_M, CAUSAL, HAS_POS)
    if any_key:
        for g in range(GROUP):
            h = hk * GROUP + g
            for m0 in range(m_begin, len_q, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                q_pos = _load_positions(QPos, q_start, offs_m, len_q, HAS_POS, len_k - len_q)
                if _query_block_sees(k_pos_min, q_pos, CAUSAL):
                    m_valid = offs_m < len_q
                    qo_mask = m_valid[:, None] & d_valid[None, :]
                    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                                mask=qo_mask, other=0.0)
                    do = tl.load(DO + (q_start + offs_m)[:, None] * stride_dot + h * stride_doh + offs_d[None, :],
                                 mask=qo_mask, other=0.0)
                    lse = tl.load(Lse + h * stride_lh + q_start + offs_m, mask=m_valid, other=float("inf"))
                    lse = tl.where(lse == float("-inf"), float("inf"), lse)  # rows that saw no key: P = 0
                    delta = tl.load(Delta + h * stride_lh + q_start + offs_m, mask=m_valid, other=0.0)
                    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale_log2
                    p = tl.math.exp2(s - (lse * 1.4426950408889634)[:, None])
                    p = tl.where(_visible(k_pos, q_pos, CAUSAL), p, 0.0)
                    dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PREC)
                    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
                    ds = p * (dp - delta[:, None])
                    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PREC)
    dk = dk * sm_scale
    tl.store(DK + (k_start + offs_n)[:, None] * stride_dkt + hk * stride_dkh + offs_d[None, :], dk, mask=kv_mask)
    tl.store(DV + (k_start + offs_n)[:, None] * stride_dkt + hk * stride_dkh + offs_d[None, :], dv, mask=kv_mask)


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, CuQ, CuK, QPos, KPos,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_lh, stride_dqt, stride_dqh,
    sm_scale, qk_scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_POS: tl.constexpr, DOT_PREC: tl.constexpr,
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
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < len_q
    d_valid = offs_d < HEAD_DIM
    qo_mask = m_valid[:, None] & d_valid[None, :]
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=qo_mask, other=0.0)
    do = tl.load(DO + (q_start + offs_m)[:, None] * stride_dot + h * stride_doh + offs_d[None, :],
                 mask=qo_mask, other=0.0)
    lse = tl.load(Lse + h * stride_lh + q_start + offs_m, mask=m_valid, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    lse2 = lse * 1.4426950408889634
    delta = tl.load(Delta + h * stride_lh + q_start + offs_m, mask=m_valid, other=0.0)
    q_pos = _load_positions(QPos, q_start, offs_m, len_q, HAS_POS, len_k - len_q)
    q_pos_max = tl.max(q_pos, axis=0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_full, n_end = _key_loop_bounds(m0, len_q, len_k, BLOCK_M, BLOCK_N, CAUSAL, HAS_POS)
    for n0 in range(0, n_full, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(K + (k_start + offs_n)[:, None] * stride_kt + hk * stride_kh + offs_d[None, :],
                    mask=d_valid[None, :], other=0.0)
        v = tl.load(V + (k_start + offs_n)[:, None] * stride_vt + hk * stride_vh + offs_d[None, :],
                    mask=d_valid[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale_log2
        p = tl.math.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
    for n0 in range(n_full, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k_pos = _load_positions(KPos, k_start, offs_n, len_k, HAS_POS, 0)
        if _block_runs(k_pos, q_pos_max, CAUSAL):
            n_valid = offs_n < len_k
            kv_mask = n_valid[:, None] & d_valid[None, :]
            k = tl.load(K + (k_start + offs_n)[:, None] * stride_kt + hk * stride_kh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            v = tl.load(V + (k_start + offs_n)[:, None] * stride_vt + hk * stride_vh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale_log2
            p = tl.math.exp2(s - lse2[:, None])
            p = tl.where(_visible(k_pos, q_pos, CAUSAL), p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
    dq = dq * sm_scale
    tl.store(DQ + (q_start + offs_m)[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :], dq, mask=qo_mask)


def _runs_two_part_kernels(head_dim: int) -> bool:
    """Head dims 129..256 (MLA's 192 and 256) run :mod:`.mla_triton`'s kernels, which split the
    width into two column parts of at most 128: with one 256-wide tile these kernels' backward
    spills 116-172 local loads/stores on sm_90a and sm_100a (AOT, triton 3.7.1)."""
    return 128 < head_dim <= 256


def forward(q, k, v, spec, out_dtype: torch.dtype):
    """q ``[T, Hq, D]``, k/v ``[Tk, Hkv, D]`` -> out ``[T, Hq, D]`` (out_dtype), lse ``[Hq, T]`` float32."""
    if _runs_two_part_kernels(q.shape[-1]):
        return mla_triton.forward(q, k, v, spec, out_dtype)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    out = torch.empty(T, Hq, D, dtype=out_dtype, device=q.device)
    lse = torch.empty(Hq, T, dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    block_m, block_n, block_d = _fwd_blocks(D, q.device)
    q_pos, k_pos, has_pos = _pos_args(spec)
    batch = spec.cu_seqlens_q.numel() - 1
    grid = (triton.cdiv(max(spec.max_seqlen_q, 1), block_m), batch, Hq)
    _attn_fwd_kernel[grid](
        q, k, v, out, lse, spec.cu_seqlens_q, spec.cu_seqlens_k, q_pos, k_pos,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        lse.stride(0), spec.softmax_scale * LOG2E,
        GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        CAUSAL=spec.causal, HAS_POS=has_pos, DOT_PREC=_dot_precision(q.dtype),
    )
    return out, lse


def backward(dout, q, k, v, out, lse, dlse, spec):
    """Recomputing backward: dq ``[T, Hq, D]``, dk/dv ``[Tk, Hkv, D]``, all float32."""
    if _runs_two_part_kernels(q.shape[-1]):
        return mla_triton.backward(dout, q, k, v, out, lse, dlse, spec)
    q, k, v, dout, lse, delta = backward_inputs(dout, q, k, v, out, lse, dlse)
    T, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    dq = torch.empty(T, Hq, D, dtype=torch.float32, device=q.device)
    dk = torch.empty(Tk, Hkv, D, dtype=torch.float32, device=q.device)
    dv = torch.empty(Tk, Hkv, D, dtype=torch.float32, device=q.device)
    if T == 0 or Tk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    block_m, block_n, block_d = _blocks(D, q.device)
    q_pos, k_pos, has_pos = _pos_args(spec)
    batch = spec.cu_seqlens_q.numel() - 1
    common = dict(GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                  CAUSAL=spec.causal, HAS_POS=has_pos, DOT_PREC=_dot_precision(q.dtype))
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dout.stride(0),
               dout.stride(1), lse.stride(0))
    scales = (spec.softmax_scale, spec.softmax_scale * LOG2E)
    # dk/dv rows of tokens outside every sequence are never visited: only cu_seqlens_k[-1] == Tk
    # is allowed, so each token belongs to one key block of one sequence and gets written.
    kv_m, kv_n, kv_warps, kv_stages = _dkdv_blocks(D, q.device, spec.causal)
    _attn_bwd_dkdv_kernel[(triton.cdiv(max(spec.max_seqlen_k, 1), kv_n), batch, Hkv)](
        q, k, v, dout, lse, delta, dk, dv, spec.cu_seqlens_q, spec.cu_seqlens_k, q_pos, k_pos,
        *strides, dk.stride(0), dk.stride(1), *scales, **dict(common, BLOCK_M=kv_m, BLOCK_N=kv_n), num_warps=kv_warps,
        num_stages=kv_stages,
    )
    _attn_bwd_dq_kernel[(triton.cdiv(max(spec.max_seqlen_q, 1), block_m), batch, Hq)](
        q, k, v, dout, lse, delta, dq, spec.cu_seqlens_q, spec.cu_seqlens_k, q_pos, k_pos,
        *strides, dq.stride(0), dq.stride(1), *scales, **common,
    )
    return dq, dk, dv


@triton.jit
def _merge_kernel(
    OutA, LseA, OutB, LseB, Out, Lse, T,
    stride_at, stride_ah, stride_bt, stride_bh, stride_ot, stride_oh, stride_la, stride_lb, stride_lo,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    t_valid = offs_t < T
    mask = t_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    la = tl.load(LseA + h * stride_la + offs_t, mask=t_valid, other=float("-inf"))
    lb = tl.load(LseB + h * stride_lb + offs_t, mask=t_valid, other=float("-inf"))
    m = tl.maximum(la, lb)
    m = tl.where(m == float("-inf"), 0.0, m)
    sa = tl.exp(la - m)
    sb = tl.exp(lb - m)
    total = sa + sb
    lse = tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    inv = tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0)
    wa = sa * inv
    wb = sb * inv
    oa = tl.load(OutA + offs_t[:, None] * stride_at + h * stride_ah + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    ob = tl.load(OutB + offs_t[:, None] * stride_bt + h * stride_bh + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    # a zero-weight block contributes exactly nothing, even when its out holds NaN/garbage
    oa = tl.where(wa[:, None] > 0, oa, 0.0)
    ob = tl.where(wb[:, None] > 0, ob, 0.0)
    out = wa[:, None] * oa + wb[:, None] * ob
    tl.store(Out + offs_t[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask)
    tl.store(Lse + h * stride_lo + offs_t, lse, mask=t_valid)


def merge_attn_states(out_a, lse_a, out_b, lse_b, *, inplace: bool):
    dst_out, dst_lse = out_a, lse_a
    out_a, out_b = _last_dim_contiguous(out_a), _last_dim_contiguous(out_b)
    lse_a, lse_b = _last_dim_contiguous(lse_a), _last_dim_contiguous(lse_b)
    T, H, D = out_a.shape
    if inplace:
        out, lse = out_a, lse_a
    else:
        out = torch.empty_like(out_a)
        lse = torch.empty(H, T, dtype=torch.float32, device=out_a.device)
    if T == 0:
        return out, lse
    block_t = 32 if out_a.device.type != "cuda" else 64
    block_d = triton.next_power_of_2(D)
    _merge_kernel[(triton.cdiv(T, block_t), H)](
        out_a, lse_a, out_b, lse_b, out, lse, T,
        out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1), out.stride(0), out.stride(1),
        lse_a.stride(0), lse_b.stride(0), lse.stride(0),
        HEAD_DIM=D, BLOCK_T=block_t, BLOCK_D=block_d,
    )
    if inplace and out is not dst_out:  # the destination had a strided last dim: write back
        dst_out.copy_(out)
    if inplace and lse is not dst_lse:
        dst_lse.copy_(lse)
    return (dst_out, dst_lse) if inplace else (out, lse)
