"""Plain-PyTorch attention over packed variable-length sequences: the spec for every backend.

Legend: T (Tk) query (key) tokens of the packed batch, Hq query heads, Hkv key/value heads
(Hq = G * Hkv, GQA), D head dim, B sequences. ``cu_seqlens_q/k`` int32 ``[B+1]``.

Visibility (the one mask rule every backend implements): query i sees key j iff both are in the
same sequence, ``k_pos[j] >= 0`` and, when causal, ``k_pos[j] <= q_pos[i]``. The default
positions are ``k_pos = 0..Lk-1`` and ``q_pos = (Lk - Lq) + 0..Lq-1`` per sequence (bottom-right
aligned causal mask, flash-attn's convention; the usual mask when Lq == Lk).

The math is done in ``compute_dtype`` (float32 by default; the tests also run it at the input
dtype to measure what plain PyTorch loses at that precision). A query that sees no key gets
``out = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

import math

import torch


def sequence_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[total]`` int64: the sequence of each packed token (``searchsorted``: no host read; token
    counts stay symbolic under torch.compile)."""
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    seq = torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True)
    return seq.clamp(max=cu_seqlens.shape[0] - 2)  # only reached by invalid offsets (checked by the caller)


def default_positions(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, T: int | None = None,
                      Tk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q_pos ``[T]`` and k_pos ``[Tk]`` int32: index within sequence, queries aligned bottom-right.
    ``T`` / ``Tk`` default to the offsets' last values (a host read); callers pass the token counts."""
    T = int(cu_seqlens_q[-1]) if T is None else T
    Tk = int(cu_seqlens_k[-1]) if Tk is None else Tk
    cq, ck = cu_seqlens_q.long(), cu_seqlens_k.long()
    sq, sk = sequence_ids(cq, T), sequence_ids(ck, Tk)
    shift = (ck[1:] - ck[:-1]) - (cq[1:] - cq[:-1])  # Lk - Lq per sequence
    q_pos = torch.arange(T, device=cq.device) - cq[sq] + shift[sq]
    k_pos = torch.arange(Tk, device=ck.device) - ck[sk]
    return q_pos.int(), k_pos.int()


def visibility(cu_seqlens_q, cu_seqlens_k, q_pos, k_pos, causal: bool) -> torch.Tensor:
    """``[T, Tk]`` bool: query i sees key j (same sequence, ``k_pos[j] >= 0``, causal ``k_pos[j] <= q_pos[i]``)."""
    T, Tk = q_pos.shape[0], k_pos.shape[0]
    sq, sk = sequence_ids(cu_seqlens_q.long(), T), sequence_ids(cu_seqlens_k.long(), Tk)
    kp, qp = k_pos.long(), q_pos.long()
    vis = (sq[:, None] == sk[None, :]) & (kp >= 0)[None, :]
    if causal:
        vis = vis & (kp[None, :] <= qp[:, None])
    return vis


def attention_dense(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, softmax_scale: float, q_pos, k_pos,
                    compute_dtype: torch.dtype = torch.float32, out_dtype: torch.dtype | None = None):
    """The same attention as :func:`attention_forward` over the whole packed block at once (one
    ``[Hkv, G, T, Tk]`` score tensor masked by :func:`visibility`), in plain differentiable ops:
    no host read and no data-dependent shape, so torch.compile, FakeTensor and meta tensors trace
    it; autograd gives the gradients (through lse too). Costs T x Tk, not sum of L^2: the form for
    the model's packed batches on CPU, not for long sequences."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    vis = visibility(cu_seqlens_q, cu_seqlens_k, q_pos, k_pos, causal)  # [T, Tk]
    s = _scores(q.view(T, Hkv, G, D), k, softmax_scale, vis, compute_dtype).float()  # [Hkv, G, T, Tk]
    seen = vis.any(1)  # [T]: a row that sees no key gets lse -inf, out 0 (and finite gradients)
    lse_raw = torch.logsumexp(torch.where(seen[:, None], s, 0.0), dim=-1)  # [Hkv, G, T]
    p = torch.exp(s - lse_raw[..., None]).to(compute_dtype)  # exactly 0 at -inf scores
    out = torch.einsum("hgmn,nhd->mhgd", p, v.to(compute_dtype))
    lse = torch.where(seen, lse_raw, float("-inf"))
    return out.reshape(T, Hq, D).to(out_dtype or q.dtype), lse.reshape(Hq, T)


def attention_backward_dense(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, causal: bool,
                             softmax_scale: float, q_pos, k_pos, compute_dtype: torch.dtype = torch.float32):
    """:func:`attention_backward` over the whole block at once (no host read; see :func:`attention_dense`)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    vis = visibility(cu_seqlens_q, cu_seqlens_k, q_pos, k_pos, causal)
    delta = (dout.float() * out.float()).sum(-1).transpose(0, 1)  # [Hq, T]
    if dlse is not None:
        delta = delta - dlse.float()
    delta = delta.reshape(Hkv, G, T)
    lse4 = lse.float().reshape(Hkv, G, T)
    lse4 = torch.where(torch.isinf(lse4) & (lse4 < 0), math.inf, lse4)  # no key seen: P = 0
    q4, do4 = q.view(T, Hkv, G, D).to(compute_dtype), dout.view(T, Hkv, G, D).to(compute_dtype)
    k_c, v_c = k.to(compute_dtype), v.to(compute_dtype)
    s = _scores(q4, k_c, softmax_scale, vis, compute_dtype)
    p = torch.exp(s.float() - lse4[..., None]).to(compute_dtype)
    dv = torch.einsum("hgmn,mhgd->nhd", p, do4).float()
    dp = torch.einsum("mhgd,nhd->hgmn", do4, v_c)
    ds = (p * (dp - delta[..., None].to(compute_dtype)) * softmax_scale).to(compute_dtype)
    dq = torch.einsum("hgmn,nhd->mhgd", ds, k_c).float()
    dk = torch.einsum("hgmn,mhgd->nhd", ds, q4).float()
    return dq.reshape(T, Hq, D), dk, dv


def _visible_block(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool):
    """For one sequence: the rows and columns that take part at all, and the mask between them.

    Trimming to them keeps the reference's cost proportional to the visible work (a ring step
    with half its keys in the future costs half), which the CPU ring benchmark relies on.
    """
    cols = (k_pos >= 0).nonzero().squeeze(1)
    if causal and cols.numel():
        cols = cols[k_pos[cols] <= q_pos.max()]
    if cols.numel() == 0:
        return None
    rows = torch.arange(q_pos.numel(), device=q_pos.device)
    if causal:
        rows = (q_pos >= k_pos[cols].min()).nonzero().squeeze(1)
    if rows.numel() == 0:
        return None
    mask = None
    if causal:
        mask = k_pos[cols][None, :] <= q_pos[rows][:, None]
    return rows, cols, mask


def _scores(q_b, k_b, scale, mask, dtype):
    """q_b [m, Hkv, G, D], k_b [n, Hkv, D] -> s [Hkv, G, m, n] in dtype, masked with -inf."""
    s = torch.einsum("mhgd,nhd->hgmn", q_b.to(dtype), k_b.to(dtype)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _segments(cu_seqlens_q, cu_seqlens_k, q_pos, k_pos, causal):
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        qs, qe, ks, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if qe == qs or ke == ks:
            continue
        vis = _visible_block(q_pos[qs:qe].long(), k_pos[ks:ke].long(), causal)
        if vis is None:
            continue
        rows, cols, mask = vis
        yield rows + qs, cols + ks, mask


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    compute_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[T, Hq, D]``, k/v ``[Tk, Hkv, D]`` -> out ``[T, Hq, D]`` (out_dtype, default q.dtype),
    lse ``[Hq, T]`` float32."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    out = torch.zeros(T, Hkv, G, D, dtype=compute_dtype, device=q.device)
    lse = torch.full((Hkv, G, T), float("-inf"), dtype=torch.float32, device=q.device)
    q4 = q.view(T, Hkv, G, D)
    for rows, cols, mask in _segments(cu_seqlens_q, cu_seqlens_k, q_pos, k_pos, causal):
        s = _scores(q4[rows], k[cols], softmax_scale, mask, compute_dtype)  # [Hkv, G, m, n]
        lse_b = torch.logsumexp(s.float(), dim=-1)  # rows here always see >= 1 key
        p = torch.exp(s.float() - lse_b[..., None]).to(compute_dtype)
        out[rows] = torch.einsum("hgmn,nhd->mhgd", p, v[cols].to(compute_dtype))
        lse[:, :, rows] = lse_b
    return out.reshape(T, Hq, D).to(out_dtype or q.dtype), lse.reshape(Hq, T)


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one attention block from the (possibly global, ring-merged) ``out`` and ``lse``.

    dS = P * (dP - delta) with P = exp(S - lse), dP = dout @ V^T and delta = rowsum(dout * out) -
    dlse. With the ring's merged out/lse, summing these block gradients over the key blocks gives
    the gradient of the whole attention. Returns dq ``[T, Hq, D]`` and dk, dv ``[Tk, Hkv, D]``,
    all float32 (callers accumulate them across blocks and cast).
    """
    T, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    G = Hq // Hkv
    delta = (dout.float() * out.float()).sum(-1).transpose(0, 1)  # [Hq, T]
    if dlse is not None:
        delta = delta - dlse.float()
    delta = delta.reshape(Hkv, G, T)
    lse4 = lse.reshape(Hkv, G, T)
    q4, do4 = q.view(T, Hkv, G, D), dout.view(T, Hkv, G, D)
    dq = torch.zeros(T, Hkv, G, D, dtype=torch.float32, device=q.device)
    dk = torch.zeros(Tk, Hkv, D, dtype=torch.float32, device=q.device)
    dv = torch.zeros(Tk, Hkv, D, dtype=torch.float32, device=q.device)
    for rows, cols, mask in _segments(cu_seqlens_q, cu_seqlens_k, q_pos, k_pos, causal):
        s = _scores(q4[rows], k[cols], softmax_scale, mask, compute_dtype)
        lse_b = lse4[:, :, rows]
        # rows whose merged lse is -inf saw no key anywhere: their probabilities are 0
        lse_b = torch.where(torch.isinf(lse_b) & (lse_b < 0), math.inf, lse_b)
        p = torch.exp(s.float() - lse_b[..., None]).to(compute_dtype)
        do_b, k_b, v_b = do4[rows].to(compute_dtype), k[cols].to(compute_dtype), v[cols].to(compute_dtype)
        dv[cols] += torch.einsum("hgmn,mhgd->nhd", p, do_b).float()
        dp = torch.einsum("mhgd,nhd->hgmn", do_b, v_b)
        ds = (p * (dp - delta[:, :, rows][..., None].to(compute_dtype)) * softmax_scale).to(compute_dtype)
        dq[rows] += torch.einsum("hgmn,nhd->mhgd", ds, k_b).float()
        dk[cols] += torch.einsum("hgmn,mhgd->nhd", ds, q4[rows].to(compute_dtype)).float()
    return dq.reshape(T, Hq, D), dk, dv


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets: out ``[T, H, D]`` (out_a.dtype), lse ``[H, T]`` float32.

    lse = max + log(exp(lse_a - max) + exp(lse_b - max)); a block with lse = -inf has weight 0
    exactly (its out is ignored, even if NaN). Differentiable (plain torch ops).
    """
    lse_a, lse_b = lse_a.float(), lse_b.float()
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isinf(m) & (m < 0), 0.0, m)
    sa, sb = torch.exp(lse_a - m_safe), torch.exp(lse_b - m_safe)
    total = sa + sb
    lse = torch.where(total > 0, m_safe + torch.log(total), float("-inf"))
    inv = torch.where(total > 0, 1.0 / total, 0.0)
    wa, wb = (sa * inv).transpose(0, 1)[..., None], (sb * inv).transpose(0, 1)[..., None]
    oa = torch.where(wa > 0, out_a.float(), 0.0)
    ob = torch.where(wb > 0, out_b.float(), 0.0)
    return (wa * oa + wb * ob).to(out_a.dtype), lse
