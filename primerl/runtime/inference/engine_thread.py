"""The engine server's engine thread: the one thread that touches the ``InferenceEngine``.

HTTP handlers never call the engine: they put work on this thread's queue and wait on a
``Future``. Between two engine steps the thread drains the queue in arrival order: new requests
join the running batch (continuous batching), aborted ones free their slot, and calls (a weight
load, pause / resume) run there, so a weight update lands between steps and the running requests
continue on the new weights with their KV cache. While paused, or with nothing to run, it idles
(2 ms polls) and keeps ``ServerStats`` current.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Callable

from ..heartbeat import beat
from .engine import InferenceEngine, Request
from .server_metrics import ServerStats

log = logging.getLogger("primerl.inference")


class Pending:
    """A request handed to the engine thread: wait on ``future``, then ``finish(result)`` is the body.
    ``rid`` (a generation's request id) is what an abort names; None for calls."""

    def __init__(self, future: Future, finish: Callable[[object], dict], rid: int | None = None):
        self.future, self.finish, self.rid = future, finish, rid


def settle(fut: Future, result=None, *, error: BaseException | None = None) -> None:
    """Complete ``fut`` unless its waiter cancelled it (a cancelled future refuses a result)."""
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class EngineThread:
    """Owns the engine's thread: ``submit`` a request, ``call`` a function between steps, ``abort`` a
    request; ``paused`` stops the stepping (requests and their cache are kept). If the thread dies,
    ``error`` holds why, every waiter gets it, and ``submit`` refuses new work."""

    def __init__(self, engine: InferenceEngine, stats: ServerStats):
        self.engine = engine
        self.stats = stats
        self.error: BaseException | None = None
        self.paused = False  # read and written on the engine thread (``set_paused``)
        self._incoming: queue.Queue = queue.Queue()
        self._futures: dict[int, Future] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- from any thread
    def new_id(self) -> int:
        """A fresh request id (1, 2, ...)."""
        with self._lock:
            self._next_id += 1
            return self._next_id

    def check_alive(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"inference engine is dead: {self.error!r}")

    def submit(self, req: Request) -> Future:
        """Queue ``req`` for the batch -> a future of its ``Completion`` (ValueError if the engine refuses it)."""
        self.check_alive()
        fut: Future = Future()
        self._incoming.put(("request", req, fut))
        return fut

    def call(self, fn: Callable[[], object]) -> Future:
        """Run ``fn()`` on the engine thread between two steps (paused or not) -> a future of its result."""
        fut: Future = Future()
        self._incoming.put(("call", fn, fut))
        return fut

    def call_and_wait(self, fn: Callable[[], object], timeout: float):
        """``call(fn)`` and wait up to ``timeout`` s for its result."""
        return self.call(fn).result(timeout)

    def set_paused(self, paused: bool) -> Future:
        """Stop (True) or continue (False) stepping the engine, after the step under way."""
        def apply():
            self.paused = paused
        return self.call(apply)

    def abort(self, rid: int) -> None:
        """Cancel request ``rid`` whose client is gone (no-op once it finished). Its future may already
        be cancelled (aiohttp cancels the future it waited on); the engine thread then drops it."""
        self._incoming.put(("abort", rid, Future()))

    def start(self) -> "EngineThread":
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ask the thread to end after the step under way (it is a daemon: nothing waits for it)."""
        self._stop.set()

    # ---------------------------------------------------------------- on the engine thread
    def _drain(self) -> None:
        """Everything queued since the last step, in arrival order."""
        while True:
            try:
                kind, payload, fut = self._incoming.get_nowait()
            except queue.Empty:
                return
            if kind == "request":
                try:
                    self.engine.add_request(payload)
                    self._futures[payload.request_id] = fut
                except ValueError as e:
                    settle(fut, error=e)
            elif kind == "abort":  # the client went away: free its slot
                if self._futures.pop(payload, None) is not None:
                    self.engine.abort([payload])
                    self.stats.count("aborted")
                fut.set_result(None)
            else:  # a weight update (or pause / resume) runs between engine steps
                try:
                    settle(fut, payload())
                except Exception as e:  # noqa: BLE001
                    settle(fut, error=e)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain()
                if self.paused or not self.engine.has_unfinished():
                    self.stats.refresh(self.engine, waiting_extra=self._incoming.qsize(), paused=self.paused)
                    self._stop.wait(0.002)
                    continue
                finished = self.engine.step()
                # the snapshot before the waiters: a client that has its completion reads /health
                # counters (generated tokens, running requests) that include it
                self.stats.refresh(self.engine, waiting_extra=self._incoming.qsize())
                for c in finished:
                    f = self._futures.pop(c.request_id, None)
                    # a waiter that gave up (aiohttp cancels the wrapped future) is an abort in flight
                    if f is not None and not f.cancelled():
                        self.stats.count("finished")  # before the waiter wakes: its client may read /health next
                        f.set_result(c)
                        beat("request finished")
        except BaseException as e:  # noqa: BLE001 - every waiter gets the error
            self.error = e
            log.exception("engine thread died")
            for f in self._futures.values():
                if not f.cancelled():
                    f.set_exception(e)


__all__ = ["EngineThread", "Pending", "settle"]
