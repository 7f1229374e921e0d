"""The trainer process's entry point (``primerl trainer``; one per rank, under torchrun when several):
logging, the launcher watchdog, the process group, then ``trainer.run_trainer``."""

from __future__ import annotations

import os

import torch

from ..config import RLConfig
from ..heartbeat import install
from ..lifetime import peer_alive, setup_logging, watch_launcher
from ..placement import resolve_placement


def trainer_main(cfg: RLConfig) -> None:
    from ..config import load_policy_env

    from .trainer import run_trainer

    setup_logging("trainer")
    watch_launcher()
    install("trainer")  # progress: each step (trainer.run_trainer); stacks on SIGUSR1
    torch.set_num_threads(cfg.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    placement = resolve_placement(cfg)
    if placement.device == "cuda":  # before the process group: NCCL binds this rank to its GPU
        torch.cuda.set_device(placement.trainer_device(int(os.environ.get("LOCAL_RANK", "0"))))
    if world > 1 and not torch.distributed.is_initialized():
        # an explicit timeout on every collective: a peer that vanished is an error naming the collective, after
        # the launcher's stall watchdog (deployment.stall_timeout_s) had its chance to dump the stacks
        torch.distributed.init_process_group(placement.dist_backend, timeout=collective_timeout(cfg))
    try:
        env = load_policy_env(cfg)
        run_trainer(cfg, env.vocab_size, orchestrator_alive=peer_alive(int(os.environ.get("PRIMERL_PEER_PID", "0"))))
        if torch.distributed.is_initialized():
            # every rank done with its last collective before any tears the group down: a rank that
            # destroyed it while another was still in its final save aborted once at exit (-6)
            torch.distributed.barrier()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def collective_timeout(cfg: RLConfig):
    """The trainer group's collective timeout: twice ``deployment.stall_timeout_s``, or twice
    ``deployment.stall_startup_s`` where that is longer (the start-up's collectives wait on the slowest
    rank's start; 30 min when the watchdog is off)."""
    from datetime import timedelta

    t = cfg.deployment.stall_timeout_s
    return timedelta(seconds=2 * max(t, cfg.deployment.stall_startup_s) if t > 0 else 1800)
