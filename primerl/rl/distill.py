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

The teacher's top-k (``distill.topk``): a sampled token carries one number of the teacher's
distribution; the teacher's k most likely next tokens at each sampled position carry most of it.
:func:`topk_distill_kl` is the forward KL from the teacher's top-k (renormalised over those k) to
the student at every loss position, ``sum_j q_T(j) (log q_T(j) - log pi_S(j))`` with
``q_T = p_T / sum_k p_T`` (>= 0, 0 only where the student matches the teacher on the k tokens and
puts no mass elsewhere): a supervised term on the student's own prefixes (GKD's on-policy
distillation with a forward KL). :func:`student_topk_logprobs` gives the student's log-probs of the
k tokens from the fused log-prob of the sampled token, without a second pass over the vocabulary.

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

__all__ = ["DistillAdvantages", "distill_advantages", "NORMALIZATIONS", "student_topk_logprobs", "topk_distill_kl"]

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


def student_topk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          target_logprobs: torch.Tensor, topk_ids: torch.Tensor, *,
                          temperature: float | torch.Tensor = 1.0, chunk_size: int = 2048) -> torch.Tensor:
    """The student's ``log softmax(hidden @ weight.T / temperature)`` at ``topk_ids``, [T, k] float32.

    hidden [T, D] and weight [V, D] (the LM head) as given to ``fused_logprobs``; targets [T] the
    tokens it scored and target_logprobs [T] its result (differentiable). Since
    ``log p(v) = (h.W_v - h.W_y) / temperature + log p(y)``, only k + 1 rows of the head are read
    per token, and the log-partition's gradient reaches ``hidden`` and ``weight`` through
    ``target_logprobs``. temperature: a float or [T]. Chunks of ``chunk_size`` tokens are
    recomputed in backward (the gathered [chunk, k + 1, D] rows are not kept).
    """
    T = hidden.shape[0]
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"student_topk_logprobs: hidden must be [T, D] and weight [V, D], got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if topk_ids.ndim != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"student_topk_logprobs: topk_ids must be [T={T}, k], got {tuple(topk_ids.shape)}")
    if targets.shape != (T,) or target_logprobs.shape != (T,):
        raise ValueError(f"student_topk_logprobs: targets and target_logprobs must be [T={T}], got "
                         f"{tuple(targets.shape)} and {tuple(target_logprobs.shape)}")
    inv_t = (1.0 / torch.as_tensor(temperature, dtype=torch.float32, device=hidden.device)).expand(T)

    def chunk(h, ids, y, inv):
        rows = weight[torch.cat([ids, y.unsqueeze(1)], 1).long()].float()  # [c, k + 1, D]
        logits = torch.einsum("cd,ckd->ck", h.float(), rows)
        return (logits[:, :-1] - logits[:, -1:]) * inv.unsqueeze(1)

    from torch.utils.checkpoint import checkpoint

    parts = []
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    for a in range(0, T, chunk_size):
        b = min(a + chunk_size, T)
        args = (hidden[a:b], topk_ids[a:b], targets[a:b], inv_t[a:b])
        parts.append(checkpoint(chunk, *args, use_reentrant=False) if grad else chunk(*args))
    diff = torch.cat(parts) if parts else hidden.new_zeros((0, topk_ids.shape[1]), dtype=torch.float32)
    return diff + target_logprobs.float().unsqueeze(1)


def topk_distill_kl(student_topk_logprobs: torch.Tensor, teacher_topk_logprobs: torch.Tensor,
                    loss_mask: torch.Tensor) -> torch.Tensor:
    """Per-token forward KL from the teacher's top-k (renormalised) to the student, [T] float32, 0
    outside ``loss_mask`` (the module docstring). student_/teacher_topk_logprobs: [T, k] at the
    same token ids (the teacher's k most likely); loss_mask [T] bool."""
    if student_topk_logprobs.shape != teacher_topk_logprobs.shape or student_topk_logprobs.ndim != 2:
        raise ValueError("topk_distill_kl: student and teacher top-k log-probs must both be [T, k], got "
                         f"{tuple(student_topk_logprobs.shape)} and {tuple(teacher_topk_logprobs.shape)}")
    if loss_mask.dtype != torch.bool or loss_mask.shape != student_topk_logprobs.shape[:1]:
        raise ValueError(f"topk_distill_kl: loss_mask must be a bool [T={student_topk_logprobs.shape[0]}], got "
                         f"{loss_mask.dtype} {tuple(loss_mask.shape)}")
    lt = teacher_topk_logprobs.float()
    lq = lt - torch.logsumexp(lt, dim=1, keepdim=True)
    kl = (lq.exp() * (lq - student_topk_logprobs.float())).sum(1)
    return torch.where(loss_mask, kl, 0.0)
