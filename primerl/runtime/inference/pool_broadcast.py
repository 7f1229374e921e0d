"""Weights to a pool of ``primerl inference`` servers (trainer rank 0's end).

Every server of the pool that answers ``/health`` has a ``torch.distributed`` group of its own with
trainer rank 0 (two ranks: rank 0 hosts the groups' TCPStore on its own node at
``inference.broadcast_port``, each pair under a prefix of its own), and every version goes over
those pairs with the bucketed transfer (``weight_transfer.BucketSender``: each bucket packed once,
cast / FP8-quantized / delta-encoded once, and posted to every pair, pipelined), driven over each
server's ``POST /collective_rpc`` (``init_weight_transfer`` to join, ``update_weights_from_transfer``
for each version, whose answer is the version the server loaded).

Why pairs and not one group: a server killed in the middle of a version breaks its own pair only.
The sends to it fail at once (its sockets are closed with the process) and the others go on, so the
survivors hold the version when the send returns, with nothing sent twice and no wait on a timeout.
In one group, a collective's relay that dies leaves ranks (trainer rank 0 among them) waiting on a
peer that is still alive, until the group's timeout (``orchestrator.weights_timeout_s``). The price:
trainer rank 0's link carries the version once per server (a tree of one group carries it about
log2(servers + 1) times).

Membership: before each version the sender asks every server's ``/health`` (its ``instance`` id
changes when the pool's supervisor replaces the process). A server that is gone or replaced loses its
pair; a new one (or the replacement) gets a pair, holds no version, and so gets the next version in
full (FP8 or not) while the others may get a delta; the orchestrator routes to a server only once it
holds the pool's version. A server whose pair fails mid-version is dropped (``lost``) and rejoins
at the next version if it answers again.

Every wait is bounded (``timeout_s``); a pool with no server answering within it, or a version
that reached no server, raises ``WeightSyncError``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable

import torch

from ..transport import TRAINER_HOST_ENV
from .weight_sync import WeightSyncError, _shutdown

log = logging.getLogger("primerl.weight_sync")

__all__ = ["PoolBroadcastSender", "TRAINER_HOST_ENV", "trainer_host"]


def trainer_host() -> str:
    """The address of this trainer process's node, where rank 0 hosts the pool's weight groups:
    ``primerl node`` sets it from the plan for the node it runs (so rank 0's node is found when
    torchrun's rendezvous has placed rank 0, whichever trainer node that is); one machine: 127.0.0.1."""
    return os.environ.get(TRAINER_HOST_ENV) or "127.0.0.1"


@dataclass
class _Pair:
    instance: str | None
    group: object
    number: int  # the pair's formation number (its store prefix is pool/<number>/)


class PoolBroadcastSender:
    """Trainer rank 0's end of the pool's weight transfer. ``servers()``: the pool's server URLs (read
    at every version: the local launcher picks the ports when it starts the pool).

    ``send(version, regions, tensors)``: as ``weight_transfer.BucketSender.send`` (what
    ``weight_channels.BucketedBroadcast`` calls; ``bucket_bytes`` / ``delta`` / ``full_every`` as
    there, FP8 marked on the regions); ``send_stream(version, specs, tensors)``: full tensors in their
    own dtypes; ``close()``; ``stats`` (``TransferStats`` over every server's link)."""

    def __init__(self, servers: Callable[[], list[str]], host: str, port: int, *, timeout_s: float = 300.0,
                 backend: str = "gloo", health_timeout_s: float = 10.0, max_attempts: int = 4,
                 bucket_bytes: int = 64 * 2**20, delta: bool = False, full_every: int = 10):
        from .weight_transfer import BucketSender

        self.servers, self.host, self.port, self.backend = servers, host, int(port), backend
        self.timeout_s, self.health_timeout_s, self.max_attempts = timeout_s, health_timeout_s, max_attempts
        self.sender = BucketSender(None, bucket_bytes=bucket_bytes, delta=delta, full_every=full_every)
        self.store = None
        self.pairs: dict[str, _Pair] = {}  # url -> its pair with trainer rank 0
        self.formed = 0  # pairs formed so far (each under its own prefix of the store)
        self.lost = 0  # servers dropped in the middle of a version (their pair failed)
        self._fan = ThreadPoolExecutor(16, thread_name_prefix="pool-weights")
        self._forming = ThreadPoolExecutor(16, thread_name_prefix="pool-forming")
        self._lock, self._lock_store = threading.Lock(), threading.Lock()

    @property
    def num_receivers(self) -> int:
        return len(self.pairs)

    @property
    def stats(self):
        return self.sender.stats

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
                raise WeightSyncError(f"weights to the inference pool: none of {urls} answered /health "
                                      f"within {self.timeout_s:.0f} s")
            time.sleep(0.5)

    def _pair(self, url: str, instance: str | None) -> _Pair:
        """A new two-rank group of rank 0 and the server at ``url`` (its own prefix of the store);
        raises :class:`_JoinFailed` as soon as the server's join fails (a server that dies while
        joining would otherwise hold rank 0's rendezvous for the whole timeout)."""
        import torch.distributed as dist

        from .vllm_client import http_json

        timeout = timedelta(seconds=self.timeout_s)
        with self._lock_store:
            self.formed += 1
            number = self.formed
        prefix = f"pool/{number}/"
        join = self._fan.submit(http_json, url + "/collective_rpc",
                                {"method": "init_weight_transfer",
                                 "args": [self.host, self.port, self.timeout_s, prefix]}, self.timeout_s)
        # a client connection of its own: an abandoned rendezvous (a server died while joining) blocks
        # its connection until the timeout, and must not block another pair's
        store = dist.PrefixStore(prefix, dist.TCPStore(self.host, self.port, None, is_master=False, timeout=timeout))

        def construct():
            if self.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                return dist.ProcessGroupNCCL(store, 0, 2, opts)
            return dist.ProcessGroupGloo(store, 0, 2, timeout)

        made = ThreadPoolExecutor(1, thread_name_prefix="pool-group").submit(construct)
        deadline = time.monotonic() + self.timeout_s
        while not (made.done() and join.done()):
            failed = join.done() and join.exception() is not None
            if failed or made.done() and made.exception() is not None or time.monotonic() > deadline:
                if failed:
                    why = f"failed to join ({str(join.exception())[:200]})"
                elif made.done():
                    why = f"trainer rank 0 could not join ({made.exception()})"
                else:
                    why = f"did not join within {self.timeout_s:.0f} s"
                raise _JoinFailed(f"{url}: weight transfer pair {number} at {self.host}:{self.port}: {why}")
            time.sleep(0.02)
        log.info("weight transfer pair %d: trainer rank 0 at %s:%d + server %s", number, self.host, self.port, url)
        return _Pair(instance, made.result(), number)

    def _update_pairs(self, members) -> None:
        """Drop the pairs of servers gone or replaced; form pairs with the new ones (at the same time)."""
        import torch.distributed as dist

        now = dict(members)
        for url in [u for u, p in self.pairs.items() if u not in now or now[u] != p.instance]:
            self._drop(url)
        new = [(u, i) for u, i in members if u not in self.pairs]
        if not new:
            return
        if self.store is None:
            self.store = dist.TCPStore(self.host, self.port, None, is_master=True,
                                       timeout=timedelta(seconds=self.timeout_s), wait_for_workers=False)
        futures = {u: self._forming.submit(self._pair, u, i) for u, i in new}
        for url, fut in futures.items():
            try:
                self.pairs[url] = fut.result()
            except _JoinFailed as e:  # left out of this version; asked again at the next
                log.warning("%s; left out of this version", e)

    def _drop(self, url: str) -> None:
        pair = self.pairs.pop(url, None)
        if pair is not None:
            self._fan.submit(_shutdown, pair.group)  # the peer may be gone: never wait on it here

    # -- sending
    def send(self, version: int, regions: list, tensors: Iterable[torch.Tensor]) -> dict:
        """``version`` to every server that answers (forming the pairs that changed first). A server
        that fails during the send is dropped; the others hold the version when this returns. Raises
        :class:`WeightSyncError` when no server took it."""
        with self._lock:
            for attempt in range(1, self.max_attempts + 1):
                self._update_pairs(self._answering())
                if self.pairs:
                    break
                if attempt == self.max_attempts:
                    raise WeightSyncError(f"weights version {version} to the inference pool: no server joined in "
                                          f"{attempt} attempts")
                time.sleep(0.5)
            urls = list(self.pairs)
            loads = {url: self._fan.submit(self._receive, url, version) for url in urls}
            stats = self.sender.send(version, regions, tensors, groups=[self.pairs[u].group for u in urls])
            for i, error in self.sender.failed.items():
                log.warning("weights version %d: %s left in the middle of the version (%s); the others go on",
                            version, urls[i], str(error)[:300])
                self._drop(urls[i])
                self.lost += 1
            held = []
            for url, fut in loads.items():
                if url not in self.pairs:
                    continue
                try:
                    fut.result(self.timeout_s)
                    held.append(url)
                except Exception as e:  # noqa: BLE001 - it took the bytes but its load failed: not routed
                    log.warning("%s did not confirm weights version %d: %s", url, version, e)
            log.info("weights version %d broadcast to %d of %d server(s) (%s)", version, len(held), len(urls),
                     stats["mode"])
            if not held:
                raise WeightSyncError(f"weights version {version} reached none of the inference pool's servers {urls}")
            return stats

    def send_stream(self, version: int, specs: list, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """``send`` of whole tensors (``specs``: ``[(name, dtype, shape)]``, the tensors in that order
        and dtype, as ``(name, tensor)``)."""
        from .weight_buckets import Piece

        regions = [Piece(n, d if isinstance(d, str) else str(d).removeprefix("torch."), tuple(s), (0,) * len(s),
                         tuple(s)) for n, d, s in specs]
        return self.send(version, regions, (t for _, t in tensors))

    def _receive(self, url: str, version: int) -> int:
        from .vllm_client import InferenceServerError, http_json, rpc_versions

        got = rpc_versions(http_json(url + "/collective_rpc", {"method": "update_weights_from_transfer", "args": []},
                                     self.timeout_s))
        if got != [version]:
            raise InferenceServerError(f"{url}: loaded weights versions {got}, expected [{version}]")
        return version

    def close(self, *, goodbye: bool = False) -> None:
        """The end of the updates: leave the pairs (the servers need no goodbye: each receive is asked)."""
        with self._lock:
            for url in list(self.pairs):
                _shutdown(self.pairs.pop(url).group)
            # the store's server goes with its last reference: a rendezvous abandoned when a server died
            # while joining fails now, instead of holding this process's exit until its timeout
            self.store = None
            self._fan.shutdown(wait=False, cancel_futures=True)
            self._forming.shutdown(wait=False, cancel_futures=True)


class _JoinFailed(WeightSyncError):
    """A server's pair could not be formed (it left while joining)."""
