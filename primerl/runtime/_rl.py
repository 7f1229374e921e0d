"""Adapters to primerl.rl (advantages, packing, policy loss) in the shapes the runtime uses.

TEMPORARY fallbacks below stand in while primerl.rl.advantages / packing / losses are being
written; they follow the formulas the rl layer documents and go once it lands.
"""

from __future__ import annotations

import torch


def advantages(rewards: torch.Tensor, group_size: int, *, method: str):
    """rewards [N] (groups contiguous) -> (advantages [N], {"num_zero_groups": int})."""
    r = rewards.view(-1, group_size).float()
    centred = r - r.mean(1, keepdim=True)
    if method == "drgrpo":
        adv = centred
    elif method == "grpo":
        adv = centred / (r.std(1, keepdim=True) + 1e-6)
    elif method == "rloo":
        adv = centred * group_size / (group_size - 1)
    else:
        raise ValueError(f"advantage method must be grpo, drgrpo or rloo, got {method!r}")
    zero = int((r.max(1).values == r.min(1).values).sum())
    return adv.flatten(), {"num_zero_groups": zero}


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


def mismatch_k3(train_logp: torch.Tensor, infer_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(sampler || trainer) from the sampler's tokens: e^d - 1 - d,
    d = log p_train - log p_infer."""
    d = train_logp - infer_logp
    return torch.exp(d) - 1 - d


def policy_loss(logprobs, inference_logprobs, advantages, loss_mask, *, method: str, total_tokens: float,
                eps_low: float = 0.2, eps_high: float = 0.28, **_):
    """PPO-clip against the sampler's log-probs, summed over masked tokens / ``total_tokens``."""
    if method != "ppo_clip":
        raise ValueError(f"trainer.loss.method {method!r} is not available in the interim loss (ppo_clip only)")
    m = loss_mask.float()
    log_ratio = logprobs - inference_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    per_tok = -torch.minimum(unclipped, clipped)
    loss = (per_tok * m).sum() / total_tokens
    with torch.no_grad():
        n = m.sum().clamp(min=1)
        metrics = {
            "mismatch_kl": float((mismatch_k3(logprobs.detach(), inference_logprobs) * m).sum() / n),
            "clip_frac": float(((unclipped != clipped).float() * m).sum() / n),
            "ratio/max": float((ratio * m).max()) if m.any() else 1.0,
        }
    return loss, metrics
