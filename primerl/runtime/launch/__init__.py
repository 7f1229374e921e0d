"""Starting the job's processes: what runs where, in one place.

The processes: entry point (``primerl`` command), who starts it, where it runs in the node plan.

trainer ranks
    ``trainer.main:trainer_main`` (``primerl trainer``; several ranks run under torchrun).
    Started by ``machine._run_rl`` (one process, or ``torchrun --standalone``) and by
    ``node.node_main`` on role ``trainer`` (``torchrun --nnodes``, c10d rendezvous).
    ``local``: this machine, ranks ``0..num_trainer_ranks-1``; ``nodes``/``slurm``: every trainer
    node, ``ranks_per_node`` ranks each (``Node.ranks``, ``Node.gpus``).
orchestrator + embedded engine (one process)
    ``orchestrator.main:orchestrator_main`` (``primerl orchestrator``); its inference client comes
    from ``orchestrator.clients:make_client``. Started by ``machine._run_rl`` and by
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
    ``threads:run_threads``: the trainer in a thread, orchestrator and engine in the caller's
    (tests, notebooks).

(entry points relative to ``primerl.runtime``; every command is ``python -m primerl.runtime.cli``.)

The launchers:

- ``machine``: one machine (``kind = "local"``, the default): ``run_rl`` (``primerl rl``) runs the warm
  start, prepares ``output_dir`` (``common.prepare_output``), starts the server pool / vLLM when the
  config asks, then the orchestrator and the trainer; stops everything when one fails.
- ``node``: ``primerl node --role trainer|orchestrator|inference``, one node of a multi-node job for
  any scheduler (SLURM, Kubernetes, by hand); trainer nodes run torchrun with c10d rendezvous;
  configs compared at the store.
- ``local``: ``kind = "nodes"`` with 127.x hosts: every node started by ``primerl rl`` on this machine.
- ``slurm``: ``kind = "slurm"``: an sbatch script rendered from ``templates/sbatch.sh.j2`` (one
  ``srun ... primerl node`` step per node and role: inference first, then trainer, then orchestrator).
- ``deployment``: ``[deployment]`` as a node plan (role, trainer ranks and GPUs of every node, the
  rendezvous); ``primerl rl --dry-run`` prints it; impossible plans are ``ConfigError``s.
- ``servers``: the server pool and router (``ServerPool``, ``processes.json``); ``common``: the
  resume step, ``prepare_output`` and ``JobFailed``; ``threads``: ``run_threads``.

Imports are lazy: ``primerl.runtime.launch.node_plan`` loads ``deployment`` on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {**{name: "deployment" for name in (
    "DEFAULT_RDZV_PORT", "Node", "NodePlan", "check_rendezvous_port", "config_hash", "describe_nodes", "node_plan")},
    **{name: "node" for name in ("NodeError", "node_main", "trainer_command")}}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .deployment import (DEFAULT_RDZV_PORT, Node, NodePlan, check_rendezvous_port, config_hash,  # noqa: F401
                             describe_nodes, node_plan)
    from .node import NodeError, node_main, trainer_command  # noqa: F401


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
