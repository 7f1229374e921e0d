"""The config package's own check, ``validate``: every section's checks (each in its section's
module), non-finite numbers, the names that resolve nowhere, and the trainer layout.

This is what ``config.load_config(check=True)`` runs. The job's full check, which adds the checks
between sections, the node plan, the policy's random init, this machine and the device placement,
is ``primerl.runtime.validate.validate`` (its docstring is the index of where each key is refused).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .data import (check_curriculum, check_env_list, check_env_mix, check_eval, check_eval_names, env_key, env_name,
                   job_envs)
from .deployment import check_deployment
from .distill import check_distill
from .errors import _need
from .inference import check_inference
from .model import check_model, check_model_path
from .orchestrator import check_orchestrator
from .parallel import validate_parallel
from .schema import RLConfig, check_env, check_env_names, check_root
from .trainer import check_loss_names, check_trainer


def validate(cfg: RLConfig) -> None:
    """Every section's checks, names and the trainer layout; raises ``ConfigError`` naming the key."""
    validate_fields(cfg)
    validate_names(cfg)
    validate_parallel(cfg)


def validate_fields(cfg: RLConfig) -> None:
    """Ranges, choices and same-section combinations of every section; ``ConfigError`` naming the key."""
    validate_finite(cfg)
    check_root(cfg)  # top-level keys, [checkpoint], [warm_start]
    check_orchestrator(cfg.orchestrator)
    check_inference(cfg.inference)
    check_trainer(cfg.trainer)
    check_model(cfg.model)
    check_env_list(cfg)
    for i, e in enumerate(job_envs(cfg)):  # [env], or each [[env]] (keys env[i].*)
        check_env(e, env_key(cfg, i))
    check_env_mix(cfg)
    check_curriculum(cfg.orchestrator.curriculum, [env_name(e) for e in job_envs(cfg)])
    check_eval(cfg)
    check_deployment(cfg.deployment)
    check_distill(cfg.distill)


def validate_finite(cfg) -> None:
    """Every float in the config (free-form tables included) must be finite: ``trainer.lr = inf``
    would turn the weights into NaN at the first update."""

    def walk(v: Any, key: str) -> None:
        if dataclasses.is_dataclass(v):
            for f in dataclasses.fields(v):
                walk(getattr(v, f.name), f"{key}.{f.name}" if key else f.name)
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{key}.{k}")
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(x, f"{key}[{i}]")
        elif isinstance(v, float):
            _need(math.isfinite(v), key, "must be a finite number", v)

    walk(cfg, "")


def validate_names(cfg: RLConfig) -> None:
    """Loss method / corrections / aggregation / hyperparameters against ``primerl.rl.losses``' lists,
    the environment factory and its arguments, and ``model.path``: resolved now, so ``--dry-run`` fails."""
    check_loss_names(cfg.trainer.loss)
    for i, e in enumerate(job_envs(cfg)):
        check_env_names(e, env_key(cfg, i))
    check_eval_names(cfg)
    check_model_path(cfg.model)
