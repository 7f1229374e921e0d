"""The node plan: which node runs which role, its trainer ranks and GPUs, and the rendezvous.

``[deployment]`` (``config.DeploymentConfig``) names the layout; :func:`node_plan` turns it into
one :class:`Node` per machine, in the job's node order: the trainer nodes first, then the
inference nodes, then the orchestrator's own node (when ``deployment.orchestrator = "own"``;
with ``"trainer"`` it runs beside the trainer on trainer node 0). Trainer nodes join one
torch.distributed group through torchrun's c10d rendezvous at ``rdzv_endpoint``; c10d numbers
the nodes itself, in the order of their addresses (``--node-rank`` is ignored with c10d), which
is the order of the plan when hosts are listed in address order.

Every impossible plan is a ``ConfigError`` naming the key, raised by ``validate.validate``
(``[deployment]``'s own checks are ``config.deployment.check_deployment``, those against the
trainer, the device and ``[inference]`` are in ``validate``); :func:`check_rendezvous_port` and
:func:`check_fixed_ports` add the checks that need this machine (the rendezvous port, and the
fixed ports the job's processes will listen on here, in use), run by ``primerl rl`` (``--dry-run``
too) before anything starts.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from dataclasses import dataclass

from ..config import ConfigError, RLConfig
from ..config.deployment import split_endpoint
from ..inference.backend import get_backend
from .kinds import get_launcher
from .kinds import trainer_ranks_per_node as launcher_ranks_per_node

__all__ = ["Node", "NodePlan", "node_plan", "describe_nodes", "check_rendezvous_port", "check_fixed_ports",
           "pool_on_nodes", "pool_server_urls", "split_endpoint", "is_loopback", "config_hash", "inference_server",
           "DEFAULT_RDZV_PORT", "ROLES"]

ROLES = ("trainer", "inference", "orchestrator")
DEFAULT_RDZV_PORT = 29400


@dataclass(frozen=True)
class Node:
    index: int  # position in the job's node list (SLURM_NODEID under SLURM)
    host: str  # address or host name; "$node<i>" in a SLURM plan before the allocation exists
    roles: tuple[str, ...]  # of ROLES
    trainer_node: int | None  # index among the trainer nodes (torchrun's node rank when hosts are in address order)
    ranks: tuple[int, ...]  # global trainer ranks on this node
    gpus: tuple[int, ...]  # local GPU index of each trainer rank; () on CPU nodes


@dataclass(frozen=True)
class NodePlan:
    kind: str
    nodes: tuple[Node, ...]
    ranks_per_node: int
    rdzv_host: str
    rdzv_port: int
    rdzv_timeout_s: float

    @property
    def rdzv_endpoint(self) -> str:
        return f"{self.rdzv_host}:{self.rdzv_port}"

    @property
    def trainer_nodes(self) -> list[Node]:
        return [n for n in self.nodes if "trainer" in n.roles]

    def with_role(self, role: str) -> list[Node]:
        return [n for n in self.nodes if role in n.roles]


def is_loopback(host: str) -> bool:
    """127.0.0.0/8 (every address there reaches this machine on Linux) or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def pool_on_nodes(cfg: RLConfig) -> bool:
    """The inference nodes each run a pool of ``inference.num_servers`` servers of the backend's own
    (``capabilities.server_pool``), behind one vllm-router on the orchestrator's node."""
    return (get_launcher(cfg).capabilities.spans_nodes and cfg.deployment.inference_nodes > 0
            and get_backend(cfg).capabilities.server_pool)


def pool_server_urls(cfg: RLConfig, plan: "NodePlan") -> list[str]:
    """Every server of the pool on the inference nodes, in node order: ``inference.num_servers`` on
    each node's address, at ports ``inference.vllm.port`` + 0, 1, ..."""
    p = cfg.inference.vllm.port
    return [f"http://{n.host}:{p + j}" for n in plan.with_role("inference") for j in range(cfg.inference.num_servers)]


def _num_nodes(cfg: RLConfig) -> int:
    d = cfg.deployment
    return d.trainer_nodes + d.inference_nodes + (d.orchestrator == "own")


def node_plan(cfg: RLConfig, hosts: list[str] | None = None) -> NodePlan:
    """The plan of a validated config. ``hosts``: the job's nodes in order (SLURM: from
    ``SLURM_JOB_NODELIST``); default ``deployment.hosts``, or ``$node<i>`` placeholders."""
    d = cfg.deployment
    per_node = launcher_ranks_per_node(cfg)
    if not get_launcher(cfg).capabilities.spans_nodes:
        gpus = _local_trainer_gpus(cfg)
        node = Node(0, "127.0.0.1", ("trainer", "orchestrator"), 0, tuple(range(cfg.num_trainer_ranks)), gpus)
        return NodePlan(d.kind, (node,), per_node, "127.0.0.1", 0, d.rdzv_timeout_s)
    n = _num_nodes(cfg)
    hosts = list(hosts or d.hosts or [f"$node{i}" for i in range(n)])
    if len(hosts) < n:
        raise ConfigError(f"deployment: the plan needs {n} nodes but the job has {len(hosts)} ({hosts})")
    # the engine beside the orchestrator takes a GPU (not when the job samples from servers of the inference nodes)
    in_process = get_backend(cfg).capabilities.engine_in_process and not d.inference_nodes
    engine_first = d.orchestrator == "trainer" and in_process and d.gpus_per_node > 1
    nodes = []
    for t in range(d.trainer_nodes):
        roles = ("trainer", "orchestrator") if t == 0 and d.orchestrator == "trainer" else ("trainer",)
        gpus = tuple(range(engine_first, engine_first + per_node)) if d.gpus_per_node else ()
        nodes.append(Node(t, hosts[t], roles, t, tuple(range(t * per_node, (t + 1) * per_node)), gpus))
    for j in range(d.inference_nodes):
        i = d.trainer_nodes + j
        nodes.append(Node(i, hosts[i], ("inference",), None, (), tuple(range(d.gpus_per_node))))
    if d.orchestrator == "own":
        nodes.append(Node(n - 1, hosts[n - 1], ("orchestrator",), None, (), ()))
    if d.rdzv_endpoint:
        rh, rp = split_endpoint(d.rdzv_endpoint)
    else:
        rh, rp = hosts[0], DEFAULT_RDZV_PORT
    return NodePlan(d.kind, tuple(nodes), per_node, rh, rp, d.rdzv_timeout_s)


def _local_trainer_gpus(cfg: RLConfig) -> tuple[int, ...]:
    from ..placement import resolve_placement

    return resolve_placement(cfg).trainer_gpus


def describe_nodes(cfg: RLConfig, hosts: list[str] | None = None) -> str:
    """The node plan as TOML comment lines (``primerl rl --dry-run`` prints them)."""
    plan = node_plan(cfg, hosts)
    d = cfg.deployment
    spans = get_launcher(cfg).capabilities.spans_nodes
    if not spans:
        head = f"# deployment: {plan.kind}, one node (torchrun --standalone for the trainer)"
    else:
        head = (f"# deployment: {plan.kind}, {len(plan.nodes)} node(s); trainer rendezvous c10d at "
                f"{plan.rdzv_endpoint} (timeout {d.rdzv_timeout_s:g} s), grace {d.grace_s:g} s")
    lines = [head]
    pool = pool_on_nodes(cfg)
    i = cfg.inference
    for n in plan.nodes:
        parts = []
        if n.ranks:
            where = ", ".join(f"cuda:{g}" for g in n.gpus) if n.gpus else "CPU"
            parts.append(f"trainer ranks {n.ranks[0]}-{n.ranks[-1]} ({where})")
        if "inference" in n.roles:
            parts.append(f"inference server (GPUs {list(n.gpus) or 'none'}): {inference_server(cfg, n.host)}")
        if "orchestrator" in n.roles:
            if pool:
                parts.append(f"orchestrator + vllm-router on {n.host}:<a free port> (policy {i.router_policy})")
            else:
                beside = get_backend(cfg).beside_orchestrator(cfg)  # its engine, or the servers and router it starts
                parts.append("orchestrator" + (f" + {beside}" if beside else ""))
        lines.append(f"# node {n.index} {n.host}: " + "; ".join(parts))
    if pool:
        urls = pool_server_urls(cfg, plan)
        lines.append(f"# inference pool: {len(urls)} server(s) {', '.join(urls)}; weights by broadcast from trainer "
                     f"rank 0 (its node's address, known once torchrun's rendezvous placed it; port "
                     f"{i.broadcast_port}) to all {len(urls)} at once")
    if spans:
        from ..zmq_transport import batch_transport

        via = batch_transport(cfg)
        how = (f" (each trainer rank pulls its micro-batches from the orchestrator on port {cfg.orchestrator.zmq_port})"
               if via == "zmq" else " (output_dir must be shared by the orchestrator's and trainer nodes)")
        lines.append(f"# rollout batches: {via}{how}")
    return "\n".join(lines) + "\n"


def inference_server(cfg: RLConfig, host: str) -> str:
    """What ``primerl node --role inference`` runs on ``host``: the node's servers of a pool
    (``pool_on_nodes``), vLLM's server (``inference.vllm.launch``, its command line) or primerl's own
    server speaking vLLM's protocol."""
    port = cfg.inference.vllm.port
    if pool_on_nodes(cfg):
        i = cfg.inference
        ports = ", ".join(f"{host}:{port + j}" for j in range(i.num_servers))
        return (f"{i.num_servers} primerl inference server(s) on {ports}, supervised by the node "
                f"(max_restarts {i.max_restarts})")
    if cfg.inference.vllm.launch:
        from ..inference.vllm_launch import serve_command_line

        return f"vLLM (inference.vllm.launch) on {host}:{port}: {serve_command_line(cfg, host=host)}"
    return f"primerl inference on {host}:{port} (vLLM's protocol; inference.vllm.launch = true runs vLLM itself)"


def check_rendezvous_port(cfg: RLConfig) -> None:
    """A plan across nodes whose rendezvous is on this machine (``kind = "nodes"`` on 127.x hosts): its
    port must be free here now. (A SLURM plan's rendezvous host is a node of the allocation.)"""
    if not get_launcher(cfg).capabilities.spans_nodes:
        return
    plan = node_plan(cfg)
    host = plan.rdzv_host
    if not (is_loopback(host) or host in (socket.gethostname(), socket.getfqdn())):
        return
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # as the store does: a closed job's TIME_WAIT is no conflict
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1" if host == "localhost" else host, plan.rdzv_port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"deployment.rdzv_endpoint: port {plan.rdzv_port} on {host} is in use (another job or "
                              f"a leftover process); choose another port, got {plan.rdzv_endpoint!r}") from None
        raise ConfigError(f"deployment.rdzv_endpoint: cannot bind {plan.rdzv_endpoint} on this machine ({e})") from None
    finally:
        s.close()


def config_hash(cfg: RLConfig) -> str:
    """What every node must agree on: the resolved config without ``output_dir`` (a node may
    write its own files elsewhere)."""
    import dataclasses
    import hashlib

    from ..config import to_toml

    return hashlib.sha256(to_toml(dataclasses.replace(cfg, output_dir="")).encode()).hexdigest()[:16]


def _on_this_machine(host: str) -> bool:
    return is_loopback(host) or host in (socket.gethostname(), socket.getfqdn())


def check_fixed_ports(cfg: RLConfig) -> None:
    """The fixed ports this job's processes will listen on, on this machine, must be free now: the
    orchestrator's ``orchestrator.metrics_port`` and ``orchestrator.zmq_port`` (rollout batches over
    ZeroMQ, bound on every address), and the P/D servers' and router's (``inference.pd.*``).
    ``ConfigError`` naming the key of the first one in use (``ports.check_ports_free``)."""
    from ..ports import check_ports_free
    from ..zmq_transport import batch_transport

    o, pd = cfg.orchestrator, cfg.inference.pd
    orch_here = (not get_launcher(cfg).capabilities.spans_nodes
                 or _on_this_machine(node_plan(cfg).with_role("orchestrator")[0].host))
    ports = []
    if orch_here and o.metrics_port:
        ports.append(("orchestrator.metrics_port", o.metrics_host, o.metrics_port))
    if orch_here and batch_transport(cfg) == "zmq":
        ports.append(("orchestrator.zmq_port", "0.0.0.0", o.zmq_port))
    if pd.enabled and _on_this_machine(pd.host):
        ports += [("inference.pd.base_port", pd.host, pd.base_port + i) for i in range(pd.prefill + pd.decode)]
        ports += [("inference.pd.router_port", pd.host, pd.router_port),
                  ("inference.pd.router_metrics_port", pd.host, pd.router_metrics_port)]
    check_ports_free(ports)
