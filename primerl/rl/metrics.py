"""KL estimators and the per-batch statistics every RL run should log.

KL estimators (Schulman, "Approximating KL Divergence", 2020): for samples x ~ q and
``log_ratio = log p(x) - log q(x)`` (so r = p/q), each k below has E_q[k] = KL(q || p) (k1, k3
exactly; k2 to second order) per sample:

    k1 = -log r            unbiased, high variance, can be negative
    k2 = (log r)^2 / 2     biased, low variance (its gradient is the forward-KL gradient)
    k3 = (r - 1) - log r   unbiased, always >= 0; k3(+ln 2) = 1 - ln 2, k3(-ln 2) = ln 2 - 1/2

The trainer-vs-inference mismatch KL is k3 with p = trainer, q = inference (the sampler), i.e.
``log_ratio = logprobs - inference_logprobs``, averaged over loss tokens (prime-rl's mismatch_kl).
"""

from __future__ import annotations

import torch

__all__ = ["kl_k1", "kl_k2", "kl_k3", "kl_estimate", "masked_mean", "effective_sample_size"]


def kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return -log_ratio


def kl_k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio * log_ratio


def kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # expm1 keeps k3 accurate near log_ratio = 0, where r - 1 and log r nearly cancel
    return torch.expm1(log_ratio) - log_ratio


_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_estimate(log_ratio: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-sample KL(q || p) estimate from ``log_ratio = log p - log q`` (samples from q)."""
    if kind not in _ESTIMATORS:
        raise ValueError(f"kl_estimate: unknown estimator {kind!r}; choose one of {tuple(_ESTIMATORS)}")
    return _ESTIMATORS[kind](log_ratio)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mean of x over mask (0 when the mask is empty)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp_min(1)


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Normalised ESS of importance weights over mask: (sum w)^2 / (n sum w^2), in (0, 1];
    1 means every weight is equal (on-policy), 1/n means one sample carries all the weight."""
    w = torch.where(mask, weights, torch.zeros_like(weights))
    n = mask.sum().clamp_min(1).to(w.dtype)
    denom = (w * w).sum()
    ess = w.sum() ** 2 / (n * denom.clamp_min(torch.finfo(w.dtype).tiny))
    return torch.where(denom > 0, ess, torch.ones_like(denom))
