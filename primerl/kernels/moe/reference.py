"""Plain-PyTorch MoE ops: the definition of what every backend computes.

Legend: T tokens, k experts per token, E experts, D model dim, I expert (intermediate) dim,
n = T * k routed slots (slot ``s = t * k + j`` is token t's j-th choice), M rows of the
permuted (expert-sorted, optionally block-padded) activations.

Layout produced by :func:`align`: the slots of expert e occupy rows
``[ends[e] - padded[e], ends[e] - padded[e] + counts[e])`` in increasing slot order (stable, so
the layout is a pure function of ``topk_ids``); the rest of each padded group is padding.

Every kernel below is written op by op in the order its Triton/CUDA twin executes, so the fast
paths can agree bit for bit (float32 accumulation, no fused multiply-add, IEEE division).
"""

from __future__ import annotations

import torch

from .._opaque import tracing
from ..fp8.reference import ROUNDINGS, cast_scaled, scale_from_amax

NORM_EPS = 1e-20


# ----------------------------------------------------------------------------------------- routing
def scores_from_logits(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    logits = logits.float()
    return logits.softmax(dim=-1) if score_func == "softmax" else logits.sigmoid()


def select_experts(
    scores: torch.Tensor, top_k: int, n_groups: int, topk_groups: int, expert_bias: torch.Tensor | None
) -> torch.Tensor:
    """Top-k expert ids [T, k] (int64, best first) of ``scores + expert_bias``, group-limited."""
    choice = scores if expert_bias is None else scores + expert_bias.float()
    if n_groups > 1:
        t, e = choice.shape
        grouped = choice.view(t, n_groups, e // n_groups)
        # DeepSeek-V3: a group is scored by the sum of its two best experts.
        group_scores = grouped.topk(min(2, e // n_groups), dim=-1).values.sum(dim=-1)
        keep = group_scores.topk(topk_groups, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(t, e)
    return choice.topk(top_k, dim=-1).indices


def topk_route(
    logits: torch.Tensor,
    top_k: int,
    score_func: str,
    n_groups: int,
    topk_groups: int,
    expert_bias: torch.Tensor | None,
    route_norm: bool,
    route_scale: float,
    replay_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = scores_from_logits(logits, score_func)
    if replay_ids is None:
        with torch.no_grad():
            ids = select_experts(scores, top_k, n_groups, topk_groups, expert_bias)
    else:
        ids = replay_ids.long()
    # Live and replayed routing share this exact graph, so replaying the live ids is bitwise a no-op.
    weights = scores.gather(1, ids)
    if route_norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPS)
    if route_scale != 1.0:
        weights = weights * route_scale
    return ids.to(torch.int32), weights


# ------------------------------------------------------------------------------ counts and layout
def _counts(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """bincount with a fixed output size (bincount's depends on the data: a host read), int64."""
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    return _counts(topk_ids.reshape(-1).long(), num_experts).to(torch.int32)


def max_padded_rows(n: int, num_experts: int, block: int) -> int:
    return n + num_experts * (block - 1)


def align(topk_ids: torch.Tensor, num_experts: int, block: int):
    """The expert-sorted, block-padded layout of the n = T*k slots.

    Returns ``row_of_slot [n]`` (int32: the row each slot goes to), ``sorted_slots [P]`` (int32:
    the slot in each row, ``n`` for padding; P = n + E*(block-1), the bound, so no host sync),
    ``block_expert [ceil(P/block)]`` (int32: the expert of each block, -1 past the end),
    ``total [1]`` (int32: the padded row count) and ``ends [E]`` (int32: cumulative padded ends).
    """
    flat = topk_ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    counts = _counts(flat, num_experts)
    padded = (counts + block - 1) // block * block
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.sort(flat, stable=True).indices
    sorted_e = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[sorted_e]
    rows = starts[sorted_e] + rank
    row_of_slot = torch.zeros(n, dtype=torch.long, device=dev)
    row_of_slot[order] = rows
    p = max_padded_rows(n, num_experts, block)
    sorted_slots = torch.full((p,), n, dtype=torch.int32, device=dev)
    sorted_slots[row_of_slot] = torch.arange(n, dtype=torch.int32, device=dev)
    nb = -(-p // block)
    block_start = torch.arange(nb, device=dev) * block
    block_expert = torch.searchsorted(ends, block_start, right=True)
    total = ends[-1:] if num_experts > 0 else torch.zeros(1, dtype=torch.long, device=dev)
    block_expert = torch.where(block_start < total, block_expert, -1).to(torch.int32)
    return row_of_slot.to(torch.int32), sorted_slots, block_expert, total.to(torch.int32), ends.to(torch.int32)


# ----------------------------------------------------------------------------------- row movement
# On CPU ``index_select`` along dim 0 copies whole rows and beats both advanced indexing
# (``aten::index``) and ``index_put`` of an expanded source, so rows move by gathers only.
# Chains of elementwise ops run over row chunks of about this many elements, so each chain stays
# in cache instead of streaming whole [M, D] temporaries through memory (same ops per element).
CHUNK_ELEMS = 1 << 18


def chunk_rows(cols: int) -> int:
    return max(1, CHUNK_ELEMS // max(cols, 1))


def slot_of_rows(row_map: torch.Tensor) -> torch.Tensor:
    """The inverse of a full layout (M == n == T*k): row r holds slot ``slot_of_rows(row_map)[r]`` [n] int64."""
    flat = row_map.reshape(-1).long()
    # traced: inductor cannot lower an index_put into a fresh torch.empty in a backward graph
    inv = torch.zeros_like(flat) if tracing(flat) else torch.empty_like(flat)
    inv[flat] = torch.arange(flat.numel(), device=flat.device)
    return inv


def scatter_rows(src: torch.Tensor, row_map: torch.Tensor, scale: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    """out [num_rows, D] (src dtype): ``out[row_map[t, j]] = src[t] (* scale[t, j])``, other rows 0."""
    t, k = row_map.shape
    if num_rows == t * k:  # no padding rows: gather each row's token (same values, no zero-fill)
        slots = slot_of_rows(row_map)
        out = src.index_select(0, torch.div(slots, k, rounding_mode="floor"))
        if scale is None:
            return out
        rows_scale = scale.reshape(-1).index_select(0, slots).unsqueeze(-1)
        return out.float().mul_(rows_scale).to(src.dtype)  # float32: .float() is out itself
    out = torch.zeros(num_rows, src.shape[1], dtype=src.dtype, device=src.device)
    rows = src.unsqueeze(1).expand(t, k, src.shape[1])
    if scale is not None:
        rows = (rows.float() * scale.unsqueeze(-1)).to(src.dtype)
    out[row_map.reshape(-1).long()] = rows.reshape(t * k, src.shape[1])
    return out


def combine_rows(y_perm: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """y [T, D] (y_perm dtype) = sum over j in order 0..k-1 of ``y_perm[row_map[t, j]] (* w[t, j])``
    accumulated in float32 from zero."""
    t, k = row_map.shape
    d = y_perm.shape[1]
    acc = torch.zeros(t, d, dtype=torch.float32, device=y_perm.device)
    idx = row_map.long().t().contiguous()  # [k, T]: column j contiguous for index_select
    if tracing(y_perm, row_map):  # no out= scratch buffers in a graph: the same ops, whole columns at once
        for j in range(k):
            term = y_perm.index_select(0, idx[j]).float()
            acc = acc + (term * weights[:, j : j + 1] if weights is not None else term)
        return acc.to(y_perm.dtype)
    step = chunk_rows(d)
    buf = y_perm.new_empty(min(step, t), d)
    for t0 in range(0, t, step):  # a token chunk's accumulator stays in cache over the k terms
        t1 = min(t0 + step, t)
        part = acc[t0:t1]
        for j in range(k):
            term = torch.index_select(y_perm, 0, idx[j, t0:t1], out=buf[: t1 - t0]).float()
            if weights is not None:
                term.mul_(weights[t0:t1, j : j + 1])  # term is a scratch gather: safe to overwrite
            part.add_(term)
    return acc.to(y_perm.dtype)


def combine_weight_grad(dy: torch.Tensor, y_perm: torch.Tensor, row_map: torch.Tensor) -> torch.Tensor:
    """d topk_weights [T, k] float32 = <dy[t], y_perm[row_map[t, j]]> in float32 (shared by all backends)."""
    t, k = row_map.shape
    gathered = y_perm.index_select(0, row_map.reshape(-1).long()).view(t, k, -1).float()
    return (gathered * dy.float().unsqueeze(1)).sum(dim=-1)


def combine_backward(dy: torch.Tensor, y_perm: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor,
                     need_perm: bool, need_weights: bool):
    """Both gradients of a weighted combine over a full layout (M == T*k), from one gather of dy
    into row order: d y_perm [M, D] = :func:`scatter_rows` (dy, row_map, weights, M) and
    d weights [T, k] = :func:`combine_weight_grad` (dy, y_perm, row_map), the same values (the
    per-row products and row sums are those of the slot-order formulas, only visited by row)."""
    t, k = row_map.shape
    slots = slot_of_rows(row_map)
    tokens = torch.div(slots, k, rounding_mode="floor")
    rows_scale = weights.reshape(-1).index_select(0, slots).unsqueeze(-1) if need_perm else None
    m, d = y_perm.shape
    # traced: the general path (the same products and row sums, without out= into scratch buffers)
    if dy.dtype != torch.float32 or y_perm.dtype != torch.float32 or tracing(dy, y_perm):
        dy_rows = dy.index_select(0, tokens).float()  # [M, D]
        grad_w = None
        if need_weights:
            per_row = (y_perm.float() * dy_rows).sum(dim=-1)  # [M]
            grad_w = per_row.index_select(0, row_map.reshape(-1).long()).view(t, k)
        grad_perm = dy_rows.mul_(rows_scale).to(dy.dtype) if need_perm else None  # dy_rows: fresh
        return grad_perm, grad_w
    # float32: gather, row dots and scaling chunk by chunk, in cache
    dy_rows = dy.new_empty(m, d)
    per_row = dy.new_empty(m) if need_weights else None
    step = chunk_rows(d)
    prod = dy.new_empty(min(step, m), d) if need_weights else None
    for r0 in range(0, m, step):
        r1 = min(r0 + step, m)
        rows = torch.index_select(dy, 0, tokens[r0:r1], out=dy_rows[r0:r1])
        if need_weights:
            torch.sum(torch.mul(y_perm[r0:r1], rows, out=prod[: r1 - r0]), dim=-1, out=per_row[r0:r1])
        if need_perm:
            rows.mul_(rows_scale[r0:r1])
    grad_w = per_row.index_select(0, row_map.reshape(-1).long()).view(t, k) if need_weights else None
    return (dy_rows if need_perm else None), grad_w


# ------------------------------------------------------------------------------------------ SwiGLU
def _sigmoid(g: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """1 / (1 + exp(-g)) in float32 (reciprocal is the IEEE quotient 1/x on CPU and CUDA), into
    ``out`` when given."""
    return torch.neg(g, out=out).exp_().add_(1.0).reciprocal_()


def swiglu_backward_rows(g, u, sig, dh, dg, du) -> None:
    """The float32 SwiGLU backward of a block of rows, in place: g, u, dh [n, I] and
    ``sig = sigmoid(g)`` (overwritten) -> dg, du [n, I] (views into d gu)."""
    torch.mul(g, sig, out=du).mul_(dh)
    torch.mul(dh, u, out=dg).mul_(sig)
    dg.mul_(sig.neg_().add_(1.0).mul_(g).add_(1.0))


def swiglu(gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gu [M, 2I] (gate columns first, then up) -> h [M, I] = silu(gate) * up, float32 math.

    ``out`` (float32 only): a contiguous [M, I] buffer to write h into."""
    i = gu.shape[1] // 2
    if out is not None and (gu.dtype != torch.float32 or out.dtype != torch.float32):
        raise ValueError(f"swiglu: out= needs float32 gu and out, got {gu.dtype} and {out.dtype}")
    if gu.dtype == torch.float32 and out is None and tracing(gu):  # the same ops, no out= buffers
        g, u = gu[:, :i], gu[:, i:]
        return torch.reciprocal(torch.exp(torch.neg(g)) + 1.0) * g * u
    if gu.dtype == torch.float32:  # the whole chain written in place into h, chunk by chunk
        m = gu.shape[0]
        h = gu.new_empty(m, i) if out is None else out
        step = chunk_rows(2 * i)
        for r0 in range(0, m, step):
            g, u = gu[r0 : r0 + step, :i], gu[r0 : r0 + step, i:]
            torch.neg(g, out=h[r0 : r0 + step]).exp_().add_(1.0).reciprocal_().mul_(g).mul_(u)
        return h
    g, u = gu[:, :i].float(), gu[:, i:].float()
    # in place where possible: on CPU fresh large buffers cost more than the arithmetic
    return _sigmoid(g).mul_(g).mul_(u).to(gu.dtype)


def swiglu_backward(gu: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """d gu [M, 2I] (gu dtype) from dh [M, I]:
    d gate = dh * up * sig * (1 + gate * (1 - sig)), d up = dh * gate * sig (sig = sigmoid(gate))."""
    i = gu.shape[1] // 2
    # traced (torch.compile cannot write through the column-sliced out= views) the general path
    # below runs: the same ops in the same order, the same bits
    if gu.dtype == torch.float32 and dh.dtype == torch.float32 and not tracing(gu, dh):
        # both halves written in place, chunk by chunk (same ops, no staging copies)
        m = gu.shape[0]
        out = torch.empty_like(gu)
        step = chunk_rows(3 * i)
        sig_buf = gu.new_empty(min(step, m), i)
        for r0 in range(0, m, step):
            r1 = min(r0 + step, m)
            g, u = gu[r0:r1, :i], gu[r0:r1, i:]
            sig = _sigmoid(g, out=sig_buf[: r1 - r0])
            swiglu_backward_rows(g, u, sig, dh[r0:r1], out[r0:r1, :i], out[r0:r1, i:])
        return out
    g, u, d = gu[:, :i].float(), gu[:, i:].float(), dh.float()
    sig = _sigmoid(g)
    silu = g * sig
    dg = (d * u).mul_(sig)
    dg.mul_(sig.neg_().add_(1.0).mul_(g).add_(1.0))
    if tracing(gu):  # inductor cannot lower slice writes into a fresh torch.empty in a backward graph
        return torch.cat([dg, silu.mul_(d)], dim=1).to(gu.dtype)
    out = torch.empty_like(gu)
    out[:, :i] = dg
    out[:, i:] = silu.mul_(d)
    return out


def swiglu_quant(gu: torch.Tensor, group_size: int, dtype: torch.dtype, ue8m0: bool,
                 rounding: str = "reciprocal"):
    """SwiGLU then per-token-group FP8 quantization of the float32 result (never rounded to bf16).

    gu [M, 2I] -> q [M, I] fp8, sf [M, I // group_size] float32 with ``h ≈ q.float() * sf``.
    Bitwise :func:`primerl.kernels.fp8.quant_per_token_group` of ``silu(g) * u`` in float32: the
    same ``rounding`` ("reciprocal" or "divide") and NaN / inf policy.
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"swiglu_quant: rounding must be one of {ROUNDINGS}, got {rounding!r}")
    i = gu.shape[1] // 2
    g, u = gu[:, :i].float(), gu[:, i:].float()
    h = _sigmoid(g).mul_(g).mul_(u)
    groups = h.reshape(h.shape[0], i // group_size, group_size)
    sf = scale_from_amax(groups.abs().amax(dim=-1), dtype, ue8m0)
    q = cast_scaled(groups, sf.unsqueeze(-1), dtype, rounding)
    return q.reshape(h.shape[0], i), sf


__all__ = [
    "align",
    "combine_backward",
    "combine_rows",
    "combine_weight_grad",
    "expert_counts",
    "max_padded_rows",
    "scatter_rows",
    "select_experts",
    "slot_of_rows",
    "swiglu",
    "swiglu_backward",
    "swiglu_quant",
    "topk_route",
]
