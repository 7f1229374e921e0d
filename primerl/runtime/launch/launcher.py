"""Launchers: how a job's processes are started, one registered object per ``deployment.kind``.

A launcher is a small object (:class:`Launcher`) with its :class:`LauncherCapabilities`; the
built-in ones register themselves when their module is imported, and :data:`LAUNCHERS` imports
those modules on its first lookup:

========== ===================================== ================================================
kind       module                                what it starts
========== ===================================== ================================================
local      ``launch.machine``                    trainer + orchestrator processes on this machine
                                                 (the server pool, launched vLLM)
nodes      ``launch.local``                      one ``primerl node`` process per node and role
                                                 (127.x hosts), or the per-host commands
slurm      ``launch.slurm``                      an sbatch script, submitted
threads    ``launch.threads``                    the whole job in this process
========== ===================================== ================================================

A third-party launcher is one module that calls ``register_launcher("mine", MyLauncher())`` (or
an entry point of group ``primerl.launchers``, or ``deployment.kind = "package.module:Attr"``).

Every kind runs the same preparation, :func:`prepare_job`: the ``output_dir`` lock (held for the
job's life), the supervised warm start (``[warm_start]``, ``trainer.vf_warmstart.job_warm_start``;
on the submitting machine for ``slurm``: the nodes read the warm-started policy from the shared
``output_dir``), ``output_dir`` prepared (stale temporary directories, the resume step, the
transport's directories, ``config.toml`` of the resolved config, ``logs/``). :func:`run_job` is
``primerl rl``: prepare, ``start``, ``wait``, ``stop`` in ``finally``.

:func:`check_launcher` is the kind's part of the config check (``validate.validate`` calls it):
an unknown kind lists the registered ones, then what the config asks of the launcher's
capabilities, then the launcher's own ``check``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import RLConfig
from .kinds import (LAUNCHERS, Launcher, LauncherCapabilities, check_launcher, check_one_machine,  # noqa: F401 (the door)
                    check_spans_nodes, get_launcher, register_launcher, trainer_ranks_per_node)

if TYPE_CHECKING:
    from ..output_dir import OutputDirLock

__all__ = ["LAUNCHERS", "Launcher", "LauncherCapabilities", "PreparedJob", "check_launcher", "check_one_machine",
           "check_spans_nodes", "get_launcher", "prepare_job", "register_launcher", "run_job", "trainer_ranks_per_node"]


@dataclass
class PreparedJob:
    """A job ready to start: what :func:`prepare_job` made, handed to ``start`` / ``wait`` / ``stop``.

    ``cfg`` is the resolved config (after the warm start: ``model.path`` is the warm-started
    policy), the one written to ``config_path``; ``start_step`` the step the job starts from
    (``checkpoint.resume``). ``parts`` receives in-process objects a caller asked for (the threads
    launcher: ``"client"``, ``"trainer"``); ``state`` is the launcher's own between its calls."""

    cfg: RLConfig
    output_dir: Path
    config_path: Path
    start_step: int
    quiet: bool = False
    parts: dict = field(default_factory=dict)
    state: dict = field(default_factory=dict)
    lock: "OutputDirLock | None" = None

    def release(self) -> None:
        """Give ``output_dir``'s lock back (the job is over)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def prepare_job(cfg: RLConfig, *, quiet: bool = False, parts: dict | None = None) -> PreparedJob:
    """The one preparation of every kind: claim ``output_dir`` (the lock is held until
    ``PreparedJob.release``), run the warm start, prepare ``output_dir`` (stale temporary
    directories removed, the resume step, the transport's directories, ``config.toml`` of the
    resolved config, ``logs/``). On a failure the lock is given back."""
    from ..output_dir import claim_output_dir
    from ..trainer.vf_warmstart import job_warm_start
    from .common import prepare_output

    from .rl_warmstart import job_rl_warm_start

    lock = claim_output_dir(cfg)
    try:
        cfg = job_rl_warm_start(cfg, run_job, quiet=quiet)
        cfg = job_warm_start(cfg, quiet=quiet)
        start = prepare_output(cfg)
    except BaseException:
        lock.release()
        raise
    out = Path(cfg.output_dir).resolve()
    return PreparedJob(cfg, out, out / "config.toml", start, quiet, {} if parts is None else parts, {}, lock)


def run_job(cfg: RLConfig, *, quiet: bool = False, launcher: Launcher | None = None,
            parts: dict | None = None) -> list[dict]:
    """``primerl rl``: the launcher of ``deployment.kind`` (or ``launcher``) prepares (:func:`prepare_job`),
    starts, waits for the job's end and stops what is left; returns the metrics rows (a submitting
    launcher, ``slurm``, returns none: the job runs later).

    Supervised restarts (a launcher with ``capabilities.restarts``): when the job fails
    (``JobFailed``: a process died or stalled), everything is stopped (``deployment.grace_s``) and
    the job starts again from its last complete checkpoint (``checkpoint.resume``; the metrics of
    steps after it are dropped, so each step is in ``metrics.jsonl`` once), at most
    ``deployment.max_restarts`` times (``config.deployment.effective_max_restarts``); past that it
    fails naming the cause of every restart. The processes see the count in
    ``lifetime.JOB_RESTARTS_ENV`` (the trainer logs it as ``job/restarts``)."""
    import dataclasses
    import os

    from ..config.deployment import effective_max_restarts
    from ..lifetime import JOB_RESTARTS_ENV as RESTARTS_ENV
    from .common import JobFailed

    launcher = get_launcher(cfg) if launcher is None else launcher
    budget = effective_max_restarts(cfg) if launcher.capabilities.restarts else 0
    causes: list[str] = []
    while True:
        os.environ[RESTARTS_ENV] = str(len(causes))
        job = prepare_job(cfg, quiet=quiet, parts=parts)
        try:
            try:
                launcher.start(job)
                return launcher.wait(job)
            finally:
                launcher.stop(job)
        except JobFailed as e:
            causes.append(str(e))
            if len(causes) > budget:
                if budget == 0:
                    raise
                raise JobFailed(f"the job failed {len(causes)} times (deployment.max_restarts = {budget}); the "
                                "causes:\n" + "\n".join(f"{i + 1}. {c.splitlines()[0]}" for i, c in enumerate(causes))
                                + f"\nthe last in full: {causes[-1]}") from None
            if not quiet:
                print(f"primerl rl: RESTART {len(causes)} of at most {budget} (from the last checkpoint): "
                      f"{str(e).splitlines()[0]}", flush=True)
            cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=True))
        finally:
            job.release()
            os.environ.pop(RESTARTS_ENV, None)

