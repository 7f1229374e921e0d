"""``deployment.kind = "local"``: the one-machine launcher (``primerl rl``'s default).

After the shared preparation (``launcher.prepare_job``: the ``output_dir`` lock, the warm start,
``<output_dir>/config.toml``), it starts the server pool (``inference.num_servers > 1``) or vLLM
(``inference.vllm.launch``) when the config asks, then two processes that only share files: the
orchestrator with its embedded inference engine (``primerl orchestrator``) and the trainer
(``primerl trainer``, under ``torchrun --standalone`` when ``num_trainer_ranks > 1``), each through
``processes.start_process`` (own process group, dies with the launcher, ``logs/<name>.log``, a row
in ``processes.json``). ``wait`` prints a progress line per step from ``metrics.jsonl`` and fails
naming the first process that failed (with the end of its log); ``stop`` ends every process; at
the end it prints the reward curve and saves ``metrics.png``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from ..config import RLConfig
from ..heartbeat import HEARTBEAT_DIR_ENV
from ..lifetime import LAUNCHER_PID_ENV, log_tail
from ..metrics import ascii_curve, progress_line, read_metrics, save_plot
from ..processes import ManagedProcess, ProcessTable, start_process
from .common import JobFailed
from .deployment import describe_nodes
from .launcher import LauncherCapabilities, PreparedJob, check_one_machine, register_launcher, run_job
from .watchdog import StallWatchdog

__all__ = ["MachineLauncher", "first_failure", "launched_vllm", "run_rl"]


def run_rl(cfg: RLConfig, *, quiet: bool = False) -> list[dict]:
    """``primerl rl`` as a function: ``launcher.run_job`` (the launcher of ``deployment.kind``); the
    metrics rows."""
    return run_job(cfg, quiet=quiet)


def first_failure(procs: dict[str, ManagedProcess], log_dir: Path) -> str | None:
    """The failure to report, or None while no process has failed. When several have, the cause
    comes first: a process that stopped because its peer was gone (ProducerDied in its log) is not."""
    failed = [(name, p.returncode, log_dir / f"{name}.log") for name, p in procs.items() if p.poll() not in (None, 0)]
    if not failed:
        return None
    failed.sort(key=lambda f: "ProducerDied" in log_tail(f[2]))
    name, rc, log_path = failed[0]
    return f"the {name} exited with code {rc}; end of {log_path}:\n" + log_tail(log_path)


class MachineLauncher:
    """Trainer + orchestrator processes on this machine (with the pool or launched vLLM)."""

    name = "local"
    capabilities = LauncherCapabilities(spans_nodes=False, server_pool=True, restarts=True)

    def check(self, cfg: RLConfig) -> None:
        check_one_machine(cfg)

    def describe(self, cfg: RLConfig) -> str:
        return describe_nodes(cfg)

    def start(self, job: PreparedJob) -> None:
        cfg, out, cfg_path = job.cfg, job.output_dir, str(job.config_path)
        stack = job.state["stack"] = contextlib.ExitStack()
        stack.enter_context(launched_vllm(cfg, quiet=job.quiet))
        py = sys.executable
        beats = out / "heartbeats"
        shutil.rmtree(beats, ignore_errors=True)  # a previous start's processes
        base_env = dict(os.environ, OMP_NUM_THREADS=str(cfg.threads), PYTHONUNBUFFERED="1",
                        **{LAUNCHER_PID_ENV: str(os.getpid()), HEARTBEAT_DIR_ENV: str(beats)})
        job.state["watchdog"] = StallWatchdog(beats, cfg.deployment.stall_timeout_s,
                                              lambda name: out / "logs" / f"{name.split('-rank')[0]}.log",
                                              startup_s=cfg.deployment.stall_startup_s)
        job.state["t0"] = time.perf_counter()
        if not job.quiet:
            print(f"primerl rl: output_dir {out} | start step {job.start_step} | logs in {out / 'logs'}", flush=True)
        from .servers import POOL_ENV, pool_for_job

        table = ProcessTable(out / "processes.json")
        try:
            pool = pool_for_job(cfg, cfg_path, out, table, base_env)  # inference.num_servers > 1: servers + router
        except FileNotFoundError as e:  # no vllm-router
            raise JobFailed(f"inference.num_servers = {cfg.inference.num_servers}: {e}") from None
        orch_env = dict(base_env, PRIMERL_PEER_PID=str(os.getpid()))
        if pool is not None:
            job.state["pool"] = pool
            pool.start()
            # the orchestrator samples through it; the trainer's rank 0 broadcasts weights to its servers
            base_env[POOL_ENV] = orch_env[POOL_ENV] = json.dumps(pool.endpoints())
        procs = job.state["procs"] = {}
        procs["orchestrator"] = start_process([py, "-m", "primerl.runtime.cli", "orchestrator", "--config", cfg_path],
                                              name="orchestrator", role="orchestrator",
                                              log_path=out / "logs" / "orchestrator.log", env=orch_env, table=table)
        trainer_cmd = [py, "-m", "primerl.runtime.cli", "trainer", "--config", cfg_path]
        if cfg.num_trainer_ranks > 1:
            trainer_cmd = [py, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={cfg.num_trainer_ranks}", "-m", "primerl.runtime.cli", "trainer",
                           "--config", cfg_path]
        procs["trainer"] = start_process(trainer_cmd, name="trainer", role="trainer",
                                         log_path=out / "logs" / "trainer.log", table=table,
                                         env=dict(base_env, PRIMERL_PEER_PID=str(procs["orchestrator"].pid)))
        (out / "pids").write_text(f"trainer {procs['trainer'].pid}\norchestrator {procs['orchestrator'].pid}\n")

    def wait(self, job: PreparedJob, *, poll_s: float = 0.2) -> list[dict]:
        cfg, out, quiet = job.cfg, job.output_dir, job.quiet
        procs, pool = job.state["procs"], job.state.get("pool")
        seen = job.start_step - 1
        while True:
            for r in read_metrics(out / "metrics.jsonl"):
                if r["step"] > seen:
                    seen = r["step"]
                    if not quiet and cfg.log.progress:
                        print(progress_line(r, cfg.max_steps), flush=True)
            failure = first_failure(procs, out / "logs")
            if failure:
                raise JobFailed(failure)
            if pool is not None and pool.failure:
                raise JobFailed(pool.failure)
            stall = job.state["watchdog"].check()
            if stall:
                raise JobFailed(stall)
            if procs["trainer"].returncode == 0:
                break
            time.sleep(poll_s)
        rows = read_metrics(out / "metrics.jsonl")
        if not rows or rows[-1]["step"] != cfg.max_steps - 1:  # nothing may go missing silently
            raise JobFailed(f"the trainer exited normally but {out / 'metrics.jsonl'} ends at step "
                            f"{rows[-1]['step'] if rows else None}, not {cfg.max_steps - 1}; end of the trainer's "
                            f"log:\n{log_tail(out / 'logs' / 'trainer.log')}")
        wall = time.perf_counter() - job.state["t0"]
        if not quiet:
            print(f"done: {len(rows)} steps in {wall:.1f} s; reward curve:\n{ascii_curve(rows)}", flush=True)
        if cfg.log.plot and rows:
            path = save_plot(rows, out / "metrics.png")
            if path and not quiet:
                print(f"plot saved to {path}", flush=True)
        return rows

    def stop(self, job: PreparedJob) -> None:
        try:
            for name in ("trainer", "orchestrator"):
                p = job.state.get("procs", {}).get(name)
                if p is not None:
                    p.stop(job.cfg.deployment.grace_s)
            if job.state.get("pool") is not None:
                job.state["pool"].stop()
            if "watchdog" in job.state:  # torchrun's workers (own sessions), a stopped one too
                job.state["watchdog"].end_leftovers()
        finally:
            if "stack" in job.state:
                job.state["stack"].close()  # launched vLLM


register_launcher("local", MachineLauncher())


@contextlib.contextmanager
def launched_vllm(cfg: RLConfig, *, quiet: bool = True):
    """The servers the inference backend starts for the job on this machine, for the job's life
    (``InferenceBackend.servers``: vLLM with ``inference.vllm.launch``), stopped when the job ends,
    failed or not; one that does not come up is a ``JobFailed``."""
    from ..inference.backend import get_backend
    from ..inference.errors import InferenceServerError

    with contextlib.ExitStack() as stack:
        try:
            started = stack.enter_context(get_backend(cfg).servers(cfg, quiet=quiet))
        except InferenceServerError as e:
            raise JobFailed(str(e)) from None
        yield started

