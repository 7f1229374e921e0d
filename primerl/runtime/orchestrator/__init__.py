"""The orchestrator process: rollouts against the inference engine, advantages, packing, hand-over.

Modules (imported lazily):
  orchestrator  Orchestrator: async level, off-policy accounting, batches to the transport; EmbeddedClient
  rollout       episodes in flight (multi-turn transcripts, log-probs, routing record)
  batching      finished groups -> advantages (``orchestrator.advantage``) -> per-rank micro-batches
  env_calls     concurrent environment calls with per-call deadlines; reward checks (rejected / clipped)
  vf_orchestrator  build_orchestrator: the built-in Orchestrator, or verifiers episodes -> samples

The names of ``orchestrator`` are re-exported here (``from primerl.runtime.orchestrator import Orchestrator``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {name: "orchestrator" for name in (
    "Orchestrator", "EmbeddedClient", "EnvError", "COUNTS", "TransportTimeout", "ProducerDied")}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .orchestrator import COUNTS, EmbeddedClient, EnvError, Orchestrator, ProducerDied, TransportTimeout  # noqa: F401


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
