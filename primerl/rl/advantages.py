"""Group-relative advantages for outcome rewards.

Rewards are laid out group-major: ``rewards[g * group_size + i]`` is the i-th sample of prompt g.
Every estimator returns :class:`Advantages` ``(advantages [N] float32, uniform_groups [G] bool)``;
a group whose rewards are all equal carries no learning signal, gets exactly zero advantage, and
is flagged so a caller can drop it (DAPO's dynamic sampling) or log the fraction (``max_rl`` also
flags, and zeroes, a group whose mean reward is <= 0).

- :func:`grpo`   A_i = (r_i - mean_g) / (std_g + eps)                 (Shao et al. 2024, DeepSeekMath)
- :func:`drgrpo` A_i = r_i - mean_g, no std division                  (Liu et al. 2025, Dr. GRPO)
- :func:`rloo`   A_i = r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean_g) (Ahmadian et al. 2024, RLOO);
  ``std_normalize="group"`` divides by (std_g + eps), ``"batch"`` by (std of every reward in the
  call + eps) (prime-rl's leave_one_out with global_std_norm)
- :func:`max_rl` A_i = (r_i - mean_g) / mean_g, 0 for a group with mean_g <= 0 (MaxRL,
  arXiv 2602.02710: the gradient of the order-G truncation of the maximum-likelihood objective;
  it upweights hard prompts like 1/p). Rewards are meant to be >= 0 (canonically 0/1).
- :func:`linear_length_penalty` r_i - coef * len_i / max_len, applied before any estimator when
  ``lengths`` and ``length_coef`` are given.

Value checks (finite rewards, lengths >= 0, advantages that fit float32) are device assertions
(:func:`primerl.kernels.check_values`): no host read, so every estimator runs under
``torch.compile(fullgraph=True)``, FakeTensorMode and on meta tensors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from primerl.kernels._args import check_int
from primerl.kernels._value_checks import check_values

__all__ = ["Advantages", "grpo", "drgrpo", "rloo", "max_rl", "linear_length_penalty"]


class Advantages(NamedTuple):
    advantages: torch.Tensor  # [N] float32
    uniform_groups: torch.Tensor  # [G] bool: all rewards in the group equal (advantage 0)

    @property
    def sample_mask(self) -> torch.Tensor:
        """[N] bool: True for samples of informative (non-uniform) groups."""
        n = self.advantages.numel() // max(self.uniform_groups.numel(), 1)
        return (~self.uniform_groups).repeat_interleave(n)


def linear_length_penalty(rewards: torch.Tensor, lengths: torch.Tensor, coef: float,
                          max_length: int | None = None) -> torch.Tensor:
    """r_i - coef * lengths_i / max_length (max_length defaults to max(lengths)); [N] -> [N] float32
    (float64 for float64 rewards)."""
    lengths = torch.as_tensor(lengths, device=rewards.device)
    if lengths.shape != rewards.shape:
        raise ValueError(f"linear_length_penalty: lengths must have shape {tuple(rewards.shape)}, "
                         f"got {tuple(lengths.shape)}")
    check_values((lengths >= 0).all(), "linear_length_penalty: lengths must be >= 0",
                 lambda: f"min {int(lengths.min())}")
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    if max_length is not None:
        if not float(max_length) > 0:
            raise ValueError(f"linear_length_penalty: max_length must be > 0, got {max_length}")
        denom = float(max_length)
    else:  # on the device (no host read); max(lengths) is an integer, exact in either dtype
        denom = lengths.max().clamp_min(1).to(dtype) if lengths.numel() else 1.0
    return rewards.to(dtype) - coef * lengths.to(dtype) / denom


def _groups(op: str, rewards, group_size: int, lengths, length_coef: float, max_length, min_group: int = 1):
    try:
        rewards = torch.as_tensor(rewards)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{op}: rewards must be real numbers (a 1-D tensor or a sequence of floats), got "
                        f"{type(rewards).__name__} {str(rewards)[:80]}") from None
    if rewards.dim() != 1 or rewards.dtype == torch.bool:
        raise ValueError(f"{op}: rewards must be a 1-D numeric tensor [N], got {rewards.dtype} {tuple(rewards.shape)}")
    check_int(op, "group_size", group_size)
    if int(group_size) < min_group:
        raise ValueError(f"{op}: group_size must be >= {min_group}, got {group_size}")
    n = rewards.numel()
    if n % group_size:
        raise ValueError(f"{op}: the number of rewards ({n}) must be a multiple of group_size ({group_size})")
    # float64 inside: float32 sums and squares of large finite rewards (|r| ~ 1e38) overflow to inf
    r = rewards.double()
    check_values(torch.isfinite(r).all(), f"{op}: rewards contain NaN or inf",
                 lambda: f"{int((~torch.isfinite(r)).sum())} of {r.numel()} rewards")
    if length_coef:
        if lengths is None:
            raise ValueError(f"{op}: length_coef={length_coef} needs lengths")
        r = linear_length_penalty(r, lengths, length_coef, max_length)
    r_g = r.view(-1, group_size)
    uniform = (r_g == r_g[:, :1]).all(dim=1)
    return r_g, uniform


def _finish(op: str, adv_g: torch.Tensor, uniform: torch.Tensor) -> Advantages:
    adv_g = torch.where(uniform.unsqueeze(1), torch.zeros_like(adv_g), adv_g).float()
    check_values(torch.isfinite(adv_g).all(),
                 f"{op}: advantages do not fit float32 (rewards differ by more than ~3.4e38 within a "
                 "group); clip the rewards first (the job does: env.max_abs_reward)")
    return Advantages(adv_g.reshape(-1), uniform)


def grpo(rewards: torch.Tensor, group_size: int, *, std_normalize: bool = True, unbiased_std: bool = True,
         eps: float = 1e-6, lengths: torch.Tensor | None = None, length_coef: float = 0.0,
         max_length: int | None = None) -> Advantages:
    """GRPO: A_i = (r_i - mean_g) / (std_g + eps) within each group of ``group_size`` samples.

    ``unbiased_std`` uses the n-1 denominator (torch.std's default, as DeepSeekMath's code);
    ``std_normalize=False`` gives Dr. GRPO's mean-centred advantage. rewards [N] -> Advantages.
    """
    if std_normalize and unbiased_std and int(group_size) == 1:
        raise ValueError("grpo: the unbiased std needs group_size >= 2 (or unbiased_std=False)")
    r_g, uniform = _groups("grpo", rewards, group_size, lengths, length_coef, max_length)
    adv = r_g - r_g.mean(dim=1, keepdim=True)
    if std_normalize:
        std = r_g.std(dim=1, keepdim=True, correction=1 if unbiased_std else 0)
        adv = adv / (std + eps)
    return _finish("grpo", adv, uniform)


def drgrpo(rewards: torch.Tensor, group_size: int, *, lengths: torch.Tensor | None = None,
           length_coef: float = 0.0, max_length: int | None = None) -> Advantages:
    """Dr. GRPO: A_i = r_i - mean_g (no std normalisation, which biases towards easy/hard prompts)."""
    r_g, uniform = _groups("drgrpo", rewards, group_size, lengths, length_coef, max_length)
    return _finish("drgrpo", r_g - r_g.mean(dim=1, keepdim=True), uniform)


def rloo(rewards: torch.Tensor, group_size: int, *, std_normalize: str | None = None, eps: float = 1e-6,
         lengths: torch.Tensor | None = None, length_coef: float = 0.0, max_length: int | None = None) -> Advantages:
    """RLOO: A_i = r_i - (sum_g - r_i) / (G - 1), the leave-one-out baseline (needs G >= 2), divided
    by (std + eps) when ``std_normalize`` is "group" (each group's unbiased std) or "batch" (the
    unbiased std of all N rewards)."""
    if std_normalize not in (None, "group", "batch"):
        raise ValueError(f"rloo: std_normalize must be None, 'group' or 'batch', got {std_normalize!r}")
    r_g, uniform = _groups("rloo", rewards, group_size, lengths, length_coef, max_length, min_group=2)
    G = r_g.shape[1]
    adv = r_g - (r_g.sum(dim=1, keepdim=True) - r_g) / (G - 1)
    if std_normalize == "group":
        adv = adv / (r_g.std(dim=1, keepdim=True) + eps)
    elif std_normalize == "batch":
        adv = adv / ((r_g.std() if r_g.numel() > 1 else r_g.new_zeros(())) + eps)
    return _finish("rloo", adv, uniform)


def max_rl(rewards: torch.Tensor, group_size: int, *, lengths: torch.Tensor | None = None,
           length_coef: float = 0.0, max_length: int | None = None) -> Advantages:
    """MaxRL: A_i = (r_i - mean_g) / mean_g; a group with mean_g <= 0 gets 0 and is flagged."""
    r_g, uniform = _groups("max_rl", rewards, group_size, lengths, length_coef, max_length)
    mean = r_g.mean(dim=1, keepdim=True)
    no_signal = uniform | (mean.squeeze(1) <= 0)
    adv = (r_g - mean) / torch.where(mean > 0, mean, torch.ones_like(mean))
    return _finish("max_rl", adv, no_signal)
