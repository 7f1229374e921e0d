"""Triton kernels of DeepSeek sparse attention: the indexer's scores, and attention over gathered
keys (forward with lse, recomputing backward).

Indexer: grid ``(cdiv(max_seqlen, BLOCK_M), B, cdiv(max_seqlen, BLOCK_N))`` over one chunk of query
rows ``[q_lo, q_hi)``; each program loads one key tile once and sums the Hi heads'
``w * relu(q . k)`` into a ``[BLOCK_M, BLOCK_N]`` score tile (tiles above the diagonal are
skipped; the launcher pre-fills -inf). The top-k is ``torch.topk`` over the chunk's score rows:
chunks keep the buffer at ``chunk x max_seqlen`` floats.

Sparse attention: grid ``(T, Hkv * cdiv(G, BLOCK_H), Dv blocks)``; a program holds one query
token and BLOCK_H query heads of one key/value group (the MMA's M side: the heads share the
gathered keys, as in DeepSeek's absorbed MQA form where G = all heads) and walks the token's K
indices BLOCK_N at a time, gathering key and value rows. The query/key width is split into a
power-of-two main part and a tail (576 = 512 + 64, 192 = 128 + 64: MLA's latent/nope and rope
parts) so neither is padded to the next power of two. Backward: two kernels over (token, head
block), each recomputing P and dS: one keeps dQ in registers; the other adds dK / dV into float32
buffers with atomics (different queries select the same keys), column chunk by column chunk.
The atomics' traffic (T x K x (Dqk + Dv) floats per head group) is this version's cost; a
key-centric pass over the transposed selection would remove it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention.mla_triton import _p2, dot_rows, split_width
from ..attention.triton_common import LOG2E, _dot_precision, _last_dim_contiguous, backward_inputs


# ----------------------------------------------------------------------------------------- indexer
@triton.jit
def _indexer_scores_kernel(
    Q, K, W, Scores, CuQ, CuK, QPos, KPos, q_lo, q_hi,
    stride_qt, stride_qh, stride_kt, stride_wt, stride_st,
    scale,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_POS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    pid_n = tl.program_id(2)
    q_start = tl.load(CuQ + b)
    len_q = tl.load(CuQ + b + 1) - q_start
    k_start = tl.load(CuK + b)
    len_k = tl.load(CuK + b + 1) - k_start
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    row0 = q_start + m0
    run = (m0 < len_q) & (n0 < len_k) & (row0 < q_hi) & (row0 + BLOCK_M > q_lo)
    if not HAS_POS:
        run = run & (n0 <= m0 + BLOCK_M - 1)  # square and causal by index: skip tiles above the diagonal
    if run:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        rows = q_start + offs_m
        row_ok = (offs_m < len_q) & (rows >= q_lo) & (rows < q_hi)
        n_ok = offs_n < len_k
        d_ok = offs_d < HEAD_DIM
        if HAS_POS:
            q_pos = tl.load(QPos + rows, mask=offs_m < len_q, other=-1)
            k_pos = tl.load(KPos + k_start + offs_n, mask=n_ok, other=-1)
        else:
            q_pos = offs_m
            k_pos = tl.where(n_ok, offs_n, -1)
        k = tl.load(K + (k_start + offs_n)[:, None] * stride_kt + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for h in range(HEADS):
            q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale
            w = tl.load(W + rows * stride_wt + h, mask=row_ok, other=0.0).to(tl.float32)
            acc += w[:, None] * tl.maximum(s, 0.0)
        visible = (k_pos[None, :] >= 0) & (k_pos[None, :] <= q_pos[:, None])
        acc = tl.where(visible, acc, float("-inf"))
        tl.store(Scores + (rows - q_lo)[:, None] * stride_st + offs_n[None, :], acc,
                 mask=row_ok[:, None] & n_ok[None, :])


INDEXER_CHUNK_ELEMENTS = 1 << 28  # one chunk's score buffer (chunk rows x max_seqlen float32) at most


def _longest(cu: torch.Tensor) -> int:
    """The longest sequence (a host read of the offsets)."""
    return int((cu[1:] - cu[:-1]).max())


def indexer_topk(q, k, weights, cu_seqlens, topk: int, softmax_scale: float, cu_seqlens_k=None, q_pos=None,
                 k_pos=None, max_seqlen: int | None = None, max_seqlen_k: int | None = None) -> torch.Tensor:
    """q ``[T, Hi, Di]``, k ``[Tk, Di]``, weights ``[T, Hi]`` -> int32 ``[T, topk]`` (the reference's
    selection), in chunks of query rows: scores by the Triton kernel, top-k by the reference's stable
    sort. ``max_seqlen`` / ``max_seqlen_k``: the longest query / key sequence (None: read from the
    offsets on the host)."""
    from .reference import topk_from_scores

    T = q.shape[0]
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    max_q = _longest(cu_seqlens) if max_seqlen is None else max_seqlen
    if cu_seqlens_k is None:
        max_len = max_q
    else:
        max_len = _longest(cu_k) if max_seqlen_k is None else max_seqlen_k
    out = torch.full((T, topk), -1, dtype=torch.int32, device=q.device)
    starts = torch.repeat_interleave(cu_k[:-1].long(), cu_seqlens.diff().long(), output_size=T)
    chunk = max(1, INDEXER_CHUNK_ELEMENTS // max(max_len, 1))
    for lo in range(0, T, chunk):
        hi = min(T, lo + chunk)
        scores = indexer_scores_chunk(q, k, weights, cu_seqlens, max_len, lo, hi, softmax_scale, cu_seqlens_k,
                                      q_pos, k_pos, max_q)
        out[lo:hi] = topk_from_scores(scores, topk, starts[lo:hi])
    return out


def _indexer_blocks(device) -> tuple[int, int]:
    return (32, 32) if device.type != "cuda" else (64, 64)


def indexer_scores_chunk(q, k, weights, cu_seqlens, max_seqlen: int, q_lo: int, q_hi: int, softmax_scale: float,
                         cu_seqlens_k=None, q_pos=None, k_pos=None, max_seqlen_q: int | None = None):
    """Scores of query rows ``[q_lo, q_hi)`` against their sequence's keys: ``[q_hi - q_lo, max_seqlen]``
    float32 (``max_seqlen``: the longest key range), column = key index within the sequence's keys,
    -inf where not visible. The non-square form (``cu_seqlens_k``, positions) as in the reference."""
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    weights = _last_dim_contiguous(weights)
    Hi, Di = q.shape[1], q.shape[2]
    scores = torch.full((q_hi - q_lo, max_seqlen), float("-inf"), dtype=torch.float32, device=q.device)
    if q_hi <= q_lo or max_seqlen == 0:
        return scores
    bm, bn = _indexer_blocks(q.device)
    batch = cu_seqlens.numel() - 1
    has_pos = cu_seqlens_k is not None
    cu_k = cu_seqlens_k if has_pos else cu_seqlens
    q_pos, k_pos = (q_pos, k_pos) if has_pos else (cu_seqlens, cu_seqlens)  # dummies, never read
    grid = (triton.cdiv(max_seqlen_q or max_seqlen, bm), batch, triton.cdiv(max_seqlen, bn))
    _indexer_scores_kernel[grid](
        q, k, weights, scores, cu_seqlens, cu_k, q_pos, k_pos, q_lo, q_hi,
        q.stride(0), q.stride(1), k.stride(0), weights.stride(0), scores.stride(0), softmax_scale,
        HEADS=Hi, HEAD_DIM=Di, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=_p2(Di), HAS_POS=has_pos,
        DOT_PREC=_dot_precision(q.dtype),
    )
    return scores


# ------------------------------------------------------------------------------- sparse attention
@triton.jit
def _selected_rows(Idx, t, stride_it, n0, n_idx, BLOCK_N: tl.constexpr):
    """Token t's selected key rows ``[n0, n0 + BLOCK_N)``: (rows int64, valid, whether any is valid)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    idx = tl.load(Idx + t * stride_it + offs_n, mask=offs_n < n_idx, other=-1)
    valid = idx >= 0
    return tl.where(valid, idx, 0).to(tl.int64), valid, tl.max(idx, axis=0) >= 0


@triton.jit
def _sparse_fwd_kernel(
    Q, K, V, Idx, Out, Lse, n_idx,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_it, stride_ot, stride_oh, stride_lh,
    qk_scale_log2,
    GROUP: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    dvb = tl.program_id(2)
    n_hblocks: tl.constexpr = (GROUP + BLOCK_H - 1) // BLOCK_H
    hk = hb // n_hblocks
    offs_h = (hb % n_hblocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < GROUP
    heads = hk * GROUP + offs_h
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_d2 = tl.arange(0, BLOCK_D2)
    offs_dv = dvb * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    q1 = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + offs_d1[None, :],
                 mask=h_ok[:, None] & (offs_d1 < D1)[None, :], other=0.0)
    q2 = q1
    if D2 > 0:
        q2 = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + D1 + offs_d2[None, :],
                     mask=h_ok[:, None] & (offs_d2 < D2)[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for n0 in range(0, n_idx, BLOCK_N):
        rows, valid, any_valid = _selected_rows(Idx, t, stride_it, n0, n_idx, BLOCK_N)
        if any_valid:
            s = dot_rows(q1, q2, K, rows, valid, hk, stride_kt, stride_kh, offs_d1, offs_d2, D1, D2, DOT_PREC)
            s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(V + rows[:, None] * stride_vt + hk * stride_vh + offs_dv[None, :],
                        mask=valid[:, None] & dv_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(Out + t * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=h_ok[:, None] & dv_ok[None, :])
    if dvb == 0:
        lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
        tl.store(Lse + heads * stride_lh + t, lse, mask=h_ok)


@triton.jit
def _chunked_scores(Q, K, t, heads, h_ok, rows, valid, hk, stride_qt, stride_qh, stride_kt, stride_kh,
                    DQK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                    DOT_PREC: tl.constexpr):
    """q [BH, Dqk] . gathered k [BN, Dqk]^T in column chunks reloaded from memory (cache hits), so
    the backward keeps no [BH, Dqk] query tile live beside its accumulators."""
    s = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
    offs_c = tl.arange(0, BLOCK_C)
    for c in tl.static_range(0, DQK, BLOCK_C):
        c_ok = (c + offs_c) < DQK
        qc = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + c + offs_c[None, :],
                     mask=h_ok[:, None] & c_ok[None, :], other=0.0)
        kc = tl.load(K + rows[:, None] * stride_kt + hk * stride_kh + c + offs_c[None, :],
                     mask=valid[:, None] & c_ok[None, :], other=0.0)
        s += tl.dot(qc, tl.trans(kc), input_precision=DOT_PREC)
    return s


@triton.jit
def _recompute_ds(Q, K, V, DO, rows, valid, h_ok, heads, hk, t, lse2, delta,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                  qk_scale_log2, DQK: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_DVC: tl.constexpr, DOT_PREC: tl.constexpr):
    """P [BH, BN] and dS = P * (dO . V^T - delta) for one block of gathered keys; dO . V^T summed
    over value chunks of BLOCK_DVC so no [*, Dv] tile stays live."""
    s = _chunked_scores(Q, K, t, heads, h_ok, rows, valid, hk, stride_qt, stride_qh, stride_kt, stride_kh,
                        DQK, BLOCK_H, BLOCK_N, BLOCK_DVC, DOT_PREC)
    p = tl.math.exp2(s * qk_scale_log2 - lse2[:, None])
    p = tl.where(valid[None, :] & h_ok[:, None], p, 0.0)
    dp = tl.zeros_like(p)
    offs_c = tl.arange(0, BLOCK_DVC)
    for c in tl.static_range(0, DV, BLOCK_DVC):
        c_ok = (c + offs_c) < DV
        do = tl.load(DO + t * stride_dot + heads[:, None] * stride_doh + c + offs_c[None, :],
                     mask=h_ok[:, None] & c_ok[None, :], other=0.0)
        v = tl.load(V + rows[:, None] * stride_vt + hk * stride_vh + c + offs_c[None, :],
                    mask=valid[:, None] & c_ok[None, :], other=0.0)
        dp += tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    return p, p * (dp - delta[:, None])


@triton.jit
def _bwd_program_setup(Lse, Delta, stride_lh, t, hb, GROUP: tl.constexpr, BLOCK_H: tl.constexpr):
    n_hblocks: tl.constexpr = (GROUP + BLOCK_H - 1) // BLOCK_H
    hk = hb // n_hblocks
    offs_h = (hb % n_hblocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < GROUP
    heads = hk * GROUP + offs_h
    lse = tl.load(Lse + heads * stride_lh + t, mask=h_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634  # no key seen: P = 0
    delta = tl.load(Delta + heads * stride_lh + t, mask=h_ok, other=0.0)
    return hk, h_ok, heads, lse2, delta


@triton.jit
def _sparse_bwd_dq_kernel(
    Q, K, V, Idx, DO, Lse, Delta, DQ, n_idx,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_it, stride_dot, stride_doh, stride_lh,
    stride_dqt, stride_dqh, sm_scale, qk_scale_log2,
    GROUP: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_DVC: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """dQ of one (token, head block, BLOCK_D1 columns of the main part; the tail goes with column
    block 0), accumulated over the token's selected keys in registers."""
    t = tl.program_id(0)
    c = tl.program_id(2)
    hk, h_ok, heads, lse2, delta = _bwd_program_setup(Lse, Delta, stride_lh, t, tl.program_id(1), GROUP, BLOCK_H)
    offs_d1 = c * BLOCK_D1 + tl.arange(0, BLOCK_D1)
    offs_d2 = tl.arange(0, BLOCK_D2)
    dq1 = tl.zeros([BLOCK_H, BLOCK_D1], tl.float32)
    dq2 = tl.zeros([BLOCK_H, BLOCK_D2], tl.float32)
    for n0 in range(0, n_idx, BLOCK_N):
        rows, valid, any_valid = _selected_rows(Idx, t, stride_it, n0, n_idx, BLOCK_N)
        if any_valid:
            p, ds = _recompute_ds(Q, K, V, DO, rows, valid, h_ok, heads, hk, t, lse2, delta,
                                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot,
                                  stride_doh, qk_scale_log2, D1 + D2, DV, BLOCK_H, BLOCK_N, BLOCK_DVC, DOT_PREC)
            ds = ds.to(K.dtype.element_ty)
            k1 = tl.load(K + rows[:, None] * stride_kt + hk * stride_kh + offs_d1[None, :],
                         mask=valid[:, None] & (offs_d1 < D1)[None, :], other=0.0)
            dq1 += tl.dot(ds, k1, input_precision=DOT_PREC)
            if (D2 > 0) & (c == 0):
                k2 = tl.load(K + rows[:, None] * stride_kt + hk * stride_kh + D1 + offs_d2[None, :],
                             mask=valid[:, None] & (offs_d2 < D2)[None, :], other=0.0)
                dq2 += tl.dot(ds, k2, input_precision=DOT_PREC)
    tl.store(DQ + t * stride_dqt + heads[:, None] * stride_dqh + offs_d1[None, :], dq1 * sm_scale,
             mask=h_ok[:, None] & (offs_d1 < D1)[None, :])
    if (D2 > 0) & (c == 0):
        tl.store(DQ + t * stride_dqt + heads[:, None] * stride_dqh + D1 + offs_d2[None, :], dq2 * sm_scale,
                 mask=h_ok[:, None] & (offs_d2 < D2)[None, :])


@triton.jit
def _sparse_bwd_dkdv_kernel(
    Q, K, V, Idx, DO, Lse, Delta, DK, DV_, n_idx,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_it, stride_dot, stride_doh, stride_lh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, sm_scale, qk_scale_log2,
    GROUP: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_DVC: tl.constexpr, DOT_PREC: tl.constexpr, SHARED_KV: tl.constexpr,
):
    """dK, dV contributions of one (token, head block), added to the selected rows with float32
    atomics (other tokens select the same keys), in value / key chunks of BLOCK_DVC columns.
    SHARED_KV (V is K's first DV columns: the absorbed MLA form): dV is added into dK's columns in
    the same atomic, halving the atomics."""
    t = tl.program_id(0)
    hk, h_ok, heads, lse2, delta = _bwd_program_setup(Lse, Delta, stride_lh, t, tl.program_id(1), GROUP, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_DVC)
    for n0 in range(0, n_idx, BLOCK_N):
        rows, valid, any_valid = _selected_rows(Idx, t, stride_it, n0, n_idx, BLOCK_N)
        if any_valid:
            p, ds = _recompute_ds(Q, K, V, DO, rows, valid, h_ok, heads, hk, t, lse2, delta,
                                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot,
                                  stride_doh, qk_scale_log2, D1 + D2, DV, BLOCK_H, BLOCK_N, BLOCK_DVC, DOT_PREC)
            pt = tl.trans(p.to(Q.dtype.element_ty))
            dst = tl.trans((ds * sm_scale).to(Q.dtype.element_ty))
            if not SHARED_KV:
                for c in tl.static_range(0, DV, BLOCK_DVC):
                    c_ok = (c + offs_c) < DV
                    do = tl.load(DO + t * stride_dot + heads[:, None] * stride_doh + c + offs_c[None, :],
                                 mask=h_ok[:, None] & c_ok[None, :], other=0.0)
                    tl.atomic_add(DV_ + rows[:, None] * stride_dvt + hk * stride_dvh + c + offs_c[None, :],
                                  tl.dot(pt, do, input_precision=DOT_PREC), mask=valid[:, None] & c_ok[None, :])
            for c in tl.static_range(0, D1 + D2, BLOCK_DVC):
                c_ok = (c + offs_c) < D1 + D2
                qc = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + c + offs_c[None, :],
                             mask=h_ok[:, None] & c_ok[None, :], other=0.0)
                acc = tl.dot(dst, qc, input_precision=DOT_PREC)
                if SHARED_KV:
                    if c < DV:  # the launcher makes DV a multiple of BLOCK_DVC
                        do = tl.load(DO + t * stride_dot + heads[:, None] * stride_doh + c + offs_c[None, :],
                                     mask=h_ok[:, None] & c_ok[None, :], other=0.0)
                        acc += tl.dot(pt, do, input_precision=DOT_PREC)
                tl.atomic_add(DK + rows[:, None] * stride_dkt + hk * stride_dkh + c + offs_c[None, :], acc,
                              mask=valid[:, None] & c_ok[None, :])


def _attn_blocks(group: int, dv: int, device, backward: bool) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, BLOCK_DV or the backward's column chunk, warps). BLOCK_H >= 16 (the
    MMA's smallest M), 64 on the GPU for wgmma; the forward splits a wide value head (MLA's 512-wide
    latent) over programs to bound its float32 accumulator; the backward walks value and key
    columns in chunks (AOT-measured on sm_90a: whole 512-wide tiles spill)."""
    block_h = min(64, _p2(group))
    if device.type != "cuda":
        return block_h, 16, (16 if backward else _p2(dv)), 4
    if backward:
        return block_h, 64, 64, 8
    return block_h, 16, min(_p2(dv), 256), 8  # BLOCK_N 32 spills on sm_100a (AOT)


def sparse_forward(q, k, v, indices, softmax_scale: float, out_dtype: torch.dtype):
    """q ``[T, Hq, Dqk]``, k ``[Tk, Hkv, Dqk]``, v ``[Tk, Hkv, Dv]``, indices ``[T, K]`` int32 ->
    out ``[T, Hq, Dv]`` (out_dtype), lse ``[Hq, T]`` float32."""
    q, k, v, indices = (_last_dim_contiguous(t) for t in (q, k, v, indices))
    T, Hq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[2]
    G = Hq // Hkv
    out = torch.empty(T, Hq, Dv, dtype=out_dtype, device=q.device)
    lse = torch.empty(Hq, T, dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    d1, d2 = split_width(D)
    bh, bn, bdv, warps = _attn_blocks(G, Dv, q.device, backward=False)
    grid = (T, Hkv * triton.cdiv(G, bh), triton.cdiv(Dv, bdv))
    _sparse_fwd_kernel[grid](
        q, k, v, indices, out, lse, indices.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), indices.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), softmax_scale * LOG2E,
        GROUP=G, D1=d1, D2=d2, DV=Dv, BLOCK_H=bh, BLOCK_N=bn, BLOCK_D1=_p2(d1), BLOCK_D2=_p2(d2),
        BLOCK_DV=bdv, DOT_PREC=_dot_precision(q.dtype), num_warps=warps,
    )
    return out, lse


def shares_storage(k: torch.Tensor, v: torch.Tensor) -> bool:
    """v is k's first Dv columns (the absorbed MLA form: values are the latent part of the keys)."""
    return (v.data_ptr() == k.data_ptr() and v.stride() == k.stride() and v.shape[:2] == k.shape[:2]
            and v.shape[2] <= k.shape[2])


def sparse_backward(dout, q, k, v, indices, out, lse, dlse, softmax_scale: float, fuse_kv: bool = False):
    """dq ``[T, Hq, Dqk]``, dk ``[Tk, Hkv, Dqk]``, dv ``[Tk, Hkv, Dv]``, all float32. With ``fuse_kv``
    (the caller knows k and v are autograd views of one tensor) and v a column prefix of k
    (:func:`shares_storage`), dv is None and dk holds dK + [dV, 0]: that tensor's gradient."""
    q, k, v, dout, lse, delta = backward_inputs(dout, q, k, v, out, lse, dlse)
    indices = _last_dim_contiguous(indices)
    T, Hq, D = q.shape
    Tk, Hkv, Dv = v.shape
    G = Hq // Hkv
    dq = torch.empty(T, Hq, D, dtype=torch.float32, device=q.device)
    dk = torch.zeros(Tk, Hkv, D, dtype=torch.float32, device=q.device)
    if T == 0:
        return dq, dk, torch.zeros(Tk, Hkv, Dv, dtype=torch.float32, device=q.device)
    d1, d2 = split_width(D)
    bh, bn, bc, warps = _attn_blocks(G, Dv, q.device, backward=True)
    shared = fuse_kv and shares_storage(k, v) and Dv % bc == 0
    dv = dk[..., :0] if shared else torch.zeros(Tk, Hkv, Dv, dtype=torch.float32, device=q.device)
    grid = (T, Hkv * triton.cdiv(G, bh))
    # 512 columns spill on sm_90a (AOT); 16 under the interpreter so its tests cover several blocks
    dq_cols = min(_p2(d1), 256 if q.device.type == "cuda" else 16)
    common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), indices.stride(0),
              dout.stride(0), dout.stride(1), lse.stride(0))
    meta = dict(GROUP=G, D1=d1, D2=d2, DV=Dv, BLOCK_H=bh, BLOCK_N=bn, BLOCK_D2=_p2(d2),
                BLOCK_DVC=bc, DOT_PREC=_dot_precision(q.dtype), num_warps=warps)
    _sparse_bwd_dq_kernel[(*grid, triton.cdiv(d1, dq_cols))](
        q, k, v, indices, dout, lse, delta, dq, indices.shape[1], *common, dq.stride(0), dq.stride(1), softmax_scale,
        softmax_scale * LOG2E, BLOCK_D1=dq_cols, **meta)
    _sparse_bwd_dkdv_kernel[grid](q, k, v, indices, dout, lse, delta, dk, dv, indices.shape[1], *common,
                                  dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), softmax_scale,
                                  softmax_scale * LOG2E, BLOCK_D1=_p2(d1), SHARED_KV=shared, **meta)
    return dq, dk, (None if shared else dv)
