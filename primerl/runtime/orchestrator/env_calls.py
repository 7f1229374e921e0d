"""Environment calls (``reward``, ``respond``) run concurrently, each with its own deadline.

The orchestrator submits a call when an episode's model turn completes and collects results
between engine steps, so one slow or hanging grader holds up only its own episode: the others'
rewards keep arriving, and the hanging call fails at its deadline with an error that names the
environment and the call (:class:`EnvCallTimeout`, :class:`EnvCallError`).

Calls run on reusable daemon worker threads, one reserved per dispatched call, so a call never
waits behind another (a hung thread cannot be killed in Python; one that passed its deadline is
abandoned with its worker, its result ignored, and no longer counts against ``max_concurrent``).
Calls beyond ``max_concurrent`` wait in order. An environment's methods are therefore called
from several threads at once; set ``env.max_concurrent_calls = 1`` for one that is not
thread-safe. ``async def`` methods run on an event loop of their calling thread.

Rewards are checked where they enter (:func:`check_reward`): a value that is not a real number
(a string, None, a list) or is NaN/inf raises :class:`RewardRejected` (the orchestrator counts it
and resamples the group); a finite reward beyond ``max_abs`` is clipped to +-max_abs and
reported as clipped, so advantages stay representable in float32.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import numbers
import queue
import threading
import time
from typing import Any, Callable

import torch

from primerl.rl.envs import call_env

__all__ = ["AsyncEnvCalls", "EnvCalls", "EnvCallError", "EnvCallTimeout", "RewardRejected", "check_reward",
           "check_token_weights"]


class EnvCallError(RuntimeError):
    """An environment call raised; the message names the environment and the call."""


class EnvCallTimeout(EnvCallError, TimeoutError):
    """An environment call passed its deadline."""


class RewardRejected(EnvCallError, ValueError):
    """A reward that cannot be used (not a real number, or NaN/inf)."""


def check_reward(value: Any, max_abs: float, env_name: str = "environment") -> tuple[float, bool]:
    """-> (reward as a float in [-max_abs, max_abs], whether it was clipped)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise RewardRejected(f"{env_name}: reward() returned {type(value).__name__} {value!r:.80}, expected a real "
                             "number (int or float)")
    r = float(value)
    if not math.isfinite(r):
        raise RewardRejected(f"{env_name}: reward() returned {r}, expected a finite number")
    if abs(r) > max_abs:
        return math.copysign(max_abs, r), True
    return r, False


def check_token_weights(value: Any, num_tokens: int, env_name: str = "environment") -> list[float] | None:
    """``token_weights()``'s result as a list of ``num_tokens`` finite floats >= 0, or None."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.tolist() if value.dim() == 1 else value
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise ValueError(f"{env_name}: token_weights() returned {type(value).__name__}, expected a sequence of "
                         f"{num_tokens} numbers (one per transcript token) or None")
    if len(value) != num_tokens:
        raise ValueError(f"{env_name}: token_weights() returned {len(value)} weights for a transcript of "
                         f"{num_tokens} tokens")
    bad = [(i, w) for i, w in enumerate(value)
           if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w) or w < 0]
    if bad:
        raise ValueError(f"{env_name}: token_weights() must be finite numbers >= 0, "
                         f"got {bad[0][1]!r} at token {bad[0][0]}")
    return [float(w) for w in value]


class EnvCalls:
    """Concurrent environment calls with per-call deadlines.

    >>> calls = EnvCalls("reverse-text", timeout_s=30, max_concurrent=64)
    >>> calls.submit(key, "reward", env.reward, episode)
    >>> for key, name, ok, value in calls.poll(wait_s=0.01): ...   # value: result or EnvCallError
    """

    def __init__(self, env_name: str, timeout_s: float, max_concurrent: int):
        if max_concurrent < 1:
            raise ValueError(f"EnvCalls: max_concurrent must be >= 1, got {max_concurrent}")
        self.env_name, self.timeout_s, self.max_concurrent = env_name, timeout_s, max_concurrent
        self._waiting: collections.deque = collections.deque()
        self._running: dict[int, tuple[Any, str, float]] = {}  # call id -> (key, name, deadline)
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self.timeouts = 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle_workers = 0  # workers blocked on _jobs and not reserved by a dispatched call
        self._lock = threading.Lock()
        self.on_result: Callable[[], None] | None = None  # called from a worker once its result is ready

    def submit(self, key: Any, name: str, fn: Callable, *args) -> None:
        self._waiting.append((key, name, fn, args))
        self._start()

    def pending(self) -> int:
        return len(self._waiting) + len(self._running)

    def next_deadline(self) -> float | None:
        """The nearest deadline (``time.monotonic()``) of a running call, or None."""
        return min((d for _, _, d in self._running.values()), default=None)

    def _start(self) -> None:
        while self._waiting and len(self._running) < self.max_concurrent:
            key, name, fn, args = self._waiting.popleft()
            cid = next(self._ids)
            self._running[cid] = (key, name, time.monotonic() + self.timeout_s)
            with self._lock:
                reserved = self._idle_workers > 0
                self._idle_workers -= reserved
            if not reserved:
                threading.Thread(target=self._worker, name=f"env-{self.env_name}-{cid}", daemon=True).start()
            self._jobs.put((cid, name, fn, args))

    def _worker(self) -> None:
        while True:
            cid, name, fn, args = self._jobs.get()
            try:
                out = (True, call_env(fn, *args, timeout=self.timeout_s))
            except Exception as e:  # noqa: BLE001 - handed to the orchestrator, attributed to the env
                err = EnvCallError(f"environment {self.env_name!r}: {name}() raised {type(e).__name__}: {e}")
                err.__cause__ = e
                out = (False, err)
            with self._lock:  # free before the result is seen, so the next dispatch can reuse this worker
                self._idle_workers += 1
            self._done.put((cid, out))
            if self.on_result is not None:
                self.on_result()

    def poll(self, wait_s: float = 0.0) -> list[tuple[Any, str, bool, Any]]:
        """Finished and timed-out calls as ``(key, name, ok, result_or_error)``; waits up to
        ``wait_s`` (not past the nearest deadline) for the first one when none is ready."""
        out = []
        if wait_s > 0 and self._running and self._done.empty():
            nearest = min(d for _, _, d in self._running.values())
            try:
                item = self._done.get(timeout=max(0.0, min(wait_s, nearest - time.monotonic())))
                self._collect(item, out)
            except queue.Empty:
                pass
        while True:
            try:
                self._collect(self._done.get_nowait(), out)
            except queue.Empty:
                break
        now = time.monotonic()
        for cid, (key, name, deadline) in list(self._running.items()):
            if now > deadline:
                del self._running[cid]
                self.timeouts += 1
                out.append((key, name, False, EnvCallTimeout(
                    f"environment {self.env_name!r}: {name}() did not return "
                    f"within env.timeout_s = {self.timeout_s} s")))
        self._start()
        return out

    def _collect(self, item, out: list) -> None:
        cid, (ok, value) = item
        entry = self._running.pop(cid, None)
        if entry is not None:  # None: it already timed out
            out.append((entry[0], entry[1], ok, value))


class AsyncEnvCalls:
    """``EnvCalls`` awaited from an event loop (the verifiers path's built-in environments):
    ``await calls.call("reward", env.reward, episode)`` returns the result or raises the call's
    ``EnvCallError`` / ``EnvCallTimeout``. A worker's result wakes the loop; a timer set to the
    nearest deadline reports a call that hangs."""

    def __init__(self, calls: EnvCalls, loop: asyncio.AbstractEventLoop):
        self.calls, self.loop = calls, loop
        self._timer: asyncio.TimerHandle | None = None
        calls.on_result = self._wake

    def _wake(self) -> None:  # a worker thread
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: the run is over
            pass

    def _deliver(self) -> None:
        for fut, _name, ok, value in self.calls.poll(0.0):
            if not fut.done():
                fut.set_result((ok, value))
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        deadline = self.calls.next_deadline()
        if deadline is not None:
            self._timer = self.loop.call_later(max(0.0, deadline - time.monotonic()) + 1e-3, self._deliver)

    async def call(self, name: str, fn: Callable, *args) -> Any:
        fut = self.loop.create_future()
        self.calls.submit(fut, name, fn, *args)
        self._deliver()  # (re)arm the deadline timer
        ok, value = await fut
        if not ok:
            raise value
        return value
