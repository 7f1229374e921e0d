"""Ulysses context parallelism over packed variable-length sequences, alone or inside ring attention (2-D).

Shape legend: t local tokens (a ``ContextShardPlan`` shard, padding included), U the Ulysses
degree, R the ring degree (cp = U x R), H query heads, Hkv key/value heads, D head dim.

The tokens are sharded exactly as for ring attention: one :class:`~primerl.parallel.context.
ContextShardPlan` over the whole cp group (zigzag or contiguous), so positions, padding, labels and
the rest of the model are unchanged. Around attention, an all-to-all over the Ulysses group turns
the sequence-sharded ``[t, H, D]`` of each of the U ranks into head-sharded ``[U*t, H/U, D]``
(every token of the U shards, this rank's H/U heads) and back after; the backward of one
all-to-all is the other. cp rank ``c = r*U + u``: Ulysses inside (consecutive cp ranks), ring
across.

* U = cp (``cp_kind = "ulysses"``): the U shards together are the whole padded batch; they are
  permuted into the padded global order and plain varlen attention runs locally (each sequence
  as one causal piece, its padding as a separate piece so no real query sees it).
* U x R (``"ulysses_ring"``): the U shards of cp ranks ``rU..rU+U-1`` of a plan over U*R ranks
  are, chunk for chunk, the shard of ring rank r of a plan over R ranks on the padded lengths
  (zigzag: chunks ``rU+u`` and ``2UR-1-rU-u`` for u < U are the super-chunks r and 2R-1-r), so
  they are permuted into that ring plan's local order and :func:`ring_attention` runs over the
  ring group with the zigzag balance intact. The ring plan sees the padding as tokens at the end
  of each sequence: with a causal mask no real query sees them (their own outputs are dropped).

Grouped-query attention with Hkv not divisible by U needs U divisible by Hkv: each KV head is
replicated U/Hkv times before the all-to-all (its gradient sums the copies back). MLA's dense
form passes H heads for q, k and v alike. The DeepSeek sparse form (one shared latent KV head,
gathered whole on every rank; the indexer's top-k rows index that gather) all-to-alls the
absorbed queries, all-gathers the top-k rows over the Ulysses group and attends locally
(:meth:`UlyssesAttention.sparse_attention`).

>>> plan = ContextShardPlan(cu_seqlens, cp_group)                  # the same plan as for ring
>>> out_local = ulysses_attention(plan.shard(q), plan.shard(k), plan.shard(v), plan)
>>> out = plan.unshard(out_local)                                  # == attention(q, k, v, cu_seqlens=...)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from primerl.kernels.attention import attention

from .context import ContextShardPlan, _check_qkv, ring_attention

__all__ = ["ulysses_attention", "UlyssesAttention", "seq_to_head", "head_to_seq", "ulysses_groups",
           "replicate_kv_heads"]


def _a2a(x: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_single of ``x [U, ...]`` (chunk j to rank j; chunk i of the result from rank i)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, U):
        ctx.group, ctx.U = group, U
        t, H, D = x.shape
        return _a2a(x.reshape(t, U, H // U, D).transpose(0, 1), group).view(U * t, H // U, D)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad, ctx.group, ctx.U), None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, U):
        ctx.group, ctx.U = group, U
        return _head_to_seq(y, group, U)

    @staticmethod
    def backward(ctx, grad):
        t, H, D = grad.shape
        U = ctx.U
        return _a2a(grad.reshape(t, U, H // U, D).transpose(0, 1), ctx.group).view(U * t, H // U, D), None, None


def _head_to_seq(y, group, U):
    n, h, D = y.shape
    return _a2a(y.reshape(U, n // U, h, D), group).transpose(0, 1).reshape(n // U, U * h, D)


def seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """``[t, H, D]`` sequence shards -> ``[U*t, H/U, D]``: rank u's heads ``[u*H/U, (u+1)*H/U)`` of
    the U ranks' tokens, rank after rank (U = the group's size; H must divide by U). Differentiable."""
    U = dist.get_world_size(group)
    if x.dim() != 3 or x.shape[1] % U:
        raise ValueError(f"seq_to_head: x must be [t, H, D] with H divisible by the group size {U}, "
                         f"got {tuple(x.shape)}")
    return x if U == 1 else _SeqToHead.apply(x, group, U)


def head_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`seq_to_head`: ``[U*t, H/U, D]`` -> ``[t, H, D]``. Differentiable."""
    U = dist.get_world_size(group)
    if y.dim() != 3 or y.shape[0] % U:
        raise ValueError(f"head_to_seq: y must be [U*t, H/U, D] with U = {U}, got {tuple(y.shape)}")
    return y if U == 1 else _HeadToSeq.apply(y, group, U)


def replicate_kv_heads(k: torch.Tensor, U: int, n_heads: int) -> torch.Tensor:
    """``k [t, Hkv, D]`` -> ``[t, max(Hkv, U), D]`` so that its heads split over U ranks like the
    ``n_heads`` query heads (rank u's query heads all map to its KV heads). Hkv % U == 0: unchanged;
    U % Hkv == 0: each KV head repeated U/Hkv times (autograd sums the copies' gradients)."""
    Hkv = k.shape[1]
    if n_heads % U:
        raise ValueError(f"ulysses: {n_heads} query heads do not divide by the Ulysses degree {U}")
    if Hkv % U == 0:
        return k
    if U % Hkv or n_heads % Hkv:
        raise ValueError(f"ulysses: {Hkv} KV heads can neither be split over nor replicated to the Ulysses "
                         f"degree {U} (one must divide the other)")
    return k.repeat_interleave(U // Hkv, dim=1)


def ulysses_groups(cp_group, ulysses: int):
    """``(ulysses_group, ring_group)`` inside the cp group: cp rank ``c = r*U + u`` is in the Ulysses
    group of the ranks with the same r and the ring group of those with the same u. Collective over
    the default group (every rank calls it, each with its own cp group); ``ring_group`` is None
    when ``ulysses`` is the whole cp group."""
    cp_ranks = dist.get_process_group_ranks(cp_group)
    W = len(cp_ranks)
    if ulysses < 1 or W % ulysses:
        raise ValueError(f"ulysses_groups: the Ulysses degree {ulysses} must divide the cp group size {W}")
    if cp_ranks != sorted(cp_ranks):
        raise ValueError(f"ulysses_groups: cp group ranks must be increasing, got {cp_ranks}")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, cp_ranks)
    lines = sorted({tuple(r) for r in everyone})
    R = W // ulysses
    u_sets = [list(line[i * ulysses:(i + 1) * ulysses]) for line in lines for i in range(R)]
    u_group, _ = dist.new_subgroups_by_enumeration(u_sets)
    if R == 1:
        return u_group, None
    r_sets = [list(line[j::ulysses]) for line in lines for j in range(ulysses)]
    r_group, _ = dist.new_subgroups_by_enumeration(r_sets)
    return u_group, r_group


class _Layout:
    """Per plan and group pair: the permutation of the U gathered shards and what attention runs on."""

    def __init__(self, plan: ContextShardPlan, u_group, r_group):
        W, c = plan.world_size, plan.rank
        U = dist.get_world_size(u_group)
        R = 1 if r_group is None else dist.get_world_size(r_group)
        if U * R != W:
            raise ValueError(f"ulysses_attention: Ulysses degree {U} x ring degree {R} != the plan's {W} ranks")
        r, u = divmod(c, U)
        if dist.get_rank(u_group) != u or (r_group is not None and dist.get_rank(r_group) != r):
            raise ValueError(f"ulysses_attention: cp rank {c} must be rank {u} of its Ulysses group and rank {r} of "
                             f"its ring group (cp rank = ring rank x U + Ulysses rank; see ulysses_groups)")
        dev = plan.device
        concat = torch.cat([plan._padded_index[r * U + j].to(dev) for j in range(U)])
        if R == 1:
            self.ring_plan = None
            ordered = torch.arange(concat.numel(), device=dev)
            lens = torch.tensor(plan._lens)
            pieces = torch.stack([lens, plan.padded_lengths - lens], 1).flatten()
            pieces = pieces[pieces > 0]
            self.cu = torch.cat([pieces.new_zeros(1), pieces.cumsum(0)]).int().to(dev)
        else:
            self.ring_plan = ContextShardPlan(plan.padded_cu_seqlens, r_group, layout=plan.layout)
            ordered = self.ring_plan._index[r].to(dev)
            if self.ring_plan.local_num_tokens != concat.numel() or bool((ordered < 0).any()):
                raise AssertionError("ulysses_attention: the ring plan's shard is not the Ulysses group's tokens")
        pos_of = torch.full((int(plan.padded_cu_seqlens[-1]),), -1, dtype=torch.long, device=dev)
        pos_of[concat] = torch.arange(concat.numel(), device=dev)
        self.perm = pos_of[ordered]  # ordered token i = concat token perm[i]
        if bool((self.perm < 0).any()):
            raise AssertionError("ulysses_attention: the Ulysses group's shards do not cover the ring shard")
        self.inv = torch.empty_like(self.perm)
        self.inv[self.perm] = torch.arange(self.perm.numel(), device=dev)
        self.padded = bool((plan.padded_lengths != torch.tensor(plan._lens)).any())
        self.U, self.R = U, R


def _layout(plan: ContextShardPlan, u_group, r_group) -> _Layout:
    cache = plan.__dict__.setdefault("_ulysses_layouts", {})
    key = (id(u_group), id(r_group))
    if key not in cache:
        cache[key] = _Layout(plan, u_group, r_group)
    return cache[key]


def ulysses_attention(q, k, v, plan: ContextShardPlan, *, ulysses_group=None, ring_group=None, causal: bool = True,
                      softmax_scale: float | None = None, backend: str | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole packed batch, heads all-to-all'd over the
    Ulysses group (and K/V around the ring group when given).

    q ``[t, H, D]``, k/v ``[t, Hkv, D]``: this rank's shards (``plan.shard``); returns this rank's
    output shard ``[t, H, D]``, differentiable in q, k, v. ``ulysses_group`` defaults to the plan's
    group (pure Ulysses: U = cp); with ``ring_group`` (see :func:`ulysses_groups`) U x R must equal
    the plan's world size. H must divide by U; Hkv by U, or U by Hkv (KV heads replicated).
    Non-causal 2-D attention needs sequence lengths that divide into the plan's chunks.
    """
    _check_qkv("ulysses_attention", q, k, v, plan)
    if plan.world_size == 1:
        return attention(q, k, v, cu_seqlens=plan.local_cu_seqlens, causal=causal, softmax_scale=softmax_scale,
                         q_positions=plan.positions, k_positions=plan.key_positions_of(plan.rank), backend=backend)
    u_group = plan.group if ulysses_group is None else ulysses_group
    lay = _layout(plan, u_group, ring_group)
    H = q.shape[1]
    k, v = replicate_kv_heads(k, lay.U, H), replicate_kv_heads(v, lay.U, H)
    if not causal and lay.R > 1 and lay.padded:
        raise ValueError("ulysses_attention: non-causal 2-D attention with padded sequences is not supported "
                         "(the ring plan would show the padding keys to real queries)")
    qh, kh, vh = (seq_to_head(x, u_group).index_select(0, lay.perm) for x in (q, k, v))
    if lay.ring_plan is None:
        o = attention(qh, kh, vh, cu_seqlens=lay.cu, causal=causal, softmax_scale=softmax_scale, backend=backend)
    else:
        o = ring_attention(qh, kh, vh, lay.ring_plan, causal=causal, softmax_scale=softmax_scale, backend=backend)
    return head_to_seq(o.index_select(0, lay.inv), u_group)


def _all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Every group rank's rows, rank after rank (integer indices: no gradient)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


class UlyssesAttention:
    """The ``context_attention`` that :func:`primerl.models.parallelize` sets with
    ``cp_kind = "ulysses"`` / ``"ulysses_ring"``: :func:`ulysses_attention` over fixed groups,
    plus the DeepSeek sparse form (:meth:`sparse_attention`)."""

    def __init__(self, ulysses_group, ring_group=None):
        self.ulysses_group, self.ring_group = ulysses_group, ring_group

    def __call__(self, q, k, v, plan, *, causal=True, softmax_scale=None, backend=None):
        return ulysses_attention(q, k, v, plan, ulysses_group=self.ulysses_group, ring_group=self.ring_group,
                                 causal=causal, softmax_scale=softmax_scale, backend=backend)

    def sparse_attention(self, q, kv, v, indices, *, softmax_scale=None, backend=None):
        """DeepSeek sparse attention, head-parallel: q ``[t, H, Dk]`` this rank's queries, kv ``[Tk, 1,
        Dk]`` / v ``[Tk, 1, Dv]`` every rank's latent keys (gathered: replicated), indices ``[t, K]``
        rows of kv. The queries go head-sharded over the Ulysses group, the rows are all-gathered
        (the same for every head), attention runs on this rank's heads of the group's tokens,
        and the output comes back ``[t, H, Dv]``."""
        from primerl.kernels.sparse_attention import sparse_attention

        g = self.ulysses_group
        U = dist.get_world_size(g)
        if q.shape[1] % U:
            raise ValueError(f"ulysses sparse attention: {q.shape[1]} heads do not divide by the Ulysses degree {U}")
        idx = indices if U == 1 else _all_gather_rows(indices, g)
        o = sparse_attention(seq_to_head(q, g), kv, v, idx, softmax_scale=softmax_scale, backend=backend)
        return head_to_seq(o, g)
