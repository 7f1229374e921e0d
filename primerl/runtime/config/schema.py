"""The job config's root: ``RLConfig`` (the top-level keys and every section), the small sections
``[env]``, ``[checkpoint]``, ``[warm_start]`` and ``[log]``, and their own checks.

The other sections live in a module each, with their checks: ``model.py`` ([model]),
``inference.py`` ([inference], [inference.vllm], [inference.pd]), ``orchestrator.py``,
``trainer.py`` ([trainer], [trainer.loss]), ``parallel.py`` ([trainer.parallel]) and
``deployment.py``; ``errors.py`` holds ``ConfigError`` and ``_need``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .data import EvalConfig
from .deployment import DeploymentConfig
from .distill import DistillConfig
from .errors import ConfigError, _need
from .inference import InferenceConfig, PDConfig, VLLMConfig, WeightTransferConfig
from .model import ModelConfig
from .orchestrator import OrchestratorConfig
from .parallel import ParallelConfig
from .trainer import LossConfig, TrainerConfig

__all__ = ["CheckpointConfig", "ConfigError", "DeploymentConfig", "DistillConfig", "EnvConfig", "InferenceConfig",
           "LogConfig", "LossConfig", "ModelConfig", "OrchestratorConfig", "PDConfig", "ParallelConfig", "RLConfig",
           "TrainerConfig", "VLLMConfig", "WarmStartConfig", "WeightTransferConfig", "_need", "check_env",
           "check_env_names", "check_root"]

DEVICES = ("auto", "cpu", "cuda")


@dataclass
class EnvConfig:
    id: str = "reverse-text"  # a built-in name or "package.module:ClassOrFactory"
    args: dict = field(default_factory=dict)
    timeout_s: float = 30.0  # per reward / env-turn call
    max_retries: int = 2  # an episode whose env call raises is resampled this many times, then fails
    max_concurrent_calls: int = 64  # env calls (reward / respond) running at once, each on its own thread
    max_abs_reward: float = 1e6  # larger |reward| is clipped to +-this (counted: rewards/clipped)
    # in a mix ([[env]], config/data.py): the environment's name (metrics reward/<name>; default its
    # id), its share of each batch's groups (weights are normalised) and its own group size / tokens
    name: str = ""
    weight: float = 1.0
    group_size: int = 0  # samples per prompt; 0: orchestrator.group_size
    max_tokens: int = 0  # per model turn, a cap on the prompt's own; 0: the environment's


@dataclass
class CheckpointConfig:
    interval: int = 0  # save every N steps (0: only at the end)
    keep: int = 2
    resume: bool = False  # continue from the latest checkpoint in output_dir
    async_save: bool = False  # write interval checkpoints in a background thread (DCP async_save)
    export_hf: bool = False  # at the end, the policy in Hugging Face's layout at <output_dir>/hf (a model.path)


@dataclass
class WarmStartConfig:
    """A supervised warm start that the job runs before RL (``primerl.runtime.trainer.vf_warmstart``):
    the random-init policy of ``[model]`` is trained on the environment's task demonstrations
    (``Task.demonstration()``, e.g. the ``primerl-vault`` tool-use task) for ``steps`` steps, written to
    ``<output_dir>/warm_start`` and RL starts from it (``model.path`` of the resolved config)."""

    steps: int = 0  # 0: no warm start
    batch_size: int = 16  # demonstrations per step
    lr: float = 3e-3
    # An RL warm start instead (any environment): the job first runs itself for rl_steps steps as
    # full fine-tuning (no trainer.lora, trainer.lr = lr above), with env.args updated by
    # rl_env_args (a related task), into <output_dir>/warm_start_rl, and starts from that policy
    # (<output_dir>/warm_start_rl/hf, Hugging Face layout): how examples/reverse_text_lora.toml
    # trains the base its LoRA run adapts.
    rl_steps: int = 0
    rl_env_args: dict = field(default_factory=dict)


@dataclass
class LogConfig:
    progress: bool = True
    plot: bool = True
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "primerl"


@dataclass
class RLConfig:
    output_dir: str = "outputs/run"
    overwrite: bool = False  # a non-empty output_dir is refused unless this or checkpoint.resume is true
    seed: int = 0
    max_steps: int = 50
    device: str = "auto"  # "auto" (cuda when torch sees a GPU), "cpu" or "cuda": where trainer and engine run
    threads: int = 1  # torch threads per process
    num_trainer_ranks: int = 1  # torchrun processes of the trainer (gloo on CPU, nccl on GPUs)
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    env_mix: list[EnvConfig] = field(default_factory=list)  # [[env]]: the mix's environments after the first
    eval: EvalConfig = field(default_factory=EvalConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    log: LogConfig = field(default_factory=LogConfig)
    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)


def check_root(cfg: RLConfig) -> None:
    """The top-level keys, ``[checkpoint]`` and ``[warm_start]`` on their own."""
    _need(cfg.max_steps >= 1, "max_steps", "must be >= 1", cfg.max_steps)
    _need(cfg.threads >= 1, "threads", "must be >= 1", cfg.threads)
    _need(cfg.num_trainer_ranks >= 1, "num_trainer_ranks", "must be >= 1", cfg.num_trainer_ranks)
    _need(bool(cfg.output_dir), "output_dir", "must be set", cfg.output_dir)
    _need(cfg.device in DEVICES, "device", "must be auto, cpu or cuda", cfg.device)
    c, w = cfg.checkpoint, cfg.warm_start
    _need(c.interval >= 0, "checkpoint.interval", "must be >= 0", c.interval)
    _need(c.keep >= 1, "checkpoint.keep", "must be >= 1", c.keep)
    _need(w.steps >= 0, "warm_start.steps", "must be >= 0 (0: no warm start)", w.steps)
    _need(w.batch_size >= 1, "warm_start.batch_size", "must be >= 1", w.batch_size)
    _need(w.lr > 0, "warm_start.lr", "must be > 0", w.lr)
    _need(w.rl_steps >= 0, "warm_start.rl_steps", "must be >= 0 (0: no RL warm start)", w.rl_steps)
    _need(not (w.rl_steps and w.steps), "warm_start.rl_steps",
          "is an RL warm start; warm_start.steps a supervised one: set one of them", w.rl_steps)
    _need(not w.rl_env_args or w.rl_steps, "warm_start.rl_env_args", "needs warm_start.rl_steps", w.rl_env_args)


def check_env(e: EnvConfig, key: str = "env") -> None:
    """``[env]``'s ranges (``key``: ``env[i]`` for an environment of a mix)."""
    _need(bool(e.id), f"{key}.id", "must be set", e.id)
    _need(e.timeout_s > 0, f"{key}.timeout_s", "must be > 0", e.timeout_s)
    _need(e.max_retries >= 0, f"{key}.max_retries", "must be >= 0", e.max_retries)
    _need(e.max_concurrent_calls >= 1, f"{key}.max_concurrent_calls", "must be >= 1", e.max_concurrent_calls)
    _need(e.max_abs_reward > 0, f"{key}.max_abs_reward", "must be > 0", e.max_abs_reward)


def check_env_names(e: EnvConfig, key: str = "env") -> None:
    """``env.id`` and ``env.args`` resolve to an environment factory and its arguments (imported now)."""
    from primerl.rl.envs import resolve_environment

    try:
        resolve_environment(e.id, e.args)
    except ValueError as err:
        raise ConfigError(f"{key}.id / {key}.args: {err}") from None
