"""Supervised restarts of a job whose ``primerl node`` agents were started by hand (issue 45).

With ``deployment.max_restarts`` > 0 (``config.deployment.effective_max_restarts``) and no
launcher above the agents that restarts them itself (:data:`SUPERVISED_ENV`: ``primerl rl`` with
``kind = "nodes"`` and the sbatch script set it), each ``primerl node`` agent supervises its role:

- trainer node 0's agent hosts the rendezvous store (``deployment.rdzv_endpoint``) for the job's
  whole life; each round's torchrun joins it as a client (``is_host=0``) under a run id of its own;
- in round r = 0, 1, ... the agent runs its role as a child ``primerl node`` (one round:
  ``node.node_main``) with ``PRIMERL_JOB_RESTARTS=r`` (the trainer logs it as ``job/restarts``)
  and, from round 1, ``--checkpoint.resume true``; the child joins the round's keys of the store
  (``node_watch.round_key``: ``primerl/r<r>/...``), so the agents rejoin through the rendezvous;
- when a process of the round dies or stalls, the round's first reason is posted under
  ``primerl/r<r>/abort`` (by the child's ``NodeWatch``, or by this agent when the child itself
  died without a word, e.g. kill -9), every node's child ends (``deployment.grace_s``) and every
  agent starts the next round from the last complete checkpoint, at most ``max_restarts`` times;
  then each agent fails naming the process and cause of every round;
- SIGTERM to any agent is no failure to heal: it posts ``primerl/stop`` and ends its child; every
  agent ends (no restart), its line naming that node;
- the normal end: trainer node 0's agent posts ``primerl/done`` once its torchrun finished; a
  serving (inference) agent then stops its servers; node 0's agent keeps the store up until every
  agent has left (``primerl/left/<node>/<role>``, at most ``max(grace_s, 30)`` s).

The job's output_dir must be shared by the nodes (as under SLURM): a restarted orchestrator finds
the step to resume from in its ``checkpoints``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time
from datetime import timedelta

from ..config import RLConfig
from ..config.deployment import effective_max_restarts
from ..heartbeat import HEARTBEAT_DIR_ENV
from ..lifetime import JOB_RESTARTS_ENV
from ..processes import start_process

log = logging.getLogger("primerl")

SUPERVISED_ENV = "PRIMERL_NODE_SUPERVISED"  # "agent": this node's agent restarts it; "launcher": one above does
STOP_KEY, DONE_KEY = "primerl/stop", "primerl/done"
SETTLE_S = 2.0  # after a round failed: how long the other nodes get to post their reasons

__all__ = ["DONE_KEY", "STOP_KEY", "SUPERVISED_ENV", "agent_restarts", "round_cause", "store_by_agent",
           "supervise_node"]


def agent_restarts(cfg: RLConfig) -> int:
    """How many times this agent restarts the job itself: ``effective_max_restarts`` when it was
    started by hand, 0 under a launcher that restarts its agents (``SUPERVISED_ENV`` set)."""
    return 0 if os.environ.get(SUPERVISED_ENV) else effective_max_restarts(cfg)


def store_by_agent() -> bool:
    """This process runs one round under a supervising agent: trainer node 0's agent hosts the store."""
    return os.environ.get(SUPERVISED_ENV) == "agent"


def _left_key(index: int, role: str) -> str:
    return f"primerl/left/{index}/{role}"


def supervise_node(cfg: RLConfig, config_path: str, overrides: list[str], plan, node, role: str, budget: int) -> int:
    """Run this node's role round after round (module docstring); the exit code, or ``NodeError``."""
    from torch.distributed import TCPStore

    from .node import NodeError, connect_store
    from .node_watch import ABORT_KEY, NodeWatch, post_first, posted, round_key
    from .watchdog import StallWatchdog

    where = f"node {node.index} ({node.host}) {role}"
    grace = cfg.deployment.grace_s
    hosts_store = role == "trainer" and node.trainer_node == 0
    if hosts_store:
        try:
            store = TCPStore(plan.rdzv_host, plan.rdzv_port, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=30), multi_tenant=True)
        except Exception as e:  # noqa: BLE001 - RuntimeError / DistNetworkError across versions
            raise NodeError(f"{where}: cannot host the rendezvous store at {plan.rdzv_endpoint}: "
                            f"{str(e).splitlines()[0]}") from None
    else:
        store = connect_store(plan, node, deadline=time.monotonic() + plan.rdzv_timeout_s)
        store.set_timeout(timedelta(seconds=30))
    log.info("%s: supervising its role, at most %d restart(s) of the job (deployment.max_restarts)", where, budget)
    held = {}

    def on_sigterm(reason: str) -> None:  # the watch's thread: tell every agent, end this node's round
        try:
            post_first(connect_store(plan, node, deadline=time.monotonic() + 5), STOP_KEY, reason)
        except Exception as e:  # noqa: BLE001 - the store may be gone already
            log.warning("%s: could not post to the rendezvous store: %s", where, str(e).splitlines()[0])
        child = held.get("child")
        if child is not None and child.returncode is None:
            try:
                os.kill(child.pid, signal.SIGTERM)  # the round's agent ends its own processes (grace_s)
            except ProcessLookupError:
                pass

    watch = NodeWatch(where, on_sigterm, grace_s=grace).start()
    beats = os.path.abspath(os.path.join(cfg.output_dir, "heartbeats", f"node{node.index}-{role}"))
    causes: list[str] = []
    try:
        for rnd in range(budget + 1):
            argv = [sys.executable, "-m", "primerl.runtime.cli", "node", "--config", config_path, "--role", role,
                    "--node-rank", str(node.index), "--rdzv", plan.rdzv_endpoint, *overrides,
                    *(["--checkpoint.resume", "true"] if rnd else [])]
            env = dict(os.environ, **{SUPERVISED_ENV: "agent", JOB_RESTARTS_ENV: str(rnd), HEARTBEAT_DIR_ENV: beats})
            if watch.reason is not None:
                break
            child = held["child"] = start_process(argv, name=f"node{node.index}-{role}", role=role, log_path=None,
                                                  env=env, die_with_parent=True)
            finished = _wait_round(child, store, role, hosts_store, grace)
            StallWatchdog(beats, 0, lambda name: None).end_leftovers()  # a killed torchrun's ranks, say
            shutil.rmtree(beats, ignore_errors=True)
            if watch.reason is not None:
                break
            if finished:
                return _finish(store, plan, node, role, hosts_store, grace, where)
            key = round_key(ABORT_KEY, rnd)
            try:
                stop = store.get(STOP_KEY).decode() if store.check([STOP_KEY]) else None
                if stop is None and child.returncode < 0:  # it died without a word (kill -9): say it for it
                    post_first(store, key, f"{where}: its process (pid {child.pid}) exited with code "
                                           f"{child.returncode}")
                time.sleep(SETTLE_S)  # the other nodes' reasons of this round, its cause among them
                cause = round_cause(posted(store, key))
            except Exception as e:  # noqa: BLE001 - the store is gone: trainer node 0's agent is
                raise NodeError(f"{where}: the round's process exited with code {child.returncode} and the "
                                f"rendezvous store at {plan.rdzv_endpoint} (hosted by trainer node 0's agent) is "
                                f"gone ({str(e).splitlines()[0]}): not restarting") from None
            if stop is not None:
                _leave(store, node, role)
                raise NodeError(f"{where}: ending: {stop}")
            causes.append(cause)
            if rnd == budget:
                _leave(store, node, role)
                raise NodeError(f"{where}: the job failed {len(causes)} times (deployment.max_restarts = {budget}); "
                                "the causes:\n" + "\n".join(f"{i + 1}. {c}" for i, c in enumerate(causes)))
            log.warning("%s: RESTART %d of at most %d (from the last checkpoint): %s", where, rnd + 1, budget, cause)
        raise NodeError(watch.reason, 143)  # SIGTERM to this agent
    finally:
        watch.close()


def round_cause(reasons: list[str]) -> str:
    """The cause of a failed round among the reasons its nodes posted (in order): a stall or a process
    killed by a signal first, then a trainer node's, then the first posted (the others are usually its
    victims: a peer gone)."""
    import re

    if not reasons:
        return "no node posted a reason"

    def rank(r: str) -> tuple[bool, bool]:
        return (not ("made no progress" in r or re.search(r"exited with code -\d+", r)),
                not ("torchrun exited" in r or re.match(r"node \d+ \([^)]*\) trainer", r)))

    return min(reasons, key=rank)  # min is stable: among equals, the first posted


def _wait_round(child, store, role: str, hosts_store: bool, grace: float) -> bool:
    """Wait for this round's child; True when the job finished (its role ended well, or a serving
    node was told the trainers are done)."""
    while child.poll() is None:
        time.sleep(0.5)
        if role == "inference" and not hosts_store:
            try:
                done = store.check([DONE_KEY])
            except Exception:  # noqa: BLE001 - the child's watch names a store that is gone
                done = False
            if done:
                child.stop(grace)
                return True
    return child.returncode == 0


def _leave(store, node, role: str) -> None:
    try:
        store.set(_left_key(node.index, role), "1")
    except Exception:  # noqa: BLE001 - the store is gone: nobody waits
        pass


def _finish(store, plan, node, role: str, hosts_store: bool, grace: float, where: str) -> int:
    """The job ended well: trainer node 0's agent tells the serving nodes and keeps the store up until
    every agent has left; the others say they have."""
    if not hosts_store:
        _leave(store, node, role)
        return 0
    store.set(DONE_KEY, "1")
    others = [_left_key(n.index, r) for n in plan.nodes for r in n.roles if (n.index, r) != (node.index, role)]
    deadline = time.monotonic() + max(grace, 30.0)
    while time.monotonic() < deadline and not store.check(others):
        time.sleep(0.2)
    if not store.check(others):
        log.warning("%s: not every agent left within %g s", where, max(grace, 30.0))
    return 0
