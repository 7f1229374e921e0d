"""The node agents of a job end together: :class:`NodeWatch` (issue 45).

Every ``primerl node`` agent (trainer, orchestrator, inference) runs one watch thread:

- SIGTERM reaches it through ``signal.set_wakeup_fd``: the Python-level handler does nothing at
  all (a handler runs only between bytecodes of the main thread, which may sit in a C call for
  minutes, and one that waits on a ``Popen`` can deadlock on the lock of the wait it interrupted);
  the C-level handler writes the signal number to a socket the thread sleeps on, so the thread
  wakes at once;
- on that signal, or when this node's role fails (:meth:`NodeWatch.fail`), the thread posts the
  reason under ``primerl/r<round>/abort`` in the rendezvous store (``round_key``: a job restarted
  by its agents, ``node_supervise``, rejoins under the next round's keys) (the first reason stays), logs it and
  ends this node: ``on_end(reason)`` (the trainer agent stops torchrun's process group, SIGKILL
  after ``deployment.grace_s``; the orchestrator and inference agents stop their server and exit);
- every ``interval_s`` it reads the store: a reason posted by another node ends this node the same
  way, naming that node; a store that stops answering (trainer node 0's torchrun hosts it, so that
  node is gone) ends this node ``deployment.grace_s`` later unless its role has finished by itself
  by then (:meth:`NodeWatch.finished`: the normal end of a job closes the store too);
- SIGTERM once the job is done is no failure: a serving node's agent ends its round that way when
  trainer node 0's agent has posted ``done_key`` (``node_supervise.DONE_KEY``). The watch thread
  (never the signal handler) reads that key when the signal comes; set, the node ends with a plain
  line and exit code 0 (:meth:`NodeWatch.final`), and no reason is posted. Unset, or the store
  unreachable, it is the failure above.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .deployment import Node, NodePlan

log = logging.getLogger("primerl")

ABORT_KEY = "abort"  # under the round's prefix (round_key): primerl/r<round>/abort

__all__ = ["ABORT_KEY", "NodeError", "NodeWatch", "connect_store", "post_first", "posted", "round_key", "this_round"]


class NodeError(RuntimeError):
    """This node cannot take its part in the job (the message says why, with the address or key);
    ``exit_code``: the agent's exit code (143 when it ended on SIGTERM)."""

    def __init__(self, msg: str, exit_code: int = 1):
        super().__init__(msg)
        self.exit_code = exit_code


def connect_store(plan: "NodePlan", node: "Node", *, deadline: float, alive=None):
    """A client of the rendezvous store at ``plan.rdzv_endpoint``, retried until ``deadline`` (a
    ``time.monotonic()``; then a ``NodeError`` naming the address). ``alive()``: False when this
    node's torchrun has already exited (stop waiting)."""
    from torch.distributed import TCPStore

    left = lambda: max(deadline - time.monotonic(), 0.1)  # noqa: E731
    store, err = None, None
    while store is None and time.monotonic() < deadline:
        if alive is not None and not alive():
            raise NodeError(f"node {node.index} ({node.host}): torchrun exited before the rendezvous at "
                            f"{plan.rdzv_endpoint} was reached (see its output above)")
        try:  # a plain connect first: TCPStore's own retries overrun a short timeout by seconds
            socket.create_connection((plan.rdzv_host, plan.rdzv_port), timeout=min(left(), 1.0)).close()
            store = TCPStore(plan.rdzv_host, plan.rdzv_port, is_master=False, timeout=timedelta(seconds=left()),
                             wait_for_workers=False)
        except (RuntimeError, TimeoutError, OSError) as e:  # not up yet (trainer node 0 starts it)
            err = e
            time.sleep(min(0.2, left()))
    if store is None:
        raise NodeError(f"node {node.index} ({node.host}): cannot reach the rendezvous at {plan.rdzv_endpoint} within "
                        f"{plan.rdzv_timeout_s:g} s (deployment.rdzv_endpoint / --rdzv; last error: "
                        f"{str(err).splitlines()[0] if err else 'none'})")
    return store


def this_round() -> int:
    """The job's round: how many times it was restarted (``lifetime.JOB_RESTARTS_ENV``, 0 at first)."""
    from ..lifetime import JOB_RESTARTS_ENV

    return int(os.environ.get(JOB_RESTARTS_ENV, "0") or 0)


def round_key(name: str, rnd: int | None = None) -> str:
    """A rendezvous-store key of one round of the job (``primerl/r<round>/<name>``): the agents of a
    restarted job rejoin the same store under the next round's keys."""
    return f"primerl/r{this_round() if rnd is None else rnd}/{name}"


def post_first(store, key: str, value: str) -> bool:
    """Set ``key`` unless another process set it first (a counter decides); True when this one did.
    Every value is also kept, in order, under ``<key>/<n>`` (:func:`posted`)."""
    n = store.add(key + "_n", 1)
    store.set(f"{key}/{n}", value)
    if n == 1:
        store.set(key, value)
        return True
    return False


def posted(store, key: str) -> list[str]:
    """Every value :func:`post_first` posted under ``key``, in order."""
    n = store.add(key + "_n", 0)
    return [store.get(f"{key}/{i}").decode() for i in range(1, n + 1) if store.check([f"{key}/{i}"])]


class NodeWatch:
    """One node agent's watch (module docstring). ``where``: how the lines name this node, e.g.
    ``"node 0 (127.0.0.1) trainer"``; ``on_end(reason)`` ends this node's role (called once, on
    the watch thread); ``reason`` / ``signalled``: why it ended (None while it has not)."""

    def __init__(self, where: str, on_end: Callable[[str], None], *, grace_s: float, interval_s: float = 0.5,
                 store_grace_s: float | None = None, done_key: str | None = None):
        self.where, self.on_end, self.grace_s, self.interval_s = where, on_end, grace_s, interval_s
        # a key of the store that marks the job's normal end (SIGTERM after it is no failure); None: none is posted
        self.done_key = done_key
        self.job_done = False  # this node ended on SIGTERM after the job was done (a normal end)
        # how long a store that stopped answering is waited out (default grace_s); a serving node (it never
        # finishes by itself) waits longer: the store also goes at the job's normal end, before the
        # launcher has seen the trainer nodes exit and stopped the servers
        self.store_grace_s = grace_s if store_grace_s is None else store_grace_s
        self.reason: str | None = None
        self.signalled = False
        self._endpoint: tuple[str, int] | None = None
        self._store_host_node = ""
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._rx, self._tx = socket.socketpair()
        self._rx.setblocking(False)
        self._tx.setblocking(False)
        self._store = None
        self._closed = False
        self.abort_key = round_key(ABORT_KEY)
        self._thread = threading.Thread(target=self._run, name="node-watch", daemon=True)

    # -- the main thread
    def start(self) -> "NodeWatch":
        """Install the SIGTERM wake-up (main thread only) and start the thread."""
        self._old = (signal.set_wakeup_fd(self._tx.fileno(), warn_on_full_buffer=False),
                     signal.signal(signal.SIGTERM, lambda *_: None))  # the C handler's wake-up byte is what counts
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching, join the thread and restore SIGTERM's handling (main thread only). Before
        the process exits: a thread left inside a store call when the interpreter finalizes aborts
        the process (C++ frames cannot be unwound by the thread's forced exit)."""
        self._closed = True
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(30)
        self._store = None
        signal.set_wakeup_fd(self._old[0])
        signal.signal(signal.SIGTERM, self._old[1])

    def attach(self, host: str, port: int, store_host_node: str) -> None:
        """Watch the rendezvous store at ``host:port`` (hosted by ``store_host_node``, for the line
        that names it when the store is gone). Called once this node has joined it."""
        self._store_host_node = store_host_node
        self._endpoint = (host, port)

    def finished(self) -> None:
        """This node's role ended by itself (successfully): a store going away is no failure now."""
        self._done.set()

    def fail(self, reason: str) -> None:
        """This node's role failed: tell the other nodes (the store) and end this node."""
        self._end(reason, post=True)

    def exit_code(self) -> int:
        """This process's exit code once the watch ended it: 0 at the job's normal end, 143 on SIGTERM, else 1."""
        return 0 if self.job_done else 143 if self.signalled else 1

    def final(self, reason: str) -> tuple[int, str]:
        """``(exit code, last line)`` of a process the watch ended (for :func:`exit_process`): a plain line at
        the job's normal end, else ``primerl node: FAILED: <reason>``."""
        return self.exit_code(), f"primerl node: {reason}" if self.job_done else f"primerl node: FAILED: {reason}"

    # -- the thread
    def _run(self) -> None:
        lost_at = None
        while self.reason is None and not self._closed:
            r, _, _ = select.select([self._rx], [], [], self.interval_s)
            if r:
                try:
                    got = self._rx.recv(64)
                except BlockingIOError:
                    got = b""
                if signal.SIGTERM in got:
                    self.signalled = True
                    if self._job_is_done():  # read here, on this thread: the signal handler does nothing
                        self.job_done = True
                        self._end(f"{self.where}: the job is done (trainer node 0 finished); ending this node",
                                  post=False)
                        return
                    self._end(f"{self.where}: got SIGTERM; ending the job's processes (grace {self.grace_s:g} s)",
                              post=True)
                    return
            if self._endpoint is None or self._done.is_set():
                continue
            try:
                posted = self._read_abort()
                lost_at = None
            except Exception as e:  # noqa: BLE001 - the store's errors differ across torch versions
                lost_at = lost_at or time.monotonic()
                if time.monotonic() - lost_at >= self.store_grace_s:
                    host, port = self._endpoint
                    self._end(f"{self.where}: the rendezvous store at {host}:{port} (hosted by "
                              f"{self._store_host_node}) stopped answering {self.store_grace_s:g} s ago "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__}): that node is gone; "
                              "ending this node", post=False)
                    return
                continue
            if posted:
                self._end(f"{self.where}: ending: {posted}", post=False)
                return

    def _client(self):
        from torch.distributed import TCPStore

        host, port = self._endpoint
        return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=max(self.interval_s * 4, 2.0)),
                        wait_for_workers=False)

    def _read_abort(self) -> str | None:
        store = self._store = self._store or self._client()  # the watch thread's own client
        try:
            if not store.check([self.abort_key]):
                return None
            return store.get(self.abort_key).decode()
        except Exception:
            self._store = None  # reconnect next time (or count it as lost)
            raise

    def _job_is_done(self) -> bool:
        """The job's normal end is posted (``done_key``); False when none is watched or the store is gone."""
        if self.done_key is None or self._endpoint is None:
            return False
        try:
            return bool(self._client().check([self.done_key]))  # a client of its own, bounded
        except Exception:  # noqa: BLE001 - the store is gone: no normal end can be told
            return False

    def _post(self, reason: str) -> None:
        if self._endpoint is None:
            return
        try:
            post_first(self._client(), self.abort_key, reason)  # a client of its own; the first reason stays
        except Exception as e:  # noqa: BLE001 - the store may be gone already
            log.warning("%s: could not post to the rendezvous store: %s", self.where, str(e).splitlines()[0])

    def _end(self, reason: str, *, post: bool) -> None:
        with self._lock:
            if self.reason is not None:
                return
            self.reason = reason
        from ..lifetime import ENDING

        ENDING["exit_code"] = self.exit_code()
        (log.info if self.job_done else log.error)("%s", reason)
        if post and self._endpoint is not None:
            self._post(reason)
            time.sleep(self.interval_s * 2)  # the other nodes read it before this node's store host may go
        try:
            self.on_end(reason)
        except Exception:  # noqa: BLE001 - the end must go on
            log.exception("%s: ending this node failed", self.where)


def exit_process(code: int, line: str) -> None:
    """End this process from the watch thread: the final line, then ``os._exit`` (no cleanup that
    could wait on the main thread, which may be stuck)."""
    import sys

    for h in logging.getLogger().handlers:
        h.flush()
    print(line, file=sys.stderr, flush=True)
    os._exit(code)
