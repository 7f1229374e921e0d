"""From finished episode groups to per-rank micro-batches.

An episode becomes a ``primerl.rl.packing.Sample`` aligned with its transcript: ``input_ids``,
``loss_mask`` (model tokens), ``inference_logprobs`` (token t's log-prob under the sampler, 0
elsewhere), the episode's advantage, the sampling temperature, optional ``replay_ids
[T, L, k]`` and the environment's per-token ``loss_weights``; ``pack`` turns them into per-rank
``MicroBatch``es. The trainer reads token t's log-prob from the hidden state at t-1 (a sequence's
first token is a prompt token, never trained).
"""

from __future__ import annotations

import torch

from primerl.rl.packing import MicroBatch, Sample, pack

# orchestrator.advantage: "rloo_std" is leave-one-out divided by the std of the step's rewards
ADVANTAGE_METHODS = ("grpo", "drgrpo", "rloo", "rloo_std", "max_rl")


def compute_advantages(rewards: torch.Tensor, group_size: int, *, method: str):
    """rewards [N] (groups contiguous) -> (advantages [N], {"num_zero_groups": int})."""
    from primerl.rl import advantages as adv

    fns = {"grpo": adv.grpo, "drgrpo": adv.drgrpo, "rloo": adv.rloo, "max_rl": adv.max_rl,
           "rloo_std": lambda r, g: adv.rloo(r, g, std_normalize="batch")}
    if method not in fns:
        raise ValueError(f"advantage method must be one of {ADVANTAGE_METHODS}, got {method!r}")
    out = fns[method](rewards, group_size)
    return out.advantages, {"num_zero_groups": int(out.uniform_groups.sum())}


def episode_sample(st, advantage: float, top_k: int, *, replay: bool, temperature: float) -> Sample:
    """One finished ``EpisodeState`` -> its ``Sample`` (module docstring)."""
    return Sample(
        input_ids=torch.tensor(st.episode.tokens, dtype=torch.long),
        loss_mask=torch.tensor(st.episode.loss_mask, dtype=torch.bool),
        advantages=float(advantage),
        inference_logprobs=torch.tensor(st.logprobs, dtype=torch.float32),
        temperature=temperature,
        replay_ids=st.routing_tensor(top_k) if replay else None,
        loss_weights=None if st.loss_weights is None else torch.tensor(st.loss_weights, dtype=torch.float32),
    )


def build_samples(groups, method: str, top_k: int, *, replay: bool, temperature: float):
    """groups: list of lists of finished ``EpisodeState`` -> (list of sample dicts, metrics)."""
    rewards = torch.tensor([[st.reward for st in grp] for grp in groups], dtype=torch.float32)
    G = rewards.shape[1]
    adv, info = compute_advantages(rewards.flatten(), G, method=method)
    adv = adv.view_as(rewards)
    samples = [episode_sample(st, float(adv[gi, mi]), top_k, replay=replay, temperature=temperature)
               for gi, grp in enumerate(groups) for mi, st in enumerate(grp)]
    metrics = {"advantage/abs_mean": float(adv.abs().mean()),
               "groups/zero_advantage": int(info.get("num_zero_groups", 0))}
    return samples, metrics


def build_mixed_samples(groups, method: str, top_k: int, *, replay: bool, temperature: float):
    """``build_samples`` for a batch whose groups may come from several environments (``st.env``)
    with different group sizes: advantages are computed per environment, each within its groups
    (a batch-wide normaliser such as rloo_std's uses that environment's rewards only); the samples
    keep the groups' order."""
    envs = sorted({grp[0].env for grp in groups})
    if len(envs) == 1:
        return build_samples(groups, method, top_k, replay=replay, temperature=temperature)
    by_group: dict[int, list] = {}
    abs_sum, n, zero = 0.0, 0, 0
    for e in envs:
        idx = [i for i, grp in enumerate(groups) if grp[0].env == e]
        samples, m = build_samples([groups[i] for i in idx], method, top_k, replay=replay, temperature=temperature)
        k = 0
        for i in idx:
            by_group[i] = samples[k:k + len(groups[i])]
            k += len(groups[i])
        abs_sum += m["advantage/abs_mean"] * len(samples)
        n += len(samples)
        zero += m["groups/zero_advantage"]
    out = [s for i in range(len(groups)) for s in by_group[i]]
    return out, {"advantage/abs_mean": abs_sum / max(n, 1), "groups/zero_advantage": zero}


def pack_for_ranks(samples: list[Sample], seq_len: int, num_ranks: int) -> list[list[MicroBatch]]:
    return pack(samples, seq_len, num_ranks, pad_to_seq_len=False)


def put_packed_batch(transport, step: int, samples, metrics: dict, seq_len: int, batch_ranks: int) -> None:
    """Hand one step's samples to the trainer: one packed batch per data rank (the mesh's batch
    view: a cp group shares one), each carrying the global loss-token and sequence counts."""
    per_rank = pack_for_ranks(samples, seq_len, batch_ranks)
    n_loss = int(sum(int(s.loss_mask.sum()) for s in samples))
    n_seqs = sum(bool(s.loss_mask.any()) for s in samples)
    for rank, mbs in enumerate(per_rank):
        transport.put_batch(step, rank, {"step": step, "micro_batches": mbs, "metrics": metrics,
                                         "num_loss_tokens": n_loss, "num_loss_seqs": n_seqs})
