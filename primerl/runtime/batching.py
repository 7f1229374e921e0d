"""From finished episode groups to per-rank micro-batches.

A sample (one episode) becomes per-token arrays aligned with its transcript: ``input_ids``,
``loss_mask`` (model tokens), ``inference_logprobs`` (token t's log-prob under the sampler, 0
elsewhere), ``advantages`` (the episode's advantage on every token) and optional
``replay_ids [T, L, k]``. Micro-batches are dicts of packed tensors with ``cu_seqlens``; the
trainer reads token t's log-prob from the hidden state at t-1 (the first token of every
sequence is a prompt token, never in the loss).
"""

from __future__ import annotations

import torch

from ._rl import advantages as compute_advantages
from ._rl import pack


def build_samples(groups, method: str, top_k: int, *, replay: bool, temperature: float):
    """groups: list of lists of finished ``EpisodeState`` -> (list of sample dicts, metrics)."""
    rewards = torch.tensor([[st.reward for st in grp] for grp in groups], dtype=torch.float32)
    G = rewards.shape[1]
    adv, info = compute_advantages(rewards.flatten(), G, method=method)
    adv = adv.view_as(rewards)
    samples = []
    for gi, grp in enumerate(groups):
        for mi, st in enumerate(grp):
            tokens = st.episode.tokens
            T = len(tokens)
            s = {
                "input_ids": torch.tensor(tokens, dtype=torch.long),
                "loss_mask": torch.tensor(st.episode.loss_mask, dtype=torch.bool),
                "inference_logprobs": torch.tensor(st.logprobs, dtype=torch.float32),
                "advantages": torch.full((T,), float(adv[gi, mi])),
                "temperature": temperature,
            }
            if replay:
                r = st.routing_tensor(top_k)
                if r is not None:
                    s["replay_ids"] = r
            samples.append(s)
    metrics = {"advantage/abs_mean": float(adv.abs().mean()),
               "groups/zero_advantage": int(info.get("num_zero_groups", 0))}
    return samples, metrics


def pack_for_ranks(samples, seq_len: int, num_ranks: int) -> list[list[dict]]:
    return pack(samples, seq_len, num_ranks)
