"""Packing rollouts into fixed-size micro-batches, balanced across data-parallel ranks.

A :class:`Sample` is one rollout as training tokens (the orchestrator builds it); :func:`pack`
places samples into bins of ``seq_len`` tokens by first-fit-decreasing, spreads the bins over
``num_ranks`` so that each rank's estimated cost (linear + quadratic in every sequence's length:
MLP/projection work plus causal attention) is about equal, and gives every rank the same number of
micro-batches by adding padding micro-batches (``is_padding=True``, no loss tokens) so that
collectives inside forward/backward stay in step. Nothing is dropped: a sample longer than
``seq_len`` raises unless ``truncate=True``.

Token alignment (every per-token field): entry t refers to token ``input_ids[t]`` — its advantage,
whether it is trained, and the sampler's log-probability of it given the tokens before it. The
first token of a sequence has no log-probability and must not be in the loss mask. To score entry
t a trainer uses the hidden state at t - 1 of the same sequence.

>>> import torch
>>> from primerl.rl.packing import Sample, pack
>>> s = Sample(input_ids=torch.tensor([1, 5, 6, 7]), loss_mask=torch.tensor([False, False, True, True]),
...            advantages=0.5, inference_logprobs=torch.tensor([0.0, 0.0, -0.3, -1.2]), temperature=1.0)
>>> per_rank = pack([s, s, s], seq_len=8, num_ranks=2)   # 2 ranks x 1 micro-batch of 8 tokens
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, fields, replace
from typing import Sequence

import torch

__all__ = ["Sample", "MicroBatch", "pack", "packing_stats", "sequence_cost"]


@dataclass
class Sample:
    """One rollout as training tokens.

    input_ids: [L] int — prompt then completion (and, for multi-turn rollouts, tool outputs).
    loss_mask: [L] bool — True on the tokens the policy loss trains (sampled completion tokens).
    advantages: [L] float tensor, or one float broadcast over the sample.
    inference_logprobs: [L] float — the sampler's log-prob of each token (anything, e.g. 0, where
        loss_mask is False).
    temperature: the sampling temperature (None: not recorded; MicroBatch.temperatures is then
        None unless another sample in the batch has one, in which case 1.0 is used).
    replay_ids: [L, num_layers, k] int — the experts the sampler routed each token to, or None.
    loss_weights: [L] float >= 0 — per-token weights of the policy-gradient term (0 takes a token
        out of it and of its denominator), or None (weight 1 on every loss token).
    teacher_topk_ids: [L, k] int, teacher_topk_logprobs: [L, k] float — a distillation teacher's k
        most likely tokens for each position and their log-probs (entry t: the distribution token
        t was drawn from; anything where loss_mask is False), or None. All samples of a batch carry
        them with one k, or none does.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor | float
    inference_logprobs: torch.Tensor
    temperature: float | None = None
    replay_ids: torch.Tensor | None = None
    loss_weights: torch.Tensor | None = None
    teacher_topk_ids: torch.Tensor | None = None
    teacher_topk_logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class MicroBatch:
    """Samples packed into one varlen batch of T tokens (T = seq_len unless pad_to_seq_len=False).

    input_ids [T] int64; position_ids [T] int64 (restarting at 0 in every sequence);
    cu_seqlens [S+1] int32 (flash-attn varlen offsets; a padding tail is its own sequence);
    loss_mask [T] bool; advantages [T] float32; inference_logprobs [T] float32;
    temperatures [T] float32 or None; replay_ids [T, num_layers, k] int64 or None (padding rows
    route to experts 0..k-1); loss_weights [T] float32 or None (None unless a packed sample has
    weights; then 1.0 for samples without, 0.0 on padding); teacher_topk_ids [T, k] int64 and
    teacher_topk_logprobs [T, k] float32 or None (padding: ids 0, log-probs 0); is_padding: the whole micro-batch is
    filler (it has no loss token);
    sample_indices: the packed samples' indices in the list given to :func:`pack`;
    cost: the estimated cost used for balancing; num_real_tokens: tokens that are not padding.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    inference_logprobs: torch.Tensor
    temperatures: torch.Tensor | None = None
    replay_ids: torch.Tensor | None = None
    loss_weights: torch.Tensor | None = None
    teacher_topk_ids: torch.Tensor | None = None
    teacher_topk_logprobs: torch.Tensor | None = None
    is_padding: bool = False
    sample_indices: tuple[int, ...] = ()
    cost: float = 0.0
    num_real_tokens: int = 0
    context_plan: object | None = field(default=None, repr=False)

    PER_TOKEN = ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "temperatures",
                 "replay_ids", "loss_weights", "teacher_topk_ids", "teacher_topk_logprobs")

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device, non_blocking: bool = False) -> "MicroBatch":
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
                 for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)

    def shard_for_context(self, plan) -> "MicroBatch":
        """This rank's part of every per-token tensor under a context-parallel plan.

        ``plan`` is a ``primerl.parallel.context.ContextShardPlan`` built from this micro-batch's
        ``cu_seqlens``; each per-token tensor goes through ``plan.shard(x, dim=0)`` so all of them
        are split identically (the plan's padding positions get loss_mask False). The result's
        ``cu_seqlens`` is the plan's ``local_cu_seqlens`` (each sequence's local tokens), so
        ``policy_loss(..., cu_seqlens=mb.cu_seqlens)`` runs on the shard; the global layout stays
        in ``context_plan``. Sequence-level loss terms (gspo, geo_rs, veto, sequence mis,
        seq_mean_token_mean) then see only this rank's part of each sequence.
        """
        from primerl.parallel.context import ContextShardPlan  # lazy: the ring module is optional here

        if not isinstance(plan, ContextShardPlan):
            raise ValueError(f"shard_for_context: plan must be a ContextShardPlan, got {type(plan).__name__}")
        if self.context_plan is not None:
            raise ValueError("shard_for_context: this micro-batch is already sharded")
        plan_cu = getattr(plan, "cu_seqlens", None)
        if isinstance(plan_cu, torch.Tensor) and not torch.equal(plan_cu.cpu().long(), self.cu_seqlens.cpu().long()):
            raise ValueError("shard_for_context: the plan was built from different cu_seqlens than this micro-batch's")
        sharded = {name: plan.shard(getattr(self, name), dim=0) for name in self.PER_TOKEN
                   if getattr(self, name) is not None}
        pad = getattr(plan, "padding_mask", None)
        if isinstance(pad, torch.Tensor) and pad.shape == sharded["loss_mask"].shape:
            sharded["loss_mask"] = sharded["loss_mask"] & ~pad.to(torch.bool)
            if "temperatures" in sharded:  # plan padding samples at 1.0, like a padding tail
                sharded["temperatures"] = sharded["temperatures"].masked_fill(pad.to(torch.bool), 1.0)
            if "replay_ids" in sharded:  # plan padding routes to experts 0..k-1, like a padding tail
                rep = sharded["replay_ids"]
                spread = torch.arange(rep.shape[-1], dtype=rep.dtype, device=rep.device).expand_as(rep)
                sharded["replay_ids"] = torch.where(pad.to(torch.bool).view(-1, *([1] * (rep.dim() - 1))), spread, rep)
        return replace(self, context_plan=plan, cu_seqlens=plan.local_cu_seqlens, **sharded)


def sequence_cost(length: int, cost: tuple[float, float]) -> float:
    """Estimated work of one sequence: linear * L + quadratic * L^2."""
    return cost[0] * length + cost[1] * length * length


def _validated(op: str, samples: Sequence[Sample], seq_len: int, truncate: bool) -> list[Sample]:
    out = []
    trailing, topk = None, 0
    for i, s in enumerate(samples):
        if not isinstance(s, Sample):
            raise ValueError(f"{op}: samples[{i}] must be a Sample, got {type(s).__name__}")
        L = len(s)
        if s.input_ids.dim() != 1 or L == 0:
            raise ValueError(f"{op}: samples[{i}].input_ids must be a non-empty 1-D tensor, "
                             f"got shape {tuple(s.input_ids.shape)}")
        per_token = ("loss_mask", "inference_logprobs")
        if isinstance(s.advantages, torch.Tensor):
            per_token += ("advantages",)
        for name in per_token:
            x = getattr(s, name)
            if x.shape != (L,):
                raise ValueError(f"{op}: samples[{i}].{name} must have shape ({L},), got {tuple(x.shape)}")
        if s.replay_ids is not None:
            if s.replay_ids.dim() != 3 or s.replay_ids.shape[0] != L:
                raise ValueError(f"{op}: samples[{i}].replay_ids must be [{L}, num_layers, k], "
                                 f"got {tuple(s.replay_ids.shape)}")
        t = None if s.replay_ids is None else tuple(s.replay_ids.shape[1:])
        if i == 0:
            trailing = t
        elif t != trailing:
            raise ValueError(f"{op}: samples[{i}].replay_ids trailing shape {t} differs from samples[0]'s {trailing} "
                             "(all samples carry replay ids of one shape, or none)")
        if s.loss_weights is not None:
            w = s.loss_weights
            if not isinstance(w, torch.Tensor) or w.shape != (L,) or not w.is_floating_point():
                raise ValueError(f"{op}: samples[{i}].loss_weights must be a float tensor of shape ({L},), got "
                                 f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
            if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
                raise ValueError(f"{op}: samples[{i}].loss_weights must be finite and >= 0, got min "
                                 f"{float(w.min())}, max {float(w.max())}")
        k = _check_topk(op, i, s)
        if i == 0:
            topk = k
        elif k != topk:
            raise ValueError(f"{op}: samples[{i}] carries the teacher's top-{k} and samples[0] its top-{topk} "
                             "(all samples carry one k, or none; 0: none)")
        if s.temperature is not None and not s.temperature > 0:
            raise ValueError(f"{op}: samples[{i}].temperature must be > 0, got {s.temperature}")
        if L > seq_len:
            if not truncate:
                raise ValueError(f"{op}: samples[{i}] has {L} tokens, more than seq_len={seq_len} "
                                 "(pass truncate=True to keep its first seq_len tokens)")
            s = _truncated(s, seq_len)
        out.append(s)
    return out


def _check_topk(op: str, i: int, s: Sample) -> int:
    """k of the teacher's top-k that ``s`` carries (0: none), after checking both tensors' shapes."""
    ids, lps = s.teacher_topk_ids, s.teacher_topk_logprobs
    if ids is None and lps is None:
        return 0
    L = len(s)
    if ids is None or lps is None or ids.ndim != 2 or ids.shape[0] != L or lps.shape != ids.shape \
            or ids.is_floating_point() or not lps.is_floating_point():
        raise ValueError(f"{op}: samples[{i}].teacher_topk_ids (int) and teacher_topk_logprobs (float) must both "
                         f"be [{L}, k], got {None if ids is None else tuple(ids.shape)} and "
                         f"{None if lps is None else tuple(lps.shape)}")
    return int(ids.shape[1])


def _truncated(s: Sample, n: int) -> Sample:
    cut = lambda x: x[:n] if isinstance(x, torch.Tensor) else x
    return Sample(cut(s.input_ids), cut(s.loss_mask), cut(s.advantages), cut(s.inference_logprobs),
                  s.temperature, cut(s.replay_ids), cut(s.loss_weights), cut(s.teacher_topk_ids),
                  cut(s.teacher_topk_logprobs))


def _first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


def _balance(costs: list[float], num_ranks: int) -> list[list[int]]:
    """Longest-processing-time-first with an equal count per rank: bins sorted by cost go to the
    least-loaded rank that still has room."""
    per_rank = math.ceil(len(costs) / num_ranks) if costs else 0
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    heap = [(0.0, r) for r in range(num_ranks)]
    for b in sorted(range(len(costs)), key=lambda b: (-costs[b], b)):
        while True:
            load, r = heapq.heappop(heap)
            if len(ranks[r]) < per_rank:
                break
        ranks[r].append(b)
        if len(ranks[r]) < per_rank:
            heapq.heappush(heap, (load + costs[b], r))
    return ranks


def _build(samples: list[Sample], idx: list[int], seq_len: int, pad_to_seq_len: bool, pad_token_id: int,
           with_temp: bool, replay_shape, cost: tuple[float, float], is_padding: bool = False,
           with_weights: bool = False, topk: int = 0) -> MicroBatch:
    parts = [samples[i] for i in idx]
    lengths = [len(s) for s in parts]
    used = sum(lengths)
    total = seq_len if pad_to_seq_len else max(used, 1)
    pad = total - used
    dev = parts[0].input_ids.device if parts else torch.device("cpu")

    def cat(chunks, fill, dtype):
        chunks = [c.to(dtype) for c in chunks]
        if pad:
            chunks.append(torch.full((pad,), fill, dtype=dtype, device=dev))
        return torch.cat(chunks) if chunks else torch.zeros(0, dtype=dtype, device=dev)

    adv = [s.advantages.float() if isinstance(s.advantages, torch.Tensor)
           else torch.full((len(s),), float(s.advantages), device=dev) for s in parts]
    seqlens = lengths + ([pad] if pad else [])
    cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32, device=dev)
    cu[1:] = torch.cumsum(torch.tensor(seqlens, dtype=torch.int32, device=dev), 0)
    if seqlens:
        position_ids = torch.cat([torch.arange(n, device=dev) for n in seqlens])
    else:
        position_ids = torch.zeros(0, dtype=torch.long)
    temps = None
    if with_temp:
        temps = cat([torch.full((len(s),), 1.0 if s.temperature is None else float(s.temperature), device=dev)
                     for s in parts], 1.0, torch.float32)
    weights = None
    if with_weights:
        weights = cat([torch.ones(len(s), device=dev) if s.loss_weights is None else s.loss_weights for s in parts],
                      0.0, torch.float32)
    replay = None
    if replay_shape is not None:
        layers, k = replay_shape
        chunks = [s.replay_ids.long() for s in parts]
        if pad:
            chunks.append(torch.arange(k, device=dev).expand(pad, layers, k))
        replay = torch.cat(chunks)
    topk_ids = topk_lps = None
    if topk:
        pad_rows = [torch.zeros(pad, topk, device=dev)] if pad else []
        topk_ids = torch.cat([s.teacher_topk_ids.long() for s in parts] + [r.long() for r in pad_rows])
        topk_lps = torch.cat([s.teacher_topk_logprobs.float() for s in parts] + pad_rows)
    return MicroBatch(
        input_ids=cat([s.input_ids for s in parts], pad_token_id, torch.long),
        position_ids=position_ids.long(),
        cu_seqlens=cu,
        loss_mask=cat([s.loss_mask for s in parts], False, torch.bool),
        advantages=cat(adv, 0.0, torch.float32),
        inference_logprobs=cat([s.inference_logprobs for s in parts], 0.0, torch.float32),
        temperatures=temps,
        replay_ids=replay,
        loss_weights=weights,
        teacher_topk_ids=topk_ids,
        teacher_topk_logprobs=topk_lps,
        is_padding=is_padding,
        sample_indices=tuple(idx),
        cost=sum(sequence_cost(n, cost) for n in lengths),
        num_real_tokens=used,
    )


def pack(
    samples: Sequence[Sample],
    seq_len: int,
    num_ranks: int = 1,
    *,
    truncate: bool = False,
    pad_to_seq_len: bool = True,
    pad_token_id: int = 0,
    cost: tuple[float, float] = (1.0, 1.0 / 16384),
) -> list[list[MicroBatch]]:
    """Pack samples into micro-batches of at most ``seq_len`` tokens for ``num_ranks`` DP ranks.

    Returns ``per_rank[r]`` = rank r's micro-batches; every rank gets the same number (padding
    micro-batches fill the gap). ``cost = (linear, quadratic)`` weighs a sequence of length L as
    linear * L + quadratic * L^2 for the balancing (the default makes attention's quadratic term
    equal the linear term at L = 16k, about right for a d_model ~ 4k decoder). No samples -> every
    rank gets an empty list.
    """
    if int(seq_len) < 1:
        raise ValueError(f"pack: seq_len must be >= 1, got {seq_len}")
    if int(num_ranks) < 1:
        raise ValueError(f"pack: num_ranks must be >= 1, got {num_ranks}")
    if len(cost) != 2 or min(cost) < 0:
        raise ValueError(f"pack: cost must be (linear >= 0, quadratic >= 0), got {cost}")
    samples = _validated("pack", samples, int(seq_len), truncate)
    lengths = [len(s) for s in samples]
    bins = _first_fit_decreasing(lengths, int(seq_len))
    bin_costs = [sum(sequence_cost(lengths[i], cost) for i in b) for b in bins]
    assignment = _balance(bin_costs, int(num_ranks))
    with_temp = any(s.temperature is not None for s in samples)
    with_weights = any(s.loss_weights is not None for s in samples)
    replay_shape = tuple(samples[0].replay_ids.shape[1:]) if samples and samples[0].replay_ids is not None else None
    topk = _check_topk("pack", 0, samples[0]) if samples else 0
    per_rank_count = max((len(a) for a in assignment), default=0)
    out = []
    for r in range(int(num_ranks)):
        mbs = [_build(samples, sorted(bins[b]), int(seq_len), pad_to_seq_len, pad_token_id, with_temp, replay_shape,
                      cost, with_weights=with_weights, topk=topk)
               for b in assignment[r]]
        while len(mbs) < per_rank_count:
            mbs.append(_build(samples, [], int(seq_len), pad_to_seq_len, pad_token_id, with_temp, replay_shape, cost,
                              is_padding=True, with_weights=with_weights, topk=topk))
        out.append(mbs)
    return out


def packing_stats(per_rank: list[list[MicroBatch]]) -> dict[str, float]:
    """efficiency: real tokens / all tokens (padding micro-batches included); imbalance: the
    largest rank's estimated cost over the mean rank's (1.0 is perfect balance)."""
    total = sum(mb.num_tokens for mbs in per_rank for mb in mbs)
    real = sum(mb.num_real_tokens for mbs in per_rank for mb in mbs)
    loads = [sum(mb.cost for mb in mbs) for mbs in per_rank]
    mean = sum(loads) / max(len(loads), 1)
    return {
        "efficiency": real / total if total else 1.0,
        "imbalance": max(loads) / mean if mean > 0 else 1.0,
        "micro_batches_per_rank": float(max((len(m) for m in per_rank), default=0)),
    }
