"""Checks of tensor *values* (ids in range, offsets monotonic, targets in vocabulary) that never
read the host in the hot path.

Shape, dtype and device checks stay plain Python (free and traceable). A value check goes through
:func:`check_values`:

- by default it is ``torch._assert_async(cond, message)``: on CUDA a device-side assert (no
  synchronisation; a violated check stops the process with the message in the CUDA error), on the
  CPU an immediate ``RuntimeError`` with the message, under ``torch.compile`` a traced assertion,
  under FakeTensorMode / on meta tensors nothing to compute. It is never skipped.
- in debug mode (:func:`set_debug_checks`, :func:`debug_checks` or ``PRIMERL_DEBUG_CHECKS=1``) an
  eager call reads the condition on the host and raises ``ValueError`` with the detailed message
  (the offending values): one synchronisation per check, for debugging and for the CPU tests.
  While tracing (compile, FakeTensor, meta) debug mode falls back to the device assertion.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator

import torch

_debug = os.environ.get("PRIMERL_DEBUG_CHECKS", "0").lower() in ("1", "true", "yes", "on")


def set_debug_checks(enabled: bool) -> None:
    """Turn debug value checks (host reads, detailed ``ValueError``) on or off globally."""
    global _debug
    _debug = bool(enabled)


def debug_checks_enabled() -> bool:
    return _debug


@contextlib.contextmanager
def debug_checks(enabled: bool = True) -> Iterator[None]:
    """Context manager form of :func:`set_debug_checks`."""
    global _debug
    old, _debug = _debug, bool(enabled)
    try:
        yield
    finally:
        _debug = old


def _tracing(t: torch.Tensor) -> bool:
    if torch.compiler.is_compiling() or t.is_meta:
        return True
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def check_values(cond: torch.Tensor, message: str, detail: Callable[[], str] | None = None) -> None:
    """Assert a boolean scalar tensor ``cond`` (e.g. ``(ids >= 0).all()``) without a host read.

    ``message`` is static (it is baked into the device assertion); ``detail`` builds the longer
    message with values and is called only in eager debug mode, after the check failed.
    """
    if _debug and not _tracing(cond):
        if not bool(cond):
            raise ValueError(message + (f": {detail()}" if detail is not None else ""))
        return
    torch._assert_async(cond, message)
