"""Comparing two trainers' updates without depending on one CPU's rounding.

AdamW's first step moves every parameter by about ``lr * sign(g)``: a gradient element near zero
that rounds to the other sign on another CPU moves its parameter by ``2 lr``, so parameters after
a step are no measure of "the same update". The gradients (and the loss) are: ``record_grads``
keeps each optimizer step's gradients, and ``assert_same_grads`` compares them relative to the
gradient's own scale.
"""

from __future__ import annotations

import torch


def record_grads(trainer) -> list[dict[str, torch.Tensor]]:
    """Returns a list that receives, at every optimizer step of ``trainer``, a copy of each
    parameter's gradient (after clipping: what the optimizer is about to apply), by name."""
    steps: list[dict[str, torch.Tensor]] = []
    names = {id(p): n for n, p in trainer.model.named_parameters()}

    def hook(optimizer, args, kwargs):
        steps.append({names[id(p)]: p.grad.detach().clone()
                      for group in optimizer.param_groups for p in group["params"] if p.grad is not None})

    trainer.optimizer.register_step_pre_hook(hook)
    return steps


def grad_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max |a - b| over all gradient elements, relative to max |a| (the gradient's scale)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    scale = max(float(g.abs().max()) for g in a.values())
    assert scale > 0, "all-zero gradients: nothing would be compared"
    return max(float((a[n] - b[n]).abs().max()) for n in a) / scale


def assert_same_grads(a: list[dict], b: list[dict], rel: float = 1e-5) -> None:
    """The same number of optimizer steps, each with gradients within ``rel`` of the scale."""
    assert len(a) == len(b) and a, (len(a), len(b))
    for step, (ga, gb) in enumerate(zip(a, b)):
        gap = grad_gap(ga, gb)
        assert gap <= rel, f"optimizer step {step}: gradients differ by {gap:.3g} of their scale (> {rel})"
