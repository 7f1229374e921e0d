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
- ``ipo``       l = -keep r A + kl_coef (lp - b)^2 with a symmetric trust region: keep drops a token
  whose probability moved more than ipo_threshold in either direction, |p - p_b| > ipo_threshold
  (0.1); the KL term stays on dropped tokens. prime-rl's IPO loss.
- ``gspo``      s_i = exp(mean_{t in i} (lp - b)) the sequence's geometric-mean ratio, gradient
  through every token of i; l = -min(s_i A, clip(s_i, 1-eps_low, 1+eps_high) A).
  GSPO (Zheng et al. 2025, Qwen3), eps 3e-4 / 4e-4; aggregation defaults to seq_mean_token_mean.
- ``gspo_token`` s_it = sg(s_i) * exp(lp_t - sg(lp_t)): same value as s_i, gradient through token
  t only, so token-level advantages can differ within a sequence (GSPO-token, same paper).
- ``cispo``     l = -sg(clip(r, 1-eps_low, 1+eps_high)) A lp: the clipped importance weight is a
  constant and every token keeps its gradient. CISPO (MiniMax-M1, 2025): no lower bound
  (eps_low = 1) and eps_high = 0.28 by default.
- ``reinforce`` l = -r A: the importance-weighted policy gradient, unclipped (r = 1 on policy).
- ``"package.module:function"`` (or a callable): a custom method, ``fn(inputs: LossInputs,
  **hparams) -> [T] per-token loss`` or ``([T] loss, {name: scalar})`` (see
  :mod:`primerl.rl.loss_terms`); the hparams that no correction or term uses go to ``fn``.

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
- ``sequence_mask`` the two-sided veto: drop a sequence when any token's rho is below
  sequence_mask_low (0) or above sequence_mask_high (100) (prime-rl's sequence_mask_low/high).
With old_logprobs, tis / mis / icepop also weight the kept tokens by rho (truncated at tis_cap
when tis is on), applied once however many of them are on. Dropped tokens still count in the
aggregation's denominator (the normalisation is a property of the batch, not of the filters).

The policy-gradient term's tokens M are the loss mask, less the tokens whose ``loss_weights`` is
0 and, with ``drop_zero_advantage=True``, less the tokens whose advantage is exactly 0 (prime-rl's
default: a uniform group then leaves the loss and its denominator instead of diluting it; its KL
term goes with it). Each token's loss is multiplied by its weight w (1 without ``loss_weights``).

Aggregations (``aggregation=``) of the policy-gradient term, over M:
``token_mean`` sum w l / sum w;  ``seq_mean_token_mean`` mean over sequences with tokens in M of
(sum_{t in i} w l / sum_{t in i} w) (divided by ``global_num_seqs`` instead of the local count when
given);  ``token_sum_norm`` sum w l / norm_constant (Dr. GRPO's constant, e.g. batch size x max
generation length);  ``global_token_sum`` sum w l / global_num_tokens, the term's weight sum over
all data/context-parallel ranks, so that summing the ranks' gradients gives the global token mean.

Further terms (:mod:`primerl.rl.loss_terms`), each normalised on its own tokens and added with its
coefficient: ``ref_logprobs`` adds ref_kl_coef (1) x the reference-KL term on the loss tokens
(``ref_weights`` to weight or select them); ``sft_weights`` adds sft_coef (1) x the cross-entropy on
the tokens with non-zero weight (loss mask or not). Their denominators default to their local
weight sums; ``global_term_tokens={"ref_kl": n, "sft": n}`` gives global ones.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from primerl.kernels._value_checks import check_values

from .loss_spec import (AGGREGATIONS, CORRECTIONS, DEFAULT_HPARAMS, LOSS_METHODS,  # noqa: F401 - re-exported
                        SEQUENCE_LEVEL_CORRECTIONS, TERMS, check_loss_spec, resolve_method)
from .loss_terms import LossInputs, ref_kl_metric, ref_kl_per_token, term_mean
from .metrics import effective_sample_size, kl_k3, masked_mean

__all__ = ["policy_loss", "LOSS_METHODS", "CORRECTIONS", "SEQUENCE_LEVEL_CORRECTIONS", "AGGREGATIONS",
           "TERMS", "DEFAULT_HPARAMS", "check_loss_spec", "resolve_method", "seq_ids_from_cu_seqlens"]

def seq_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """[S+1] offsets -> [T] int64 sequence index of every token."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths, output_size=T)


def _segment_sum(x: torch.Tensor, seq_ids: torch.Tensor, S: int) -> torch.Tensor:
    return torch.zeros(S, dtype=x.dtype, device=x.device).index_add(0, seq_ids, x)


def _positive(x: torch.Tensor) -> torch.Tensor:
    """x where x > 0, else 1 (the denominator of an empty term)."""
    return torch.where(x > 0, x, torch.ones_like(x))


def _check_tensors(logprobs, named, weights, num_seqs):
    """Shapes, devices and dtypes of the per-token tensors; ``num_seqs`` (S, or None without
    cu_seqlens) also admits advantages [S]. -> T."""
    if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 1 or not logprobs.dtype.is_floating_point:
        raise ValueError(f"policy_loss: logprobs must be a 1-D float tensor [T] (one entry per packed token), got "
                         f"{getattr(logprobs, 'dtype', type(logprobs))} {tuple(getattr(logprobs, 'shape', ()))}")
    T = logprobs.shape[0]
    for name, x in {**named, **weights}.items():
        per_seq = name == "advantages" and num_seqs is not None and isinstance(x, torch.Tensor) \
            and x.dim() == 1 and x.shape[0] == num_seqs
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or (x.shape[0] != T and not per_seq):
            also = ""
            if name == "advantages" and num_seqs is not None:
                also = f" or [S={num_seqs}] (one per sequence of cu_seqlens)"
            raise ValueError(f"policy_loss: {name} must be a 1-D tensor [T={T}] like logprobs{also}, got "
                             f"{tuple(getattr(x, 'shape', ())) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.device != logprobs.device:
            raise ValueError(f"policy_loss: {name} is on {x.device} but logprobs is on {logprobs.device}")
        if name == "loss_mask":
            if x.dtype != torch.bool:
                raise ValueError(f"policy_loss: loss_mask must be a bool tensor (or 0/1 float/int), got {x.dtype}")
        elif not x.dtype.is_floating_point:
            raise ValueError(f"policy_loss: {name} must be floating point, got {x.dtype}")
    for name, x in weights.items():
        check_values((torch.isfinite(x) & (x >= 0)).all(), f"policy_loss: {name} must be finite and >= 0",
                     lambda x=x: f"min {float(x.min())}, non-finite {int((~torch.isfinite(x)).sum())}")
    return T


def _bool_mask(loss_mask):
    """A 0/1 float or integer mask -> bool (a fractional weight is ``loss_weights``' job)."""
    if not isinstance(loss_mask, torch.Tensor) or loss_mask.dtype == torch.bool:
        return loss_mask
    if not (loss_mask.dtype.is_floating_point or loss_mask.dtype in (torch.uint8, torch.int8, torch.int16,
                                                                         torch.int32, torch.int64)):
        raise ValueError(f"policy_loss: loss_mask must be bool (or 0/1 float/int), got {loss_mask.dtype}")
    check_values(((loss_mask == 0) | (loss_mask == 1)).all(),
                 "policy_loss: a float/int loss_mask must hold only 0 and 1 (weights go in loss_weights=; "
                 "convert with loss_mask.bool())",
                 lambda: f"values {torch.unique(loss_mask)[:8].tolist()}")
    return loss_mask != 0


def _positive_number(name: str, x) -> None:
    """x > 0, for a Python number (checked here) or a tensor (a device assertion)."""
    if isinstance(x, torch.Tensor):
        check_values((x > 0).all(), f"policy_loss: {name} must be > 0", lambda: f"got {x.tolist()}")
    elif not float(x) > 0:
        raise ValueError(f"policy_loss: {name} must be > 0, got {x}")


def _validate(logprobs, inference_logprobs, advantages, loss_mask, method, old_logprobs, corrections, aggregation,
              cu_seqlens, norm_constant, global_num_tokens, global_num_seqs, entropy, ref_logprobs, weights,
              global_term_tokens, hparams):
    terms = tuple(t for t, on in (("ref_kl", ref_logprobs is not None), ("sft", "sft_weights" in weights)) if on)
    if "ref_weights" in weights and ref_logprobs is None:
        raise ValueError("policy_loss: ref_weights weight the reference-KL term, which needs ref_logprobs")
    name, custom, fn_kwargs, corrections, aggregation, hp = check_loss_spec(method, corrections, aggregation,
                                                                           hparams, terms)
    if "tis" in corrections and old_logprobs is None:
        raise ValueError("policy_loss: correction 'tis' needs old_logprobs (in bypass mode the method's ratio "
                         "pi_theta/pi_inference already is the importance weight; bound it with 'mis' or 'icepop')")

    named = {"inference_logprobs": inference_logprobs, "advantages": advantages, "loss_mask": loss_mask}
    for key, x in (("old_logprobs", old_logprobs), ("entropy", entropy), ("ref_logprobs", ref_logprobs)):
        if x is not None:
            named[key] = x
    num_seqs = cu_seqlens.numel() - 1 if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 else None
    T = _check_tensors(logprobs, named, weights, num_seqs)

    needs_seqs = (name in ("gspo", "gspo_token") or aggregation == "seq_mean_token_mean"
                  or any(c in corrections for c in SEQUENCE_LEVEL_CORRECTIONS)
                  or ("mis" in corrections and hp["mis_level"] == "sequence"))
    if needs_seqs and cu_seqlens is None:
        raise ValueError(f"policy_loss: method={name!r}, corrections={corrections}, aggregation={aggregation!r} "
                         "work per sequence and need cu_seqlens")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 \
                or cu_seqlens.dtype.is_floating_point:
            raise ValueError(f"policy_loss: cu_seqlens must be a 1-D integer tensor [S+1], got "
                             f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens))} "
                             f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
        check_values((cu_seqlens[0] == 0) & (cu_seqlens[-1] == T) & (cu_seqlens[1:] >= cu_seqlens[:-1]).all(),
                     # a symbolic T (dynamic shapes) stays out of the message: formatting it would specialise T
                     "policy_loss: cu_seqlens must start at 0, be non-decreasing and end at "
                     + ("T = logprobs.shape[0]" if torch.compiler.is_compiling() else f"T={T}"),
                     lambda: f"got {cu_seqlens.tolist()}")
    for agg, key, x in (("token_sum_norm", "norm_constant", norm_constant),
                        ("global_token_sum", "global_num_tokens", global_num_tokens)):
        if aggregation == agg:
            if x is None:
                raise ValueError(f"policy_loss: aggregation {agg!r} needs {key} > 0, got None")
            _positive_number(key, x)
    if global_num_seqs is not None:
        if aggregation != "seq_mean_token_mean":
            raise ValueError(f"policy_loss: global_num_seqs ({global_num_seqs}) is used only by aggregation "
                             f"'seq_mean_token_mean', got aggregation {aggregation!r}")
        _positive_number("global_num_seqs", global_num_seqs)
    for key, n in (global_term_tokens or {}).items():
        if key not in terms:
            raise ValueError(f"policy_loss: global_term_tokens[{key!r}] = {n}: keys must name a term in use {terms}")
        _positive_number(f"global_term_tokens[{key!r}]", n)
    return name, custom, fn_kwargs, corrections, aggregation, hp


def _method_loss(method, lp, b, adv, mask, log_ratio, seq, hp):
    """-> (per-token loss [T], method ratio [T] detached, clip/mask flags low/high [T] bool, extra flags)."""
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
    elif method in ("dppo_tv", "ipo"):
        diff = torch.exp(lp.detach()) - torch.exp(b)
        if method == "dppo_tv":  # only the move in the advantage's direction leaves the trust region
            high, low = (adv > 0) & (diff > hp["delta_high"]), (adv < 0) & (diff < -hp["delta_low"])
        else:
            high, low = diff > hp["ipo_threshold"], diff < -hp["ipo_threshold"]
        loss = -torch.where(high | low, torch.zeros_like(ratio), ratio * adv)
    elif method == "cispo":
        lo, hi = 1.0 - hp["eps_low"], 1.0 + hp["eps_high"]
        loss = -(r.clamp(lo, hi) * adv * lp)
        low, high = r < lo, r > hi
    else:  # reinforce
        loss = -(ratio * adv)
        low = high = torch.zeros_like(mask)
    return loss, r, low & mask, high & mask, extra


def _custom_loss(fn, name, inputs: LossInputs, kwargs, dtype):
    """-> (per-token loss [T], ratio [T] detached, no flags, the function's scalar metrics)."""
    out = fn(inputs, **kwargs)
    metrics = {}
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], dict):
            raise ValueError(f"policy_loss: custom method {name} must return a [T] tensor or ([T] tensor, dict), "
                             f"got a tuple of {len(out)}")
        out, metrics = out
    T = inputs.logprobs.shape[0]
    if not isinstance(out, torch.Tensor) or out.shape != (T,) or not out.dtype.is_floating_point:
        raise ValueError(f"policy_loss: custom method {name} must return the per-token loss as a float tensor [{T}], "
                         f"got {getattr(out, 'dtype', type(out))} {tuple(getattr(out, 'shape', ()))}")
    r = torch.exp(inputs.logprobs - inputs.behaviour_logprobs).detach()
    no = torch.zeros_like(inputs.loss_mask)
    return out.to(dtype), r, no, no, {f"custom/{k}": torch.as_tensor(v).detach() for k, v in metrics.items()}


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
    for name, lo, hi in (("veto", "veto_threshold", None),
                         ("sequence_mask", "sequence_mask_low", "sequence_mask_high")):
        if name in corrections:
            seq_ids, S, _ = seq
            bad = rho < hp[lo]
            if hi is not None:
                bad = bad | (rho > hp[hi])
            dropped[name] = (_segment_sum((bad & mask).to(torch.int32), seq_ids, S) > 0)[seq_ids] & mask
    for d in dropped.values():
        keep &= ~d
    weight = torch.ones_like(rho)
    if weighted and any(c in corrections for c in ("tis", "mis", "icepop")):
        weight = rho.clamp(max=hp["tis_cap"]) if "tis" in corrections else rho
    return weight, keep, dropped


def _aggregate(loss, w, aggregation, seq_w, norm_constant, global_num_tokens, global_num_seqs):
    """The policy-gradient term from per-token losses [T] and weights [T] (0 off the term's tokens)."""
    weighted = torch.where(w != 0, w * loss, torch.zeros_like(loss))
    if aggregation == "token_mean":
        return weighted.sum() / _positive(w.sum())
    if aggregation == "token_sum_norm":
        return weighted.sum() / (norm_constant if isinstance(norm_constant, torch.Tensor) else float(norm_constant))
    if aggregation == "global_token_sum":
        return weighted.sum() / global_num_tokens
    seq_ids, S, w_i = seq_w
    per_seq = _segment_sum(weighted, seq_ids, S) / _positive(w_i)
    n = global_num_seqs if global_num_seqs is not None else (w_i > 0).sum().clamp_min(1)
    return per_seq.sum() / n


def policy_loss(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    method: str | Callable = "ppo_clip",
    old_logprobs: torch.Tensor | None = None,
    corrections: Sequence[str] | str = (),
    aggregation: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    norm_constant: float | None = None,
    global_num_tokens: float | torch.Tensor | None = None,
    global_num_seqs: float | None = None,
    entropy: torch.Tensor | None = None,
    drop_zero_advantage: bool = False,
    loss_weights: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    ref_weights: torch.Tensor | None = None,
    sft_weights: torch.Tensor | None = None,
    global_term_tokens: dict[str, float] | None = None,
    **hparams,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of a packed batch and its metrics (see the module docstring for formulas).

    Defaults differ from the job's (``primerl rl``, ``trainer.loss``): here ``method="ppo_clip"``,
    ``drop_zero_advantage=False`` and a local token mean; the job's default loss is prime-rl's,
    ``method="dppo_tv", drop_zero_advantage=True`` with the token mean taken over the global
    policy-gradient token count (``aggregation="global_token_sum"``). Pass those to get the job's
    loss. Value checks (cu_seqlens, weights, a 0/1 mask) are device assertions
    (:func:`primerl.kernels.check_values`): no host read, traceable by ``torch.compile``.

    Args:
        logprobs: [T] trainer log-probs of the sampled tokens (differentiable).
        inference_logprobs: [T] the sampler's log-probs of the same tokens.
        advantages: [T] per-token advantages (a sequence's advantage repeated over its tokens), or
            [S] one per sequence of ``cu_seqlens`` (repeated over its tokens here; when S == T the
            two readings agree only for one-token sequences, so [T] is taken).
        loss_mask: [T] bool, True on trained tokens (completions); other positions may hold
            anything. A float or integer mask of 0/1 values is accepted (other values fail a
            check: fractional weights go in ``loss_weights``).
        method: a name in LOSS_METHODS, or a custom method: ``"package.module:function"`` or a
            callable ``fn(inputs: LossInputs, **hparams) -> [T] loss | ([T] loss, metrics)``.
        corrections / aggregation: see the module docstring; aggregation None picks the method's
            source default (gspo: seq_mean_token_mean, else token_mean).
        old_logprobs: [T] pi_old log-probs (recomputed by the trainer before the update), or None
            for bypass mode.
        cu_seqlens: [S+1] int offsets of the packed sequences (needed by the sequence-level parts).
        norm_constant / global_num_tokens / global_num_seqs: the denominators of token_sum_norm /
            global_token_sum / seq_mean_token_mean (the last defaults to the local sequence count).
        entropy: [T] optional per-token entropy, only logged.
        drop_zero_advantage: remove tokens with advantage exactly 0 from the policy-gradient term
            and its denominator.

        loss_weights: [T] float >= 0, per-token weights of the policy-gradient term (0 removes a
            token from it and from its denominator).
        ref_logprobs: [T] reference-model log-probs: adds the reference-KL term on the loss tokens
            (``ref_weights`` [T] weights or selects them).
        sft_weights: [T] float >= 0: adds the cross-entropy term on the tokens with weight > 0.
        global_term_tokens: {"ref_kl": n, "sft": n}, the denominators of those terms over all
            ranks (default: their local weight sums).
        **hparams: eps_low, eps_high, dual_clip_c, delta_low, delta_high, ipo_threshold, kl_coef,
            tis_cap, mis_low, mis_high, mis_level, icepop_alpha, icepop_beta, geo_rs_low,
            geo_rs_high, veto_threshold, sequence_mask_low, sequence_mask_high, ref_kl_coef,
            ref_kl_delta, ref_kl_drift, sft_coef; defaults per method/correction/term in
            DEFAULT_HPARAMS. A name that the method, corrections and terms in use do not use raises
            ValueError, except that a custom method receives every name the others do not use.

    Returns: (loss, metrics): a scalar loss and a dict of detached scalars — mismatch_kl (k3,
    trainer vs inference), policy_kl (k3, trainer vs behaviour), ratio_mean/ratio_max (the method's
    importance ratio), ess (normalised effective sample size of pi_theta/pi_inference),
    clip_frac_low/clip_frac_high (tokens clipped or masked by the method), dual_clip_frac,
    correction_drop_frac and <correction>_drop_frac, zero_adv_frac (loss tokens with advantage 0),
    pg_loss, pg_tokens (the policy-gradient term and its weight sum), ref_kl (k3 KL to the
    reference), ref_kl_loss, ref_kl_drop_frac, sft_nll, entropy, num_tokens, custom/<name>.
    Fractions are over the loss tokens; mismatch_kl, ess and num_tokens over every loss token.
    """
    weights = {k: v for k, v in (("loss_weights", loss_weights), ("ref_weights", ref_weights),
                                 ("sft_weights", sft_weights)) if v is not None}
    loss_mask = _bool_mask(loss_mask)
    name, custom, fn_kwargs, corrections, aggregation, hp = _validate(
        logprobs, inference_logprobs, advantages, loss_mask, method, old_logprobs, corrections, aggregation,
        cu_seqlens, norm_constant, global_num_tokens, global_num_seqs, entropy, ref_logprobs, weights,
        global_term_tokens, hparams)
    if advantages.shape[0] != logprobs.shape[0]:  # [S] per sequence (checked against cu_seqlens)
        advantages = advantages[seq_ids_from_cu_seqlens(cu_seqlens.to(advantages.device), logprobs.shape[0])]
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    mask = loss_mask
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    # Positions outside the mask may hold placeholders (prompt tokens): zero their log-ratios so a
    # wild value there cannot overflow into inf * 0 = NaN.
    lp = torch.where(mask, logprobs.to(dtype), zero)
    ilp = torch.where(mask, inference_logprobs.to(dtype), zero)
    b = ilp if old_logprobs is None else torch.where(mask, old_logprobs.to(dtype), zero)
    raw_adv = torch.where(mask, advantages.to(dtype), zero)

    zero_adv = mask & (raw_adv == 0)
    pg_mask = mask
    if loss_weights is not None:
        pg_mask = pg_mask & (loss_weights != 0)
    if drop_zero_advantage:
        pg_mask = pg_mask & ~zero_adv
    w = torch.where(pg_mask, zero + 1 if loss_weights is None else loss_weights.to(dtype), zero)
    # the policy-gradient term sees its own tokens only: a dropped token contributes no value or gradient
    lp_pg, b_pg, ilp_pg, adv = (torch.where(pg_mask, x, zero) for x in (lp, b, ilp, raw_adv))
    log_ratio = lp_pg - b_pg

    seq = seq_w = None
    if cu_seqlens is not None:
        T = lp.shape[0]
        seq_ids = seq_ids_from_cu_seqlens(cu_seqlens.to(lp.device), T)
        S = cu_seqlens.numel() - 1
        seq = (seq_ids, S, _segment_sum(pg_mask.to(dtype), seq_ids, S))
        seq_w = (seq_ids, S, _segment_sum(w, seq_ids, S))

    if custom is None:
        pg, ratio, low, high, extra = _method_loss(name, lp_pg, b_pg, adv, pg_mask, log_ratio, seq, hp)
        custom_metrics = {}
    else:
        inputs = LossInputs(lp_pg, b_pg, ilp_pg, adv, pg_mask, cu_seqlens)
        pg, ratio, low, high, custom_metrics = _custom_loss(custom, name, inputs, fn_kwargs, dtype)
        extra = {}
    rho_log = (b_pg - ilp_pg) if old_logprobs is not None else (lp_pg.detach() - ilp_pg)
    weight, keep, dropped = _corrections(corrections, hp, rho_log, pg_mask, seq, weighted=old_logprobs is not None)
    per_token = torch.where(keep, weight * pg, torch.zeros_like(pg))
    if hp.get("kl_coef"):
        per_token = per_token + hp["kl_coef"] * log_ratio * log_ratio
    pg_loss = _aggregate(per_token, w, aggregation, seq_w, norm_constant, global_num_tokens, global_num_seqs)
    loss = pg_loss
    term_tokens = global_term_tokens or {}
    term_metrics = {}
    if ref_logprobs is not None:
        ref_mask = mask if ref_weights is None else mask & (ref_weights != 0)
        w_ref = torch.where(ref_mask, zero + 1 if ref_weights is None else ref_weights.to(dtype), zero)
        ref = torch.where(ref_mask, ref_logprobs.to(dtype), zero)
        lp_ref, b_ref = torch.where(ref_mask, lp, zero), torch.where(ref_mask, b, zero)
        per_ref, ref_dropped = ref_kl_per_token(lp_ref, b_ref, ref, ref_mask, hp["ref_kl_delta"], hp["ref_kl_drift"])
        ref_loss = term_mean(per_ref, w_ref, term_tokens.get("ref_kl"))
        loss = loss + hp["ref_kl_coef"] * ref_loss
        term_metrics.update(ref_kl=ref_kl_metric(lp_ref, ref, ref_mask), ref_kl_loss=ref_loss.detach(),
                            ref_kl_drop_frac=masked_mean(ref_dropped.to(dtype), ref_mask))
    if sft_weights is not None:
        w_sft = sft_weights.to(dtype)
        nll = torch.where(w_sft != 0, -logprobs.to(dtype), zero)
        sft_loss = term_mean(nll, w_sft, term_tokens.get("sft"))
        loss = loss + hp["sft_coef"] * sft_loss
        term_metrics["sft_nll"] = (w_sft * nll).sum().detach() / _positive(w_sft.sum())

    with torch.no_grad():
        train_vs_inf = lp.detach() - ilp
        ratio_on_mask = torch.where(pg_mask, ratio, torch.zeros_like(ratio))
        metrics = {
            "mismatch_kl": masked_mean(kl_k3(train_vs_inf), mask),
            "policy_kl": masked_mean(kl_k3(log_ratio.detach()), pg_mask),
            "ratio_mean": masked_mean(ratio, pg_mask),
            "ratio_max": ratio_on_mask.max() if ratio.numel() else zero,
            "ess": effective_sample_size(torch.exp(train_vs_inf), mask),
            "clip_frac_low": masked_mean(low.to(dtype), mask),
            "clip_frac_high": masked_mean(high.to(dtype), mask),
            "correction_drop_frac": masked_mean((pg_mask & ~keep).to(dtype), mask),
            "zero_adv_frac": masked_mean(zero_adv.to(dtype), mask),
            "pg_loss": pg_loss.detach(),
            "pg_tokens": w.sum(),
            "num_tokens": mask.sum().to(dtype),
            **term_metrics,
            **custom_metrics,
        }
        for key, flags in extra.items():
            metrics[key] = masked_mean(flags.to(dtype), mask)
        for key, d in dropped.items():
            metrics[f"{key}_drop_frac"] = masked_mean(d.to(dtype), mask)
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy.detach().to(dtype), mask)
        metrics = {k: v.detach() for k, v in metrics.items()}
    return loss, metrics
