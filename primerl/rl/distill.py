"""On-policy distillation (OPD): the per-token reverse-KL advantage of a teacher over the student.

The student samples ``y ~ pi_S``; a teacher scores the student's own tokens; every sampled token
gets the advantage

    A_t = log pi_T(y_t | y_<t) - log pi_S(y_t | y_<t)

With it the policy gradient ``E_{y~pi_S}[sum_t A_t grad log pi_S(y_t)]`` is minus the gradient of
the reverse KL ``KL(pi_S || pi_T)`` summed over the positions (``grad KL = E_S[(log S - log T)
grad log S]``: the extra ``E_S[grad log S]`` term is zero), and ``mean_t(-A_t)`` over sampled tokens
is an unbiased estimate of the per-token reverse KL (the k1 estimator), reported as ``reverse_kl``.

Options (all on per-token tensors ``[T]``, aligned with the packed batch: entry t is token t):

- ``clip``: clamp ``A_t`` to ``[-clip, clip]`` (a few tokens the teacher finds very unlikely would
  otherwise dominate the step).
- ``normalize``: ``None`` (raw), ``"token"`` (divide by the std of A over every loss token of the
  call, + eps) or ``"sequence"`` (divide each sequence's tokens by the std of A over that
  sequence's loss tokens, + eps; needs ``cu_seqlens``). Scale only: no centring, so a token the
  teacher prefers keeps a positive advantage.
- composition with reward advantages: ``reward_advantages + coef * A`` (``reward_advantages`` per
  token ``[T]`` or a float; ``None`` is pure OPD, ``coef * A``).

``A_t`` is exactly 0 outside ``loss_mask`` (there a token keeps only its reward advantage).

>>> import torch
>>> from primerl.rl import distill_advantages
>>> out = distill_advantages(torch.tensor([0.0, -1.0, -2.0]), torch.tensor([0.0, -0.5, -3.0]),
...                          torch.tensor([False, True, True]))
>>> out.advantages.tolist(), round(float(out.reverse_kl), 3)
([0.0, 0.5, -1.0], 0.25)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["DistillAdvantages", "distill_advantages", "NORMALIZATIONS"]

NORMALIZATIONS = (None, "token", "sequence")


class DistillAdvantages(NamedTuple):
    advantages: torch.Tensor  # [T] float32: reward_advantages + coef * A (A is 0 outside the loss mask)
    reverse_kl: torch.Tensor  # 0-d float32: mean over loss tokens of log pi_S - log pi_T (before clip / scale)


def _check(name: str, x: torch.Tensor, shape) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"distill_advantages: {name} must be a tensor [T], got {type(x).__name__}")
    if x.shape != shape:
        raise ValueError(f"distill_advantages: {name} must have shape {tuple(shape)} (as loss_mask), "
                         f"got {tuple(x.shape)}")
    return x


def _seq_ids(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2 or int(cu_seqlens[-1]) != T or int(cu_seqlens[0]) != 0:
        raise ValueError(f"distill_advantages: cu_seqlens must be [B+1] from 0 to T={T}, got {cu_seqlens.tolist()}")
    lens = cu_seqlens.diff().long()
    if (lens < 0).any():
        raise ValueError(f"distill_advantages: cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")
    return torch.repeat_interleave(torch.arange(lens.numel(), device=cu_seqlens.device), lens)


def _masked_std(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    n = mask.sum().clamp_min(1)
    mean = torch.where(mask, x, 0.0).sum() / n
    return (torch.where(mask, (x - mean) ** 2, 0.0).sum() / n).sqrt()


def distill_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, loss_mask: torch.Tensor, *,
                       clip: float | None = None, normalize: str | None = None,
                       cu_seqlens: torch.Tensor | None = None, eps: float = 1e-6,
                       reward_advantages: torch.Tensor | float | None = None,
                       coef: float = 1.0) -> DistillAdvantages:
    """Per-token reverse-KL advantages ``log pi_T - log pi_S`` on the loss tokens, optionally clipped
    and normalised, scaled by ``coef`` and added to ``reward_advantages`` (the module docstring).

    student_logprobs, teacher_logprobs: [T] log-probs of the sampled tokens (entry t: token t);
    loss_mask: [T] bool; cu_seqlens: [B+1] (``normalize="sequence"`` only). -> DistillAdvantages.
    """
    if not isinstance(loss_mask, torch.Tensor) or loss_mask.dtype != torch.bool or loss_mask.ndim != 1:
        raise ValueError("distill_advantages: loss_mask must be a 1-D bool tensor [T], got "
                         f"{getattr(loss_mask, 'dtype', type(loss_mask).__name__)} "
                         f"{tuple(getattr(loss_mask, 'shape', ()))}")
    shape = loss_mask.shape
    ls = _check("student_logprobs", student_logprobs, shape).float()
    lt = _check("teacher_logprobs", teacher_logprobs, shape).float()
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"distill_advantages: normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    if clip is not None and not clip > 0:
        raise ValueError(f"distill_advantages: clip must be > 0 (or None), got {clip}")
    bad = loss_mask & ~(torch.isfinite(ls) & torch.isfinite(lt))
    if bool(bad.any()):
        raise ValueError(f"distill_advantages: {int(bad.sum())} loss tokens have non-finite student or teacher "
                         "log-probs")
    adv = torch.where(loss_mask, lt - ls, 0.0)
    n = loss_mask.sum().clamp_min(1)
    reverse_kl = -adv.sum() / n
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    if normalize == "token":
        adv = adv / (_masked_std(adv, loss_mask) + eps)
    elif normalize == "sequence":
        if cu_seqlens is None:
            raise ValueError("distill_advantages: normalize='sequence' needs cu_seqlens [B+1]")
        seq = _seq_ids(cu_seqlens.to(adv.device), shape[0])
        B = cu_seqlens.numel() - 1
        m = loss_mask.float()
        cnt = torch.zeros(B, device=adv.device).index_add_(0, seq, m).clamp_min(1)
        mean = torch.zeros(B, device=adv.device).index_add_(0, seq, adv * m) / cnt
        var = torch.zeros(B, device=adv.device).index_add_(0, seq, (adv - mean[seq]) ** 2 * m) / cnt
        adv = adv / (var.sqrt()[seq] + eps)
    adv = torch.where(loss_mask, coef * adv, 0.0)
    if reward_advantages is not None:
        if isinstance(reward_advantages, torch.Tensor) and reward_advantages.ndim:
            _check("reward_advantages", reward_advantages, shape)
        adv = adv + torch.as_tensor(reward_advantages, dtype=torch.float32, device=adv.device)
    return DistillAdvantages(adv.float(), reverse_kl.float())
