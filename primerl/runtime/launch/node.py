"""``primerl node``: what one node of a multi-node job runs, for any scheduler (SLURM, by hand).

    primerl node --config cfg.toml --role trainer|orchestrator|inference [--node-rank R] [--rdzv HOST:PORT]

The node rank falls back to ``SLURM_NODEID`` and the job's host list to ``deployment.hosts`` or
``scontrol show hostnames $SLURM_JOB_NODELIST``. A trainer node runs
``torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT
--local-addr <its host>`` over ``primerl trainer``; trainer node 0 hosts the rendezvous store.

Before its role starts, every node joins that store as a client (waiting at most
``deployment.rdzv_timeout_s``, then failing with the address in the message), posts the hash of
its resolved config (``deployment.config_hash``) and checks the other nodes' hashes: nodes
started with different configs are refused, naming both.

An agent started by hand supervises its role (``node_supervise``): it runs the role as a child,
watches its processes' heartbeats (``deployment.stall_timeout_s``) and, with
``deployment.max_restarts`` > 0, restarts the job with the other agents (they rejoin through the
rendezvous, from the last complete checkpoint).

The agents end together (``node_watch.NodeWatch``): SIGTERM to any agent, or its role failing,
is posted in the rendezvous store, and every other agent ends its role naming that node; no
agent's signal handler waits on a process (issue 45).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from datetime import timedelta

from ..config import RLConfig
from ..config.deployment import effective_max_restarts
from ..processes import start_process
from .deployment import ROLES, Node, NodePlan, config_hash, node_plan, pool_on_nodes, pool_server_urls, split_endpoint
from .kinds import get_launcher
from .node_supervise import DONE_KEY, die_with_agent, store_by_agent, supervise_node, supervised_from_above
from .node_watch import NodeError, NodeWatch, connect_store, exit_process  # noqa: F401 (NodeError: re-exported)

log = logging.getLogger("primerl")

__all__ = ["NodeError", "job_hosts", "resolve_node", "trainer_command", "connect_store", "join_rendezvous", "peer_env",
           "run_vllm_node", "run_pool_node", "start_pool_router", "node_main"]


def job_hosts(cfg: RLConfig) -> list[str]:
    """The job's nodes in order: ``deployment.hosts``, else SLURM's node list expanded by scontrol."""
    if cfg.deployment.hosts:
        return list(cfg.deployment.hosts)
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        raise NodeError("no host list: set deployment.hosts, or run under SLURM (SLURM_JOB_NODELIST is not set)")
    if shutil.which("scontrol") is None:
        raise NodeError(f"SLURM_JOB_NODELIST={nodelist!r} but scontrol is not on PATH to expand it")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise NodeError(f"scontrol show hostnames {nodelist!r} failed: {out.stderr.strip()}")
    return out.stdout.split()


def resolve_node(cfg: RLConfig, role: str, node_rank: int | None = None, rdzv: str | None = None
                 ) -> tuple[NodePlan, Node]:
    """This node's entry of the plan, its rank from the argument or ``SLURM_NODEID``."""
    if role not in ROLES:
        raise NodeError(f"--role must be one of {ROLES}, got {role!r}")
    if not get_launcher(cfg).capabilities.spans_nodes:
        raise NodeError(f"deployment.kind is {cfg.deployment.kind!r}: `primerl rl` runs the whole job on this machine; "
                        "`primerl node` is for a kind whose processes span nodes ('nodes' or 'slurm')")
    if node_rank is None:
        env = os.environ.get("SLURM_NODEID")
        if env is None:
            raise NodeError("no node rank: pass --node-rank, or run under SLURM (SLURM_NODEID is not set)")
        node_rank = int(env)
    plan = node_plan(cfg, job_hosts(cfg))
    if not 0 <= node_rank < len(plan.nodes):
        raise NodeError(f"--node-rank {node_rank}: the plan has nodes 0..{len(plan.nodes) - 1}")
    node = plan.nodes[node_rank]
    if role not in node.roles:
        raise NodeError(f"node {node_rank} ({node.host}) has roles {list(node.roles)} in the plan, not {role!r}")
    if rdzv:
        h, p = split_endpoint(rdzv, "--rdzv")
        plan = NodePlan(plan.kind, plan.nodes, plan.ranks_per_node, h, p, plan.rdzv_timeout_s)
    return plan, node


def trainer_command(plan: NodePlan, node: Node, entry: list[str], *, python: str = sys.executable,
                    run_id: str = "primerl") -> list[str]:
    """torchrun for one trainer node: c10d rendezvous, its address as ``--local-addr``; trainer
    node 0 hosts the store (``is_host``; not when its agent hosts it: ``node_supervise``), a restarted
    job's torchrun joins under ``<run_id>-r<round>``. ``entry``: the script or ``-m module`` with arguments."""
    from .node_watch import this_round

    # under an agent that restarts its role (node_supervise), trainer node 0's agent hosts the store for the
    # job's whole life; each round's torchrun joins it under a run id of its own
    host = node.trainer_node == 0 and not store_by_agent()
    rnd = this_round()
    run_id = f"{run_id}-r{rnd}" if rnd else run_id
    return [python, "-m", "torch.distributed.run", f"--nnodes={len(plan.trainer_nodes)}",
            f"--nproc-per-node={plan.ranks_per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={plan.rdzv_endpoint}",
            f"--rdzv-id={run_id}", f"--rdzv-conf=join_timeout={plan.rdzv_timeout_s:g},is_host={int(host)}",
            f"--local-addr={node.host}", "--max-restarts=0", *entry]


def join_rendezvous(plan: NodePlan, node: Node, role: str, digest: str, *, deadline: float,
                    alive=None):
    """Connect to the rendezvous store, post this node's config hash and compare it with every
    other node's role process (all must post before ``deadline``, a ``time.monotonic()``).
    ``alive()``: False when this node's torchrun has already exited (stop waiting). Returns the store."""
    from .node_watch import round_key

    store = connect_store(plan, node, deadline=deadline, alive=alive)
    left = lambda: max(deadline - time.monotonic(), 0.1)  # noqa: E731
    store.set(round_key(f"config/{node.index}/{role}"), f"{digest} {node.host}")
    names = {round_key(f"config/{n.index}/{r}"): f"{n.index} {r}" for n in plan.nodes for r in n.roles}
    keys = list(names)
    store.set_timeout(timedelta(seconds=left()))
    try:
        store.wait(keys)
    except Exception:  # noqa: BLE001 - the store's timeout type differs across versions
        missing = [names[k] for k in keys if not store.check([k])]
        raise NodeError(f"node {node.index} ({node.host}): {missing} (node, role) did not join the rendezvous at "
                        f"{plan.rdzv_endpoint} within {plan.rdzv_timeout_s:g} s") from None
    posted = {names[k]: store.get(k).decode().split(" ", 1) for k in keys}
    other = [(i, h, d) for i, (d, h) in posted.items() if d != digest]
    if other:
        i, h, d = other[0]
        raise NodeError(f"node {node.index} {role} ({node.host}, config {digest}) and node {i} ({h}, config {d}) were "
                        "started with different configs; every node must run the same resolved config "
                        "(output_dir aside)")
    return store


def peer_env(plan: NodePlan, role: str) -> dict[str, str]:
    """What a trainer or orchestrator process learns of its peers from the plan: where the
    orchestrator serves rollout batches (``orchestrator.batch_transport = "zmq"``) and hosts the
    embedded engine's weight broadcast group, and who the peer is, for the errors."""
    from ..transport import ENGINE_HOST_ENV, ORCHESTRATOR_NODE_ENV, TRAINER_NODE_ENV

    orch = plan.with_role("orchestrator")[0]
    if role == "orchestrator":
        nodes = ", ".join(f"{n.index} ({n.host})" for n in plan.trainer_nodes)
        many = "s" * (len(plan.trainer_nodes) > 1)
        return {ENGINE_HOST_ENV: orch.host, TRAINER_NODE_ENV: f"the trainer on node{many} {nodes}"}
    return {"PRIMERL_BATCH_HOST": orch.host, ENGINE_HOST_ENV: orch.host,
            ORCHESTRATOR_NODE_ENV: f"the orchestrator on node {orch.index} ({orch.host})"}


def _pool_env(cfg: RLConfig, plan: NodePlan, node: Node) -> dict[str, str]:
    """A trainer node's part of the pool's weights: its own address (rank 0, wherever torchrun's
    rendezvous puts it, hosts the weight group there) and the URLs of the pool's servers."""
    import json

    from ..transport import INFERENCE_POOL_ENV, TRAINER_HOST_ENV

    env = {TRAINER_HOST_ENV: node.host}
    if pool_on_nodes(cfg):
        env[INFERENCE_POOL_ENV] = json.dumps({"servers": pool_server_urls(cfg, plan)})
    return env


def run_pool_node(cfg: RLConfig, config_path: str, overrides: list[str], plan: NodePlan, node: Node, *,
                  poll_s: float = 0.5, watch: NodeWatch | None = None) -> int:
    """An inference node of a pool: ``inference.num_servers`` ``primerl inference`` servers on the
    node's address at ports ``inference.vllm.port`` + 0, 1, ..., supervised (``launch.servers.ServerPool``
    without a router: a server that exits or hangs is restarted on its port, at most
    ``inference.max_restarts`` times, then the node fails naming it). Rows in
    ``<output_dir>/processes-node<i>.json``, logs ``<output_dir>/logs/inference-<k>.log`` (k: the
    server's index in the pool). Serves until SIGTERM (exit 143)."""
    from pathlib import Path

    from ..lifetime import watch_launcher
    from ..processes import ProcessTable
    from .servers import ServerPool

    i, out = cfg.inference, Path(cfg.output_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    first = [n.index for n in plan.with_role("inference")].index(node.index) * i.num_servers
    pool = ServerPool(config_path, i.num_servers, out / "logs", ProcessTable(out / f"processes-node{node.index}.json"),
                      router=False, host=node.host, ports=[i.vllm.port + j for j in range(i.num_servers)],
                      first_index=first, max_restarts=i.max_restarts, health_timeout_s=i.health_timeout_s,
                      request_timeout_s=i.timeout_s, extra_args=list(overrides))
    where = f"node {node.index} ({node.host}) inference"

    def stop(reason: str) -> None:  # on the watch's thread (no signal handler waits on a process)
        log.info("%s: stopping its %d server(s)", where, len(pool.servers))
        pool.stop()
        exit_process(*watch.final(reason))  # a plain line, rc 0, at the job's normal end

    own = watch is None
    if own:
        watch = NodeWatch(where, stop, grace_s=cfg.deployment.grace_s).start()
    watch.on_end = stop
    watch_launcher()  # started by `primerl rl` on this machine: SIGTERM to itself when the launcher is gone
    try:
        pool.start()
        log.info("%s: %d server(s) %s", where, len(pool.servers), pool.urls)
        while pool.failure is None:
            time.sleep(poll_s)
        pool.stop()
        raise NodeError(f"{where}: {pool.failure}")
    finally:
        if own:
            watch.close()


def start_pool_router(cfg: RLConfig, config_path: str, plan: NodePlan, node: Node):
    """The orchestrator's node of a pool on inference nodes: vllm-router on this node's address (a
    free port), supervised, empty (the pool client adds each server once it holds the pool's
    weights); ``PRIMERL_INFERENCE_POOL`` names it and the servers of the plan for the orchestrator.
    Returns the started ``ServerPool`` (stop it at the end)."""
    import json
    from pathlib import Path

    from ..processes import ProcessTable
    from ..transport import INFERENCE_POOL_ENV
    from .servers import ServerPool

    i, out = cfg.inference, Path(cfg.output_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    table = ProcessTable(out / f"processes-node{node.index}.json")
    try:
        router = ServerPool(config_path, 0, out / "logs", table, router=True, policy=i.router_policy, host=node.host,
                            max_restarts=i.max_restarts, request_timeout_s=i.timeout_s).start()
    except FileNotFoundError as e:
        raise NodeError(f"node {node.index} ({node.host}) orchestrator: {e}") from None
    os.environ[INFERENCE_POOL_ENV] = json.dumps({"servers": pool_server_urls(cfg, plan), "router": router.router_url,
                                                 "processes": str(table.path)})
    log.info("vllm-router on %s for the pool's servers %s", router.router_url, pool_server_urls(cfg, plan))
    return router


def run_vllm_node(cfg: RLConfig, node: Node, *, poll_s: float = 0.5, watch: NodeWatch | None = None) -> int:
    """An inference node with ``inference.vllm.launch = true``: vLLM's server on the node's address
    and ``inference.vllm.port`` (``vllm_launch.launch_for_job``: ``inference.vllm.model`` /
    ``model.path``, or the seeded init in this node's ``output_dir``), its log in
    ``<output_dir>/logs/vllm.log``. Serves until the scheduler's SIGTERM, which stops the server's
    whole process group (``deployment.grace_s``, then SIGKILL) and exits 143; a server that exits by
    itself, or never answers /health, fails the node naming it."""
    from ..config import load_policy_env

    from ..inference.errors import InferenceServerError
    from ..inference.vllm_launch import job_launcher

    v = cfg.inference.vllm
    where = f"node {node.index} ({node.host}) inference"
    if cfg.deployment.inference_nodes == 1 and v.url.rstrip("/") != f"http://{node.host}:{v.port}":
        log.warning("inference.vllm.url = %r but this node's vLLM listens on http://%s:%d: the orchestrator must "
                    "reach it there", v.url, node.host, v.port)
    try:
        server = job_launcher(cfg, load_policy_env(cfg).vocab_size, host=node.host)
    except InferenceServerError as e:
        raise NodeError(f"{where}: {e}") from None

    def stop(reason: str) -> None:  # on the watch's thread, also while vLLM loads: it must not outlive this node
        log.info("%s: stopping vLLM (grace %g s)", where, cfg.deployment.grace_s)
        server.stop(cfg.deployment.grace_s)
        exit_process(*watch.final(reason))  # a plain line, rc 0, at the job's normal end

    own = watch is None
    if own:
        watch = NodeWatch(where, stop, grace_s=cfg.deployment.grace_s).start()
    watch.on_end = stop
    try:
        return _serve_vllm(server, where, poll_s)
    finally:
        if own:
            watch.close()


def _serve_vllm(server, where: str, poll_s: float) -> int:
    from ..inference.errors import InferenceServerError

    log.info("%s: starting vLLM: %s (log: %s)", where, " ".join(server.cmd), server.log_path)
    try:
        server.start()
    except InferenceServerError as e:
        raise NodeError(f"{where}: {e}") from None
    log.info("%s: vLLM is serving (pid %d)", where, server.proc.pid)
    while (rc := server.proc.poll()) is None:
        time.sleep(poll_s)
    from ..lifetime import log_tail

    server.stop(5.0)  # what is left of its group (engine core, workers)
    raise NodeError(f"{where}: the vLLM server exited with code {rc} while the job ran; end of {server.log_path}:\n"
                    f"{log_tail(server.log_path)}")


def node_main(cfg: RLConfig, config_path: str, overrides: list[str], role: str, *, node_rank: int | None = None,
              rdzv: str | None = None) -> int:
    """Run this node's role to its end; return the exit code (a failure raises ``NodeError``)."""
    plan, node = resolve_node(cfg, role, node_rank, rdzv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format=f"%(asctime)s node{node.index}-{role} %(levelname)s %(message)s")
    log.info("node %d (%s) role %s; rendezvous %s", node.index, node.host, role, plan.rdzv_endpoint)
    if not supervised_from_above():  # started by hand: this agent supervises its role, round by round
        return supervise_node(cfg, config_path, overrides, plan, node, role, effective_max_restarts(cfg))
    die_with_agent()  # a round under its node's agent (node_supervise)
    deadline = time.monotonic() + plan.rdzv_timeout_s
    digest = config_hash(cfg)
    where = f"node {node.index} ({node.host}) {role}"
    host0 = plan.trainer_nodes[0]
    store_node = f"trainer node 0 ({host0.host})"
    grace = cfg.deployment.grace_s
    if role != "trainer":
        # the role runs in this process: ending it (SIGTERM, another node gone) ends the process. Under a
        # hand-started agent, SIGTERM after trainer node 0's agent posted DONE_KEY is the job's normal end (a
        # serving node's agent ends its round so): a plain line and rc 0, not a failure
        watch = NodeWatch(where, lambda reason: exit_process(*watch.final(reason)), grace_s=grace,
                          store_grace_s=max(grace, 30.0) if role == "inference" else None,
                          done_key=DONE_KEY if store_by_agent() else None).start()
        try:
            return _run_role(cfg, config_path, overrides, plan, node, role, digest, deadline, watch, store_node)
        finally:
            watch.close()
    held = {}
    # SIGTERM from the scheduler (or the local launcher), or another node's end: the watch's thread stops
    # torchrun's whole group (no signal handler waits on a process: the wait below would deadlock it)
    watch = NodeWatch(where, lambda reason: held["proc"].stop(grace) if "proc" in held else None,
                      grace_s=grace).start()
    try:
        return _run_trainer(cfg, config_path, overrides, plan, node, digest, deadline, watch, store_node, held)
    finally:
        watch.close()


def _run_role(cfg, config_path, overrides, plan, node, role, digest, deadline, watch, store_node) -> int:
    """An orchestrator or inference node's role, in this process."""
    where = watch.where
    join_rendezvous(plan, node, role, digest, deadline=deadline)
    watch.attach(plan.rdzv_host, plan.rdzv_port, store_node)
    try:
        if role == "orchestrator":
            from ..orchestrator.main import orchestrator_main

            os.environ.update(peer_env(plan, role))
            router = None
            if pool_on_nodes(cfg):  # the pool client waits for every server (bounded)
                router = start_pool_router(cfg, config_path, plan, node)
            elif plan.with_role("inference"):  # their servers come up beside this process: wait (bounded)
                from ..inference.vllm_client import VLLMClient

                log.info("waiting for the inference server at %s", cfg.inference.vllm.url)
                VLLMClient(cfg.inference.vllm, timeout_s=cfg.inference.timeout_s).wait_healthy(
                    cfg.inference.vllm.launch_timeout_s)
            try:
                orchestrator_main(cfg)
            finally:
                if router is not None:
                    router.stop()
        elif cfg.inference.vllm.launch:
            return run_vllm_node(cfg, node, watch=watch)
        elif pool_on_nodes(cfg):
            return run_pool_node(cfg, config_path, overrides, plan, node, watch=watch)
        else:
            from ..inference.server import serve

            serve(cfg, host=node.host, port=cfg.inference.vllm.port)
    except Exception as e:
        if watch.job_done:  # the job is done and this node was ended with it (the watch's thread exits too)
            return 0
        if watch.reason is not None:  # this node is ending (SIGTERM, another node's end): the error follows from it
            raise NodeError(watch.reason, watch.exit_code()) from None
        log.exception("%s failed", where)
        watch.fail(str(e) if isinstance(e, NodeError) else
                   f"{where} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise
    watch.finished()
    return 0


def _run_trainer(cfg, config_path, overrides, plan, node, digest, deadline, watch, store_node, held) -> int:
    """A trainer node: torchrun over ``primerl trainer``, stopped by ``watch`` when the job ends early."""
    grace = cfg.deployment.grace_s
    entry = ["-m", "primerl.runtime.cli", "trainer", "--config", config_path, *overrides]
    cmd = trainer_command(plan, node, entry, run_id=os.environ.get("SLURM_JOB_ID", "primerl"))
    log.info("trainer node %d: %s", node.trainer_node, " ".join(cmd))
    proc = held["proc"] = start_process(cmd, name=f"node{node.index}-trainer", role="trainer", log_path=None,
                                        env=dict(os.environ, **peer_env(plan, "trainer"), **_pool_env(cfg, plan, node)),
                                        die_with_parent=False)
    if watch.reason is not None:  # SIGTERM before torchrun was started
        proc.stop(grace)
    ranks = f"{node.host}, trainer ranks {node.ranks[0]}-{node.ranks[-1]}"
    try:
        join_rendezvous(plan, node, "trainer", digest, deadline=deadline, alive=lambda: proc.poll() is None)
    except NodeError as e:
        proc.stop(5.0)
        if watch.reason is not None:
            raise NodeError(watch.reason, 143 if watch.signalled else 1) from None
        watch.fail(str(e))
        raise
    watch.attach(plan.rdzv_host, plan.rdzv_port, store_node)
    rc = proc.wait()
    if watch.reason is not None:
        raise NodeError(watch.reason, 143 if watch.signalled else 1)
    if rc != 0:
        msg = f"node {node.index} ({ranks}): torchrun exited with code {rc}"
        watch.fail(msg)
        raise NodeError(msg)
    watch.finished()
    return 0
