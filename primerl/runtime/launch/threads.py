"""``deployment.kind = "threads"``: the whole job in ONE process (trainer in a thread, orchestrator
and embedded engine in the caller's), for tests, notebooks and experiments; each side still talks
only through the transport. ``run_threads(cfg)`` runs any config this way (whatever its
``deployment.kind``), through the registered launcher and the shared preparation
(``launcher.prepare_job``: the ``output_dir`` lock, the warm start, ``config.toml``)."""

from __future__ import annotations

from ..config import ConfigError, RLConfig
from .launcher import LauncherCapabilities, PreparedJob, check_one_machine, get_launcher, register_launcher, run_job

__all__ = ["ThreadsLauncher", "run_threads"]


def run_threads(cfg: RLConfig, *, quiet: bool = True, parts: dict | None = None) -> list[dict]:
    """The job in ONE process: trainer in a thread, orchestrator + engine in this one; the metrics rows.

    Holds ``output_dir``'s lock for the job's life. ``parts``, when given, receives the job's
    ``"client"`` (with the engine) and, at the end, its ``"trainer"``."""
    return run_job(cfg, quiet=quiet, launcher=get_launcher("threads"), parts=parts)


class ThreadsLauncher:
    """The trainer in a thread of this process; the orchestrator (and launched vLLM, if asked) here."""

    name = "threads"
    capabilities = LauncherCapabilities(spans_nodes=False, server_pool=False)

    def check(self, cfg: RLConfig) -> None:
        check_one_machine(cfg)
        if cfg.num_trainer_ranks != 1:
            raise ConfigError("num_trainer_ranks: deployment.kind = 'threads' runs one trainer rank (in a thread); "
                              f"several ranks need kind = 'local', got {cfg.num_trainer_ranks!r}")

    def describe(self, cfg: RLConfig) -> str:
        return ("# deployment: threads, the whole job in this process (the trainer in a thread; the orchestrator "
                "and its inference engine in the caller's)\n")

    def start(self, job: PreparedJob) -> None:
        import contextlib
        import threading

        from ..config import load_policy_env

        from ..inference.backend import get_backend
        from ..orchestrator.clients import make_client
        from ..orchestrator.vf_orchestrator import build_orchestrator  # the built-in Orchestrator or the verifiers one
        from ..policy import model_config
        from ..trainer.trainer import run_trainer
        from ..zmq_transport import make_transport
        from .machine import launched_vllm

        cfg, parts, st = job.cfg, job.parts, job.state
        st["stack"] = contextlib.ExitStack()
        st["stack"].enter_context(launched_vllm(cfg))
        env = load_policy_env(cfg)
        errors: list[BaseException] = st.setdefault("errors", [])
        done = threading.Event()

        def trainer_thread():
            try:
                parts["trainer"] = run_trainer(cfg, env.vocab_size, orchestrator_alive=lambda: not errors)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)
            finally:
                done.set()

        cfg.log.progress = cfg.log.progress and not job.quiet
        st["thread"] = th = threading.Thread(target=trainer_thread, name="trainer", daemon=True)
        th.start()
        transport = st["transport"] = make_transport(cfg, job.output_dir / "transport", "orchestrator")
        client = parts["client"] = make_client(cfg, env.vocab_size)
        weights = st["weights"] = get_backend(cfg).weight_receiver(cfg, client, transport)
        st["orchestrator"] = build_orchestrator(
            cfg, env, client, transport, start_step=job.start_step, weights=weights,
            trainer_alive=lambda: not done.is_set() or not errors, top_k=model_config(cfg, env.vocab_size).top_k)

    def wait(self, job: PreparedJob) -> list[dict]:
        from ..metrics import read_metrics

        st, errors = job.state, job.state["errors"]
        try:
            st["orchestrator"].run()
        except BaseException:
            if errors:
                raise errors[0]
            raise
        st["thread"].join(timeout=job.cfg.trainer.batch_timeout_s + 60)
        st.pop("transport").close()
        if errors:
            raise errors[0]
        st["weights"].close(timeout=30)  # a broadcast receiver: the trainer said goodbye, its thread leaves the group
        return read_metrics(job.output_dir / "metrics.jsonl")

    def stop(self, job: PreparedJob) -> None:
        try:
            transport = job.state.pop("transport", None)
            if transport is not None:  # the job failed: free the ZeroMQ batch server's port
                transport.close()
        finally:
            if "stack" in job.state:
                job.state["stack"].close()  # launched vLLM


register_launcher("threads", ThreadsLauncher())
