"""Layer 2: thin, composable RL modules: advantages, policy losses, packing, environments."""

from .advantages import Advantages, drgrpo, grpo, linear_length_penalty, max_rl, rloo  # noqa: E402,F401
from .distill import DistillAdvantages, distill_advantages, student_topk_logprobs, topk_distill_kl  # noqa: E402,F401
from .loss_terms import LossInputs  # noqa: E402,F401
from .losses import AGGREGATIONS, CORRECTIONS, DEFAULT_HPARAMS, LOSS_METHODS, policy_loss  # noqa: E402,F401
from .metrics import effective_sample_size, kl_estimate, kl_k1, kl_k2, kl_k3, masked_mean  # noqa: E402,F401
from .packing import MicroBatch, Sample, pack, packing_stats  # noqa: E402,F401
from .next_token import next_token_batch, next_token_targets, token_aligned  # noqa: E402,F401
from .losses import seq_ids_from_cu_seqlens  # noqa: E402,F401

__all__ = [
    "Advantages", "grpo", "drgrpo", "rloo", "max_rl", "linear_length_penalty",
    "DistillAdvantages", "distill_advantages", "student_topk_logprobs", "topk_distill_kl",
    "LossInputs", "policy_loss", "AGGREGATIONS", "CORRECTIONS", "DEFAULT_HPARAMS", "LOSS_METHODS",
    "seq_ids_from_cu_seqlens",
    "effective_sample_size", "kl_estimate", "kl_k1", "kl_k2", "kl_k3", "masked_mean",
    "MicroBatch", "Sample", "pack", "packing_stats",
    "next_token_batch", "next_token_targets", "token_aligned",
]
