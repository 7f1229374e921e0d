"""``run_threads``: the whole job in ONE process (trainer in a thread, orchestrator and embedded
engine in the caller's), for tests, notebooks and experiments."""

from __future__ import annotations

from pathlib import Path

from ..config import RLConfig
from ..inference.backend import get_backend
from ..metrics import read_metrics
from ..orchestrator.clients import make_client
from ..output_dir import claim_output_dir
from ..trainer.vf_warmstart import job_warm_start
from ..zmq_transport import make_transport
from .machine import launched_vllm, prepare_output


def run_threads(cfg: RLConfig, *, quiet: bool = True, parts: dict | None = None) -> list[dict]:
    """The same job in ONE process: trainer in a thread, orchestrator + engine in this one.

    For tests, notebooks and experiments; each side still talks only through the transport.
    Holds ``output_dir``'s lock for the job's life, as ``run_rl`` does. ``parts``, when given,
    receives the job's ``"client"`` (with the engine) and, at the end, its ``"trainer"``.
    """
    with claim_output_dir(cfg):
        cfg = job_warm_start(cfg, quiet=quiet)
        with launched_vllm(cfg):
            return _run_threads(cfg, quiet=quiet, parts={} if parts is None else parts)


def _run_threads(cfg: RLConfig, *, quiet: bool, parts: dict) -> list[dict]:
    import threading

    from primerl.rl.envs import load_environment

    from ..orchestrator.vf_orchestrator import build_orchestrator  # the built-in Orchestrator, or the verifiers path
    from ..policy import model_config
    from ..trainer.trainer import run_trainer

    out = Path(cfg.output_dir)
    start = prepare_output(cfg)
    env = load_environment(cfg.env.id, **cfg.env.args)
    errors: list[BaseException] = []
    done = threading.Event()

    def trainer_thread():
        try:
            parts["trainer"] = run_trainer(cfg, env.vocab_size, orchestrator_alive=lambda: not errors)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
        finally:
            done.set()

    cfg.log.progress = cfg.log.progress and not quiet
    th = threading.Thread(target=trainer_thread, name="trainer", daemon=True)
    th.start()
    transport = make_transport(cfg, out / "transport", "orchestrator")
    client = parts["client"] = make_client(cfg, env.vocab_size)
    weights = get_backend(cfg).weight_receiver(cfg, client, transport)
    orch = build_orchestrator(cfg, env, client, transport, start_step=start, weights=weights,
                        trainer_alive=lambda: not done.is_set() or not errors, top_k=model_config(cfg, env.vocab_size).top_k)
    try:
        orch.run()
    except BaseException:
        transport.close()  # the ZeroMQ batch server's port
        if errors:
            raise errors[0]
        raise
    th.join(timeout=cfg.trainer.batch_timeout_s + 60)
    transport.close()
    if errors:
        raise errors[0]
    weights.close(timeout=30)  # a broadcast receiver: the trainer said goodbye, its thread leaves the group
    return read_metrics(out / "metrics.jsonl")
