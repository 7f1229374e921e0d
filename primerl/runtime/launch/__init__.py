"""Starting the job's processes: what runs where, in one place.

- ``deployment``: ``[deployment]`` as a node plan (role, trainer ranks and GPUs of every node, the
  rendezvous); ``primerl rl --dry-run`` prints it; impossible plans are ``ConfigError``s.
- ``machine``: one machine (``kind = "local"``, the default): ``run_rl`` starts the trainer
  (``torchrun --standalone`` when several ranks) and the orchestrator with its engine.
- ``node``: ``primerl node --role trainer|orchestrator|inference``, one node of a multi-node job for
  any scheduler; trainer nodes run torchrun with c10d rendezvous; configs compared at the store.
- ``local``: ``kind = "nodes"`` with 127.x hosts, every node started by ``primerl rl`` here.
- ``slurm``: ``kind = "slurm"``, an sbatch script rendered from ``templates/sbatch.sh.j2``.

The processes themselves: ``job.trainer_main`` / ``job.orchestrator_main`` (``primerl trainer`` /
``primerl orchestrator``) and ``inference.server.serve`` (``primerl inference``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {**{name: "deployment" for name in (
    "DEFAULT_RDZV_PORT", "Node", "NodePlan", "check_rendezvous_port", "config_hash", "describe_nodes", "node_plan",
    "validate_deployment")}, **{name: "node" for name in ("NodeError", "node_main", "trainer_command")}}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .deployment import (DEFAULT_RDZV_PORT, Node, NodePlan, check_rendezvous_port, config_hash,  # noqa: F401
                             describe_nodes, node_plan, validate_deployment)
    from .node import NodeError, node_main, trainer_command  # noqa: F401


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
