"""Checks that stop a run before a non-finite policy leaves the trainer.

The trainer already skips an update whose loss or gradients are non-finite; an update can still
produce non-finite weights from finite gradients (an infinite or huge learning rate, an
overflowing optimizer state). :func:`check_finite_parameters` runs after every optimizer step,
before the weights are published or checkpointed, so a NaN policy never reaches the sampler.
Cost: one fused reduction per parameter and a single host sync per optimizer step (plus one
all-reduce of a flag when distributed, which every rank joins).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["NonFiniteParametersError", "check_finite_parameters"]


class NonFiniteParametersError(RuntimeError):
    pass


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def check_finite_parameters(model: torch.nn.Module, step: int, *, distributed: bool = False) -> None:
    """Raise :class:`NonFiniteParametersError` if any parameter holds NaN/inf after ``step``'s update.

    ``distributed``: a collective over the default group (every rank must call it); the error is
    raised on every rank, naming the first bad parameter where this rank holds it."""
    named = [(n, _local(p.detach())) for n, p in model.named_parameters()]
    flags = torch.stack([torch.isfinite(p).all() for _, p in named if p.numel()]) if named else torch.ones(1, dtype=torch.bool)
    bad_local = ~flags.all()
    if distributed and dist.is_initialized() and dist.get_world_size() > 1:
        flag = bad_local.to(torch.float32).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        bad = bool(flag.item())
    else:
        bad = bool(bad_local)
    if not bad:
        return
    first = next((n for n, p in named if p.numel() and not bool(torch.isfinite(p).all())), None)
    where = f"first: {first}" if first is not None else "on another rank's shard"
    raise NonFiniteParametersError(
        f"step {step}: the optimizer update made the policy's parameters non-finite (NaN/inf; {where}); "
        "these weights are neither published nor checkpointed. Lower trainer.lr or trainer.max_grad_norm, "
        "check trainer.beta1/beta2/weight_decay, or resume from the last checkpoint.")
