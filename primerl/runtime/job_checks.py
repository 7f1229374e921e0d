"""The config's checks against this machine, made by ``validate.validate`` so that ``--dry-run``
refuses them with one line naming the key before any process starts or anything is written:
packages that ``log.*`` and ``env.id`` need, and ``output_dir``. (The checks between sections that
lived here are ``validate.check_between_sections``, ``validate.check_warm_start_tasks`` and, for
the loss, ``config/trainer.py``.)

Nothing here writes: ``output_dir`` is checked by looking at it (the launcher's own guard for
what only an attempt reveals is ``output_dir.OutputDirUnusable``, also a one-line error)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

__all__ = ["check_packages", "check_output_dir", "check_programs"]


def _error(key: str, msg: str, value):
    from .config import ConfigError

    return ConfigError(f"{key}: {msg}, got {value!r}")


def check_packages(cfg) -> None:
    """``log.tensorboard`` / ``log.wandb`` and ``env.id = "verifiers"`` need their packages installed here."""
    for key, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if getattr(cfg.log, key) and not _installed(package):
            raise _error(f"log.{key}", f"needs the {package} package (pip install {package})", True)
    if cfg.orchestrator.metrics_port and not _installed("prometheus_client"):
        raise _error("orchestrator.metrics_port", "GET /metrics needs the prometheus-client package "
                     "(pip install 'primerl[serve]')", cfg.orchestrator.metrics_port)
    from .config.data import env_key, job_envs

    for i, e in enumerate(job_envs(cfg)):
        missing = [m for m in ("verifiers", "verifiers.v1", "renderers") if not _installed(m)]
        if e.id == "verifiers" and missing:
            raise _error(f"{env_key(cfg, i)}.id", f"the verifiers environment needs verifiers 0.4.0 and renderers "
                         f"({', '.join(missing)} not installed: pip install 'primerl[verifiers]'; docs/verifiers.md)",
                         e.id)


def check_programs(cfg) -> None:
    """``inference.vllm.python``, where this machine starts vLLM with it (a backend that launches
    servers, ``inference.vllm.launch`` or ``inference.pd``, on a launcher that keeps the job here),
    is an executable file."""
    from .inference.backend import get_backend
    from .launch.kinds import get_launcher

    i = cfg.inference
    py = i.vllm.python
    if not py or not (i.vllm.launch or i.pd.enabled) or not get_backend(cfg).capabilities.launch:
        return
    if get_launcher(cfg).capabilities.spans_nodes:  # the path is the nodes', not this machine's
        return
    p = Path(py).expanduser()
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise _error("inference.vllm.python", "is not an executable file on this machine (the interpreter "
                     "with vLLM installed; docs/vllm.md)", py)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a submodule's parent is missing
        return False


def check_output_dir(output_dir: str) -> None:
    """``output_dir`` is a directory, or can be made one: no regular file in the way and the
    nearest existing ancestor is a writable directory. Looks only, writes nothing."""
    p = Path(output_dir).expanduser().absolute()
    if p.exists() and not p.is_dir():
        raise _error("output_dir", "is not a directory (a file of that name exists)", output_dir)
    if p.is_dir():
        if not os.access(p, os.W_OK | os.X_OK):
            raise _error("output_dir", "is a directory this user cannot write to", output_dir)
        return
    a = p.parent
    while not a.exists():
        a = a.parent
    if not a.is_dir():
        raise _error("output_dir", f"cannot be created: {a} is not a directory", output_dir)
    if not os.access(a, os.W_OK | os.X_OK):
        raise _error("output_dir", f"cannot be created: {a} is not writable by this user", output_dir)
    if os.statvfs(a).f_flag & os.ST_RDONLY:
        raise _error("output_dir", f"cannot be created: {a} is on a read-only filesystem", output_dir)
    kernel = a == Path("/dev") or any(a == Path(k) or Path(k) in a.parents for k in ("/proc", "/sys"))
    if kernel:  # root passes access() there (/dev/shm, a tmpfs, is fine)
        raise _error("output_dir", f"cannot be created under {a} (a kernel filesystem)", output_dir)
