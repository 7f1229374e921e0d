"""Run an Orchestrator for a few steps against a stand-in trainer thread (no optimisation)."""

from __future__ import annotations

import threading


def run_orchestrator_with_stub_trainer(cfg, env, model, transport, steps: int = 2) -> list[dict]:
    """Publish ``model``'s weights as versions 0..steps and collect the batch of each step.

    Returns the payloads the orchestrator handed over, one per step, in order.
    """
    from primerl.runtime.orchestrator.clients import make_client
    from primerl.runtime.orchestrator import Orchestrator

    seen: list[dict] = []

    def trainer():
        for version in range(steps + 1):
            transport.publish_weights(version, model.state_dict())
            if version < steps:
                seen.append(transport.get_batch(version, 0, timeout=60))

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    Orchestrator(cfg, env, make_client(cfg, env.vocab_size), transport, top_k=2).run()
    thread.join(30)
    return seen
