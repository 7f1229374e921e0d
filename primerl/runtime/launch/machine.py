"""One machine: ``primerl rl``'s launcher (moved here from ``job.py`` unchanged).

``primerl rl`` first runs the config's supervised warm start, if it has one (``[warm_start]``,
``trainer.vf_warmstart.job_warm_start``), then writes the resolved config to ``<output_dir>/config.toml`` and starts two
processes that only share files: the trainer (``primerl trainer``, under torchrun when
``num_trainer_ranks > 1``) and the orchestrator with its embedded inference engine
(``primerl orchestrator``). Each logs to ``<output_dir>/logs/<name>.log``; the launcher prints a
progress line per step from ``metrics.jsonl``, stops everything when one process fails (naming
it, with the end of its log), and at the end prints the reward curve and saves ``metrics.png``.
With ``deployment.kind = "nodes"`` on 127.x hosts it starts the nodes instead (``local.run_nodes``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..config import RLConfig
from ..lifetime import LAUNCHER_PID_ENV, die_with_parent, log_tail, stop_process_group
from ..metrics import ascii_curve, progress_line, read_metrics, save_plot
from ..output_dir import claim_output_dir
from ..trainer.vf_warmstart import job_warm_start
from .common import JobFailed, prepare_output, start_step  # noqa: F401 (re-exported)

__all__ = ["JobFailed", "first_failure", "launched_vllm", "prepare_output", "run_rl", "start_step"]


_tail = log_tail


def first_failure(procs: dict[str, subprocess.Popen], log_dir: Path) -> str | None:
    """The failure to report, or None while no process has failed. When several have, the cause
    comes first: a process that stopped because its peer was gone (ProducerDied in its log) is not."""
    failed = [(name, p.returncode, log_dir / f"{name}.log") for name, p in procs.items() if p.poll() not in (None, 0)]
    if not failed:
        return None
    failed.sort(key=lambda f: "ProducerDied" in _tail(f[2]))
    name, rc, log_path = failed[0]
    return f"the {name} exited with code {rc}; end of {log_path}:\n" + _tail(log_path)


def _spawn(args: list[str], log_path: Path, env: dict) -> subprocess.Popen:
    f = open(log_path, "ab")
    return subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=die_with_parent(os.getpid()))


_stop = stop_process_group


def run_rl(cfg: RLConfig, *, quiet: bool = False, poll_s: float = 0.2) -> list[dict]:
    """Run trainer + orchestrator as two processes until ``max_steps``; return the metrics rows.

    Holds ``output_dir``'s lock for the job's life (``output_dir.claim_output_dir``)."""
    with claim_output_dir(cfg):
        cfg = job_warm_start(cfg, quiet=quiet)
        if cfg.deployment.kind == "nodes":  # several nodes on this machine (127.x hosts)
            from .local import run_nodes

            return run_nodes(cfg, quiet=quiet, poll_s=poll_s)
        with launched_vllm(cfg, quiet=quiet):
            return _run_rl(cfg, quiet=quiet, poll_s=poll_s)


@contextlib.contextmanager
def launched_vllm(cfg: RLConfig, *, quiet: bool = True):
    """The servers the inference backend starts for the job on this machine, for the job's life
    (``InferenceBackend.servers``: vLLM with ``inference.vllm.launch``), stopped when the job ends,
    failed or not; one that does not come up is a ``JobFailed``."""
    from ..inference.backend import get_backend
    from ..inference.vllm_client import InferenceServerError

    with contextlib.ExitStack() as stack:
        try:
            started = stack.enter_context(get_backend(cfg).servers(cfg, quiet=quiet))
        except InferenceServerError as e:
            raise JobFailed(str(e)) from None
        yield started


def _run_rl(cfg: RLConfig, *, quiet: bool, poll_s: float) -> list[dict]:
    out = Path(cfg.output_dir)
    start = prepare_output(cfg)
    cfg_path = str(out / "config.toml")
    py = sys.executable
    base_env = dict(os.environ, OMP_NUM_THREADS=str(cfg.threads), PYTHONUNBUFFERED="1", **{LAUNCHER_PID_ENV: str(os.getpid())})
    t0 = time.perf_counter()
    if not quiet:
        print(f"primerl rl: output_dir {out} | start step {start} | logs in {out / 'logs'}", flush=True)
    from .servers import POOL_ENV, ProcessTable, pool_for_job

    table = ProcessTable(out / "processes.json")
    try:
        pool = pool_for_job(cfg, cfg_path, out, table, base_env)  # inference.num_servers > 1: servers + router
    except FileNotFoundError as e:  # no vllm-router
        raise JobFailed(f"inference.num_servers = {cfg.inference.num_servers}: {e}") from None
    orch_env = dict(base_env, PRIMERL_PEER_PID=str(os.getpid()))
    if pool is not None:
        pool.start()
        orch_env[POOL_ENV] = json.dumps(pool.endpoints())
    orch = _spawn([py, "-m", "primerl.runtime.cli", "orchestrator", "--config", cfg_path], out / "logs" / "orchestrator.log",
                  orch_env)
    table.set("orchestrator", "orchestrator", orch.pid, None)
    trainer_cmd = [py, "-m", "primerl.runtime.cli", "trainer", "--config", cfg_path]
    if cfg.num_trainer_ranks > 1:
        trainer_cmd = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.num_trainer_ranks}",
                       "-m", "primerl.runtime.cli", "trainer", "--config", cfg_path]
    trainer = _spawn(trainer_cmd, out / "logs" / "trainer.log",
                     dict(base_env, PRIMERL_PEER_PID=str(orch.pid)))
    (out / "pids").write_text(f"trainer {trainer.pid}\norchestrator {orch.pid}\n")
    table.set("trainer", "trainer", trainer.pid, None)
    seen = start - 1
    try:
        while True:
            rows = read_metrics(out / "metrics.jsonl")
            for r in rows:
                if r["step"] > seen:
                    seen = r["step"]
                    if not quiet and cfg.log.progress:
                        print(progress_line(r, cfg.max_steps), flush=True)
            failure = first_failure({"trainer": trainer, "orchestrator": orch}, out / "logs")
            if failure:
                raise JobFailed(failure)
            if pool is not None and pool.failure:
                raise JobFailed(pool.failure)
            if trainer.returncode == 0:
                break
            time.sleep(poll_s)
    finally:
        _stop(trainer)
        _stop(orch)
        if pool is not None:
            pool.stop()
    rows = read_metrics(out / "metrics.jsonl")
    if not rows or rows[-1]["step"] != cfg.max_steps - 1:  # nothing may go missing silently
        raise JobFailed(f"the trainer exited normally but {out / 'metrics.jsonl'} ends at step "
                        f"{rows[-1]['step'] if rows else None}, not {cfg.max_steps - 1}; end of the trainer's log:\n"
                        + _tail(out / "logs" / "trainer.log"))
    wall = time.perf_counter() - t0
    if not quiet:
        print(f"done: {len(rows)} steps in {wall:.1f} s; reward curve:\n{ascii_curve(rows)}", flush=True)
    if cfg.log.plot and rows:
        path = save_plot(rows, out / "metrics.png")
        if path and not quiet:
            print(f"plot saved to {path}", flush=True)
    return rows
