"""Checks of the combinations that ``primerl rl`` can only run one way, made by ``validate.validate``
so that ``--dry-run`` refuses them with one line naming the key before any process starts or
anything is written (each of them used to fail only after both processes had started).

Nothing here writes: ``output_dir`` is checked by looking at it (the launcher's own guard for
what only an attempt reveals is ``output_dir.OutputDirUnusable``, also a one-line error)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

__all__ = ["validate_job", "check_output_dir"]


def _error(key: str, msg: str, value):
    from .config import ConfigError

    return ConfigError(f"{key}: {msg}, got {value!r}")


def validate_job(cfg) -> None:
    loss, t, i = cfg.trainer.loss, cfg.trainer, cfg.inference
    if "tis" in loss.corrections:
        raise _error("trainer.loss.corrections", "'tis' needs the trainer's pre-update log-probs (old_logprobs), "
                     "which the job does not compute (the method's own ratio pi_theta/pi_inference already is the "
                     "importance weight): bound it with 'mis' or 'icepop' instead", loss.corrections)
    if loss.aggregation == "token_sum_norm":
        c = loss.hparams.get("norm_constant")
        if not (isinstance(c, (int, float)) and not isinstance(c, bool) and 0 < c < float("inf")):
            raise _error("trainer.loss.hparams.norm_constant", "aggregation 'token_sum_norm' divides the token sum "
                         "by it: set a number > 0 (e.g. --trainer.loss.hparams.norm_constant 4096)", c)
    if t.router_replay and not i.capture_routing:
        raise _error("trainer.router_replay", "replay needs the sampler's routing: with inference.capture_routing = "
                     "false set trainer.router_replay = false too (or capture routing)", t.router_replay)
    for key, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if getattr(cfg.log, key) and not _installed(package):
            raise _error(f"log.{key}", f"needs the {package} package (pip install {package})", True)
    if cfg.env.id == "verifiers":
        missing = [m for m in ("verifiers", "verifiers.v1", "renderers") if not _installed(m)]
        if missing:
            raise _error("env.id", f"the verifiers environment needs verifiers 0.4.0 and renderers "
                         f"({', '.join(missing)} not installed: pip install 'primerl[verifiers]'; README: verifiers)",
                         cfg.env.id)
    if cfg.warm_start.steps:
        _check_demonstrations(cfg)
    check_output_dir(cfg.output_dir)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a submodule's parent is missing
        return False


def _check_demonstrations(cfg) -> None:
    from primerl.rl.envs import load_environment

    from .config import ConfigError

    try:  # built here only with a warm start: its tasks are what it trains on
        env = load_environment(cfg.env.id, **cfg.env.args)
        tasks = getattr(env, "tasks", None)
    except (ValueError, TypeError, ImportError) as e:
        raise ConfigError(f"env.id / env.args (for warm_start.steps): {e}") from None
    if not tasks or not callable(getattr(tasks[0], "demonstration", None)):
        raise _error("warm_start.steps", f"the warm start trains on the environment's task demonstrations and "
                     f"{cfg.env.id!r} has none (Task.demonstration()); set warm_start.steps = 0", cfg.warm_start.steps)


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
