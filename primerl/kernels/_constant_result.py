"""``assume_constant_result``: ``torch.compiler.assume_constant_result`` without importing torch._dynamo.

torch's decorator imports ``torch._dynamo`` (1.4 s of CPU) to set one attribute on the function, and
primerl decorates functions at import time, so every process that imports primerl (each trainer rank,
orchestrator and server of a job) paid for dynamo, though most never compile. The mark is the one
dynamo reads when it traces a call; tests/kernels/test_constant_result.py checks it is the one
torch's decorator sets, and the compile tests check that dynamo honours it."""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

__all__ = ["assume_constant_result"]


def assume_constant_result(fn: F) -> F:
    """Mark ``fn`` so that torch.compile calls it at trace time and uses its result as a constant."""
    fn._dynamo_marked_constant = True  # torch._dynamo.decorators.assume_constant_result sets exactly this
    return fn
