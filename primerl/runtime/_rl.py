"""Adapters to primerl.rl (advantages, packing, policy loss) in the shapes the runtime uses.

``pack`` is a TEMPORARY stand-in while primerl.rl.packing is being written (same contract:
first-fit-decreasing bins, cost-balanced ranks, equal micro-batch counts with flagged padding).
"""

from __future__ import annotations

import torch


def advantages(rewards: torch.Tensor, group_size: int, *, method: str):
    """rewards [N] (groups contiguous) -> (advantages [N], {"num_zero_groups": int})."""
    from primerl.rl import advantages as adv

    fns = {"grpo": adv.grpo, "drgrpo": adv.drgrpo, "rloo": adv.rloo}
    if method not in fns:
        raise ValueError(f"advantage method must be grpo, drgrpo or rloo, got {method!r}")
    out = fns[method](rewards, group_size)
    return out.advantages, {"num_zero_groups": int(out.uniform_groups.sum())}


def _cost(n: int) -> float:
    return n + n * n / 4096


def pack(samples: list[dict], seq_len: int, num_ranks: int) -> list[list[dict]]:
    """First-fit-decreasing into bins of ``seq_len`` tokens, bins spread over ranks by cost; every
    rank gets the same number of micro-batches (padding ones have an all-False loss mask)."""
    for i, s in enumerate(samples):
        if s["input_ids"].numel() > seq_len:
            raise ValueError(f"sample {i} has {s['input_ids'].numel()} tokens > seq_len={seq_len}; raise orchestrator.seq_len")
    order = sorted(range(len(samples)), key=lambda i: -samples[i]["input_ids"].numel())
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = samples[i]["input_ids"].numel()
        for b, r in enumerate(room):
            if r >= n:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(seq_len - n)
    per_rank: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    load = [0.0] * num_ranks
    for b in sorted(bins, key=lambda b: -sum(_cost(samples[i]["input_ids"].numel()) for i in b)):
        r = min(range(num_ranks), key=lambda k: (load[k], len(per_rank[k])))
        per_rank[r].append(b)
        load[r] += sum(_cost(samples[i]["input_ids"].numel()) for i in b)
    n_mb = max(len(x) for x in per_rank)
    out = []
    for r in range(num_ranks):
        mbs = [_collate([samples[i] for i in sorted(b)]) for b in per_rank[r]]
        while len(mbs) < n_mb:
            mbs.append(_padding_like(samples[0]))
        out.append(mbs)
    return out


def _collate(items: list[dict]) -> dict:
    lens = torch.tensor([s["input_ids"].numel() for s in items])
    cu = torch.zeros(len(items) + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    mb = {
        "input_ids": torch.cat([s["input_ids"] for s in items]),
        "position_ids": torch.cat([torch.arange(int(n)) for n in lens]),
        "cu_seqlens": cu,
        "loss_mask": torch.cat([s["loss_mask"] for s in items]),
        "advantages": torch.cat([s["advantages"] for s in items]),
        "inference_logprobs": torch.cat([s["inference_logprobs"] for s in items]),
        "temperature": items[0]["temperature"],
        "is_padding": False,
    }
    if all("replay_ids" in s for s in items):
        mb["replay_ids"] = torch.cat([s["replay_ids"] for s in items])
    return mb


def _padding_like(s: dict) -> dict:
    mb = _collate([s])
    mb["loss_mask"] = torch.zeros_like(mb["loss_mask"])
    mb["advantages"] = torch.zeros_like(mb["advantages"])
    mb["is_padding"] = True
    return mb


def policy_loss(logprobs, mb: dict, loss_cfg, *, total_tokens: int, total_seqs: int, entropy=None):
    """The configured primerl.rl.losses.policy_loss on one micro-batch, scaled so that summing over
    every micro-batch (and rank) gives the batch-level aggregation. -> (loss, float metrics)."""
    from primerl.rl.losses import policy_loss as _policy_loss

    hp = dict(loss_cfg.hparams)
    agg = loss_cfg.aggregation
    kw: dict = {}
    scale = 1.0
    if agg in ("token_mean", "global_token_sum"):
        agg, kw["global_num_tokens"] = "global_token_sum", float(max(total_tokens, 1))
    elif agg == "token_sum_norm":
        if "norm_constant" not in hp:
            raise ValueError("trainer.loss.aggregation = 'token_sum_norm' needs trainer.loss.hparams.norm_constant")
        kw["norm_constant"] = hp.pop("norm_constant")
    elif agg == "seq_mean_token_mean":
        mask, cu = mb["loss_mask"], mb["cu_seqlens"].long()
        n_seq = sum(bool(mask[s:e].any()) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()))
        scale = n_seq / max(total_seqs, 1)
    else:
        raise ValueError(f"trainer.loss.aggregation {agg!r} is not one of token_mean, global_token_sum, "
                         "token_sum_norm, seq_mean_token_mean")
    loss, metrics = _policy_loss(logprobs, mb["inference_logprobs"], mb["advantages"], mb["loss_mask"],
                                 method=loss_cfg.method, corrections=tuple(loss_cfg.corrections), aggregation=agg,
                                 cu_seqlens=mb["cu_seqlens"], entropy=entropy, **kw, **hp)
    return loss * scale, {k: float(v) for k, v in metrics.items()}
