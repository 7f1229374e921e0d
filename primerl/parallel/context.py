"""Context parallelism over packed variable-length sequences: ring attention and its sharding plan.

A packed batch (B sequences back to back, global ``cu_seqlens`` ``[B+1]``) is split across the
W ranks of a process group *per sequence*, so every rank holds a piece of every sequence:

* ``layout="zigzag"`` (load-balanced for causal attention): each sequence is cut into 2W equal
  chunks and rank r keeps chunks r and 2W-1-r (an early and a late chunk);
* ``layout="contiguous"``: W chunks, rank r keeps chunk r.

A sequence whose length does not divide by the chunk count is padded at its end inside the plan
(shard fills zeros there, unshard drops it, attention masks padded keys). Every rank holds the
same number of tokens per sequence, so the local ``cu_seqlens`` is the same on every rank.

Ring attention keeps the queries still and passes K/V around the ring (rank r sends to r+1):
at step i rank r holds the K/V of rank r-i, computes that block (``primerl.kernels.attention.
attention_forward``) and merges it into a float32 output with ``merge_attn_states_``. Each step is
one call with the kernels' default mask over pseudo-sequences cut from the layout
(:meth:`ContextShardPlan.ring_block`: a causal square on the rank's own keys, a full block against
earlier chunks), so ``backend=None`` runs torch's cuDNN / Flash Attention kernels per step rather
than the positions-masked Triton kernel. The backward passes K/V around again with a second ring that carries the
dK/dV accumulators back to their owners, while dQ accumulates locally in float32.

>>> plan = ContextShardPlan(cu_seqlens, group, layout="zigzag")          # same on every rank
>>> out_local = ring_attention(plan.shard(q), plan.shard(k), plan.shard(v), plan)
>>> out = plan.unshard(out_local)                                        # == attention(q, k, v, cu_seqlens=...)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from primerl.kernels.attention import attention, attention_backward, attention_forward, merge_attn_states_

__all__ = ["ContextShardPlan", "ring_attention", "allgather_attention", "gather_shards", "padded_key_positions"]

LAYOUTS = ("zigzag", "contiguous")


class ContextShardPlan:
    """How one packed batch is split over a process group (build once per batch, on every rank).

    Args:
        cu_seqlens: int ``[B+1]`` global sequence offsets, the same on every rank.
        group: the context-parallel process group (None: the default group, or a single process
            when torch.distributed is not initialized).
        layout: ``"zigzag"`` or ``"contiguous"``.
        world_size, rank: plan offline for a given group shape without a process group (for
            analysis and tests); only valid when ``group`` is None. ``unshard`` then needs W = 1.

    Attributes: ``world_size``, ``rank``, ``total_tokens`` (T), ``local_num_tokens`` (t, padding
    included), ``local_cu_seqlens`` (int32 ``[B+1]``, same on every rank), ``positions`` (int32
    ``[t]``, each local token's position in its sequence), ``padding_mask`` (bool ``[t]``, True at
    padding tokens), ``padded_lengths`` (per sequence).
    """

    def __init__(self, cu_seqlens: torch.Tensor, group=None, *, layout: str = "zigzag",
                 world_size: int | None = None, rank: int | None = None):
        if layout not in LAYOUTS:
            raise ValueError(f"ContextShardPlan: layout must be one of {LAYOUTS}, got {layout!r}")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
                or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"ContextShardPlan: cu_seqlens must be an int32/int64 1-D tensor [B+1], got "
                             f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens))} "
                             f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"ContextShardPlan: cu_seqlens must start at 0 and be non-decreasing, got {cu[:8]}")
        if world_size is not None or rank is not None:
            if group is not None:
                raise ValueError("ContextShardPlan: pass either group or world_size/rank, not both")
            if world_size is None or rank is None or not 0 <= rank < world_size:
                raise ValueError(f"ContextShardPlan: need 0 <= rank < world_size, "
                                 f"got rank={rank} world_size={world_size}")
            self.world_size, self.rank = int(world_size), int(rank)
        elif dist.is_available() and dist.is_initialized():
            self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        else:
            if group is not None:
                raise ValueError("ContextShardPlan: a group was given but torch.distributed is not initialized")
            self.world_size, self.rank = 1, 0
        self.group, self.layout = group, layout
        self.device = cu_seqlens.device
        W = self.world_size
        n_chunks = 1 if W == 1 else (2 * W if layout == "zigzag" else W)
        self._owned = [[0]] if W == 1 else [
            ([r, 2 * W - 1 - r] if layout == "zigzag" else [r]) for r in range(W)
        ]
        lens = torch.tensor([b - a for a, b in zip(cu, cu[1:])], dtype=torch.long)
        self.cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=self.device)
        self.total_tokens = cu[-1]
        self.chunk_lengths = (lens + n_chunks - 1) // n_chunks  # per sequence
        self.padded_lengths = self.chunk_lengths * n_chunks
        local_lens = self.chunk_lengths * len(self._owned[0])
        local_cu = torch.cat([torch.zeros(1, dtype=torch.long), local_lens.cumsum(0)])
        self.local_cu_seqlens = local_cu.int().to(self.device)
        self.local_num_tokens = int(local_lens.sum())
        padded_cu = torch.cat([torch.zeros(1, dtype=torch.long), self.padded_lengths.cumsum(0)])
        self.padded_cu_seqlens = padded_cu.int().to(self.device)
        # per rank: global token index (-1 at padding), position in sequence, padded-global index
        self._index, self._positions, self._padded_index = [], [], []
        seq = torch.repeat_interleave(torch.arange(len(lens)), local_lens, output_size=self.local_num_tokens)
        within_seq = torch.arange(self.local_num_tokens) - self.local_cu_seqlens.cpu().long()[:-1][seq]
        chunk = self.chunk_lengths[seq]
        slot = within_seq // chunk.clamp_min(1)
        for r in range(W):
            owned = torch.tensor(self._owned[r], dtype=torch.long)
            pos = owned[slot] * chunk + within_seq % chunk.clamp_min(1)
            valid = pos < lens[seq]
            start = torch.tensor(cu[:-1], dtype=torch.long)[seq]
            self._index.append(torch.where(valid, start + pos, -1).to(self.device))
            self._positions.append(pos.int().to(self.device))
            self._padded_index.append((padded_cu[:-1][seq] + pos).to(self.device))
        self.positions = self._positions[self.rank]
        self.padding_mask = self._index[self.rank] < 0
        self._lens = lens.tolist()
        self._ring_blocks: dict[tuple[int, bool], object] = {}

    # -- per-token tensors ------------------------------------------------------------------
    def positions_of(self, rank: int) -> torch.Tensor:
        """Positions within their sequences of ``rank``'s local tokens (int32 ``[t]``)."""
        return self._positions[rank]

    def key_positions_of(self, rank: int) -> torch.Tensor:
        """As :meth:`positions_of` with padding tokens at -1 (the attention kernels' key mask)."""
        return torch.where(self._index[rank] < 0, -1, self._positions[rank])

    def _check_tokens(self, op, x, dim, expected):
        if not isinstance(x, torch.Tensor) or not -x.dim() <= dim < x.dim() or x.shape[dim] != expected:
            raise ValueError(f"ContextShardPlan.{op}: expected {expected} tokens along dim {dim}, got shape "
                             f"{tuple(getattr(x, 'shape', ()))}")

    def shard(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's part ``[..., t, ...]`` of a per-token tensor ``[..., T, ...]`` (the same on
        every rank); zeros at padding. Backward all-gathers the gradient, so ``x.grad`` is the
        full gradient on every rank (the input is treated as replicated)."""
        self._check_tokens("shard", x, dim, self.total_tokens)
        return _Shard.apply(x.movedim(dim, 0), self).movedim(0, dim)

    def unshard(self, x_local: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The full ``[..., T, ...]`` tensor from every rank's part (padding dropped), the same on
        every rank. Backward keeps this rank's part of the gradient (the output is replicated)."""
        self._check_tokens("unshard", x_local, dim, self.local_num_tokens)
        if self.world_size > 1 and not dist.is_initialized():
            raise ValueError("ContextShardPlan.unshard: an offline plan (world_size > 1, no process group) "
                             "cannot gather")
        return _Unshard.apply(x_local.movedim(dim, 0), self).movedim(0, dim)

    # -- helpers used by the ops below --------------------------------------------------------
    def _select(self, x_full: torch.Tensor, rank: int) -> torch.Tensor:
        idx = self._index[rank].to(x_full.device)
        out = x_full.new_zeros((idx.numel(),) + tuple(x_full.shape[1:]))
        valid = idx >= 0
        out[valid] = x_full[idx[valid]]
        return out

    def _gather(self, x_local: torch.Tensor) -> list[torch.Tensor]:
        if self.world_size == 1:
            return [x_local]
        parts = [torch.empty_like(x_local) for _ in range(self.world_size)]
        dist.all_gather(parts, x_local.contiguous(), group=self.group)
        return parts

    def _assemble(self, x_local: torch.Tensor) -> torch.Tensor:
        parts = self._gather(x_local)
        full = x_local.new_zeros((self.total_tokens,) + tuple(x_local.shape[1:]))
        for r, part in enumerate(parts):
            idx = self._index[r].to(x_local.device)
            full[idx[idx >= 0]] = part[idx >= 0]
        return full

    def _global_rank(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def visible(self, src: int, causal: bool) -> bool:
        """Whether this rank's queries see any key of rank ``src`` (zigzag: always)."""
        return not (causal and self.layout == "contiguous" and src > self.rank)

    def ring_block(self, src: int, causal: bool):
        """This rank's queries against rank ``src``'s keys as one attention call with the default
        mask: ``(cu_seqlens_q, cu_seqlens_k, causal)`` over pseudo-sequences, or None when no
        query sees any key of ``src``, or ``"positions"`` when the visible pairs of some sequence
        are not one block (then the step needs explicit positions; no layout here produces that).

        Per sequence, the chunks this rank and ``src`` own give the visible pairs: every pair when
        not causal, chunk index q > k when causal (a full block), the rank's own chunks causal
        against themselves (a causal square over the valid tokens: the local order is position
        order). The visible rows and keys form one rectangle; the local tokens are cut into
        pieces ``(queries, keys)`` in order - the rectangle, queries before/after it with no keys,
        keys before/after it (and padding keys) with no queries - so the kernels' default mask
        (bottom-right causal, or none) on the packed pieces is exactly the positions rule for
        every valid query. Padding queries may see fewer keys than the positions rule gives them;
        their outputs are dropped by ``unshard`` and their gradients are zero, so nothing changes.
        Cached per (src, causal): the same cu_seqlens tensors every layer (no host sync)."""
        key = (src, bool(causal))
        if key not in self._ring_blocks:
            self._ring_blocks[key] = self._make_ring_block(src, bool(causal))
        return self._ring_blocks[key]

    def _make_ring_block(self, src: int, causal: bool):
        own_q, own_k = self._owned[self.rank], self._owned[src]
        self_causal = causal and src == self.rank
        pieces, any_visible = [], False
        for length, c in zip(self._lens, self.chunk_lengths.tolist()):
            t = c * len(own_q)
            valid = [max(0, min(c, length - ch * c)) for ch in own_k]  # valid keys per owned chunk (a prefix)
            if self_causal:
                v = sum(valid)
                pieces += [(v, v), (t - v, 0), (0, t - v)]
                any_visible |= v > 0
                continue
            vis = [[(not causal or qc > kc) and valid[j] > 0 for j, kc in enumerate(own_k)] for qc in own_q]
            rows = [i for i in range(len(own_q)) if any(vis[i])]
            cols = [j for j in range(len(own_k)) if any(vis[i][j] for i in range(len(own_q)))]
            if not rows:
                pieces += [(t, 0), (0, t)]
                continue
            rect = all(vis[i][j] for i in rows for j in cols)
            if not rect or rows != list(range(rows[0], rows[-1] + 1)) or cols != list(range(cols[0], cols[-1] + 1)):
                return "positions"
            qa, qb = rows[0] * c, (rows[-1] + 1) * c
            ka, kb = cols[0] * c, cols[-1] * c + valid[cols[-1]]
            pieces += [(qa, 0), (0, ka), (qb - qa, kb - ka), (t - qb, 0), (0, t - kb)]
            any_visible = True
        if not any_visible:
            return None
        pieces = [p for p in pieces if p != (0, 0)]
        cu_q = torch.tensor([0] + [p[0] for p in pieces], dtype=torch.int64).cumsum(0).int().to(self.device)
        cu_k = torch.tensor([0] + [p[1] for p in pieces], dtype=torch.int64).cumsum(0).int().to(self.device)
        return cu_q, cu_k, self_causal

    def attention_pairs(self, rank: int, causal: bool = True) -> int:
        """Visible (query, key) pairs of ``rank``'s queries: its share of the attention FLOPs."""
        valid = self._index[rank] >= 0
        if not causal:
            lens = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long().cpu()
            local_lens = (self.local_cu_seqlens[1:] - self.local_cu_seqlens[:-1]).long().cpu()
            seq = torch.repeat_interleave(torch.arange(lens.numel()), local_lens)
            return int(lens[seq][valid.cpu()].sum())
        return int((self._positions[rank].long() + 1)[valid].sum())


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan):
        ctx.plan = plan
        return plan._select(x, plan.rank)

    @staticmethod
    def backward(ctx, grad):
        return ctx.plan._assemble(grad.contiguous()), None


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, plan):
        ctx.plan = plan
        return plan._assemble(x_local)

    @staticmethod
    def backward(ctx, grad):
        return ctx.plan._select(grad, ctx.plan.rank), None


def _check_qkv(op, q, k, v, plan):
    if not isinstance(plan, ContextShardPlan):
        raise ValueError(f"{op}: plan must be a ContextShardPlan, got {type(plan).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[0] != plan.local_num_tokens:
            raise ValueError(f"{op}: {name} must be this rank's shard [{plan.local_num_tokens}, heads, head_dim] "
                             f"(from plan.shard), got {tuple(getattr(t, 'shape', ()))}")
    if k.shape != v.shape:
        raise ValueError(f"{op}: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.device != plan.device:
        raise ValueError(f"{op}: q is on {q.device} but the plan on {plan.device}; build the plan from "
                         f"cu_seqlens on the attention's device")


def _local_attention(q, k, v, plan, causal, softmax_scale, backend):
    return attention(q, k, v, cu_seqlens=plan.local_cu_seqlens, causal=causal, softmax_scale=softmax_scale,
                     q_positions=plan.positions, k_positions=plan.key_positions_of(plan.rank), backend=backend)


def ring_attention(q, k, v, plan: ContextShardPlan, *, causal: bool = True, softmax_scale: float | None = None,
                   backend: str | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole packed batch, K/V passed around a ring.

    q ``[t, Hq, D]``, k/v ``[t, Hkv, D]``: this rank's shards (``plan.shard``). Returns this
    rank's output shard ``[t, Hq, D]``; differentiable in q, k, v (dk/dv include every rank's
    queries). W = 1 runs the local kernel. ``backend`` goes to the attention kernels.
    """
    _check_qkv("ring_attention", q, k, v, plan)
    if plan.world_size == 1:
        return _local_attention(q, k, v, plan, causal, softmax_scale, backend)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q, k, v, plan, bool(causal), float(scale), backend)


def _ring_exchange(plan: ContextShardPlan, send: torch.Tensor, recv: torch.Tensor, tag: int):
    """Post send to rank+1 and receive from rank-1 (non-blocking); returns the requests."""
    nxt = plan._global_rank((plan.rank + 1) % plan.world_size)
    prv = plan._global_rank((plan.rank - 1) % plan.world_size)
    ops = [dist.P2POp(dist.isend, send, nxt, plan.group, tag), dist.P2POp(dist.irecv, recv, prv, plan.group, tag)]
    return dist.batch_isend_irecv(ops)


def _wait(reqs):
    for req in reqs:
        req.wait()


_KV_TAG, _KV_BWD_TAG, _DKV_TAG = 11, 12, 13


def _step_kwargs(plan: ContextShardPlan, src: int, kw: dict) -> dict | None:
    """The attention arguments of the ring step against rank ``src``'s keys (None: nothing visible):
    the pseudo-sequences of :meth:`ContextShardPlan.ring_block` with the default mask, which every
    backend runs (the torch fast paths included), or the global positions as the mask."""
    block = plan.ring_block(src, kw["causal"])
    if block is None:
        return None
    if block == "positions":
        return dict(kw, cu_seqlens=plan.local_cu_seqlens, q_positions=plan.positions,
                    k_positions=plan.key_positions_of(src))
    cu_q, cu_k, causal = block
    return dict(kw, cu_seqlens=cu_q, cu_seqlens_k=cu_k, causal=causal)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, causal, scale, backend):
        W, rank = plan.world_size, plan.rank
        merge_backend = backend if backend in ("torch", "triton") else None
        kw = dict(causal=causal, softmax_scale=scale, backend=backend)
        kv = torch.stack([k, v]).contiguous()
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(W):
            src = (rank - step) % W
            if step < W - 1:
                kv_next = torch.empty_like(kv)
                reqs = _ring_exchange(plan, kv, kv_next, _KV_TAG)  # overlaps the block below
            step_kw = _step_kwargs(plan, src, kw)
            if step_kw is not None:
                o_b, l_b = attention_forward(q, kv[0], kv[1], out_dtype=torch.float32, **step_kw)
                merge_attn_states_(out, lse, o_b, l_b, backend=merge_backend)
            if step < W - 1:
                _wait(reqs)
                kv = kv_next
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.kw = plan, kw
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan, kw = ctx.plan, ctx.kw
        W, rank = plan.world_size, plan.rank
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        zeros_dkv = None
        dkv_in = dkv_reqs = None  # the dK/dV accumulator in flight (set at step 0, read from step 1)
        for step in range(W):
            src = (rank - step) % W
            if step < W - 1:
                kv_next = torch.empty_like(kv)
                kv_reqs = _ring_exchange(plan, kv, kv_next, _KV_BWD_TAG)
            step_kw = _step_kwargs(plan, src, kw)
            if step_kw is not None:
                dq_b, dk_b, dv_b = attention_backward(dout, q, kv[0], kv[1], out, lse, **step_kw)
                dq += dq_b
                block = torch.stack([dk_b, dv_b])
            else:
                if zeros_dkv is None:
                    zeros_dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
                block = zeros_dkv
            # the dK/dV accumulator of rank src arrives from rank-1 (it holds the contributions of
            # the ranks before us), takes ours, and moves on; after W hops it is back at src.
            if step == 0:
                dkv = block.clone() if block is zeros_dkv else block
            else:
                _wait(dkv_reqs)
                dkv = dkv_in + block
            dkv_in = torch.empty_like(dkv)
            dkv_reqs = _ring_exchange(plan, dkv, dkv_in, _DKV_TAG)
            if step < W - 1:
                _wait(kv_reqs)
                kv = kv_next
        _wait(dkv_reqs)
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None, None, None


class _AllGatherPadded(torch.autograd.Function):
    """Every rank's shard -> ``[sum(padded_lengths), ...]`` in padded global order (all ranks).
    Backward sums the gradient over ranks and keeps this rank's tokens."""

    @staticmethod
    def forward(ctx, x_local, plan):
        ctx.plan = plan
        parts = plan._gather(x_local)
        full = x_local.new_zeros((int(plan.padded_cu_seqlens[-1]),) + tuple(x_local.shape[1:]))
        for r, part in enumerate(parts):
            full[plan._padded_index[r].to(full.device)] = part
        return full

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        grad = grad.contiguous()
        if plan.world_size > 1:
            dist.all_reduce(grad, group=plan.group)
        return grad[plan._padded_index[plan.rank].to(grad.device)], None


def gather_shards(x_local: torch.Tensor, plan: ContextShardPlan) -> torch.Tensor:
    """Every rank's shard ``[t, ...]`` -> ``[sum(plan.padded_lengths), ...]`` in padded global order, the
    same on every rank (sequence b's tokens at ``plan.padded_cu_seqlens[b]:...``, zeros at padding).
    Differentiable: the backward sums the gradient over ranks and keeps this rank's rows. Used for
    keys that any rank's queries may select (DeepSeek sparse attention's latent KV)."""
    return _AllGatherPadded.apply(x_local, plan)


def padded_key_positions(plan: ContextShardPlan) -> torch.Tensor:
    """int32 ``[sum(padded_lengths)]``: each gathered token's position in its sequence, -1 at padding."""
    lens = plan.padded_lengths.to(plan.device)
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=plan.device), lens)
    k_pos = torch.arange(seq.numel(), device=plan.device) - plan.padded_cu_seqlens.long()[:-1][seq]
    true_lens = (plan.cu_seqlens[1:] - plan.cu_seqlens[:-1]).long()
    return torch.where(k_pos < true_lens[seq], k_pos, -1).int()


def allgather_attention(q, k, v, plan: ContextShardPlan, *, causal: bool = True, softmax_scale: float | None = None,
                        backend: str | None = None) -> torch.Tensor:
    """Same contract as :func:`ring_attention`, but gathers the whole K/V once (Llama 3's
    context parallelism) and runs one local attention of this rank's queries against it."""
    _check_qkv("allgather_attention", q, k, v, plan)
    if plan.world_size == 1:
        return _local_attention(q, k, v, plan, causal, softmax_scale, backend)
    k_full = _AllGatherPadded.apply(k, plan)
    v_full = _AllGatherPadded.apply(v, plan)
    lens = plan.padded_lengths.to(plan.device)
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=plan.device), lens)
    k_pos = torch.arange(seq.numel(), device=plan.device) - plan.padded_cu_seqlens.long()[:-1][seq]
    true_lens = (plan.cu_seqlens[1:] - plan.cu_seqlens[:-1]).long()
    k_pos = torch.where(k_pos < true_lens[seq], k_pos, -1).int()
    return attention(q, k_full, v_full, cu_seqlens=plan.local_cu_seqlens, cu_seqlens_k=plan.padded_cu_seqlens,
                     causal=causal, softmax_scale=softmax_scale, q_positions=plan.positions, k_positions=k_pos,
                     backend=backend)
