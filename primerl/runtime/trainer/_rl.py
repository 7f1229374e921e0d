"""Adapters to primerl.rl (reference model, policy loss) in the shapes the trainer uses.

The trainer routes every loss setting of ``trainer.loss`` through this module: ``reference_model``
once at start (a frozen copy of the initial policy when ``ref_kl_coef > 0``; under ``trainer.lora``
the policy itself, run with its adapters off), then per optimizer
step ``loss_counts`` (on the host, from the packed CPU batch, while the step is prepared; all-reduced
by the trainer), per micro-batch ``reference_logprobs`` and ``policy_loss``, and ``LossMetrics`` for
the metrics of the extra terms. Nothing here reads a device value on the host during the step's
device work: metrics stay 0-d tensors and are read once per optimizer step by the trainer.
"""

from __future__ import annotations

import contextlib
import copy

import torch


def reference_model(loss_cfg, policy: torch.nn.Module, *, lora: bool = False) -> torch.nn.Module | None:
    """When the reference-KL term is on (``trainer.loss.ref_kl_coef > 0``): a frozen copy of
    ``policy`` (call it on the freshly built initial policy), or with ``lora`` (``trainer.lora``, the
    base frozen) ``policy`` itself, which :func:`reference_logprobs` runs with its adapters disabled:
    the base, without a second copy of it. Else None."""
    if not loss_cfg.ref_kl_coef > 0:
        return None
    if lora:
        return policy
    ref = copy.deepcopy(policy).eval()
    ref.requires_grad_(False)
    return ref


def reference_logprobs(ref_model: torch.nn.Module | None, logprob_fn) -> torch.Tensor | None:
    """``logprob_fn(ref_model)`` (the trainer's per-token log-probs of one micro-batch under a model)
    without autograd, or None when there is no reference model. A model with LoRA adapters (the
    policy of a LoRA job) runs with them disabled (``primerl.models.lora.adapters_disabled``)."""
    if ref_model is None:
        return None
    if getattr(ref_model, "lora", None) is None:
        with torch.no_grad():
            return logprob_fn(ref_model).detach()
    with torch.no_grad(), _as_reference(ref_model):
        return logprob_fn(ref_model).detach()


@contextlib.contextmanager
def _as_reference(policy: torch.nn.Module):
    """The LoRA policy as its own reference: adapters off and eval mode (as the frozen copy was: the
    MoE layers then count no tokens for the expert-bias update), both restored after."""
    from primerl.models.lora import adapters_disabled

    training = policy.training
    policy.eval()
    try:
        with adapters_disabled(policy):
            yield
    finally:
        policy.train(training)


def _pg_mask(mb, loss_cfg) -> torch.Tensor:
    mask = mb.loss_mask
    if mb.loss_weights is not None:
        mask = mask & (mb.loss_weights != 0)
    return mask & (mb.advantages != 0) if loss_cfg.drop_zero_advantage else mask


def loss_counts(mbs, loss_cfg) -> torch.Tensor:
    """float64 [3] (CPU) over this rank's micro-batches, which must still be the packed CPU tensors
    (host-side planning: these reads are not device synchronisations): loss tokens, sequences with policy-gradient
    tokens, policy-gradient tokens (loss tokens less the zero-advantage ones when
    ``drop_zero_advantage`` and less those of weight 0; with per-token ``loss_weights``, the sum
    of their weights). The trainer sums it over ranks and passes it to ``policy_loss``."""
    n_tok = n_seq = n_pg = 0
    for mb in mbs:
        pg = _pg_mask(mb, loss_cfg)
        cu = mb.cu_seqlens.tolist()
        n_tok += int(mb.loss_mask.sum())
        w = mb.loss_weights
        n_pg += int(pg.sum()) if w is None else float(torch.where(pg, w.double(), 0.0).sum())
        n_seq += sum(bool(pg[a:b].any()) for a, b in zip(cu[:-1], cu[1:]))
    return torch.tensor([n_tok, n_seq, n_pg], dtype=torch.float64)


def policy_loss(logprobs, mb, loss_cfg, counts, *, entropy=None, ref_logprobs=None):
    """The configured ``primerl.rl.losses.policy_loss`` on one micro-batch, normalised by the global
    ``counts`` (``loss_counts`` summed over micro-batches and ranks, as Python floats: read once
    on the host when the step is prepared) so that summing over every micro-batch and rank gives
    the batch-level loss. -> (loss, metrics as detached 0-d tensors; no host read)."""
    from primerl.rl.losses import policy_loss as _policy_loss

    hp = dict(loss_cfg.hparams)
    if isinstance(counts, torch.Tensor):
        raise TypeError("policy_loss: counts must be Python numbers (loss_counts(...).tolist() on the host), "
                        "not a tensor: reading it here would be a host read per micro-batch")
    n_tok, n_seq, n_pg = (max(float(c), 1.0) for c in counts[:3])
    agg = loss_cfg.aggregation
    kw: dict = {}
    if agg in ("token_mean", "global_token_sum"):
        agg, kw["global_num_tokens"] = "global_token_sum", n_pg
    elif agg == "token_sum_norm":
        if "norm_constant" not in hp:
            raise ValueError("trainer.loss.aggregation = 'token_sum_norm' needs trainer.loss.hparams.norm_constant")
        kw["norm_constant"] = hp.pop("norm_constant")
    elif agg == "seq_mean_token_mean":
        kw["global_num_seqs"] = n_seq
    else:
        raise ValueError(f"trainer.loss.aggregation {agg!r} is not one of token_mean, global_token_sum, "
                         "token_sum_norm, seq_mean_token_mean")
    terms = {}
    if loss_cfg.ref_kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("trainer.loss.ref_kl_coef > 0 needs reference log-probs (the trainer's reference model)")
        kw["ref_logprobs"], hp["ref_kl_coef"], terms["ref_kl"] = ref_logprobs, loss_cfg.ref_kl_coef, n_tok
    if loss_cfg.sft_coef > 0:
        kw["sft_weights"], hp["sft_coef"], terms["sft"] = mb.loss_mask.to(logprobs.dtype), loss_cfg.sft_coef, n_tok
    loss, metrics = _policy_loss(logprobs, mb.inference_logprobs, mb.advantages, mb.loss_mask,
                                 method=loss_cfg.method, corrections=tuple(loss_cfg.corrections), aggregation=agg,
                                 cu_seqlens=mb.cu_seqlens, entropy=entropy,
                                 drop_zero_advantage=loss_cfg.drop_zero_advantage,
                                 loss_weights=mb.loss_weights,
                                 global_term_tokens=terms or None, **kw, **hp)
    return loss, metrics


def topk_distill_term(model, hidden, mb, targets, logprobs, coef: float, counts, num_tokens: int):
    """The teacher's top-k term of one micro-batch (``distill.topk``; ``primerl.rl.distill``):
    ``coef`` * the forward KL from the teacher's renormalised top-k to the student, summed over the
    micro-batch's loss tokens and divided by the step's (``counts[0]``, all ranks), so that the sum
    over micro-batches and ranks is the mean per loss token. ``hidden`` [t, D], ``targets`` and
    ``logprobs`` [t]: the policy's forward and fused log-probs of ``mb`` (a ``next_token_batch``).
    -> (the term, the micro-batch's mean KL per loss token as a detached 0-d tensor)."""
    from primerl.rl.distill import student_topk_logprobs, topk_distill_kl

    temperature = 1.0 if mb.temperatures is None else mb.temperatures
    student = student_topk_logprobs(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight, targets, logprobs,
                                    mb.teacher_topk_ids, temperature=temperature)
    kl = topk_distill_kl(student, mb.teacher_topk_logprobs, mb.loss_mask).sum()
    return coef * kl / max(float(counts[0]), 1.0), kl.detach() / max(num_tokens, 1)


class LossMetrics:
    """Means over a step's micro-batches (and ranks) of the metrics of the policy-loss options, each
    weighted by the tokens it is a mean over (policy_kl and a custom method's metrics: the
    policy-gradient tokens; the rest: the loss tokens), and the terms' values (pg_loss,
    ref_kl_loss: already normalised by the global counts) summed. ``add`` per micro-batch (on the
    device, no host read), then once per step: ``sums()`` (the trainer all-reduces it with its own
    statistics and reads everything in one host read) and ``result(values)`` on the values read.
    Keys are fixed by the config so every rank reduces the same tensor; a custom method's own
    metrics (``custom()``, not reduced) are logged only with one rank."""

    def __init__(self, loss_cfg, world_size: int = 1, device: torch.device | str = "cpu", extra: tuple = ()):
        self.keys = ["zero_adv_frac", "correction_drop_frac", "policy_kl", "pg_loss", *extra]
        if loss_cfg.ref_kl_coef > 0:
            self.keys += ["ref_kl", "ref_kl_loss", "ref_kl_drop_frac"]
        if loss_cfg.sft_coef > 0:
            self.keys += ["sft_nll"]
        self.world_size = world_size
        self._sums = torch.zeros(len(self.keys) + 2, dtype=torch.float64, device=device)  # + loss tokens, pg tokens
        self._custom: dict[str, torch.Tensor] = {}

    def add(self, metrics: dict[str, torch.Tensor], num_tokens: int) -> None:
        """``metrics``: ``policy_loss``'s 0-d tensors of one micro-batch; ``num_tokens``: its loss
        tokens (a host int from the batch's preparation)."""
        zero = self._sums.new_zeros(())
        pg = torch.as_tensor(metrics.get("pg_tokens", zero)).to(self._sums)
        row = [torch.as_tensor(metrics.get(key, zero)).to(self._sums) * self._weight(key, num_tokens, pg)
               for key in self.keys]
        self._sums += torch.stack([*row, zero + num_tokens, pg])
        for key, v in metrics.items():
            if key.startswith("custom/"):
                v = torch.as_tensor(v).to(self._sums) * pg
                self._custom[key] = self._custom[key] + v if key in self._custom else v

    @staticmethod
    def _weight(key: str, loss_tokens, pg_tokens):
        return 1.0 if key in ("pg_loss", "ref_kl_loss") else pg_tokens if key == "policy_kl" else loss_tokens

    def sums(self) -> torch.Tensor:
        """float64 [len(keys) + 2] on the device: the weighted sums, loss tokens, pg tokens (summed
        over ranks by the caller)."""
        return self._sums

    def custom(self) -> tuple[list[str], torch.Tensor]:
        """A custom method's metric names and their pg-token-weighted sums (this rank only)."""
        keys = list(self._custom)
        return keys, torch.stack([self._custom[k] for k in keys]) if keys else self._sums.new_zeros(0)

    def result(self, sums: list[float], custom: list[float] = ()) -> dict[str, float]:
        """The step's metrics from the values of ``sums()`` (all-reduced) and ``custom()`` read on the host."""
        n, n_pg = max(float(sums[-2]), 1.0), float(sums[-1])
        n_pg = n_pg if n_pg > 0 else 1.0
        out = {f"loss/{k}": float(sums[i]) / self._weight(k, n, n_pg) for i, k in enumerate(self.keys)}
        if self.world_size == 1:
            out.update({f"loss/{k}": v / n_pg for k, v in zip(self._custom, custom)})
        return out
