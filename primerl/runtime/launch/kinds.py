"""The launcher registry and what is asked of a launcher, without the job's preparation:
:class:`LauncherCapabilities`, the :class:`Launcher` protocol, :data:`LAUNCHERS`,
:func:`register_launcher` / :func:`get_launcher` and the kind's config checks
(:func:`check_launcher`). Everything here is also importable from ``launch.launcher`` (the door);
this module imports only ``config`` and ``registry``, so the modules that ask a capability
(placement, the transport, the node plan, ``validate``) do not import the job's preparation
(warm start, ``output_dir``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..config import ConfigError, RLConfig
from ..registry import Registry

if TYPE_CHECKING:
    from .launcher import PreparedJob

__all__ = ["LAUNCHERS", "Launcher", "LauncherCapabilities", "check_launcher", "check_one_machine", "check_spans_nodes",
           "get_launcher", "register_launcher", "trainer_ranks_per_node"]


@dataclass(frozen=True)
class LauncherCapabilities:
    """What a launcher can do; other code asks these, never the kind's name."""

    spans_nodes: bool  # processes on several nodes: rollout batches by ZeroMQ when 'auto', no shared cwd
    server_pool: bool  # starts inference.num_servers > 1 servers (or external inference.vllm.urls) and a router
    warm_start: bool = True  # runs [warm_start] in prepare_job (every built-in one does: the shared preparation)
    restarts: bool = False  # run_job restarts a failed job from its last checkpoint (deployment.max_restarts)
    job_restarts: bool = False  # the job it submits restarts its own steps from the last checkpoint (sbatch script)


@runtime_checkable
class Launcher(Protocol):
    """One ``deployment.kind``. ``check``: this kind's ``deployment.*`` checks (``ConfigError``
    naming the key); ``describe``: the ``--dry-run`` plan (nodes, commands, sbatch script);
    ``start`` / ``wait`` (the metrics rows; ``JobFailed`` naming the process) / ``stop``."""

    name: str
    capabilities: LauncherCapabilities

    def check(self, cfg: RLConfig) -> None: ...

    def describe(self, cfg: RLConfig) -> str: ...

    def start(self, job: "PreparedJob") -> None: ...

    def wait(self, job: "PreparedJob") -> list[dict]: ...

    def stop(self, job: "PreparedJob") -> None: ...


LAUNCHERS: Registry[Launcher] = Registry(
    "launcher", "deployment.kind",
    ("primerl.runtime.launch.machine", "primerl.runtime.launch.local", "primerl.runtime.launch.slurm",
     "primerl.runtime.launch.threads"),
    "primerl.launchers")


def register_launcher(name: str, launcher: Launcher | None = None):
    """Register ``launcher`` as ``deployment.kind = name`` (a decorator without ``launcher``)."""
    return LAUNCHERS.register(name, launcher)


def get_launcher(name_or_cfg: str | RLConfig) -> Launcher:
    """The launcher of a kind name or of ``cfg.deployment.kind`` (a registered class is instantiated: a
    launcher keeps a job's state in its ``PreparedJob``); an unknown one is a ``ConfigError`` listing
    the registered kinds."""
    name = name_or_cfg if isinstance(name_or_cfg, str) else name_or_cfg.deployment.kind
    launcher = LAUNCHERS.get(name)
    if isinstance(launcher, type):  # a class registered (``@register_launcher("mine")``): launchers keep no state
        launcher = launcher()
    if not isinstance(launcher, Launcher) or not isinstance(getattr(launcher, "capabilities", None),
                                                            LauncherCapabilities):
        raise ConfigError(f"deployment.kind: {name!r} is registered as {launcher!r}, which is not a launcher "
                          "(name, capabilities: LauncherCapabilities, check, describe, start, wait, stop)")
    return launcher


def _need(cond: bool, key: str, msg: str, value) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}, got {value!r}")


def _can_start_a_pool(name: str) -> bool:
    # another registered kind that is broken (not a launcher) is its own error, not this config's
    try:
        return get_launcher(name).capabilities.server_pool
    except ConfigError:
        return False


def check_launcher(cfg: RLConfig) -> None:
    """The kind's part of the config check: registered, the capabilities the config needs, then the
    launcher's own ``check``. Raises ``ConfigError`` naming the key."""
    launcher = get_launcher(cfg)
    i = cfg.inference
    on_nodes = launcher.capabilities.spans_nodes and cfg.deployment.inference_nodes > 0 and not i.vllm.urls
    if (i.num_servers > 1 or i.vllm.urls) and not launcher.capabilities.server_pool and not on_nodes:
        able = " or ".join(repr(n) for n in LAUNCHERS.names() if _can_start_a_pool(n))
        pool = i.num_servers > 1
        key, value = ("inference.num_servers", i.num_servers) if pool else ("inference.vllm.urls", i.vllm.urls)
        nodes = (" or on inference nodes (deployment.inference_nodes >= 1, inference.num_servers on each)"
                 if launcher.capabilities.spans_nodes and pool else "")
        _need(False, key, f"a server pool is started by a launcher that can (deployment.kind {able}){nodes}, "
              f"not by deployment.kind = {cfg.deployment.kind!r}", value)
    launcher.check(cfg)


def check_one_machine(cfg: RLConfig) -> None:
    """``deployment.*`` of a kind that runs every process on this machine (``local``, ``threads``)."""
    d = cfg.deployment
    _need(d.trainer_nodes == 1 and d.inference_nodes == 0 and d.orchestrator == "trainer", "deployment.kind",
          f"{d.kind!r} runs every process on this machine; several nodes need kind = 'nodes' or 'slurm'",
          {"trainer_nodes": d.trainer_nodes, "inference_nodes": d.inference_nodes, "orchestrator": d.orchestrator})
    _need(not d.hosts, "deployment.hosts", f"is for kind = 'nodes' (kind is {d.kind!r})", d.hosts)


def trainer_ranks_per_node(cfg: RLConfig) -> int:
    """Trainer ranks on one trainer node: ``num_trainer_ranks`` when the launcher keeps the job on one
    machine; else ``deployment.ranks_per_node``, or the ranks shared out over ``deployment.trainer_nodes``."""
    d = cfg.deployment
    if not get_launcher(cfg).capabilities.spans_nodes:
        return cfg.num_trainer_ranks
    return d.ranks_per_node or max(cfg.num_trainer_ranks // max(d.trainer_nodes, 1), 1)


def check_spans_nodes(cfg: RLConfig) -> None:
    """``deployment.*`` of a kind whose processes run on several nodes (``nodes``, ``slurm``): the
    trainer ranks per node and the nodes' GPUs (how the inference nodes take weights is the
    backend's ``check``: no directory is shared with them)."""
    d = cfg.deployment
    if d.trainer_nodes < 1 or d.ranks_per_node < 0:
        return  # the field checks (config.deployment.check_deployment) name these keys
    ranks = cfg.num_trainer_ranks
    if d.ranks_per_node:
        _need(d.ranks_per_node * d.trainer_nodes == ranks, "deployment.ranks_per_node",
              f"times deployment.trainer_nodes = {d.trainer_nodes} must equal num_trainer_ranks = {ranks}",
              d.ranks_per_node)
    else:
        _need(ranks % d.trainer_nodes == 0, "deployment.trainer_nodes",
              f"must divide num_trainer_ranks = {ranks} (each trainer node runs the same number of ranks)",
              d.trainer_nodes)
    per_node = trainer_ranks_per_node(cfg)
    if cfg.device == "cpu":
        _need(d.gpus_per_node == 0, "deployment.gpus_per_node", "must be 0 with device = 'cpu'", d.gpus_per_node)
    elif cfg.device == "cuda":
        _need(d.gpus_per_node >= 1, "deployment.gpus_per_node", "must be set (>= 1) with device = 'cuda'",
              d.gpus_per_node)
    if d.gpus_per_node:
        from ..inference.backend import get_backend

        # an engine in the orchestrator's process beside the trainer takes a GPU of trainer node 0
        # (placement: engine first); what the backend can do across nodes is check_backend's
        in_process = get_backend(cfg).capabilities.engine_in_process and not d.inference_nodes  # else: servers there
        engine = int(d.orchestrator == "trainer" and in_process and d.gpus_per_node > 1)
        _need(per_node + engine <= d.gpus_per_node, "deployment.ranks_per_node",
              f"{per_node} trainer ranks per node{' plus the engine' if engine else ''} need "
              f"{per_node + engine} GPUs; deployment.gpus_per_node = {d.gpus_per_node}", per_node)
