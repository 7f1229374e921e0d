"""The stall watchdog of node agents started by hand (issue 45): :class:`JobProgress`, one per
round of a supervising agent (``node_supervise``)."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("primerl")

REPORT_DELAY_S = 3.0  # a stall: how much later than the node holding a stopped process the others report

__all__ = ["JobProgress", "REPORT_DELAY_S"]


class JobProgress:
    """The job's progress as every agent sees it: each posts its node's heartbeat count under the
    round's ``progress/<node>/<role>``; no count of any node changed for ``stall_timeout_s`` (this
    agent's clock) is a stall. The agent holding a stopped (SIGSTOP) process reports it at once; the
    others wait ``REPORT_DELAY_S`` more, then report their own (the first posted is the round's reason
    unless ``round_cause`` ranks another first). A process of this node stopped for
    ``stall_timeout_s`` is reported even while the rest of the job goes on (this node's round agent
    too, which beats no heartbeat). Reporting dumps this node's stacks to its log.

    Start-up: each agent's count ends in ``+`` once every process of its node made progress past its
    start (``watchdog.started_up``); until every node's count does, the quiet allowed is
    ``max(stall_timeout_s, deployment.stall_startup_s)`` (the watchdog's ``startup_s``)."""

    def __init__(self, sup, rnd: int):  # sup: the agent's supervisor (store, child, watchdog, plan, node, role)
        from .node_watch import round_key

        self.sup, self.rnd = sup, rnd
        self.mine = round_key(f"progress/{sup.node.index}/{sup.role}", rnd)
        self.keys = [round_key(f"progress/{n.index}/{r}", rnd) for n in sup.plan.nodes for r in n.roles]
        self.seen, self.changed, self.posted = None, time.monotonic(), None
        self.started, self.stopped_since = time.time(), {}

    def _stopped_alone(self, rows: list[dict]) -> list[dict] | None:
        """A process of this node stopped (SIGSTOP) for ``stall_timeout_s`` while the job may go on
        (this node's round agent, which has no heartbeat, too): the rows to report, it first."""
        import socket

        from .watchdog import process_state

        sup, now = self.sup, time.monotonic()
        watched = list(rows)
        if sup.child is not None and all(r["pid"] != sup.child.pid for r in rows):
            watched.append({"name": f"node{sup.node.index}-{sup.role} agent", "pid": sup.child.pid,
                            "host": socket.gethostname(), "progress": 0, "time": self.started,
                            "what": "its round's start (a node agent beats no heartbeat)"})
        for r in watched:
            if process_state(r["pid"]) in ("T", "t"):
                self.stopped_since.setdefault(r["pid"], now)
            else:
                self.stopped_since.pop(r["pid"], None)
        long = [r for r in watched if now - self.stopped_since.get(r["pid"], now) >= sup.stall_s]
        return long + [r for r in watched if r not in long] if long else None

    def _report(self, rows: list[dict], *, alone: bool = False) -> bool:
        from .node_watch import ABORT_KEY, post_first, round_key

        sup = self.sup
        line = sup.watchdog.report(rows, time.time(), alone=alone)
        log.error("%s: %s", sup.where, line)
        try:
            post_first(sup.store, round_key(ABORT_KEY, self.rnd), f"{sup.where}: {line}")
        except Exception:  # noqa: BLE001 - the store is gone
            pass
        return True

    def stalled(self) -> bool:
        from .watchdog import process_state, started_up

        sup = self.sup
        if not sup.stall_s:
            return False
        rows = sup.watchdog.live()
        alone = self._stopped_alone(rows)
        if alone:
            return self._report(alone, alone=True)
        count = str(sum(r.get("progress", 0) for r in rows) + 1000 * len(rows)) + ("+" if started_up(rows) else "")
        try:
            if count != self.posted:
                sup.store.set(self.mine, count)
                self.posted = count
            seen = [sup.store.get(k) if sup.store.check([k]) else b"" for k in self.keys]
        except Exception:  # noqa: BLE001 - the store is gone: the child's watch ends this node
            return False
        now = time.monotonic()
        if seen != self.seen:
            self.seen, self.changed = seen, now
            return False
        quiet = now - self.changed
        stopped = any(process_state(r["pid"]) in ("T", "t") for r in rows)
        limit = sup.stall_s if all(v.endswith(b"+") for v in seen) else max(sup.stall_s, sup.watchdog.startup_s)
        if not rows or quiet < limit or (not stopped and quiet < limit + REPORT_DELAY_S):
            return False
        return self._report(rows)
