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
   ``trainer.*``, ``trainer.loss.*``            ``config/trainer.py`` ``check_trainer``
   ``deployment.*``                             ``config/deployment.py`` ``check_deployment``
   ===========================================  =================================================

2. ``inference.backend`` and ``deployment.kind``, and every check that depends on which backend or
   launcher kind is named: ``_backend_and_kind_checks`` below (moving to the backends' and the
   launchers' own ``check``); for a job spanning nodes it runs ``check_trainer_nodes`` and
   ``check_inference_nodes`` (``deployment.*`` against ``num_trainer_ranks``, ``device`` and
   ``inference.vllm.weight_update``).
3. the checks between two sections: ``check_between_sections`` below (``trainer.mixed_precision``
   against ``model.dtype``, ``warm_start.steps`` against ``model.path``, ``trainer.router_replay``
   against ``inference.capture_routing``).
4. names that must resolve: ``trainer.loss.method`` / ``corrections`` / ``aggregation`` /
   ``hparams`` (``config/trainer.py`` ``check_loss_names``), ``env.id`` / ``env.args``
   (``config/schema.py`` ``check_env_names``), ``model.path`` (``config/model.py``
   ``check_model_path``).
5. a random init's ``model.*`` against the model's own rules (``policy.model_config`` builds
   ``MoETransformerConfig``; ``model.vocab_size`` against the environment's).
6. ``trainer.parallel.*`` (and ``trainer.fsdp``, ``trainer.attention``) against
   ``num_trainer_ranks``, the model's heads and dims and the loss (``config/parallel.py``
   ``validate_parallel``).
7. this machine: ``log.tensorboard`` / ``log.wandb`` / ``env.id = "verifiers"`` need their
   packages (``job_checks.check_packages``), ``warm_start.steps`` needs the environment's task
   demonstrations (``check_warm_start_tasks`` below), ``output_dir`` can be written
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
from .config import ConfigError, RLConfig, _need, trainer_ranks_per_node
from .launch.deployment import KINDS, _num_nodes
from .inference.backend import check_backend, get_backend
from .placement import resolve_placement
from .policy import model_config

__all__ = ["load_config", "validate", "check_between_sections", "check_trainer_nodes", "check_inference_nodes",
           "check_warm_start_tasks"]


def validate(cfg: RLConfig) -> None:
    """Every check of ``cfg`` before the job starts (the module docstring lists them); raises
    ``ConfigError`` naming the key."""
    config.validate_fields(cfg)  # 1. every section on its own
    check_backend(cfg)  # 2. inference.backend registered, its capabilities cover the config, its own checks
    _backend_and_kind_checks(cfg)  # 2. (with the node plan's checks)
    check_between_sections(cfg)  # 3.
    config.validate_names(cfg)  # 4.
    if not cfg.model.path:  # 5. a random init: its fields are checked by the model's own config
        model_config(cfg, 1)
    config.validate_parallel(cfg)  # 6.
    job_checks.check_packages(cfg)  # 7.
    check_warm_start_tasks(cfg)
    job_checks.check_output_dir(cfg.output_dir)
    resolve_placement(cfg)  # 8. device, GPUs, precision and weight path


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *, check: bool = True) -> RLConfig:
    """``config.load_config`` (TOML + ``--key.sub value`` overrides), then, with ``check``, ``validate``."""
    cfg = config.load_config(path, overrides, check=False)
    if check:
        validate(cfg)
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


def check_trainer_nodes(cfg: RLConfig) -> None:
    """A plan over several nodes: ``deployment.ranks_per_node`` / ``trainer_nodes`` against
    ``num_trainer_ranks``, ``deployment.gpus_per_node`` against ``device``."""
    d, ranks = cfg.deployment, cfg.num_trainer_ranks
    if d.ranks_per_node:
        _need(d.ranks_per_node * d.trainer_nodes == ranks, "deployment.ranks_per_node",
              f"times deployment.trainer_nodes = {d.trainer_nodes} must equal num_trainer_ranks = {ranks}",
              d.ranks_per_node)
    else:
        _need(ranks % d.trainer_nodes == 0, "deployment.trainer_nodes",
              f"must divide num_trainer_ranks = {ranks} (each trainer node runs the same number of ranks)",
              d.trainer_nodes)
    if cfg.device == "cpu":
        _need(d.gpus_per_node == 0, "deployment.gpus_per_node", "must be 0 with device = 'cpu'", d.gpus_per_node)
    elif cfg.device == "cuda":
        _need(d.gpus_per_node >= 1, "deployment.gpus_per_node", "must be set (>= 1) with device = 'cuda'",
              d.gpus_per_node)


def check_inference_nodes(cfg: RLConfig) -> None:
    """A plan over several nodes: inference nodes share no ``output_dir`` with the trainer."""
    d = cfg.deployment
    _need(d.inference_nodes == 0 or cfg.inference.vllm.weight_update == "broadcast", "inference.vllm.weight_update",
          "'filesystem' has the inference nodes' servers load the trainer's files from output_dir, which the nodes do "
          "not share: use 'broadcast' (trainer rank 0 to the servers' workers, inference.vllm.broadcast_host = its "
          "node)",
          cfg.inference.vllm.weight_update)


def check_warm_start_tasks(cfg: RLConfig) -> None:
    """``warm_start.steps`` against ``env.id``: the warm start trains on the environment's task
    demonstrations (the environment is built here, only with a warm start)."""
    if not cfg.warm_start.steps:
        return
    from primerl.rl.envs import load_environment

    try:
        env = load_environment(cfg.env.id, **cfg.env.args)
        tasks = getattr(env, "tasks", None)
    except (ValueError, TypeError, ImportError) as e:
        raise ConfigError(f"env.id / env.args (for warm_start.steps): {e}") from None
    _need(bool(tasks) and callable(getattr(tasks[0], "demonstration", None)), "warm_start.steps",
          f"the warm start trains on the environment's task demonstrations and {cfg.env.id!r} has none "
          "(Task.demonstration()); set warm_start.steps = 0", cfg.warm_start.steps)


# --------------------------------------------------------------------------------------------
# BEGIN backend / kind block (issue 41): the checks that compare inference.backend or
# deployment.kind to a name, as they stood in config/checks.py and launch/deployment.py
# (validate_deployment). They move into InferenceBackend.check / Launcher.check; delete this
# block at the merge (a launcher whose capabilities span nodes then runs check_trainer_nodes and
# check_inference_nodes in its check).


def _backend_and_kind_checks(cfg: RLConfig) -> None:
    i, v, d = cfg.inference, cfg.inference.vllm, cfg.deployment
    # from config/checks.py validate_fields (the backend's lines are check_backend's now)
    pool = i.num_servers > 1 or bool(v.urls)
    _need(not pool or cfg.deployment.kind == "local", "inference.num_servers",
          "a server pool is started by the one-machine launcher (deployment.kind = 'local')", i.num_servers)
    # from launch/deployment.py validate_deployment
    _need(d.kind in KINDS, "deployment.kind", f"must be one of {KINDS}", d.kind)
    if d.kind == "local":
        _need(d.trainer_nodes == 1 and d.inference_nodes == 0 and d.orchestrator == "trainer", "deployment.kind",
              "'local' runs every process on this machine; several nodes need kind = 'nodes' or 'slurm'",
              {"trainer_nodes": d.trainer_nodes, "inference_nodes": d.inference_nodes, "orchestrator": d.orchestrator})
        _need(not d.hosts, "deployment.hosts", "is for kind = 'nodes' (kind is 'local')", d.hosts)
        return
    check_trainer_nodes(cfg)  # (not a comparison: the checks that stood here, between the kind's lines)
    per_node = trainer_ranks_per_node(cfg)
    if d.gpus_per_node:
        # the embedded engine beside the trainer takes a GPU of trainer node 0 (placement: engine first)
        engine = int(d.orchestrator == "trainer" and get_backend(cfg).capabilities.engine_in_process
                     and d.gpus_per_node > 1)
        _need(per_node + engine <= d.gpus_per_node, "deployment.ranks_per_node",
              f"{per_node} trainer ranks per node{' plus the engine' if engine else ''} need "
              f"{per_node + engine} GPUs; deployment.gpus_per_node = {d.gpus_per_node}", per_node)
    check_inference_nodes(cfg)  # (not a comparison: the check that stood here, between the kind's lines)
    if d.kind == "nodes":
        n = _num_nodes(cfg)
        _need(len(d.hosts) == n, "deployment.hosts",
              f"must list {n} hosts ({d.trainer_nodes} trainer + {d.inference_nodes} inference"
              f"{' + 1 orchestrator' if d.orchestrator == 'own' else ''}, in that order)", d.hosts)
        _need(len(set(d.hosts)) == len(d.hosts), "deployment.hosts", "must be distinct", d.hosts)
    else:
        _need(not d.hosts, "deployment.hosts", "comes from SLURM_JOB_NODELIST under kind = 'slurm'; leave it empty",
              d.hosts)

# END backend / kind block
# --------------------------------------------------------------------------------------------
