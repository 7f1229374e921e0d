"""Adapters to primerl.rl (advantages, packing, policy loss) in the shapes the runtime uses."""

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


def policy_loss(logprobs, mb, loss_cfg, *, total_tokens: int, total_seqs: int, entropy=None):
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
        mask, cu = mb.loss_mask, mb.cu_seqlens.long()
        n_seq = sum(bool(mask[s:e].any()) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()))
        scale = n_seq / max(total_seqs, 1)
    else:
        raise ValueError(f"trainer.loss.aggregation {agg!r} is not one of token_mean, global_token_sum, "
                         "token_sum_norm, seq_mean_token_mean")
    loss, metrics = _policy_loss(logprobs, mb.inference_logprobs, mb.advantages, mb.loss_mask,
                                 method=loss_cfg.method, corrections=tuple(loss_cfg.corrections), aggregation=agg,
                                 cu_seqlens=mb.cu_seqlens, entropy=entropy, **kw, **hp)
    return loss * scale, {k: float(v) for k, v in metrics.items()}
