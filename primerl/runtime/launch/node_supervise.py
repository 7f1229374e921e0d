"""The supervision of a job whose ``primerl node`` agents were started by hand (issue 45).

An agent started by hand (no supervisor above it: :data:`SUPERVISED_ENV` unset; ``primerl rl``
with ``kind = "nodes"`` and the sbatch script set it) runs its role as a child ``primerl node``,
one round at a time, and supervises it:

- trainer node 0's agent hosts the rendezvous store (``deployment.rdzv_endpoint``) for the job's
  whole life; each round's torchrun joins it as a client (``is_host=0``) under a run id of its own;
- in round r the child (``node.node_main``) runs with ``PRIMERL_JOB_RESTARTS=r`` (the trainer logs
  it as ``job/restarts``) and, from round 1, ``--checkpoint.resume true``; it joins the round's
  keys of the store (``node_watch.round_key``: ``primerl/r<r>/...``), so the agents rejoin through
  the rendezvous;
- stall watchdog: the child's processes beat into ``<output_dir>/heartbeats/node<i>-<role>``;
  every agent posts its node's count and sees the others' (``node_stall.JobProgress``); when no process of
  the job progressed for ``deployment.stall_timeout_s``, the agents dump their processes' stacks
  (``py-spy dump``) to their logs, the one holding a stopped process names it, and the round ends;
- when a process of the round dies or stalls, the round's reasons are posted under
  ``primerl/r<r>/abort`` (by the child's ``NodeWatch``, by this agent for a child killed without
  a word, or by the watchdog), every node's child ends (``deployment.grace_s``), and with
  ``deployment.max_restarts`` = N > 0 every agent starts the next round from the last complete
  checkpoint, at most N times; then each fails naming the process and cause of every round
  (:func:`round_cause` picks a round's cause among its nodes' reasons). With N = 0 the agent exits
  as its child did;
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
import threading
import time
from datetime import timedelta
from typing import Callable

from ..config import RLConfig
from ..heartbeat import HEARTBEAT_DIR_ENV
from ..lifetime import JOB_RESTARTS_ENV
from ..processes import start_process

log = logging.getLogger("primerl")

SUPERVISED_ENV = "PRIMERL_NODE_SUPERVISED"  # "agent": this node's agent restarts it; "launcher": one above does
STOP_KEY, DONE_KEY = "primerl/stop", "primerl/done"
SETTLE_S = 1.0  # after every node's round ended: a moment more for their last reasons
ALIVE_TICK_S, ALIVE_GONE_S = 0.5, 5.0  # an agent's sign of life in the store; none for this long: gone

__all__ = ["DONE_KEY", "STOP_KEY", "SUPERVISED_ENV", "supervised_from_above", "round_cause", "store_by_agent",
           "supervise_node"]


def supervised_from_above() -> bool:
    """This agent runs one round for a supervisor above it (its own node's agent, the local nodes
    launcher, the sbatch script): ``SUPERVISED_ENV`` is set. Else it was started by hand."""
    return bool(os.environ.get(SUPERVISED_ENV))


AGENT_PID_ENV = "PRIMERL_NODE_AGENT_PID"


def die_with_agent() -> None:
    """A round process dies at once (SIGKILL) with its supervising agent, as the agent's own role
    process would: a killed agent is not a SIGTERM of the job (Linux; elsewhere nothing is set)."""
    pid = int(os.environ.get(AGENT_PID_ENV, "0") or 0)
    if not pid or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != pid:  # gone already
        os._exit(137)


def store_by_agent() -> bool:
    """This process runs one round under a supervising agent: trainer node 0's agent hosts the store."""
    return os.environ.get(SUPERVISED_ENV) == "agent"


def _left_key(index: int, role: str) -> str:
    return f"primerl/left/{index}/{role}"


def _alive_key(index: int, role: str) -> str:
    return f"primerl/alive/{index}/{role}"


def supervise_node(cfg: RLConfig, config_path: str, overrides: list[str], plan, node, role: str, budget: int) -> int:
    """Run this node's role round after round (module docstring); the exit code, or ``NodeError``."""
    return _Supervisor(cfg, config_path, overrides, plan, node, role, budget).run()


class _Supervisor:
    def __init__(self, cfg, config_path, overrides, plan, node, role, budget):
        from .watchdog import StallWatchdog

        self.cfg, self.config_path, self.overrides, self.plan, self.node = cfg, config_path, overrides, plan, node
        self.role, self.budget = role, budget
        self.where = f"node {node.index} ({node.host}) {role}"
        self.grace, self.stall_s = cfg.deployment.grace_s, cfg.deployment.stall_timeout_s
        self.hosts_store = role == "trainer" and node.trainer_node == 0
        self.beats = os.path.abspath(os.path.join(cfg.output_dir, "heartbeats", f"node{node.index}-{role}"))
        self.watchdog = StallWatchdog(self.beats, self.stall_s, lambda name: None,  # stacks to this agent's log
                                      startup_s=cfg.deployment.stall_startup_s)
        self.child = None

    def _store(self):
        from torch.distributed import TCPStore

        from .node_watch import NodeError, connect_store

        if not self.hosts_store:
            store = connect_store(self.plan, self.node, deadline=time.monotonic() + self.plan.rdzv_timeout_s)
            store.set_timeout(timedelta(seconds=30))
            return store
        try:
            return TCPStore(self.plan.rdzv_host, self.plan.rdzv_port, is_master=True, wait_for_workers=False,
                            timeout=timedelta(seconds=30), multi_tenant=True)
        except Exception as e:  # noqa: BLE001 - RuntimeError / DistNetworkError across versions
            raise NodeError(f"{self.where}: cannot host the rendezvous store at {self.plan.rdzv_endpoint}: "
                            f"{str(e).splitlines()[0]}") from None

    def _on_sigterm(self, reason: str) -> None:  # the watch's thread: tell every agent, end this node's round
        from .node_watch import connect_store
        from .node_watch import post_first

        try:
            post_first(connect_store(self.plan, self.node, deadline=time.monotonic() + 5), STOP_KEY, reason)
        except Exception as e:  # noqa: BLE001 - the store may be gone already
            log.warning("%s: could not post to the rendezvous store: %s", self.where, str(e).splitlines()[0])
        child = self.child
        if child is not None and child.returncode is None:
            try:
                os.kill(child.pid, signal.SIGTERM)  # the round's agent ends its own processes (grace_s)
            except ProcessLookupError:
                pass

    def run(self) -> int:
        from .node_watch import NodeError
        from .node_watch import NodeWatch

        self.store = self._store()
        stall = f"{self.stall_s:g} s" if self.stall_s else "off"
        if self.stall_s and self.watchdog.startup_s > self.stall_s:
            stall += f" ({self.watchdog.startup_s:g} s in the start-up)"
        log.info("%s: supervising its role: at most %d restart(s) of the job (deployment.max_restarts), stall "
                 "watchdog %s", self.where, self.budget, stall)
        self.watch = NodeWatch(self.where, self._on_sigterm, grace_s=self.grace).start()
        self._closing = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="agent-alive", daemon=True)
        self._ticker.start()
        causes: list[str] = []
        try:
            for rnd in range(self.budget + 1):
                if self.watch.reason is not None:
                    break
                ended = self._round(rnd)
                if self.watch.reason is not None:
                    break
                if ended == "finished":
                    return self._finish()
                rc = self.child.returncode
                if self.budget == 0 and rc > 0 and ended != "stalled":  # as without supervision: its line said why,
                    stall = self._stall_reported(rnd)  # unless the watchdog named a stopped process: the cause
                    if stall is not None:
                        raise NodeError(f"{self.where}: ending: {stall}")
                    return rc
                stop, cause = self._cause(rnd, rc)
                self._leave_if(stop is not None or rnd == self.budget)
                if stop is not None:
                    raise NodeError(f"{self.where}: ending: {stop}")
                causes.append(cause)
                if self.budget == 0:
                    raise NodeError(cause)
                if rnd == self.budget:
                    raise NodeError(f"{self.where}: the job failed {len(causes)} times (deployment.max_restarts = "
                                    f"{self.budget}); the causes:\n" + "\n".join(f"{i + 1}. {c}"
                                                                                 for i, c in enumerate(causes)))
                log.warning("%s: RESTART %d of at most %d (from the last checkpoint): %s", self.where, rnd + 1,
                            self.budget, cause)
            raise NodeError(self.watch.reason, 143)  # SIGTERM to this agent
        finally:
            self.watch.close()
            if not self.hosts_store:
                self._leave()
            self._linger()
            self._closing.set()
            # a tick in flight when the store's host left fails with torch's C++ warning on stderr: it
            # comes before this agent's last line (its verdict), not after it
            self._ticker.join(ALIVE_TICK_S + 10)

    def _tick(self) -> None:
        """This agent is alive: a counter in the store, advanced every ``ALIVE_TICK_S`` (its own
        client) until the agent ends; the others stop waiting for an agent whose counter stands."""
        from .node_watch import connect_store

        try:
            client = connect_store(self.plan, self.node, deadline=time.monotonic() + 10)
            while not self._closing.is_set():
                client.add(_alive_key(self.node.index, self.role), 1)
                self._closing.wait(ALIVE_TICK_S)
        except Exception:  # noqa: BLE001 - the store is gone: nobody is waiting
            return

    def _wait_agents(self, key: Callable[[int, str], str], wait_s: float) -> list[str]:
        """Wait until every other agent has set ``key(node, role)``, gave no sign of life for
        ``ALIVE_GONE_S`` (killed), or ``wait_s`` passed; the agents still missing, named."""
        others = [(n.index, r) for n in self.plan.nodes for r in n.roles if (n.index, r) != (self.node.index,
                                                                                              self.role)]
        last: dict = {}
        deadline = time.monotonic() + wait_s
        while True:
            now, missing = time.monotonic(), []
            for i, r in others:
                if self.store.check([key(i, r)]):
                    continue
                count = self.store.add(_alive_key(i, r), 0)
                if last.get((i, r), (None,))[0] != count:
                    last[(i, r)] = (count, now)
                if now - last[(i, r)][1] < ALIVE_GONE_S:
                    missing.append(f"node {i} {r}")
            if not missing or now >= deadline:
                return missing
            time.sleep(0.2)

    def _linger(self) -> None:
        """Trainer node 0's agent keeps the store up until every other agent has left (at most
        ``max(grace_s, 30)`` s; one that stopped ticking is not waited for): they read the round's
        reasons and the end from it."""
        if not self.hosts_store:
            return
        try:
            missing = self._wait_agents(_left_key, max(self.grace, 30.0))
            if missing:
                log.warning("%s: %s did not leave within %g s", self.where, missing, max(self.grace, 30.0))
        except Exception:  # noqa: BLE001 - a store error here must not hide the agent's own end
            pass

    def _round(self, rnd: int) -> str:
        """Run round ``rnd``'s child to its end: ``"finished"``, ``"failed"`` or ``"stalled"``."""
        from .node_stall import JobProgress
        from .node_watch import round_key

        argv = [sys.executable, "-m", "primerl.runtime.cli", "node", "--config", self.config_path, "--role",
                self.role, "--node-rank", str(self.node.index), "--rdzv", self.plan.rdzv_endpoint, *self.overrides,
                *(["--checkpoint.resume", "true"] if rnd else [])]
        env = dict(os.environ, **{SUPERVISED_ENV: "agent", JOB_RESTARTS_ENV: str(rnd), HEARTBEAT_DIR_ENV: self.beats,
                                  AGENT_PID_ENV: str(os.getpid())})
        self.child = start_process(argv, name=f"node{self.node.index}-{self.role}", role=self.role, log_path=None,
                                   env=env, die_with_parent=True)
        progress = JobProgress(self, rnd)
        self.vanished, seen, aborted = [], {}, False
        ended = "failed"
        while self.child.poll() is None:
            time.sleep(0.5)
            self._note_vanished(seen, aborted)  # against the previous pass's abort: both may be seen at once
            aborted = aborted or self._aborted(rnd)
            if self._done():
                self.child.stop(self.grace)
                ended = "finished"
                break
            if progress.stalled():
                ended = "stalled"
                self.child.stop(self.grace)
                break
        else:
            ended = "finished" if self.child.returncode == 0 else "failed"
        self.watchdog.end_leftovers()  # a killed torchrun's ranks, a stopped process
        shutil.rmtree(self.beats, ignore_errors=True)
        try:
            self.store.set(round_key(f"ended/{self.node.index}/{self.role}", rnd), "1")
        except Exception:  # noqa: BLE001 - the store is gone: _cause says so
            pass
        return ended

    def _stall_reported(self, rnd: int) -> str | None:
        """A stall the watchdog of some node reported in round ``rnd`` (the round's true cause), or None."""
        from .node_watch import ABORT_KEY, posted, round_key

        try:
            return next((r for r in posted(self.store, round_key(ABORT_KEY, rnd)) if "made no progress" in r), None)
        except Exception:  # noqa: BLE001 - the store is gone
            return None

    def _aborted(self, rnd: int) -> bool:
        from .node_watch import ABORT_KEY, round_key

        try:
            return self.store.check([round_key(ABORT_KEY, rnd)])
        except Exception:  # noqa: BLE001 - the store is gone: the child's watch ends this node
            return False

    def _note_vanished(self, seen: dict, aborted: bool) -> None:
        """A process of this node (a heartbeat row) that ended before any node reported a failure is
        a candidate cause, posted if the round fails (a trainer rank killed under torchrun: its exit
        code is torchrun's to see; the orchestrator's "peer gone" error is often posted first). The
        round's own process (the orchestrator runs in it) is not one: its end is said by its exit code
        (``_cause``) or by the error it posted itself, and taken for a vanished process it would outrank
        the process whose loss it reports (its death and its post fall in one poll)."""
        from ..heartbeat import read_heartbeats
        from .watchdog import process_state

        for r in read_heartbeats(self.beats):
            if r["pid"] == self.child.pid:
                continue
            alive = process_state(r["pid"]) not in (None, "Z", "X")
            if alive:
                seen[r["pid"]] = r
            elif r["pid"] in seen:
                gone = seen.pop(r["pid"])
                if not aborted:
                    self.vanished.append(f"{self.where}: the {gone['name']} process (pid {gone['pid']}) ended while "
                                         f"the job ran, before any node reported a failure (its last progress: "
                                         f"{gone['what']})")

    def _done(self) -> bool:
        """A serving node is told that the trainers finished."""
        if self.role != "inference" or self.hosts_store:
            return False
        try:
            return self.store.check([DONE_KEY])
        except Exception:  # noqa: BLE001 - the child's watch names a store that is gone
            return False

    def _cause(self, rnd: int, rc: int) -> tuple[str | None, str]:
        """``(stop, cause)``: the reason every agent ends (SIGTERM to one), or the cause of this round."""
        from .node_watch import NodeError
        from .node_watch import ABORT_KEY, post_first, posted, round_key

        key = round_key(ABORT_KEY, rnd)
        try:
            if self.store.check([STOP_KEY]):
                return self.store.get(STOP_KEY).decode(), ""
            if rc < 0:  # it died without a word (kill -9): say it for it
                post_first(self.store, key, f"{self.where}: its process (pid {self.child.pid}) exited with code {rc}")
            for why in self.vanished:
                post_first(self.store, key, why)
            # every node's round ended (within grace_s): their reasons are in, the cause among them
            self._wait_agents(lambda i, r: round_key(f"ended/{i}/{r}", rnd), self.grace + 15)
            time.sleep(SETTLE_S)
            if self.store.check([STOP_KEY]):
                return self.store.get(STOP_KEY).decode(), ""
            return None, round_cause(posted(self.store, key))
        except Exception as e:  # noqa: BLE001 - the store is gone: trainer node 0's agent is
            raise NodeError(f"{self.where}: the round's process exited with code {rc} and the rendezvous store at "
                            f"{self.plan.rdzv_endpoint} (hosted by trainer node 0's agent) is gone "
                            f"({str(e).splitlines()[0]})") from None

    def _leave_if(self, cond: bool) -> None:
        if cond:
            self._leave()

    def _leave(self) -> None:
        try:
            self.store.set(_left_key(self.node.index, self.role), "1")
        except Exception:  # noqa: BLE001 - the store is gone: nobody waits
            pass

    def _finish(self) -> int:
        """The job ended well: trainer node 0's agent tells the serving nodes and keeps the store up
        until every agent has left; the others say they have."""
        if not self.hosts_store:
            self._leave()
            return 0
        self.store.set(DONE_KEY, "1")  # run() lingers until the others have left
        return 0


def round_cause(reasons: list[str]) -> str:
    """The cause of a failed round among the reasons its nodes posted (in order): a stall or a process
    killed by a signal first, then a process that ended before any failure was reported, then a
    trainer node's, then the first posted (the others are usually its victims: a peer gone)."""
    import re

    if not reasons:
        return "no node posted a reason"

    def rank(r: str) -> int:
        if "made no progress" in r or re.search(r"exited with code -\d+", r):
            return 0
        if "before any node reported a failure" in r:
            return 1
        return 2 if ("torchrun exited" in r or re.match(r"node \d+ \([^)]*\) trainer", r)) else 3

    return min(reasons, key=rank)  # min is stable: among equals, the first posted
