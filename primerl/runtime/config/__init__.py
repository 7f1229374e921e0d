"""Typed configuration of an RL job: dataclasses loaded from TOML plus ``--key.sub value`` overrides.

Every section is a dataclass; unknown keys (in the file or on the command line) raise
``ConfigError`` naming the full dotted key, and ``validate`` runs every section's own checks, the
names and the trainer layout. This package imports nothing from the runtime (placement, policy,
launch import it; it may import ``primerl.models``, a lower layer): the job's full check, which adds
the checks between sections, the node plan, the policy's random init, this machine and the device
placement, is ``primerl.runtime.validate`` (its ``load_config`` is what ``primerl rl`` and the
tests call).

>>> cfg = load_config("examples/reverse_text.toml", ["--trainer.lr", "1e-3"], check=False)
>>> print(to_toml(cfg))   # the resolved config, what ``primerl rl --dry-run`` prints

Modules: one per section with that section's own checks next to its dataclass (schema: the root
RLConfig, [env], [checkpoint], [warm_start], [log]; model; inference; orchestrator; trainer;
parallel: [trainer.parallel]; deployment), errors (ConfigError, _need), parse (TOML, overrides,
to_toml) and checks (``validate``: every section's checks). The checks between sections are in
``primerl.runtime.validate``, whose docstring is the index of where each key is refused. Every
public name is re-exported here.
"""

from __future__ import annotations

from .errors import ConfigError, _need  # noqa: F401
from .distill import distill_enabled  # noqa: F401
from .data import (CurriculumConfig, EvalConfig, EvalEnvConfig, env_name, eval_env_spec, eval_name, job_envs,  # noqa: F401
                   load_policy_env, policy_env)
from .checks import validate, validate_fields, validate_finite, validate_names  # noqa: F401
from .parallel import (  # noqa: F401
    CP_KINDS, FP8_RECIPES, cp_degrees, describe_cp, describe_parallel, parallel_dims, validate_cp_split,
    validate_parallel
)
from .parse import apply_override, from_dict, load_config, parse_overrides, to_dict, to_toml  # noqa: F401
from .schema import (  # noqa: F401
    CheckpointConfig, DeploymentConfig, DistillConfig, EnvConfig, InferenceConfig, LogConfig, LossConfig,
    ModelConfig, OrchestratorConfig, PDConfig, ParallelConfig, RLConfig, TrainerConfig, VLLMConfig,
    WarmStartConfig, WeightTransferConfig
)

__all__ = [
    "CP_KINDS", "CheckpointConfig", "ConfigError", "CurriculumConfig", "DeploymentConfig", "DistillConfig",
    "EnvConfig", "EvalConfig", "EvalEnvConfig", "FP8_RECIPES", "env_name", "eval_env_spec", "eval_name", "job_envs",
    "InferenceConfig", "LogConfig", "LossConfig", "ModelConfig", "OrchestratorConfig", "PDConfig",
    "ParallelConfig", "RLConfig", "TrainerConfig", "VLLMConfig", "WarmStartConfig", "WeightTransferConfig",
    "apply_override", "distill_enabled",
    "cp_degrees", "describe_cp", "describe_parallel", "from_dict", "load_config", "parallel_dims",
    "parse_overrides", "to_dict", "to_toml", "validate", "validate_cp_split",
    "validate_fields", "validate_finite", "validate_names", "validate_parallel"
]
