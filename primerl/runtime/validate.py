"""The job's full config check, and the one index of where each key is refused.

``validate(cfg)`` runs, in this order, and each raises ``ConfigError("<key>: ...")`` naming the key,
so ``primerl rl --dry-run`` refuses a config with one line before anything starts or is written:

1. every section's own checks (ranges, choices, combinations of that section's keys), each next to
   its section's dataclass in ``primerl.runtime.config`` (``config.validate_fields``):

   ===========================================  =================================================
   keys                                         checked in
   ===========================================  =================================================
   every float anywhere (finite)                ``config/checks.py`` ``validate_finite``
   top level (``max_steps``, ``threads``,       ``config/schema.py`` ``check_root``
   ``num_trainer_ranks``, ``output_dir`` set,
   ``device``), ``checkpoint.*``,
   ``warm_start.*``
   ``env.*``                                    ``config/schema.py`` ``check_env``
   ``model.*``                                  ``config/model.py`` ``check_model``
   ``inference.*``, ``inference.vllm.*``,       ``config/inference.py`` ``check_inference``
   ``inference.pd.*``
   ``orchestrator.*``                           ``config/orchestrator.py`` ``check_orchestrator``
   ``trainer.*``, ``trainer.loss.*``,           ``config/trainer.py`` ``check_trainer``
   ``trainer.lora.*``
   ``deployment.*``                             ``config/deployment.py`` ``check_deployment``
   ``distill.*``                                ``config/distill.py`` ``check_distill``
   ===========================================  =================================================

2. ``deployment.kind`` and ``inference.backend``: each names a registered object
   (``launch.kinds.check_launcher``, ``inference.backend.check_backend``; an unknown name lists the
   registered ones), the config asks for nothing the launcher's / backend's capabilities lack (a
   server pool, P/D, broadcast, routed experts, inference nodes, ...), then the launcher's and the
   backend's own ``check`` (for a kind spanning nodes, ``launch.kinds.check_spans_nodes``:
   ``deployment.*`` against ``num_trainer_ranks``, ``device`` and ``inference.vllm.weight_update``).
3. the checks between two sections: ``check_between_sections`` below (``trainer.mixed_precision``
   against ``model.dtype``, ``warm_start.steps`` against ``model.path``, ``trainer.router_replay``
   against ``inference.capture_routing``); ``distill.teacher`` / ``distill.teachers`` against the
   student (``check_distill_teachers``: each teacher's directory is readable, shares the student's
   vocabulary and environment, and ``distill.teachers`` names the job's environments).
4. names that must resolve: ``trainer.loss.method`` / ``corrections`` / ``aggregation`` /
   ``hparams`` (``config/trainer.py`` ``check_loss_names``), ``env.id`` / ``env.args``
   (``config/schema.py`` ``check_env_names``), ``model.path`` (``config/model.py``
   ``check_model_path``).
5. a random init's ``model.*`` against the model's own rules (``policy.model_config`` builds
   ``MoETransformerConfig``; ``model.vocab_size`` against the environment's); ``trainer.lora.targets``
   against the model (``check_lora_model`` below).
6. ``trainer.parallel.*`` (and ``trainer.fsdp``, ``trainer.attention``) against
   ``num_trainer_ranks``, the model's heads and dims and the loss (``config/parallel.py``
   ``validate_parallel``).
7. this machine: ``log.tensorboard`` / ``log.wandb`` / ``env.id = "verifiers"`` /
   ``orchestrator.metrics_port`` need their packages (``job_checks.check_packages``),
   ``inference.vllm.python`` is an executable where vLLM is launched here
   (``job_checks.check_programs``), the backend's own machine checks (``check_machine``: e.g. a vLLM
   launched here without a GPU cannot serve LoRA on a MoE model), ``[distill]``'s teachers exist and
   share the student's vocabulary
   (``check_distill_teachers``), ``warm_start.steps`` needs the environment's task demonstrations
   (``check_warm_start_tasks`` below), ``orchestrator.curriculum`` needs each environment it covers
   to declare a prompt dataset with ids (``check_curriculum_prompts``; the mix's keys ``env[i].*``,
   ``eval.*`` and ``orchestrator.filter`` are in ``config/data.py``), ``output_dir`` can be written
   (``job_checks.check_output_dir``).
8. the device placement on this machine's GPUs: ``device``, ``inference.gpu_ids``,
   ``num_trainer_ranks`` against the GPUs, ``trainer.mixed_precision`` against ``trainer.fsdp``,
   ``inference.weight_update = "broadcast"`` on a shared GPU (``placement.resolve_placement``).

``config`` imports nothing from the runtime; this module is where the checks that meet it are.

>>> cfg = load_config("examples/reverse_text.toml", ["--trainer.lr", "1e-3"])
"""

from __future__ import annotations

from pathlib import Path

from . import config, job_checks
from .config import ConfigError, RLConfig, _need
from .inference.backend import check_backend, get_backend
from .launch.kinds import check_launcher
from .placement import resolve_placement
from .policy import model_config

__all__ = ["load_config", "validate", "check_between_sections", "check_curriculum_prompts", "check_distill_teachers",
           "check_lora_model", "check_warm_start_tasks", "check_weight_transfer"]


def validate(cfg: RLConfig, *, this_machine: bool = True) -> None:
    """Every check of ``cfg`` before the job starts (the module docstring lists them); raises
    ``ConfigError`` naming the key. ``this_machine = False`` (``primerl plan``: planning a cluster
    from a laptop) leaves out 7. and 8., what this machine has: packages, programs, GPUs."""
    config.validate_fields(cfg)  # 1. every section on its own
    check_backend(cfg)  # 2. inference.backend registered, its capabilities cover the config, its own checks
    check_launcher(cfg)  # 2. deployment.kind registered, its capabilities cover the config, its own checks
    check_between_sections(cfg)  # 3.
    config.validate_names(cfg)  # 4.
    if not cfg.model.path:  # 5. a random init: its fields are checked by the model's own config
        model_config(cfg, 1)
    check_lora_model(cfg)  # 5. trainer.lora.targets against the model
    config.validate_parallel(cfg)  # 6.
    if not this_machine:
        return
    job_checks.check_packages(cfg)  # 7.
    job_checks.check_programs(cfg)
    get_backend(cfg).check_machine(cfg)
    check_distill_teachers(cfg)  # 3. (the teachers' files are on this machine: not needed to plan)
    check_warm_start_tasks(cfg)
    check_curriculum_prompts(cfg)
    job_checks.check_output_dir(cfg.output_dir)
    check_weight_transfer(resolve_placement(cfg), cfg)  # 8. device, GPUs, precision and weight path


def check_weight_transfer(placement, cfg: RLConfig) -> None:
    """``inference.weight_transfer.dtype = "fp8"`` / ``delta`` against the placement's weight path:
    both are forms of the bucketed broadcast (files carry the engine's dtype in full; P/D servers load
    files). The embedded engine and a pool of ``primerl inference`` servers take them (vLLM is refused
    by its backend's capabilities)."""
    w, i = cfg.inference.weight_transfer, cfg.inference
    for key, asked in (("dtype", w.dtype != "auto"), ("delta", w.delta)):
        if not asked:
            continue
        value = getattr(w, key)
        _need(not i.pd.enabled, f"inference.weight_transfer.{key}",
              "P/D servers take weights as files (full, in the engine's dtype); the bucketed transfer's "
              "FP8 / delta forms reach the embedded engine or a pool of servers by broadcast", value)
        _need(placement.weight_update == "broadcast", f"inference.weight_transfer.{key}",
              "is a form of the broadcast, but the weights go by files here (set inference.weight_update = "
              "'broadcast')", value)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *, check: bool = True,
                this_machine: bool = True) -> RLConfig:
    """``config.load_config`` (TOML + ``--key.sub value`` overrides), then, with ``check``, ``validate``."""
    cfg = config.load_config(path, overrides, check=False)
    if check:
        validate(cfg, this_machine=this_machine)
    return cfg


# --------------------------------------------------------------------------------------------
# between sections


def check_between_sections(cfg: RLConfig) -> None:
    """Combinations of two sections' keys (none of them names a backend or a launcher kind)."""
    t, m, w = cfg.trainer, cfg.model, cfg.warm_start
    _need(t.mixed_precision != "bf16" or m.dtype == "float32", "trainer.mixed_precision",
          "'bf16' keeps float32 master weights: it needs model.dtype = 'float32' (model.dtype = 'bfloat16' "
          "trains in pure bf16; set trainer.mixed_precision = 'off' or 'auto' for that)", t.mixed_precision)
    _need(not (w.steps and m.path), "warm_start.steps",
          f"the warm start trains the random init of [model]; leave model.path empty (it is {m.path!r})", w.steps)
    _need(not t.router_replay or cfg.inference.capture_routing, "trainer.router_replay",
          "replay needs the sampler's routing: with inference.capture_routing = false set trainer.router_replay = "
          "false too (or capture routing)", t.router_replay)


def check_lora_model(cfg: RLConfig) -> None:
    """``trainer.lora.targets`` against the model (built on the meta device): every named target
    exists there and can take an adapter (``primerl.models.lora.resolve_targets``)."""
    lora = cfg.trainer.lora
    if not lora.rank:
        return
    import torch

    from primerl.models import MoETransformer
    from primerl.models.lora import LoRAError, resolve_targets

    with torch.device("meta"):
        model = MoETransformer(model_config(cfg, 1))
    try:
        resolve_targets(model, lora.targets or None)
    except LoRAError as e:
        raise ConfigError(f"trainer.lora.targets: {str(e).removeprefix('apply_lora: ')}") from None


def check_warm_start_tasks(cfg: RLConfig) -> None:
    """``warm_start.steps`` against ``env.id``: the warm start trains on the environment's task
    demonstrations (the environment is built here, only with a warm start)."""
    if not cfg.warm_start.steps:
        return
    try:
        env = config.load_policy_env(cfg)
        tasks = getattr(env, "tasks", None)
    except (ValueError, TypeError, ImportError) as e:
        raise ConfigError(f"env.id / env.args (for warm_start.steps): {e}") from None
    _need(bool(tasks) and callable(getattr(tasks[0], "demonstration", None)), "warm_start.steps",
          f"the warm start trains on the environment's task demonstrations and {config.policy_env(cfg).id!r} has none "
          "(Task.demonstration()); set warm_start.steps = 0", cfg.warm_start.steps)


def check_distill_teachers(cfg: RLConfig) -> None:
    """``[distill]`` against the student: every teacher directory resolves
    (``inference.teacher.resolve_teacher``) and shares the student's vocabulary (size, and a
    primerl teacher's environment; ``check_same_vocabulary``); ``distill.teachers`` keys are the
    job's environment ids; the verifiers path has no teacher scoring."""
    d = cfg.distill
    if not config.distill_enabled(d):
        return
    from .inference.teacher import check_same_vocabulary, resolve_teacher

    job_envs = config.job_envs(cfg)
    _need(all(e.id != "verifiers" for e in job_envs), "distill.teacher",
          "teacher scoring runs in the built-in orchestrator; the verifiers path (env.id = 'verifiers') has none",
          d.teacher or d.teachers)
    if d.backend:
        from .inference.backend import get_backend

        try:
            get_backend(d.backend)
        except ConfigError as e:
            raise ConfigError(f"distill.backend: {e}") from None
    envs = [e.id for e in job_envs]
    for name in d.teachers:
        _need(name in envs, f"distill.teachers.{name}", f"names no environment of the job (env ids: {envs})",
              d.teachers[name])
    try:
        student_vocab = model_config(cfg, config.load_policy_env(cfg).vocab_size).vocab_size
    except (ValueError, TypeError, ImportError):
        return  # the environment / model is refused by its own check, naming its key
    _need(d.topk <= student_vocab, "distill.topk", f"must be at most the vocabulary size ({student_vocab})", d.topk)
    keyed = ([("distill.teacher", d.teacher)] if d.teacher else []) + \
        [(f"distill.teachers.{k}", v) for k, v in d.teachers.items()]
    for key, path in keyed:
        check_same_vocabulary(resolve_teacher(path, key), cfg, student_vocab, key)


def check_curriculum_prompts(cfg: RLConfig) -> None:
    """``orchestrator.curriculum``: every environment it covers declares a prompt dataset with ids
    (``prompts()``; the environments are built here, only with a curriculum on)."""
    c = cfg.orchestrator.curriculum
    if not c.enabled:
        return
    from primerl.rl.envs import load_environment, prompt_ids

    for e in config.job_envs(cfg):
        name = config.env_name(e)
        if c.envs and name not in c.envs:
            continue
        try:
            ids = prompt_ids(load_environment(e.id, **e.args))
        except (ValueError, TypeError, ImportError) as err:
            raise ConfigError(f"orchestrator.curriculum: environment {name!r}: {err}") from None
        _need(ids is not None, "orchestrator.curriculum",
              f"environment {name!r} declares no prompt dataset (prompts() with ids; for reverse-text set "
              "env.args.num_prompts), so per-prompt pass rates have nothing to key on", name)
