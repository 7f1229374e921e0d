"""The next-token shift between packed batches and log-probabilities.

A :class:`~primerl.rl.packing.MicroBatch` is token-aligned: entry t of every per-token field
(advantage, loss mask, sampler log-prob, temperature, weight) describes token ``input_ids[t]``,
which the model predicts from its hidden state at t - 1. ``fused_logprobs(hidden, W, targets)``
scores ``targets[t]`` from ``hidden[t]``. Two ways to line them up, both here so that a trainer
cannot score the wrong tokens:

- :func:`next_token_batch` moves the loss-side fields one token earlier (entry t now describes
  token t+1) and returns the targets ``input_ids[t+1]``; the loss then runs on ``fused_logprobs``'
  output as it is. This is what the job's trainer does (under context parallelism no shift then
  crosses a shard).
- :func:`token_aligned` moves the log-probs one token later instead (entry t from the hidden state
  at t-1, 0 at each sequence's first token), for code that keeps the batch token-aligned.

Both run on the device with no host read (``torch.compile(fullgraph=True)``, FakeTensorMode).

>>> import torch
>>> from primerl.rl import Sample, pack, next_token_batch
>>> s = Sample(input_ids=torch.tensor([1, 5, 6, 7]), loss_mask=torch.tensor([False, False, True, True]),
...            advantages=0.5, inference_logprobs=torch.tensor([0.0, 0.0, -0.3, -1.2]))
>>> mb = pack([s], seq_len=4, num_ranks=1)[0][0]
>>> shifted, targets = next_token_batch(mb)
>>> targets.tolist(), shifted.loss_mask.tolist()  # hidden[t] predicts targets[t]; the last entry leaves the loss
([5, 6, 7, 1], [False, True, True, False])
"""

from __future__ import annotations

from dataclasses import replace

import torch

__all__ = ["FORWARD_FIELDS", "next_token_batch", "next_token_targets", "token_aligned"]

FORWARD_FIELDS = ("input_ids", "position_ids", "replay_ids")  # what the model reads; the rest is loss-side


def _last_tokens(cu_seqlens: torch.Tensor, T: int, device) -> torch.Tensor:
    """[T] bool: True at the last token of every sequence."""
    last = torch.zeros(T, dtype=torch.bool, device=device)
    if T:
        last[(cu_seqlens[1:].to(device).long() - 1).clamp(0, T - 1)] = True
    return last


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids [T] -> targets [T]: ``input_ids[t+1]`` (the entry at a sequence's last token is the
    next sequence's first token; :func:`next_token_batch` masks it out of the loss)."""
    return torch.roll(input_ids, -1, 0)


def next_token_batch(mb):
    """-> (mb', targets [T]): ``mb`` with every loss-side per-token field moved one token earlier,
    so entry t describes token t+1 and is scored from the hidden state at t, and the targets
    ``input_ids[t+1]``. Forward inputs (``FORWARD_FIELDS``) stay. An entry at a sequence's last
    token is masked out (its next token opens another sequence). Sequence membership of every
    masked-in entry is unchanged, so per-sequence loss terms (``cu_seqlens``) see the same tokens."""
    T = mb.input_ids.shape[0]
    last = _last_tokens(mb.cu_seqlens, T, mb.input_ids.device)
    moved = {name: torch.roll(getattr(mb, name), -1, 0) for name in mb.PER_TOKEN
             if name not in FORWARD_FIELDS and getattr(mb, name) is not None}
    moved["loss_mask"] = moved["loss_mask"] & ~last
    return replace(mb, **moved), next_token_targets(mb.input_ids)


def token_aligned(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-prediction values [T] (entry t from the hidden state at t, e.g. ``fused_logprobs`` of
    ``next_token_targets``) -> token-aligned [T]: entry t = x[t-1], 0 at each sequence's first token."""
    T = x.shape[0]
    starts = torch.zeros(T, dtype=torch.bool, device=x.device)
    if T:
        starts[cu_seqlens[:-1].to(x.device).long().clamp(max=T - 1)] = True
    shifted = torch.cat([x.new_zeros(1), x[:-1]]) if T else x
    return torch.where(starts, torch.zeros_like(shifted), shifted)
