"""Policy-gradient losses over a packed batch, with trainer/inference mismatch corrections.

Every tensor is per token over a packed batch of T tokens; ``cu_seqlens`` (int [S+1], flash-attn's
varlen convention) marks the sequences for the sequence-level pieces. Notation, per token t:

    lp = logprobs (trainer, current policy pi_theta; carries the gradient)
    b  = the behaviour log-probs the ratio is taken against: ``old_logprobs`` when given, else
         ``inference_logprobs`` (prime-rl's bypass mode: the sampler *is* pi_old)
    r  = exp(lp - b),  A = advantages,  M = loss_mask

Methods (``method=``), per-token loss l_t before corrections and aggregation:

- ``ppo_clip``  l = -min(r A, clip(r, 1-eps_low, 1+eps_high) A); with ``dual_clip_c`` = c and
  A < 0, l = -max(min(...), c A).  PPO (Schulman et al. 2017); asymmetric "clip-higher" and the
  0.2/0.28 defaults from DAPO (Yu et al. 2025); dual clip from Ye et al. 2020 (verl uses c = 3).
- ``dppo_tv``   l = -keep r A + kl_coef (lp - b)^2, where keep drops a token whose probability
  moved beyond the trust region in the advantage's direction: p - p_b > delta_high when A > 0,
  p - p_b < -delta_low when A < 0 (p = exp(lp), p_b = exp(b)). Binary-TV DPPO ("Rethinking the
  trust region in LLM RL", arXiv 2602.04879) with Kimi-K2.5's squared-log-ratio KL term; prime-rl's
  default loss (delta 0.2/0.2, KL 1e-3).
- ``gspo``      s_i = exp(mean_{t in i} (lp - b)) the sequence's geometric-mean ratio, gradient
  through every token of i; l = -min(s_i A, clip(s_i, 1-eps_low, 1+eps_high) A).
  GSPO (Zheng et al. 2025, Qwen3), eps 3e-4 / 4e-4; aggregation defaults to seq_mean_token_mean.
- ``gspo_token`` s_it = sg(s_i) * exp(lp_t - sg(lp_t)): same value as s_i, gradient through token
  t only, so token-level advantages can differ within a sequence (GSPO-token, same paper).
- ``cispo``     l = -sg(clip(r, 1-eps_low, 1+eps_high)) A lp: the clipped importance weight is a
  constant and every token keeps its gradient. CISPO (MiniMax-M1, 2025): no lower bound
  (eps_low = 1) and eps_high = 0.28 by default.
- ``reinforce`` l = -r A: the importance-weighted policy gradient, unclipped (r = 1 on policy).

On policy (lp = b) every method has REINFORCE's gradient -A grad(lp) (for gspo with an advantage
that is constant within each sequence).

Corrections (``corrections=``) for the trainer/inference mismatch. rho = pi_old / pi_inference =
exp(old_logprobs - inference_logprobs) when ``old_logprobs`` is given, else the detached
exp(lp - inference_logprobs) (in bypass mode the method's own ratio already is pi_theta/pi_inf):

- ``tis``     multiply by min(rho, tis_cap): truncated importance sampling (Yao et al. 2025, "Your
  efficient RL framework secretly brings you off-policy RL training"), cap 2. Needs old_logprobs.
- ``mis``     masked importance sampling: drop tokens (``mis_level="token"``) or whole sequences
  (``"sequence"``, on the product of the token ratios) whose rho lies outside [mis_low, mis_high]
  (0.5, 2; Liu, Yao et al. 2025, "When speed kills stability"; verl's rollout rejection sampling).
- ``icepop``  drop tokens with rho outside [icepop_alpha, icepop_beta] = [0.5, 5] (IcePop, Ring-1T).
- ``geo_rs``  drop a sequence whose geometric-mean rho exp(mean log rho) is outside
  [geo_rs_low, geo_rs_high] = [0.999, 1.001] (verl's geometric rejection sampling).
- ``veto``    drop a sequence containing any token with rho < veto_threshold = 1e-4 (verl's
  catastrophic-token veto).
With old_logprobs, tis / mis / icepop also weight the kept tokens by rho (truncated at tis_cap
when tis is on), applied once however many of them are on. Dropped tokens still count in the
aggregation's denominator (the normalisation is a property of the batch, not of the filters).

Aggregations (``aggregation=``), all over M (the loss mask):
``token_mean`` sum l / sum M;  ``seq_mean_token_mean`` mean over sequences with loss tokens of
(sum_{t in i} l / n_i);  ``token_sum_norm`` sum l / norm_constant (Dr. GRPO's constant, e.g.
batch size x max generation length);  ``global_token_sum`` sum l / global_num_tokens, the loss-token
count over all data/context-parallel ranks, so that summing the ranks' gradients gives the global
token mean.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .metrics import effective_sample_size, kl_k3, masked_mean

__all__ = ["policy_loss", "METHODS", "CORRECTIONS", "AGGREGATIONS", "DEFAULT_HPARAMS", "seq_ids_from_cu_seqlens"]

METHODS = ("ppo_clip", "dppo_tv", "gspo", "gspo_token", "cispo", "reinforce")
CORRECTIONS = ("tis", "mis", "icepop", "geo_rs", "veto")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "token_sum_norm", "global_token_sum")

_METHOD_HPARAMS = {
    "ppo_clip": {"eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": None, "kl_coef": 0.0},
    "dppo_tv": {"delta_low": 0.2, "delta_high": 0.2, "kl_coef": 1e-3},
    "gspo": {"eps_low": 3e-4, "eps_high": 4e-4, "kl_coef": 0.0},
    "gspo_token": {"eps_low": 3e-4, "eps_high": 4e-4, "kl_coef": 0.0},
    "cispo": {"eps_low": 1.0, "eps_high": 0.28, "kl_coef": 0.0},
    "reinforce": {"kl_coef": 0.0},
}
_CORRECTION_HPARAMS = {
    "tis": {"tis_cap": 2.0},
    "mis": {"mis_low": 0.5, "mis_high": 2.0, "mis_level": "token"},
    "icepop": {"icepop_alpha": 0.5, "icepop_beta": 5.0},
    "geo_rs": {"geo_rs_low": 0.999, "geo_rs_high": 1.001},
    "veto": {"veto_threshold": 1e-4},
}
DEFAULT_HPARAMS = {**{m: dict(h) for m, h in _METHOD_HPARAMS.items()}, **{c: dict(h) for c, h in _CORRECTION_HPARAMS.items()}}
_ALL_HPARAMS = sorted({k for h in DEFAULT_HPARAMS.values() for k in h})
_DEFAULT_AGGREGATION = {"gspo": "seq_mean_token_mean"}


def seq_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """[S+1] offsets -> [T] int64 sequence index of every token."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths, output_size=T)


def _segment_sum(x: torch.Tensor, seq_ids: torch.Tensor, S: int) -> torch.Tensor:
    return torch.zeros(S, dtype=x.dtype, device=x.device).index_add(0, seq_ids, x)


def _validate(logprobs, inference_logprobs, advantages, loss_mask, method, old_logprobs, corrections,
              aggregation, cu_seqlens, norm_constant, global_num_tokens, entropy, hparams):
    if method not in METHODS:
        raise ValueError(f"policy_loss: unknown method {method!r}; choose one of {METHODS}")
    if isinstance(corrections, str):
        corrections = (corrections,)
    corrections = tuple(corrections)
    for c in corrections:
        if c not in CORRECTIONS:
            raise ValueError(f"policy_loss: unknown correction {c!r}; choose from {CORRECTIONS}")
    if len(set(corrections)) != len(corrections):
        raise ValueError(f"policy_loss: corrections repeat a name: {corrections}")
    aggregation = aggregation or _DEFAULT_AGGREGATION.get(method, "token_mean")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"policy_loss: unknown aggregation {aggregation!r}; choose one of {AGGREGATIONS}")
    used = dict(_METHOD_HPARAMS[method])
    for c in corrections:
        used.update(_CORRECTION_HPARAMS[c])
    for name in hparams:
        if name not in _ALL_HPARAMS:
            raise ValueError(f"policy_loss: unknown hyperparameter {name!r}; known: {_ALL_HPARAMS}")
        if name not in used:
            raise ValueError(f"policy_loss: hyperparameter {name!r} is not used by method={method!r} with "
                             f"corrections={corrections}; it uses {sorted(used)}")
    hp = {**used, **hparams}
    if hp.get("mis_level", "token") not in ("token", "sequence"):
        raise ValueError(f"policy_loss: mis_level must be 'token' or 'sequence', got {hp['mis_level']!r}")
    for lo, hi in (("eps_low", "eps_high"), ("delta_low", "delta_high"), ("mis_low", "mis_high"),
                   ("icepop_alpha", "icepop_beta"), ("geo_rs_low", "geo_rs_high")):
        if lo in hp and not (hp[lo] >= 0 and hp[hi] >= 0):
            raise ValueError(f"policy_loss: {lo}/{hi} must be >= 0, got {hp[lo]}/{hp[hi]}")
    if hp.get("dual_clip_c") is not None and not hp["dual_clip_c"] > 1:
        raise ValueError(f"policy_loss: dual_clip_c must be > 1 (or None), got {hp['dual_clip_c']}")
    if "tis_cap" in hp and not hp["tis_cap"] > 0:
        raise ValueError(f"policy_loss: tis_cap must be > 0, got {hp['tis_cap']}")
    if "tis" in corrections and old_logprobs is None:
        raise ValueError("policy_loss: correction 'tis' needs old_logprobs (in bypass mode the method's ratio "
                         "pi_theta/pi_inference already is the importance weight; bound it with 'mis' or 'icepop')")

    T = logprobs.shape[0] if isinstance(logprobs, torch.Tensor) and logprobs.dim() == 1 else -1
    named = {"logprobs": logprobs, "inference_logprobs": inference_logprobs, "advantages": advantages,
             "loss_mask": loss_mask}
    if old_logprobs is not None:
        named["old_logprobs"] = old_logprobs
    if entropy is not None:
        named["entropy"] = entropy
    for name, x in named.items():
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.shape[0] != T:
            raise ValueError(f"policy_loss: {name} must be a 1-D tensor [T] matching logprobs "
                             f"({getattr(logprobs, 'shape', type(logprobs))}), got {getattr(x, 'shape', type(x))}")
        if name != "loss_mask" and not x.dtype.is_floating_point:
            raise ValueError(f"policy_loss: {name} must be floating point, got {x.dtype}")

    needs_seqs = (method in ("gspo", "gspo_token") or aggregation == "seq_mean_token_mean"
                  or "geo_rs" in corrections or "veto" in corrections
                  or ("mis" in corrections and hp["mis_level"] == "sequence"))
    if needs_seqs and cu_seqlens is None:
        raise ValueError(f"policy_loss: method={method!r}, corrections={corrections}, aggregation={aggregation!r} "
                         "work per sequence and need cu_seqlens")
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype.is_floating_point:
            raise ValueError(f"policy_loss: cu_seqlens must be a 1-D integer tensor [S+1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T or bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError(f"policy_loss: cu_seqlens must start at 0, be non-decreasing and end at T={T}, got {cu_seqlens.tolist()}")
    if aggregation == "token_sum_norm" and not (norm_constant is not None and float(norm_constant) > 0):
        raise ValueError(f"policy_loss: aggregation 'token_sum_norm' needs norm_constant > 0, got {norm_constant}")
    if aggregation == "global_token_sum" and not (global_num_tokens is not None and float(global_num_tokens) > 0):
        raise ValueError(f"policy_loss: aggregation 'global_token_sum' needs global_num_tokens > 0, got {global_num_tokens}")
    return corrections, aggregation, hp


def _method_loss(method, lp, b, adv, mask, log_ratio, seq, hp):
    """-> (per-token loss [T], method ratio [T] detached, clip/mask flags low/high [T] bool, extra metrics)."""
    extra = {}
    if method in ("gspo", "gspo_token"):
        seq_ids, S, n_i = seq
        seq_log_ratio = _segment_sum(log_ratio, seq_ids, S) / n_i.clamp_min(1)
        if method == "gspo":
            ratio = torch.exp(seq_log_ratio)[seq_ids]
        else:
            ratio = torch.exp(seq_log_ratio.detach()[seq_ids] + lp - lp.detach())
    else:
        ratio = torch.exp(log_ratio)
    r = ratio.detach()
    if method in ("ppo_clip", "gspo", "gspo_token"):
        lo, hi = 1.0 - hp["eps_low"], 1.0 + hp["eps_high"]
        obj = torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
        low, high = (adv < 0) & (r < lo), (adv > 0) & (r > hi)
        c = hp.get("dual_clip_c")
        if c is not None:
            dual = (adv < 0) & (obj < c * adv)
            obj = torch.where(dual, c * adv, obj)
            extra["dual_clip_frac"] = dual
        loss = -obj
    elif method == "dppo_tv":
        diff = torch.exp(lp.detach()) - torch.exp(b)
        high, low = (adv > 0) & (diff > hp["delta_high"]), (adv < 0) & (diff < -hp["delta_low"])
        loss = -torch.where(high | low, torch.zeros_like(ratio), ratio * adv)
    elif method == "cispo":
        lo, hi = 1.0 - hp["eps_low"], 1.0 + hp["eps_high"]
        loss = -(r.clamp(lo, hi) * adv * lp)
        low, high = r < lo, r > hi
    else:  # reinforce
        loss = -(ratio * adv)
        low = high = torch.zeros_like(mask)
    return loss, r, low & mask, high & mask, extra


def _corrections(corrections, hp, rho_log, mask, seq, weighted):
    """-> (weight [T] detached, keep [T] bool, per-correction dropped masks)."""
    keep = mask.clone()
    dropped = {}
    rho = torch.exp(rho_log)
    if "mis" in corrections:
        if hp["mis_level"] == "token":
            bad = (rho < hp["mis_low"]) | (rho > hp["mis_high"])
        else:
            seq_ids, S, _ = seq
            seq_rho = torch.exp(_segment_sum(rho_log, seq_ids, S))
            bad = ((seq_rho < hp["mis_low"]) | (seq_rho > hp["mis_high"]))[seq_ids]
        dropped["mis"] = bad & mask
    if "icepop" in corrections:
        dropped["icepop"] = ((rho < hp["icepop_alpha"]) | (rho > hp["icepop_beta"])) & mask
    if "geo_rs" in corrections:
        seq_ids, S, n_i = seq
        geo = torch.exp(_segment_sum(rho_log, seq_ids, S) / n_i.clamp_min(1))
        dropped["geo_rs"] = ((geo < hp["geo_rs_low"]) | (geo > hp["geo_rs_high"]))[seq_ids] & mask
    if "veto" in corrections:
        seq_ids, S, _ = seq
        tiny = ((rho < hp["veto_threshold"]) & mask).to(torch.int32)
        dropped["veto"] = (_segment_sum(tiny, seq_ids, S) > 0)[seq_ids] & mask
    for d in dropped.values():
        keep &= ~d
    weight = torch.ones_like(rho)
    if weighted and any(c in corrections for c in ("tis", "mis", "icepop")):
        weight = rho.clamp(max=hp["tis_cap"]) if "tis" in corrections else rho
    return weight, keep, dropped


def _aggregate(loss, mask, aggregation, seq, norm_constant, global_num_tokens):
    masked = torch.where(mask, loss, torch.zeros_like(loss))
    if aggregation == "token_mean":
        return masked.sum() / mask.sum().clamp_min(1)
    if aggregation == "token_sum_norm":
        return masked.sum() / float(norm_constant)
    if aggregation == "global_token_sum":
        return masked.sum() / global_num_tokens
    seq_ids, S, n_i = seq
    per_seq = _segment_sum(masked, seq_ids, S) / n_i.clamp_min(1)
    return per_seq.sum() / (n_i > 0).sum().clamp_min(1)


def policy_loss(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    method: str = "ppo_clip",
    old_logprobs: torch.Tensor | None = None,
    corrections: Sequence[str] | str = (),
    aggregation: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    norm_constant: float | None = None,
    global_num_tokens: float | torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    **hparams,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of a packed batch and its metrics (see the module docstring for formulas).

    Args:
        logprobs: [T] trainer log-probs of the sampled tokens (differentiable).
        inference_logprobs: [T] the sampler's log-probs of the same tokens.
        advantages: [T] per-token advantages (a sequence's advantage repeated over its tokens).
        loss_mask: [T] bool, True on trained tokens (completions); other positions may hold anything.
        method / corrections / aggregation: see the module docstring; aggregation None picks the
            method's source default (gspo: seq_mean_token_mean, else token_mean).
        old_logprobs: [T] pi_old log-probs (recomputed by the trainer before the update), or None
            for bypass mode.
        cu_seqlens: [S+1] int offsets of the packed sequences (needed by the sequence-level parts).
        norm_constant / global_num_tokens: the denominators of token_sum_norm / global_token_sum.
        entropy: [T] optional per-token entropy, only logged.
        **hparams: eps_low, eps_high, dual_clip_c, delta_low, delta_high, kl_coef, tis_cap, mis_low,
            mis_high, mis_level, icepop_alpha, icepop_beta, geo_rs_low, geo_rs_high, veto_threshold;
            defaults per method/correction in DEFAULT_HPARAMS. A name the chosen method and
            corrections do not use raises ValueError.

    Returns: (loss, metrics): a scalar loss and a dict of detached scalars — mismatch_kl (k3,
    trainer vs inference), policy_kl (k3, trainer vs behaviour), ratio_mean/ratio_max (the method's
    importance ratio), ess (normalised effective sample size of pi_theta/pi_inference),
    clip_frac_low/clip_frac_high (tokens clipped or masked by the method), dual_clip_frac,
    correction_drop_frac and <correction>_drop_frac, entropy, num_tokens.
    """
    corrections, aggregation, hp = _validate(
        logprobs, inference_logprobs, advantages, loss_mask, method, old_logprobs, corrections, aggregation,
        cu_seqlens, norm_constant, global_num_tokens, entropy, hparams)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    # Positions outside the mask may hold placeholders (prompt tokens): zero their log-ratios so a
    # wild value there cannot overflow into inf * 0 = NaN.
    lp = torch.where(mask, logprobs.to(dtype), zero)
    ilp = torch.where(mask, inference_logprobs.to(dtype), zero)
    b = ilp if old_logprobs is None else torch.where(mask, old_logprobs.to(dtype), zero)
    adv = torch.where(mask, advantages.to(dtype), zero)
    log_ratio = lp - b

    seq = None
    if cu_seqlens is not None:
        T = lp.shape[0]
        seq_ids = seq_ids_from_cu_seqlens(cu_seqlens.to(lp.device), T)
        S = cu_seqlens.numel() - 1
        seq = (seq_ids, S, _segment_sum(mask.to(dtype), seq_ids, S))

    pg, ratio, low, high, extra = _method_loss(method, lp, b, adv, mask, log_ratio, seq, hp)
    rho_log = (b - ilp) if old_logprobs is not None else (lp.detach() - ilp)
    weight, keep, dropped = _corrections(corrections, hp, rho_log, mask, seq, weighted=old_logprobs is not None)
    per_token = torch.where(keep, weight * pg, torch.zeros_like(pg))
    if hp["kl_coef"]:
        per_token = per_token + hp["kl_coef"] * log_ratio * log_ratio
    loss = _aggregate(per_token, mask, aggregation, seq, norm_constant, global_num_tokens)

    with torch.no_grad():
        train_vs_inf = lp.detach() - ilp
        ratio_on_mask = torch.where(mask, ratio, torch.zeros_like(ratio))
        metrics = {
            "mismatch_kl": masked_mean(kl_k3(train_vs_inf), mask),
            "policy_kl": masked_mean(kl_k3(log_ratio.detach()), mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": ratio_on_mask.max() if ratio.numel() else zero,
            "ess": effective_sample_size(torch.exp(train_vs_inf), mask),
            "clip_frac_low": masked_mean(low.to(dtype), mask),
            "clip_frac_high": masked_mean(high.to(dtype), mask),
            "correction_drop_frac": masked_mean((mask & ~keep).to(dtype), mask),
            "num_tokens": mask.sum().to(dtype),
        }
        for name, flags in extra.items():
            metrics[name] = masked_mean(flags.to(dtype), mask)
        for name, d in dropped.items():
            metrics[f"{name}_drop_frac"] = masked_mean(d.to(dtype), mask)
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy.detach().to(dtype), mask)
        metrics = {k: v.detach() for k, v in metrics.items()}
    return loss, metrics
