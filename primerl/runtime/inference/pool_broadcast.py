"""Weights by broadcast to a pool of ``primerl inference`` servers (trainer rank 0's end).

One ``torch.distributed`` group holds trainer rank 0 (rank 0, hosting the group's TCPStore on its
own node at ``inference.broadcast_port``) and every server of the pool that answers ``/health``
(ranks 1..n, in the order of the pool's URLs); every version is one broadcast to all of them
(``weight_broadcast``'s wire protocol, driven over each server's ``POST /collective_rpc`` as for
one server: ``init_broadcast`` to join, ``update_weights_from_broadcast`` for each version, whose
answer is the version the server loaded).

Membership: before each version :class:`PoolBroadcastSender` asks every server's ``/health`` (its
``instance`` id changes when the pool's supervisor replaces the process). When the set of
(URL, instance) differs from the group's, it forms a new group (a new key prefix in the same
store) with the servers that answer, so a replaced server rejoins at the next version and gets
that version in full before the orchestrator routes anything to it (the pool client routes only
to servers that hold the pool's version). A server that dies during a send makes the send fail on
every rank: the sender forms a group of the survivors and sends the same version again, from the
copy of the version's tensors it keeps on rank 0's host while a version is in flight (the stream
from the trainer ranks' gathers cannot be replayed; that copy is the price of surviving a death
mid-send: one model in the transfer dtype, released when every server acknowledged).

Every wait is bounded (``timeout_s``); a pool with no server answering within it raises
``WeightSyncError``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Callable, Iterable, Iterator

import torch

from ..transport import TRAINER_HOST_ENV
from .weight_sync import WeightSyncError, _shutdown

log = logging.getLogger("primerl.weight_sync")

__all__ = ["PoolBroadcastSender", "TRAINER_HOST_ENV", "trainer_host"]


def trainer_host() -> str:
    """The address of this trainer process's node, where rank 0 hosts the pool's weight group:
    ``primerl node`` sets it from the plan for the node it runs (so rank 0's node is found when
    torchrun's rendezvous has placed rank 0, whichever trainer node that is); one machine: 127.0.0.1."""
    return os.environ.get(TRAINER_HOST_ENV) or "127.0.0.1"


class PoolBroadcastSender:
    """Trainer rank 0's end of the pool's broadcast group. ``servers()``: the pool's server URLs
    (read at every version: the local launcher picks the ports when it starts the pool).
    ``send_stream`` / ``close(goodbye=)`` as ``weight_sync.BroadcastWeightSender`` (what
    ``weight_channels.EngineBroadcast`` calls)."""

    def __init__(self, servers: Callable[[], list[str]], host: str, port: int, *, timeout_s: float = 300.0,
                 backend: str = "gloo", health_timeout_s: float = 10.0, max_attempts: int = 4):
        self.servers, self.host, self.port, self.backend = servers, host, int(port), backend
        self.timeout_s, self.health_timeout_s, self.max_attempts = timeout_s, health_timeout_s, max_attempts
        self.store = None
        self.group = None
        self.members: tuple[tuple[str, str | None], ...] = ()  # (url, instance) of the group's ranks 1..n
        self.generation = 0  # groups formed so far (each under its own prefix of the store)
        self.resent = 0  # versions sent again after a server died during the send
        self._fan = ThreadPoolExecutor(16, thread_name_prefix="pool-weights")
        self._lock = threading.Lock()

    @property
    def num_receivers(self) -> int:
        return len(self.members)

    # -- membership
    def _health(self, url: str) -> tuple[str, str | None] | None:
        from .vllm_client import InferenceServerError, http_json

        try:
            h = http_json(url + "/health", None, timeout=self.health_timeout_s)
        except InferenceServerError:
            return None
        return url, h.get("instance")

    def _answering(self) -> tuple[tuple[str, str | None], ...]:
        """The servers that answer ``/health`` now, waiting (bounded) until at least one does."""
        urls = [u.rstrip("/") for u in self.servers()]
        deadline = time.monotonic() + self.timeout_s
        while True:
            found = tuple(m for m in self._fan.map(self._health, urls) if m is not None)
            if found:
                return found
            if time.monotonic() > deadline:
                raise WeightSyncError(f"weights by broadcast to the inference pool: none of {urls} answered /health "
                                      f"within {self.timeout_s:.0f} s")
            time.sleep(0.5)

    def _form(self, members) -> None:
        """A new group of rank 0 and ``members`` under a new prefix of this side's store."""
        import torch.distributed as dist

        from .vllm_client import http_json

        self._drop_group()
        timeout = timedelta(seconds=self.timeout_s)
        if self.store is None:
            self.store = dist.TCPStore(self.host, self.port, None, is_master=True, timeout=timeout,
                                       wait_for_workers=False)
        self.generation += 1
        prefix, world = f"pool/{self.generation}/", len(members) + 1
        args = lambda rank: [self.host, self.port, rank, world, self.timeout_s, prefix]  # noqa: E731
        joins = {url: self._fan.submit(http_json, url + "/collective_rpc",
                                       {"method": "init_broadcast", "args": args(rank)}, self.timeout_s)
                 for rank, (url, _) in enumerate(members, 1)}
        # a client connection of its own: an abandoned rendezvous (a server died while joining) blocks
        # its connection until the timeout, and must not block the next group's
        store = dist.PrefixStore(prefix, dist.TCPStore(self.host, self.port, None, is_master=False, timeout=timeout))

        def construct():
            if self.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                return dist.ProcessGroupNCCL(store, 0, world, opts)
            return dist.ProcessGroupGloo(store, 0, world, timeout)

        # rank 0's rendezvous waits for every rank; a server that dies meanwhile would hold it for the
        # whole timeout: watch the joins, and give up on this group as soon as one fails
        made = ThreadPoolExecutor(1, thread_name_prefix="pool-group").submit(construct)
        deadline = time.monotonic() + self.timeout_s
        while not (made.done() and all(f.done() for f in joins.values())):
            bad = [u for u, f in joins.items() if f.done() and f.exception() is not None]
            if bad or made.done() and made.exception() is not None or time.monotonic() > deadline:
                if bad:
                    why = f"{bad} failed to join ({[str(joins[u].exception())[:200] for u in bad]})"
                elif made.done():
                    why = f"trainer rank 0 could not join ({made.exception()})"
                else:
                    why = f"not every server joined within {self.timeout_s:.0f} s"
                raise _Reform(f"the inference pool's weight group {self.generation} at {self.host}:{self.port} "
                              f"({world - 1} server(s)): {why}")
            time.sleep(0.02)
        self.group, self.members = made.result(), tuple(members)
        log.info("weight broadcast group %d: trainer rank 0 at %s:%d + %d server(s) %s", self.generation, self.host,
                 self.port, len(members), [u for u, _ in members])

    def _drop_group(self) -> None:
        group, self.group, self.members = self.group, None, ()
        if group is not None:
            self._fan.submit(_shutdown, group)  # a peer may be gone: never wait on it here

    # -- sending
    def send_stream(self, version: int, specs: list, tensors: Iterable) -> None:
        """Broadcast ``version`` to every server that answers (forming the group first when the pool
        changed); a death during the send re-forms the group with the survivors and sends the version
        again. Raises :class:`WeightSyncError` after ``max_attempts`` failed sends."""
        from .weight_broadcast import send_update_stream

        with self._lock:
            kept: list = []
            source = iter(tensors)
            for attempt in range(1, self.max_attempts + 1):
                members = self._answering()
                if self.group is None or members != self.members:
                    try:
                        self._form(members)
                    except _Reform as e:  # a server died while joining: the next attempt goes without it
                        log.warning("%s; forming the group again", e)
                        if attempt == self.max_attempts:
                            raise WeightSyncError(str(e)) from e
                        time.sleep(0.5)
                        continue
                loads = {url: self._fan.submit(self._receive, url, version) for url, _ in self.members}
                try:
                    send_update_stream(self.group, version, specs, _replay(kept, source))
                except Exception as e:  # noqa: BLE001 - a receiver died or timed out: re-form and resend
                    kept.extend((n, _host_copy(t)) for n, t in source)  # the other trainer ranks' gathers go on
                    dead = [u for u, f in loads.items() if f.done() and f.exception() is not None]
                    log.warning("weights version %d to the inference pool failed (attempt %d of %d; %s): %s; "
                                "re-forming the group", version, attempt, self.max_attempts, dead or "a server", e)
                    self._drop_group()
                    self.resent += 1
                    if attempt == self.max_attempts:
                        raise WeightSyncError(f"weights version {version} to the inference pool failed "
                                              f"{attempt} times: {e}") from e
                    continue
                held = {}
                for url, fut in loads.items():
                    try:
                        held[url] = fut.result(self.timeout_s)
                    except Exception as e:  # noqa: BLE001 - it took the bytes but its load failed: not routed
                        log.warning("%s did not confirm weights version %d: %s", url, version, e)
                log.info("weights version %d broadcast to %d of %d server(s)", version,
                         sum(v == version for v in held.values()), len(self.members))
                return

    def _receive(self, url: str, version: int) -> int:
        from .vllm_client import InferenceServerError, http_json, rpc_versions

        got = rpc_versions(http_json(url + "/collective_rpc", {"method": "update_weights_from_broadcast", "args": []},
                                     self.timeout_s))
        if got != [version]:
            raise InferenceServerError(f"{url}: loaded weights versions {got}, expected [{version}]")
        return version

    def close(self, *, goodbye: bool = False) -> None:
        """The end of the updates: leave the group (the servers need no goodbye: each receive is asked)."""
        with self._lock:
            group, self.group = self.group, None
            _shutdown(group)
            # the store's server goes with its last reference: a rendezvous abandoned when a server died
            # while joining fails now, instead of holding this process's exit until its timeout
            self.store = None
            self._fan.shutdown(wait=False, cancel_futures=True)


class _Reform(WeightSyncError):
    """Forming the group failed because a server left while joining."""


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu") if t.device.type != "cpu" else t.detach()


def _replay(kept: list, source: Iterator) -> Iterator:
    """What was sent before (``kept``), then the rest of ``source``, each kept for a resend."""
    yield from kept
    for name, t in source:
        kept.append((name, _host_copy(t)))
        yield name, t
