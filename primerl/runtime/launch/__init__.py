"""Starting the job's processes: on one machine, on nodes started by hand or any scheduler
(``primerl node``), and under SLURM (an sbatch script from a Jinja2 template).

What runs where is the node plan (``deployment.node_plan``): ``primerl rl --dry-run`` prints it.
"""

from .deployment import (DEFAULT_RDZV_PORT, Node, NodePlan, check_rendezvous_port, config_hash, describe_nodes,
                         node_plan, validate_deployment)
from .node import NodeError, node_main, trainer_command

__all__ = ["DEFAULT_RDZV_PORT", "Node", "NodePlan", "NodeError", "check_rendezvous_port", "config_hash",
           "describe_nodes", "node_main", "node_plan", "trainer_command", "validate_deployment"]
