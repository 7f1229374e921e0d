"""A dense fast path for training on many short packed sequences (CPU).

The model's attention kernel walks a packed batch sequence by sequence, which dominates the
trainer's time when a micro-batch holds hundreds of 10-token rollouts. Here the sequences are
padded into one ``[B, H, Lmax, Dh]`` batch and ``torch.nn.functional.scaled_dot_product_attention``
runs once with a causal + key-padding mask (autograd through SDPA). It plugs into the model's
``Attention.context_attention`` hook: the batch's ``cu_seqlens`` travel as a :class:`PaddedPlan`.

Use through :func:`padded_forward`; the result equals the kernel path up to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class PaddedPlan:
    """Stands in for ``cu_seqlens`` so the model routes attention to :func:`padded_attention`.

    Building one reads ``cu_seqlens`` on the host (the longest sequence, the token count): the
    trainer builds it from the packed CPU batch while it prepares a step, then moves it with
    :meth:`to`, so the step's device work holds no host read for it."""

    def __init__(self, cu_seqlens: torch.Tensor):
        cu = cu_seqlens.long()
        self.cu_seqlens = cu_seqlens
        self.lengths = cu[1:] - cu[:-1]
        self.max_len = int(self.lengths.max()) if self.lengths.numel() else 0
        T = int(cu[-1])
        seq = torch.repeat_interleave(torch.arange(len(self.lengths)), self.lengths)
        pos = torch.arange(T) - cu[:-1][seq]
        self.index = (seq, pos)  # token t -> (sequence, position) in the padded layout
        # [B, Lmax] real keys: the padded width travels as a tensor size, which a model compiled with
        # dynamic shapes (trainer.compile) sees as symbolic, so another Lmax does not recompile
        self.keep = torch.arange(self.max_len)[None, :] < self.lengths[:, None]

    def to(self, device, non_blocking: bool = False) -> "PaddedPlan":
        """This plan with its index tensors on ``device`` (sizes stay host values)."""
        out = object.__new__(PaddedPlan)
        mv = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        out.cu_seqlens, out.lengths, out.max_len = mv(self.cu_seqlens), mv(self.lengths), self.max_len
        out.index, out.keep = (mv(self.index[0]), mv(self.index[1])), mv(self.keep)
        return out

    def shard(self, *args, **kwargs):  # the model checks for a plan object by this attribute
        raise NotImplementedError("PaddedPlan is not a context-parallel plan")


def padded_attention(q, k, v, plan: PaddedPlan, *, causal: bool = True, softmax_scale: float | None = None,
                     backend: str | None = None):
    """q ``[T, H, Dh]``, k/v ``[T, Hkv, Dh]`` -> ``[T, H, Dh]`` (per-sequence causal attention;
    always torch's SDPA: ``backend``, the model's attention backend, does not apply)."""
    B, L = plan.keep.shape
    seq, pos = plan.index

    def pad(x):
        out = x.new_zeros(B, L, *x.shape[1:])
        out[seq, pos] = x
        return out.transpose(1, 2)  # [B, H, L, Dh]

    mask = plan.keep[:, None, None, :]
    if causal:
        mask = mask & torch.ones(L, L, dtype=torch.bool).tril()[None, None]
    o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask, scale=softmax_scale,
                                       enable_gqa=q.shape[1] != k.shape[1])
    return o.transpose(1, 2)[seq, pos]


class _PaddedOrInner:
    """The attention hook :func:`padded_forward` leaves on each layer: a :class:`PaddedPlan` goes to
    :func:`padded_attention`, any other plan to the hook that was there before (if any).

    It stays installed after the forward: activation checkpointing recomputes each block's forward
    inside the backward, after ``padded_forward`` has returned, and the recompute must take the
    same path (a hook removed on return left the recompute with no way to read a PaddedPlan)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, q, k, v, plan, **kwargs):
        if isinstance(plan, PaddedPlan):
            return padded_attention(q, k, v, plan, **kwargs)
        if self.inner is None:
            raise TypeError(f"attention: cu_seqlens must be a tensor or a plan, got {type(plan).__name__}")
        return self.inner(q, k, v, plan, **kwargs)


def padded_forward(model, input_ids, position_ids, cu_seqlens, *, replay_ids=None):
    """``model(...)`` with every attention layer on the padded SDPA path (hidden states ``[T, D]``).
    ``cu_seqlens``: a tensor, or a :class:`PaddedPlan` built from it beforehand (no host read here).
    Backward-safe under activation checkpointing (see :class:`_PaddedOrInner`); calls with a
    ``cu_seqlens`` tensor or another plan are unaffected."""
    for layer in model.layers:
        a = layer.attention
        if not isinstance(a.context_attention, _PaddedOrInner):
            a.context_attention = _PaddedOrInner(a.context_attention)
    plan = cu_seqlens if isinstance(cu_seqlens, PaddedPlan) else PaddedPlan(cu_seqlens)
    # a sparse-attention model picks its dense or sparse form by the longest sequence: the plan has it
    sparse = getattr(getattr(model, "config", None), "is_sparse", False)
    extra = {"max_seqlen": plan.max_len} if sparse else {}
    return model(input_ids, position_ids, plan, replay_ids=replay_ids, **extra)
