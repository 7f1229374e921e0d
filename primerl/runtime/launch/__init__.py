"""Starting the job's processes: what runs where, in one place.

The processes: entry point (``primerl`` command), who starts it, where it runs in the node plan.

trainer ranks
    ``trainer.main:trainer_main`` (``primerl trainer``; several ranks run under torchrun).
    Started by ``machine.MachineLauncher`` (one process, or ``torchrun --standalone``) and by
    ``node.node_main`` on role ``trainer`` (``torchrun --nnodes``, c10d rendezvous).
    ``local``: this machine, ranks ``0..num_trainer_ranks-1``; ``nodes``/``slurm``: every trainer
    node, ``ranks_per_node`` ranks each (``Node.ranks``, ``Node.gpus``).
orchestrator + embedded engine (one process)
    ``orchestrator.main:orchestrator_main`` (``primerl orchestrator``); its inference client comes
    from ``orchestrator.clients:make_client``. Started by ``machine.MachineLauncher`` and by
    ``node.node_main`` on role ``orchestrator``. ``local``: this machine; else trainer node 0
    (``deployment.orchestrator = "trainer"``) or a node of its own (``"own"``).
inference servers (embedded engine over HTTP)
    ``inference.server:serve`` (``primerl inference``). Started by ``servers.ServerPool`` when
    ``inference.num_servers > 1`` (this machine, free ports) and by ``node.node_main`` on role
    ``inference`` (the ``inference_nodes``) when ``inference.vllm.launch = false``.
router
    ``vllm-router`` (an external binary), started by ``servers.ServerPool`` (``router_process``) on
    this machine, in front of the pool.
vLLM server
    ``vllm serve`` (``primerl vllm-command`` prints the command), started by
    ``machine.launched_vllm`` when ``inference.vllm.launch`` (``inference.vllm_launch``), on
    ``inference.vllm.host:port``; by ``node.run_vllm_node`` on role ``inference`` with
    ``inference.vllm.launch = true`` (on the node's address, ``inference.vllm.port``; the
    ``--dry-run`` plan line prints its command); or external servers (``inference.vllm.urls``).
P/D: prefill and decode servers, router in P/D mode
    ``primerl inference --role prefill|decode`` (or vLLM with ``--kv-transfer-config``) and
    ``vllm-router --vllm-pd-disaggregation``, started inside the orchestrator process by
    ``orchestrator.clients:make_pd_client`` (``inference.pd_launch.PDDeployment``) on
    ``inference.pd.host``, ports from ``pd.base_port``, router at ``pd.router_port``.
the whole job in one process
    ``threads:run_threads`` (``deployment.kind = "threads"``): the trainer in a thread, orchestrator
    and engine in the caller's (tests, notebooks).

(entry points relative to ``primerl.runtime``; every command is ``python -m primerl.runtime.cli``.)

The launchers (``launcher``: the ``Launcher`` protocol, ``LauncherCapabilities``, the registry
``LAUNCHERS`` keyed by ``deployment.kind``, and ``prepare_job`` / ``run_job``, the one preparation
every kind shares: the ``output_dir`` lock, the warm start, ``config.toml``), each registered by its
module:

- ``machine``: ``kind = "local"`` (the default), one machine: the server pool / vLLM when the config
  asks, then the orchestrator and the trainer; stops everything when one fails.
- ``local``: ``kind = "nodes"``: every node started by ``primerl rl`` on this machine (127.x hosts),
  or the command to run on each host.
- ``slurm``: ``kind = "slurm"``: an sbatch script rendered from ``templates/sbatch.sh.j2`` (one
  ``srun ... primerl node`` step per node and role: inference first, then trainer, then orchestrator).
- ``threads``: ``kind = "threads"``: the whole job in this process.

Beside them: ``node``: ``primerl node --role trainer|orchestrator|inference``, one node of a
multi-node job for any scheduler (SLURM, Kubernetes, by hand); trainer nodes run torchrun with c10d
rendezvous; configs compared at the store. ``deployment``: ``[deployment]`` as a node plan (role,
trainer ranks and GPUs of every node, the rendezvous); ``primerl rl --dry-run`` prints the
launcher's ``describe``. ``servers``: the server pool and router (``ServerPool``); every process
starts through ``primerl.runtime.processes.start_process`` (``processes.json``). ``common``: the
resume step, ``prepare_output`` and ``JobFailed``.

Imports are lazy: ``primerl.runtime.launch.node_plan`` loads ``deployment`` on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy_exports

_EXPORTS = {**{name: "deployment" for name in (
    "DEFAULT_RDZV_PORT", "Node", "NodePlan", "check_rendezvous_port", "config_hash", "describe_nodes", "node_plan")},
    **{name: "node" for name in ("NodeError", "node_main", "trainer_command")}}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .deployment import (DEFAULT_RDZV_PORT, Node, NodePlan, check_rendezvous_port, config_hash,  # noqa: F401
                             describe_nodes, node_plan)
    from .node import NodeError, node_main, trainer_command  # noqa: F401


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
