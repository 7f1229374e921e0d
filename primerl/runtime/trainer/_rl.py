"""Adapters to primerl.rl (reference model, policy loss) in the shapes the trainer uses.

The trainer routes every loss setting of ``trainer.loss`` through this module: ``reference_model``
once at start (a frozen copy of the initial policy when ``ref_kl_coef > 0``), then per optimizer
step ``loss_counts`` (all-reduced by the trainer), per micro-batch ``reference_logprobs`` and
``policy_loss``, and ``LossMetrics`` for the metrics of the extra terms.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist


def reference_model(loss_cfg, policy: torch.nn.Module) -> torch.nn.Module | None:
    """A frozen copy of ``policy`` (call it on the freshly built initial policy) when the
    reference-KL term is on (``trainer.loss.ref_kl_coef > 0``), else None."""
    if not loss_cfg.ref_kl_coef > 0:
        return None
    ref = copy.deepcopy(policy).eval()
    ref.requires_grad_(False)
    return ref


def reference_logprobs(ref_model: torch.nn.Module | None, logprob_fn) -> torch.Tensor | None:
    """``logprob_fn(ref_model)`` (the trainer's per-token log-probs of one micro-batch under a model)
    without autograd, or None when there is no reference model."""
    if ref_model is None:
        return None
    with torch.no_grad():
        return logprob_fn(ref_model).detach()


def _pg_mask(mb, loss_cfg) -> torch.Tensor:
    mask = mb.loss_mask
    if mb.loss_weights is not None:
        mask = mask & (mb.loss_weights != 0)
    return mask & (mb.advantages != 0) if loss_cfg.drop_zero_advantage else mask


def loss_counts(mbs, loss_cfg) -> torch.Tensor:
    """float64 [3] over this rank's micro-batches: loss tokens, sequences with policy-gradient
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
    ``counts`` (``loss_counts`` summed over micro-batches and ranks) so that summing over every
    micro-batch and rank gives the batch-level loss. -> (loss, float metrics)."""
    from primerl.rl.losses import policy_loss as _policy_loss

    hp = dict(loss_cfg.hparams)
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
    return loss, {k: float(v) for k, v in metrics.items()}


class LossMetrics:
    """Means over a step's micro-batches (and ranks) of the metrics of the policy-loss options, each
    weighted by the tokens it is a mean over (policy_kl and a custom method's metrics: the
    policy-gradient tokens; the rest: the loss tokens), and the terms' values (pg_loss,
    ref_kl_loss: already normalised by the global counts) summed. ``add`` per micro-batch, ``result`` once per
    step (collective when distributed: every rank calls it). Keys are fixed by the config so every
    rank reduces the same tensor; a custom method's own metrics are logged only with one rank."""

    def __init__(self, loss_cfg, world_size: int = 1):
        self.keys = ["zero_adv_frac", "correction_drop_frac", "policy_kl", "pg_loss"]
        if loss_cfg.ref_kl_coef > 0:
            self.keys += ["ref_kl", "ref_kl_loss", "ref_kl_drop_frac"]
        if loss_cfg.sft_coef > 0:
            self.keys += ["sft_nll"]
        self.world_size = world_size
        self.sums = torch.zeros(len(self.keys) + 2, dtype=torch.float64)  # + loss tokens, pg tokens
        self.custom: dict[str, float] = {}

    def add(self, metrics: dict[str, float], num_tokens: int) -> None:
        pg = metrics.get("pg_tokens", 0.0)
        for i, key in enumerate(self.keys):
            self.sums[i] += metrics.get(key, 0.0) * self._weight(key, num_tokens, pg)
        self.sums[-2] += num_tokens
        self.sums[-1] += pg
        for key, v in metrics.items():
            if key.startswith("custom/"):
                self.custom[key] = self.custom.get(key, 0.0) + v * pg

    @staticmethod
    def _weight(key: str, loss_tokens: float, pg_tokens: float) -> float:
        return 1.0 if key in ("pg_loss", "ref_kl_loss") else pg_tokens if key == "policy_kl" else loss_tokens

    def result(self) -> dict[str, float]:
        sums = self.sums.clone()
        if self.world_size > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        n, n_pg = max(float(sums[-2]), 1.0), float(sums[-1])
        n_pg = n_pg if n_pg > 0 else 1.0
        out = {f"loss/{k}": float(sums[i]) / self._weight(k, n, n_pg) for i, k in enumerate(self.keys)}
        if self.world_size == 1:
            out.update({f"loss/{k}": v / n_pg for k, v in self.custom.items()})
        return out
