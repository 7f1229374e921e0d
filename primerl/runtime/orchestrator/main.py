"""The orchestrator process's entry point (``primerl orchestrator``): the environment, the inference
client and the versions it can load (the backend's ``make_client`` and ``weight_receiver``: the
embedded engine lives in this process), the batch transport, then ``Orchestrator.run``."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ..config import RLConfig
from ..inference.backend import get_backend
from ..trainer.checkpoint import start_step
from ..heartbeat import install
from ..lifetime import ENDING, peer_alive, setup_logging, watch_launcher
from ..zmq_transport import make_transport

log = logging.getLogger("primerl")


def orchestrator_main(cfg: RLConfig) -> None:
    from ..config import load_policy_env

    from ..policy import model_config
    from .vf_orchestrator import build_orchestrator  # the built-in Orchestrator, or the verifiers path

    setup_logging("orchestrator")
    watch_launcher()
    install("orchestrator")  # progress: each request finished and batch handed over; stacks on SIGUSR1
    torch.set_num_threads(cfg.threads)
    env = load_policy_env(cfg)
    start = start_step(cfg)
    transport = make_transport(cfg, Path(cfg.output_dir) / "transport", "orchestrator")
    transport.drop_batches_from(start)
    backend = get_backend(cfg)
    client = backend.make_client(cfg, env.vocab_size)

    def on_batch(step, m):
        log.info("batch %d written: reward %.3f off_policy<=%d version %d %.0f tok/s", step, m["reward/mean"],
                 m["off_policy/max"], m["policy_version"], m["inference/tokens_per_s"])

    weights = backend.weight_receiver(cfg, client, transport)  # markers, the engine's receiver, or the servers
    try:
        orch = build_orchestrator(cfg, env, client, transport, start_step=start, weights=weights,
                                  trainer_alive=peer_alive(int(os.environ.get("PRIMERL_PEER_PID", "0"))),
                                  top_k=model_config(cfg, env.vocab_size).top_k)
        if cfg.orchestrator.metrics_port:
            from .monitor import OrchestratorMonitor

            orch.monitor = OrchestratorMonitor(cfg.orchestrator.metrics_host, cfg.orchestrator.metrics_port).start()
        orch.run(on_batch=on_batch)
        transport.wait_taken(cfg.trainer.batch_timeout_s)  # zmq: no batch left in a socket at exit
        weights.close()  # a broadcast receiver: until the trainer's end-of-updates message
        transport.close()  # ZeroMQ: the batch server's thread and sockets
    except BaseException:
        _exit_past_receiver(weights)
        raise


def _exit_past_receiver(weights) -> None:
    """A failed orchestrator whose weight receiver still waits in a collective: exit at once with
    the traceback logged (rc 1); a normal exit would abort (-6) on the receiver's live thread."""
    if weights.alive:
        log.exception("the orchestrator failed (its weight receiver is still in the trainer's group)")
        logging.shutdown()
        os._exit(ENDING["exit_code"] or 1)  # 143: this node is ending on SIGTERM, the failure follows from it
