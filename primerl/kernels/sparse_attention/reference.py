"""Plain-PyTorch DeepSeek sparse attention (DSA): the spec for every backend.

Legend: T query tokens of a packed batch, Tk key tokens, Hi indexer heads, Di indexer head dim,
Hq query heads, Hkv key/value heads (Hq = G * Hkv), Dqk query/key width, Dv value width, K the
number of selected keys per query (``topk``). ``cu_seqlens`` int32 ``[B+1]`` (flash-attn's varlen
convention).

Indexer (the "lightning indexer")::

    score[t, s] = sum_h weights[t, h] * relu(softmax_scale * q[t, h] . k[s])

over the keys ``s`` of t's own sequence with ``pos(s) <= pos(t)`` (causal); each query keeps the
``topk`` best, the earlier key first among equal scores. Indices are rows of the packed key tensor
(int32); a query with fewer than ``topk`` visible keys keeps all of them and pads with -1. Order:
best first.

Sparse attention: softmax attention of query t over the keys ``indices[t]`` only (``-1`` = none);
the indices already encode the causal mask. A query with no key gets ``out = 0``, ``lse = -inf``.
"""

from __future__ import annotations

import torch


def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """One sequence: q ``[L, Hi, Di]``, k ``[L, Di]``, weights ``[L, Hi]`` -> causal scores ``[L, L]``
    float32 (``-inf`` above the diagonal)."""
    s = torch.einsum("thd,sd->ths", q.float(), k.float()) * softmax_scale
    scores = torch.einsum("th,ths->ts", weights.float(), torch.relu(s))
    L = q.shape[0]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~causal, float("-inf"))


def topk_from_scores(scores: torch.Tensor, topk: int, row_offset: torch.Tensor) -> torch.Tensor:
    """scores ``[M, N]`` (-inf = not visible), row_offset ``[M]`` -> indices ``[M, topk]`` int32: the
    best ``min(topk, N)`` columns plus ``row_offset``, -1 where the score is -inf or past N."""
    k_eff = min(topk, scores.shape[1])
    # A stable sort, not torch.topk: among equal scores (relu makes exact zeros common) the earlier
    # key wins, whatever the row's length or padding, so every layout (packed, context-parallel
    # shards, the engine's cache) selects the same keys.
    vals, cols = torch.sort(scores, dim=1, descending=True, stable=True)
    vals, cols = vals[:, :k_eff], cols[:, :k_eff]
    idx = torch.where(vals == float("-inf"), -1, cols + row_offset[:, None].to(cols.dtype))
    out = torch.full((scores.shape[0], topk), -1, dtype=torch.int32, device=scores.device)
    out[:, :k_eff] = idx.to(torch.int32)
    return out


def indexer_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, cu_seqlens: torch.Tensor, topk: int,
                 softmax_scale: float, cu_seqlens_k: torch.Tensor | None = None, q_pos: torch.Tensor | None = None,
                 k_pos: torch.Tensor | None = None) -> torch.Tensor:
    """q ``[T, Hi, Di]``, k ``[Tk, Di]``, weights ``[T, Hi]`` -> indices ``[T, topk]`` int32 (packed key rows).

    Square form (``cu_seqlens_k`` None): keys are the queries' own tokens, causal by index. Non-square
    form (a context-parallel shard's queries against the gathered keys): sequence b's queries
    ``cu_seqlens[b]:cu_seqlens[b+1]`` see its keys ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` with
    ``0 <= k_pos <= q_pos`` (negative k_pos: padding).

    Scores the whole packed block at once (``[T, Tk]``, keys of other sequences masked to -inf):
    no host read and no data-dependent shape (torch.compile, FakeTensor and meta trace it); the
    selected rows are the per-sequence selection's, as a masked key never outranks a visible one
    and the stable sort keeps the earlier key among equal scores."""
    T, Tk = q.shape[0], k.shape[0]
    s = torch.einsum("thd,sd->ths", q.float(), k.float()) * softmax_scale
    scores = torch.einsum("th,ths->ts", weights.float(), torch.relu(s))
    cu = cu_seqlens.long()
    tq = torch.arange(T, device=q.device)
    sq = torch.searchsorted(cu[1:].contiguous(), tq, right=True).clamp(max=cu.shape[0] - 2)
    if cu_seqlens_k is None:
        tk = torch.arange(Tk, device=q.device)
        vis = (sq[:, None] == sq[None, :]) & (tk[None, :] <= tq[:, None])
    else:
        cuk = cu_seqlens_k.long()
        sk = torch.searchsorted(cuk[1:].contiguous(), torch.arange(Tk, device=q.device), right=True)
        sk = sk.clamp(max=cuk.shape[0] - 2)
        kp, qp = k_pos.long(), q_pos.long()
        vis = (sq[:, None] == sk[None, :]) & (kp[None, :] >= 0) & (kp[None, :] <= qp[:, None])
    scores = scores.masked_fill(~vis, float("-inf"))
    return topk_from_scores(scores, topk, torch.zeros(T, dtype=torch.long, device=q.device))


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
                     compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[T, Hq, Dqk]``, k ``[Tk, Hkv, Dqk]``, v ``[Tk, Hkv, Dv]``, indices ``[T, K]`` -> out
    ``[T, Hq, Dv]`` (q.dtype), lse ``[Hq, T]`` float32. Plain differentiable torch ops: autograd
    gives the gradients of q, k, v (and through lse)."""
    T, Hq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[2]
    G = Hq // Hkv
    valid = indices >= 0  # [T, K]
    rows = indices.clamp(min=0).long()
    kg = k[rows].to(compute_dtype)  # [T, K, Hkv, Dqk]
    vg = v[rows].to(compute_dtype)  # [T, K, Hkv, Dv]
    s = torch.einsum("thgd,tkhd->thgk", q.view(T, Hkv, G, D).to(compute_dtype), kg).float() * softmax_scale
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    # a query with no key: logsumexp over zeros keeps the graph finite, then lse = -inf, p = 0
    seen = valid.any(1)[:, None, None]
    lse_raw = torch.logsumexp(torch.where(seen[..., None], s, 0.0), dim=-1)  # [T, Hkv, G]
    lse = torch.where(seen, lse_raw, float("-inf"))
    p = torch.exp(s - lse_raw[..., None])  # exactly 0 at -inf scores
    out = torch.einsum("thgk,tkhe->thge", p.to(compute_dtype), vg)
    return out.reshape(T, Hq, Dv).to(q.dtype), lse.reshape(T, Hq).transpose(0, 1).contiguous()
