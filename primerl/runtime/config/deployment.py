"""``[deployment]``: where the job's processes run (``DeploymentConfig``) and the section's own
checks. The node plan built from it is ``primerl.runtime.launch.deployment``; its checks against
``num_trainer_ranks``, the device and ``[inference]`` are in ``primerl.runtime.validate``."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ConfigError, _need


@dataclass
class DeploymentConfig:
    """Where the job's processes run (``primerl.runtime.launch``): one machine (``"local"``, the
    default), nodes started by hand or any scheduler with ``primerl node`` (``"nodes"``), or a SLURM
    batch job (``"slurm"``). Trainer nodes run torchrun with c10d rendezvous at ``rdzv_endpoint``."""

    kind: str = "local"  # a registered launcher (launch.launcher): "local", "nodes", "slurm", "threads"
    trainer_nodes: int = 1  # nodes running trainer ranks (torchrun --nnodes)
    inference_nodes: int = 0  # nodes running inference servers (vLLM); 0: the engine is in the orchestrator
    orchestrator: str = "trainer"  # "trainer": beside the trainer on trainer node 0; "own": a node of its own
    ranks_per_node: int = 0  # trainer ranks per trainer node; 0: num_trainer_ranks / trainer_nodes
    gpus_per_node: int = 0  # GPUs of each node; 0: CPU nodes (trainer ranks are processes)
    hosts: list = field(default_factory=list)  # "nodes": trainer hosts, then inference, then the orchestrator's own
    rdzv_endpoint: str = ""  # "host:port" of the c10d rendezvous; "": the first trainer host, port 29400
    rdzv_timeout_s: float = 60.0  # a node that cannot join the rendezvous fails after this
    grace_s: float = 30.0  # when one node fails, the others get this long to stop (checkpoints finish)
    # supervised restarts (issue 45): when a process dies or stalls, stop the rest (grace_s) and restart the job
    # from the last complete checkpoint, at most this many times; -1: auto (3 for a long job: max_steps >= 1000
    # with checkpoints, checkpoint.interval > 0; else 0); 0: fail at the first death
    max_restarts: int = -1
    stall_timeout_s: float = 600.0  # no process of the job made progress this long: a stall (stacks dumped); 0: off
    # the job's start-up (until every process made progress past its start: a step, a finished request) may go
    # without progress max(this, stall_timeout_s); 0: stall_timeout_s from the start. A stopped process: stall_timeout_s
    stall_startup_s: float = 0.0
    sbatch_template: str = ""  # a Jinja2 sbatch template; "": primerl/runtime/launch/templates/sbatch.sh.j2
    sbatch_args: list = field(default_factory=list)  # extra #SBATCH options, e.g. ["--partition=gpu", "--time=4:00:00"]



def split_endpoint(endpoint: str, key: str = "deployment.rdzv_endpoint") -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; ConfigError naming ``key`` unless the port is a TCP port."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{key}: must be 'host:port' with a TCP port, got {endpoint!r}")
    return host, int(port)


def check_deployment(d: DeploymentConfig) -> None:
    """``[deployment]`` on its own (``deployment.kind``'s own rules: ``validate._backend_and_kind_checks``)."""
    _need(d.trainer_nodes >= 1, "deployment.trainer_nodes", "must be >= 1", d.trainer_nodes)
    _need(d.inference_nodes >= 0, "deployment.inference_nodes", "must be >= 0", d.inference_nodes)
    _need(d.orchestrator in ("trainer", "own"), "deployment.orchestrator", "must be 'trainer' or 'own'", d.orchestrator)
    _need(d.ranks_per_node >= 0, "deployment.ranks_per_node", "must be >= 0 (0: num_trainer_ranks / trainer_nodes)",
          d.ranks_per_node)
    _need(d.gpus_per_node >= 0, "deployment.gpus_per_node", "must be >= 0 (0: CPU nodes)", d.gpus_per_node)
    _need(d.rdzv_timeout_s > 0, "deployment.rdzv_timeout_s", "must be > 0", d.rdzv_timeout_s)
    _need(d.grace_s >= 0, "deployment.grace_s", "must be >= 0", d.grace_s)
    _need(d.max_restarts >= -1, "deployment.max_restarts", "must be >= 0 (-1: auto)", d.max_restarts)
    _need(d.stall_timeout_s >= 0, "deployment.stall_timeout_s", "must be >= 0 (0: off)", d.stall_timeout_s)
    _need(d.stall_startup_s >= 0, "deployment.stall_startup_s", "must be >= 0 (0: stall_timeout_s)", d.stall_startup_s)
    _need(all(isinstance(h, str) and h for h in d.hosts), "deployment.hosts", "must be host names or addresses",
          d.hosts)
    _need(all(isinstance(a, str) for a in d.sbatch_args), "deployment.sbatch_args", "must be strings", d.sbatch_args)
    if d.rdzv_endpoint:
        split_endpoint(d.rdzv_endpoint)


def effective_max_restarts(cfg) -> int:
    """``deployment.max_restarts`` with -1 (auto) resolved: 3 for a long job (``max_steps >=
    LONG_JOB_STEPS`` with checkpoints: ``checkpoint.interval > 0``), else 0."""
    n = cfg.deployment.max_restarts
    if n >= 0:
        return n
    return 3 if cfg.checkpoint.interval > 0 and cfg.max_steps >= LONG_JOB_STEPS else 0


LONG_JOB_STEPS = 1000
