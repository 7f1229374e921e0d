"""The loss terms beside the policy gradient, and custom policy-gradient methods by import path.

Per token t over a packed batch of T tokens (notation as in :mod:`primerl.rl.losses`: lp the
trainer's log-probs, b the behaviour log-probs, ref the reference model's log-probs, p = exp(lp),
p_b = exp(b), w the term's per-token weight):

- reference KL / distillation (``ref_kl``): the reverse KL to a reference model used as a
  per-token reward, importance-weighted, with a one-sided trust region and a drift penalty:
      l_t = -keep_t * sg(ref_t - lp_t) * exp(lp_t - b_t) + drift * (lp_t - b_t)^2,
      keep_t = not (p - p_b < -delta)   (drop a token whose probability fell more than delta),
  delta 0.2 and drift 1e-3 (prime-rl's ref_kl / on-policy distillation loss).
- supervised cross-entropy (``sft``): l_t = -lp_t.

Each term is normalised on its own tokens: sum_t w_t l_t / N, where N is the sum of the term's
weights (its token count while the weights are 0/1), or the global count the caller passes.

A custom method is a function ``fn(inputs: LossInputs, **hparams)`` returning the per-token
policy-gradient loss [T] (or ``([T] loss, {name: scalar tensor})``); ``policy_loss`` then applies
the corrections, the loss weights and the aggregation to it. It is named by import path,
``"package.module:function"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .loss_spec import load_custom_loss  # noqa: F401 - its old home
from .metrics import kl_k3

__all__ = ["LossInputs", "load_custom_loss", "ref_kl_metric", "ref_kl_per_token", "term_mean"]


@dataclass
class LossInputs:
    """What a custom policy-gradient method sees; every tensor is [T] over the packed batch.

    logprobs: trainer log-probs (carries the gradient; 0 outside ``loss_mask``).
    behaviour_logprobs: the log-probs the ratio is taken against (old_logprobs, else the sampler's).
    inference_logprobs: the sampler's log-probs.
    advantages: per-token advantages (0 outside ``loss_mask``).
    loss_mask: bool, the tokens of the policy-gradient term (zero-advantage tokens already removed
        when ``drop_zero_advantage``; tokens with loss weight 0 removed).
    cu_seqlens: [S+1] int offsets of the packed sequences, or None.
    """

    logprobs: torch.Tensor
    behaviour_logprobs: torch.Tensor
    inference_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    cu_seqlens: torch.Tensor | None


def ref_kl_per_token(lp: torch.Tensor, b: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor,
                     delta: float, drift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token reference-KL loss [T] (0 outside ``mask``) and the trust-region drop flags [T] bool."""
    log_ratio = lp - b
    dropped = mask & (torch.exp(lp.detach()) - torch.exp(b) < -delta)
    reward = (ref - lp).detach()
    pg = torch.where(mask & ~dropped, reward * torch.exp(log_ratio), torch.zeros_like(lp))
    per = -pg + drift * log_ratio * log_ratio
    return torch.where(mask, per, torch.zeros_like(per)), dropped


def term_mean(per_token: torch.Tensor, weights: torch.Tensor, denom: float | torch.Tensor | None) -> torch.Tensor:
    """sum(weights * per_token) / denom, denom defaulting to sum(weights) (1 when that is 0);
    ``weights`` is 0 outside the term's tokens."""
    total = (weights * per_token).sum()
    if denom is None:
        wsum = weights.sum()
        denom = torch.where(wsum > 0, wsum, torch.ones_like(wsum))
    return total / denom


def ref_kl_metric(lp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean k3 estimate of KL(pi_theta || pi_ref) over ``mask`` (samples from ~pi_theta)."""
    k3 = kl_k3((ref - lp).detach())
    m = mask.to(k3.dtype)
    return (k3 * m).sum() / m.sum().clamp_min(1)
