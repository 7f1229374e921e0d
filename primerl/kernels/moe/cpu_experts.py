"""The routed-expert SwiGLU MLP on CPU in float32, one expert at a time (the torch backend's path).

Same values as the op-by-op composition in :mod:`._functions` (permute -> grouped GEMM ->
SwiGLU -> grouped GEMM -> combine, each an autograd Function), computed expert by expert so
that each expert's rows, its [rows, 2I] / [rows, I] intermediates and their gradients stay in
cache, and so that only what autograd must keep (``gu`` and ``y_perm``) or return is a fresh
full-size tensor. On CPU every fresh [T*k, D] buffer costs page faults (about 10 ms per 32 MB
on the 2-core CI machine), more than the arithmetic of the elementwise ops around the GEMMs.

Differences from the composition:
- the gathered rows ``x[token of row]`` and ``h = swiglu(gu)`` are not saved; the backward
  gathers the rows again and recomputes ``h`` (same ops, so the same bits) per expert;
- the combine's backward (the gather of ``dy`` into row order, its scaling by the routing
  weight and the row dots that give d weights) runs inside the expert loop (same bits);
- d x is accumulated in place, expert after expert (``index_add_`` into a zeroed [T, D]), so a
  token's k row gradients are summed in expert order rather than the composition's k order:
  deterministic, the same float32 accumulation, but not its bits (no [T*k, D] buffer).

Legend: T tokens, k experts per token, E experts, D model dim, I expert dim, M = T*k rows.
"""

from __future__ import annotations

import torch

from ..._kernel_sizes import CPU_EXPERTS_MIN_BYTES
from . import reference as R

MIN_BYTES = CPU_EXPERTS_MIN_BYTES  # below it the op-by-op chain is as fast (primerl/_kernel_sizes.py)


def supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, fp8_recipe) -> bool:
    """Whether the expert-by-expert path applies (CPU, float32 everywhere, no FP8)."""
    return (
        fp8_recipe is None
        and x.device.type == "cpu"
        and x.dtype == w13.dtype == w2.dtype == torch.float32
    )


def worthwhile(rows: int, w13: torch.Tensor) -> bool:
    """Whether ``rows`` routed rows are enough for the expert-by-expert path to pay off."""
    return rows * max(w13.shape[1], w13.shape[2]) * w13.element_size() >= MIN_BYTES


def _group_bounds(ends: list[int]) -> list[tuple[int, int, int]]:
    """(expert, start row, end row) of every expert, empty groups included."""
    bounds, start = [], 0
    for e, end in enumerate(ends):
        bounds.append((e, start, end))
        start = end
    return bounds


class _Scratch:
    """Per-call buffers sized for the largest expert group (reused by every expert)."""

    def __init__(self, like: torch.Tensor, rows: int, widths: dict[str, int]):
        self.bufs = {name: like.new_empty(max(rows, 1), w) for name, w in widths.items()}

    def __call__(self, name: str, rows: int) -> torch.Tensor:
        return self.bufs[name][:rows]


class ExpertsByExpert(torch.autograd.Function):
    """x [T, D] (``slots`` [M] given: row r of the expert layout is slot ``slots[r]``, token
    ``slots[r] // k``) or x_perm [M, D] (``slots`` None: rows already grouped by expert), w13 [E, 2I, D],
    w2 [E, D, I], ``ends`` (Python list, cumulative row ends per expert, ends[-1] == M).

    With ``row_map`` [T, k] and ``weights`` [T, k] float32: returns y [T, D] =
    sum over j (in order 0..k-1) of weights[t, j] * y_perm[row_map[t, j]], the combine of
    :func:`.reference.combine_rows`; without: returns y_perm [M, D] (unweighted).
    """

    @staticmethod
    def forward(ctx, x, w13, w2, weights, slots, row_map, ends: list[int]):
        m, i = ends[-1], w2.shape[2]
        tokens = None if slots is None else torch.div(slots, row_map.shape[1], rounding_mode="floor")
        bounds = _group_bounds(ends)
        rows_max = max((b - a for _, a, b in bounds), default=0)
        scratch = _Scratch(x, rows_max, {"x": x.shape[1], "h": i})
        gu = x.new_empty(m, 2 * i)
        y_perm = x.new_empty(m, w2.shape[1])
        for e, s, t in bounds:
            if t == s:
                continue
            xs = x[s:t] if tokens is None else torch.index_select(x, 0, tokens[s:t], out=scratch("x", t - s))
            torch.mm(xs, w13[e].t(), out=gu[s:t])
            h = R.swiglu(gu[s:t], out=scratch("h", t - s))
            torch.mm(h, w2[e].t(), out=y_perm[s:t])
        ctx.save_for_backward(x, w13, w2, weights, slots, tokens, row_map, gu, y_perm)
        ctx.bounds, ctx.rows_max = bounds, rows_max
        if row_map is None:
            return y_perm
        return R.combine_rows(y_perm, row_map, weights)

    @staticmethod
    def backward(ctx, dy):
        x, w13, w2, weights, slots, tokens, row_map, gu, y_perm = ctx.saved_tensors
        need_x, need_w13, need_w2, need_weights = ctx.needs_input_grad[:4]
        dy = dy.contiguous()
        m, d, i = gu.shape[0], x.shape[1], w2.shape[2]
        routed = row_map is not None
        need_mlp = need_x or need_w13 or need_w2
        scratch = _Scratch(x, ctx.rows_max, {"x": d, "dy": d, "prod": d, "h": i, "dh": i, "sig": i, "dgu": 2 * i})
        dx = None  # [T, D] accumulated expert by expert (routed) or [M, D] row by row (grouped)
        if need_x:
            dx = x.new_zeros(x.shape) if routed else x.new_empty(m, d)
        dw13 = torch.empty_like(w13) if need_w13 else None
        dw2 = torch.empty_like(w2) if need_w2 else None
        per_row = x.new_empty(m) if need_weights else None
        if routed:
            rows_scale = weights.reshape(-1).index_select(0, slots).unsqueeze(-1)  # [M, 1]
        for e, s, t in ctx.bounds:
            n = t - s
            if n == 0:
                for grad in (dw13, dw2):
                    if grad is not None:
                        grad[e].zero_()
                continue
            if routed:
                dys = torch.index_select(dy, 0, tokens[s:t], out=scratch("dy", n))
                if need_weights:
                    torch.sum(torch.mul(y_perm[s:t], dys, out=scratch("prod", n)), dim=-1, out=per_row[s:t])
                dys.mul_(rows_scale[s:t])
            else:
                dys = dy[s:t]
            if not need_mlp:
                continue
            dh = torch.mm(dys, w2[e], out=scratch("dh", n))
            g, u = gu[s:t, :i], gu[s:t, i:]
            sig = R._sigmoid(g, out=scratch("sig", n))
            if need_w2:
                h = torch.mul(sig, g, out=scratch("h", n)).mul_(u)  # swiglu's ops: the forward's bits
                torch.mm(dys.t(), h, out=dw2[e])
            if need_x or need_w13:
                dgu = scratch("dgu", n)
                R.swiglu_backward_rows(g, u, sig, dh, dgu[:, :i], dgu[:, i:])
                if need_x and routed:
                    dx.index_add_(0, tokens[s:t], torch.mm(dgu, w13[e], out=scratch("x", n)))
                elif need_x:
                    torch.mm(dgu, w13[e], out=dx[s:t])
                if need_w13:
                    xs = x[s:t] if tokens is None else torch.index_select(x, 0, tokens[s:t], out=scratch("x", n))
                    torch.mm(dgu.t(), xs, out=dw13[e])
        dweights = None
        if need_weights:
            dweights = per_row.index_select(0, row_map.reshape(-1).long()).view(row_map.shape)
        return dx, dw13, dw2, dweights, None, None, None


def routed_experts(x, w13, w2, topk_weights, row_map, ends: torch.Tensor) -> torch.Tensor:
    """x [T, D] -> y [T, D]: the fused_experts of :mod:`._functions` with ``row_map`` [T, k]
    from :func:`.reference.align` (block 1) and its ``ends`` [E]."""
    return ExpertsByExpert.apply(x, w13, w2, topk_weights, R.slot_of_rows(row_map), row_map, ends.tolist())


def grouped_experts(x_perm, w13, w2, ends: list[int]) -> torch.Tensor:
    """x_perm [M, D] grouped by expert (cumulative ``ends`` [E], ends[-1] == M) -> y_perm [M, D]."""
    return ExpertsByExpert.apply(x_perm, w13, w2, None, None, None, ends)
