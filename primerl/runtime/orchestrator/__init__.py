"""The orchestrator process: rollouts against the inference engine, advantages, packing, hand-over.

Modules (imported lazily):
  main          orchestrator_main: the process's entry point (``primerl orchestrator``)
  clients       make_client: the inference client (embedded engine, vLLM, server pool, P/D deployment)
  orchestrator  Orchestrator: async level, off-policy accounting, batches to the transport; EmbeddedClient
  rollout       episodes in flight (multi-turn transcripts, log-probs, routing record)
  batching      finished groups -> advantages (``orchestrator.advantage``, per environment) -> micro-batches
  sampling      environment mixes (``[[env]]``), replacement prompts (dapo), the curriculum and its state
  evaluation    OnlineEval: ``[[eval.env]]`` next to the rollouts, pass@k
  evaluate      ``primerl eval --checkpoint``: the evals on a saved checkpoint
  env_calls     concurrent environment calls with per-call deadlines; reward checks (rejected / clipped)
  vf_orchestrator  build_orchestrator: the built-in Orchestrator, or verifiers episodes -> samples
  monitor       OrchestratorMonitor: /health and /metrics (orchestrator.metrics_port)
  samples_log   samples/step_N.jsonl (orchestrator.save_samples)

The names of ``orchestrator`` are re-exported here (``from primerl.runtime.orchestrator import Orchestrator``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy_exports

_EXPORTS = {**{name: "orchestrator" for name in (
    "Orchestrator", "EmbeddedClient", "EnvError", "COUNTS", "TransportTimeout", "ProducerDied")},
    "OrchestratorMonitor": "monitor"}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .monitor import OrchestratorMonitor  # noqa: F401
    from .orchestrator import COUNTS, EmbeddedClient, EnvError, Orchestrator, ProducerDied, TransportTimeout  # noqa: F401


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
