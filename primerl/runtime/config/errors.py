"""``ConfigError`` and ``_need``, the one-line check every section's checks are written with."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A bad configuration value or key; the message names the dotted key."""


def _need(cond: bool, key: str, msg: str, value: Any) -> None:
    """Raise ``ConfigError("<key>: <msg>, got <value!r>")`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{key}: {msg}, got {value!r}")
