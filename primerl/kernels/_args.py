"""Argument checks shared by the public entry points (kernels and the layers above them)."""

from __future__ import annotations

import numbers


def check_int(op: str, name: str, value, *, min_value: int | None = None) -> int:
    """``value`` as an int; TypeError naming ``name`` for a float, bool or non-number (``2.0`` is
    rejected: a size that arrives as a float is usually a computed value gone wrong)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if min_value is not None and value < min_value:
        raise ValueError(f"{op}: {name} must be >= {min_value}, got {value}")
    return value
