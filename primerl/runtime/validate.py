"""The job's full config check, above the modules it consults: ``config`` (fields, names, trainer
layout), the node plan (``launch.deployment``), the policy's random init (``policy``), the job's
combinations (``job_checks``) and the device placement (``placement``). Each raises ``ConfigError``
naming the key, so ``primerl rl --dry-run`` refuses a config with one line before anything starts.

``config`` imports nothing from the runtime; this module is where the checks that do meet it.

>>> cfg = load_config("examples/reverse_text.toml", ["--trainer.lr", "1e-3"])
"""

from __future__ import annotations

from pathlib import Path

from . import config
from .config import RLConfig
from .job_checks import validate_job
from .launch.deployment import validate_deployment
from .launch.kinds import check_launcher
from .placement import resolve_placement
from .policy import model_config

__all__ = ["load_config", "validate"]


def validate(cfg: RLConfig) -> None:
    """Every check of ``cfg`` before the job starts; raises ``ConfigError`` naming the key."""
    config.validate_fields(cfg)
    check_launcher(cfg)  # deployment.kind: registered, its capabilities, the launcher's own checks
    validate_deployment(cfg)  # the node plan: ranks per node, hosts, rendezvous address
    config.validate_names(cfg)
    if not cfg.model.path:  # a random init: its fields are checked by the model's own config
        model_config(cfg, 1)
    config.validate_parallel(cfg)
    validate_job(cfg)  # combinations the job can only fail on after starting (issue 37)
    resolve_placement(cfg)  # device, GPUs, precision and weight path: named errors before anything starts


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *, check: bool = True) -> RLConfig:
    """``config.load_config`` (TOML + ``--key.sub value`` overrides), then, with ``check``, ``validate``."""
    cfg = config.load_config(path, overrides, check=False)
    if check:
        validate(cfg)
    return cfg
