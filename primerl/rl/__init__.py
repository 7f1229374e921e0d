"""Layer 2: thin, composable RL modules: advantages, policy losses, packing, environments.

The names below are imported from their modules on first access: a process that only reads a job's
configuration (the launcher, ``--dry-run``) does not load torch through them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports as _lazy_exports

_EXPORTS = {
    **dict.fromkeys(("Advantages", "drgrpo", "grpo", "linear_length_penalty", "max_rl", "rloo"), "advantages"),
    **dict.fromkeys(("DistillAdvantages", "distill_advantages", "student_topk_logprobs", "topk_distill_kl"),
                    "distill"),
    "LossInputs": "loss_terms",
    **dict.fromkeys(("AGGREGATIONS", "CORRECTIONS", "DEFAULT_HPARAMS", "LOSS_METHODS", "policy_loss",
                     "seq_ids_from_cu_seqlens"), "losses"),
    **dict.fromkeys(("effective_sample_size", "kl_estimate", "kl_k1", "kl_k2", "kl_k3", "masked_mean"), "metrics"),
    **dict.fromkeys(("MicroBatch", "Sample", "pack", "packing_stats"), "packing"),
    **dict.fromkeys(("next_token_batch", "next_token_targets", "token_aligned"), "next_token"),
}

__all__ = [
    "Advantages", "grpo", "drgrpo", "rloo", "max_rl", "linear_length_penalty",
    "DistillAdvantages", "distill_advantages", "student_topk_logprobs", "topk_distill_kl",
    "LossInputs", "policy_loss", "AGGREGATIONS", "CORRECTIONS", "DEFAULT_HPARAMS", "LOSS_METHODS",
    "seq_ids_from_cu_seqlens",
    "effective_sample_size", "kl_estimate", "kl_k1", "kl_k2", "kl_k3", "masked_mean",
    "MicroBatch", "Sample", "pack", "packing_stats",
    "next_token_batch", "next_token_targets", "token_aligned",
]

if TYPE_CHECKING:
    from .advantages import Advantages, drgrpo, grpo, linear_length_penalty, max_rl, rloo  # noqa: F401
    from .distill import DistillAdvantages, distill_advantages, student_topk_logprobs, topk_distill_kl  # noqa: F401
    from .loss_terms import LossInputs  # noqa: F401
    from .losses import (AGGREGATIONS, CORRECTIONS, DEFAULT_HPARAMS, LOSS_METHODS, policy_loss,  # noqa: F401
                         seq_ids_from_cu_seqlens)
    from .metrics import effective_sample_size, kl_estimate, kl_k1, kl_k2, kl_k3, masked_mean  # noqa: F401
    from .next_token import next_token_batch, next_token_targets, token_aligned  # noqa: F401
    from .packing import MicroBatch, Sample, pack, packing_stats  # noqa: F401

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
