"""Checks that stop a run before a non-finite policy leaves the trainer.

The trainer already skips an update whose loss or gradients are non-finite; an update can still
produce non-finite weights from finite gradients (an infinite or huge learning rate, an
overflowing optimizer state). :func:`check_finite_parameters` runs after every optimizer step,
before the weights are published or checkpointed, so a NaN policy never reaches the sampler.
Cost: one fused reduction per parameter and a single host sync per optimizer step (plus one
all-reduce of a flag when distributed, which every rank joins). The trainer splits it in two so
that the sync is the step's one metrics read: :func:`nonfinite_parameters` (a device flag, no host
read) and :func:`raise_nonfinite_parameters` once the flag has been read.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["NonFiniteParametersError", "check_finite_parameters", "nonfinite_parameters",
           "raise_nonfinite_parameters"]


class NonFiniteParametersError(RuntimeError):
    pass


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def nonfinite_parameters(model: torch.nn.Module, *, distributed: bool = False) -> torch.Tensor:
    """A 0-d bool tensor on the parameters' device: True if any parameter holds NaN/inf, with no
    host read. ``distributed``: also True if any rank's shard does (a collective over the default
    group: every rank must call it)."""
    flags = [torch.isfinite(_local(p.detach())).all() for p in model.parameters() if p.numel()]
    bad = ~torch.stack(flags).all() if flags else torch.zeros((), dtype=torch.bool)
    if distributed and dist.is_initialized() and dist.get_world_size() > 1:
        flag = bad.to(torch.float32).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        bad = flag[0] > 0
    return bad


def raise_nonfinite_parameters(model: torch.nn.Module, step: int) -> None:
    """Raise :class:`NonFiniteParametersError` for ``step`` (after ``nonfinite_parameters`` was read
    True), naming the first bad parameter where this rank holds it."""
    named = [(n, _local(p.detach())) for n, p in model.named_parameters()]
    first = next((n for n, p in named if p.numel() and not bool(torch.isfinite(p).all())), None)
    where = f"first: {first}" if first is not None else "on another rank's shard"
    raise NonFiniteParametersError(
        f"step {step}: the optimizer update made the policy's parameters non-finite (NaN/inf; {where}); "
        "these weights are neither published nor checkpointed. Lower trainer.lr or trainer.max_grad_norm, "
        "check trainer.beta1/beta2/weight_decay, or resume from the last checkpoint.")


def check_finite_parameters(model: torch.nn.Module, step: int, *, distributed: bool = False) -> None:
    """Raise :class:`NonFiniteParametersError` if any parameter holds NaN/inf after ``step``'s update
    (one host read: the flag of :func:`nonfinite_parameters`).

    ``distributed``: a collective over the default group (every rank must call it); the error is
    raised on every rank, naming the first bad parameter where this rank holds it."""
    if bool(nonfinite_parameters(model, distributed=distributed)):
        raise_nonfinite_parameters(model, step)
