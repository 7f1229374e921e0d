"""The trainer process: loss, AdamW, schedule, NaN handling, checkpoints, weight publication.

Modules (imported lazily: ``primerl.runtime.trainer.checkpoint`` does not load the training loop):
  main            trainer_main: the process's entry point (``primerl trainer``; one per rank)
  trainer         Trainer / run_trainer: the step, log-probs of packed micro-batches, LR schedule
  _rl             the loss settings (``trainer.loss``) on ``primerl.rl.losses``: reference model, counts, metrics
  checkpoint      atomic full-state checkpoint save / load / latest
  dcp_checkpoint  sharded DCP checkpoints (save_dcp_checkpoint / load_dcp_checkpoint, optional async), any layout
  full_state      full model / optimizer state dicts gathered from (and scattered to) any layout
  publish         iter_full_weights / WeightStream: full weights to rank 0 one tensor at a time
  guards          parameters checked finite after every update, before publication
  padded_attention  one padded SDPA call for many short packed sequences (``trainer.attention``)
  vf_warmstart    supervised warm start from a verifiers task's demonstrations (before RL)

The names of ``trainer`` are re-exported here (``from primerl.runtime.trainer import Trainer``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy_exports

_EXPORTS = {name: "trainer" for name in (
    "Trainer", "run_trainer", "lr_lambda", "shifted_logprobs", "next_token_logprobs", "next_token_batch",
    "NonFiniteLossError", "open_single_rank_group", "FORWARD_FIELDS")}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .trainer import (FORWARD_FIELDS, NonFiniteLossError, Trainer, lr_lambda, next_token_batch,  # noqa: F401
                          next_token_logprobs, open_single_rank_group, run_trainer, shifted_logprobs)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
