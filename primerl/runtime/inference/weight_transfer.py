"""The bucketed weight transfer (issue 42): both ends of one version's trip, below the channel.

Groups (:func:`join_transfer_groups`): one ``torch.distributed`` group per sending trainer rank
``r`` ("source"), ``{source r (rank 0), receiver 0 (rank 1), ..., receiver R-1 (rank R)}``, all on
one TCPStore (prefix ``weights/src<r>``), so every source streams to the receivers on its own links
at the same time (sharded sending) and no collective orders one source behind another.

One version on one source's group (:class:`BucketSender` / :class:`SourceReceiver`):

1. ``allreduce(MIN)`` of the version each receiver holds intact from this source (-1: none, a new
   receiver, or one whose last bucket failed its checksum); the sender sends a delta only when
   every receiver holds the sender's previous version (and it is not a ``full_every`` version);
2. the header (length, then JSON ``{"version", "mode", "delta", "layout"}``; version -1 = no more
   updates): the buckets' pieces (``weight_buckets``), known before any byte is packed;
3. per bucket ``[kind, wire bytes, crc32, raw bytes]`` (int64) then the payload; the sender packs
   bucket i+1 (gathers, casts, quantizes, xors + compresses it) while bucket i is on the wire (the
   broadcasts are asynchronous, at most ``window`` buckets in flight);
4. ``allreduce(SUM)`` of the receivers' failed buckets: 0 ends the version; otherwise the failure
   is counted (``repairs``) and the version is sent again in full, from the raw buckets the
   sender keeps (it never reaches the engine: the receiver discards what it got).

The receiving end (``SourceReceiver``, ``receive_version``, the engine's and a server's receivers)
is ``weight_receive``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator

import numpy as np
import torch

from .weight_buckets import (
    DELTA, FULL, PIECES, Piece, checksum, encode_bucket, encode_delta, header_bytes, layout_to_json, piece_wire,
    plan_buckets, split_pieces, wire_bytes
)

log = logging.getLogger("primerl.weight_sync")

__all__ = ["BucketSender", "TransferStats", "join_transfer_groups"]

END_OF_UPDATES = -1
_NO_VERSION = 2**62


def _pg(store, rank: int, size: int, timeout_s: float, backend: str):
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def join_transfer_groups(host: str, port: int, *, sources: int, receivers: int, source: int | None = None,
                         receiver: int | None = None, store_master: bool, timeout_s: float = 300.0,
                         backend: str = "gloo") -> dict:
    """Join the transfer groups as ``source`` (a trainer rank: ``{source: its group}``) or as
    ``receiver`` j (``{r: group of source r}`` for every source). ``store_master``: this process
    hosts the TCPStore at ``host:port`` (exactly one process does)."""
    import torch.distributed as dist
    from datetime import timedelta

    if (source is None) == (receiver is None):
        raise ValueError("join_transfer_groups: give exactly one of source / receiver")
    store = dist.TCPStore(host, port, None, is_master=store_master, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    if source is not None:
        return {source: _pg(dist.PrefixStore(f"weights/src{source}", store), 0, receivers + 1, timeout_s, backend)}
    if sources == 1:
        return {0: _pg(dist.PrefixStore("weights/src0", store), receiver + 1, receivers + 1, timeout_s, backend)}
    with ThreadPoolExecutor(sources, thread_name_prefix="weight-join") as pool:  # the sources arrive in any order
        futures = {r: pool.submit(_pg, dist.PrefixStore(f"weights/src{r}", store), receiver + 1, receivers + 1,
                                  timeout_s, backend) for r in range(sources)}
        return {r: f.result() for r, f in futures.items()}


def _device_of(group) -> str:
    import torch.distributed as dist

    nccl = getattr(dist, "ProcessGroupNCCL", None)
    return "cuda" if nccl is not None and isinstance(group, nccl) else "cpu"


def _bcast(group, t: torch.Tensor):
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([t], opts)


def _allreduce(group, value: int, op) -> int:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=_device_of(group))
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    group.allreduce([t], opts).wait()
    return int(t.item())


class TransferStats:
    """What one sender has moved: ``wire_bytes`` (payloads), ``raw_bytes`` (the same buckets whole),
    ``versions``, ``delta_versions``, ``repairs`` (versions sent again in full after a receiver's
    checksum failed), ``last``: the last version's ``{"wire_bytes", "raw_bytes", "mode", "seconds"}``."""

    def __init__(self):
        self.wire_bytes = self.raw_bytes = self.versions = self.delta_versions = self.repairs = 0
        self.last: dict = {}


class _Link:
    """One receiving group of a :class:`BucketSender`'s version: its posted operations (at most
    ``2 * window`` in flight), the mode it gets and the error that dropped it (a dead peer)."""

    def __init__(self, group, index: int):
        self.group, self.index = group, index
        self.pending: deque = deque()  # one entry per bucket (and the header): its [(work, tensor kept alive)]
        self._open: list = []
        self.error: BaseException | None = None
        self.use_delta = False
        self.wire = 0

    @property
    def live(self) -> bool:
        return self.error is None

    def post(self, work, keep) -> None:
        self._open.append((work, keep))

    def wait_to(self, n: int) -> None:
        """Close the bucket being posted; wait until at most ``n`` buckets are in flight. A failure
        drops the link."""
        if self._open:
            self.pending.append(self._open)
            self._open = []
        try:
            while len(self.pending) > n:
                for work, _ in self.pending.popleft():
                    work.wait()
        except Exception as e:  # noqa: BLE001 - a receiver died or timed out: only this link stops
            self.fail(e)

    def fail(self, e: BaseException) -> None:
        if self.error is None:
            self.error = e
        self.pending.clear()
        self._open = []


def _allreduce_links(links: list[_Link], value: int, op) -> list[int | None]:
    """One int64 all-reduce on every live link at once (posted first, then waited on): the result
    per link, ``None`` for a link that failed (and is dropped)."""
    import torch.distributed as dist

    posted = []
    for link in links:
        if not link.live:
            posted.append(None)
            continue
        t = torch.tensor([value], dtype=torch.int64, device=_device_of(link.group))
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        try:
            posted.append((link.group.allreduce([t], opts), t))
        except Exception as e:  # noqa: BLE001
            link.fail(e)
            posted.append(None)
    out: list[int | None] = []
    for link, p in zip(links, posted):
        if p is None or not link.live:
            out.append(None)
            continue
        try:
            p[0].wait()
            out.append(int(p[1].item()))
        except Exception as e:  # noqa: BLE001
            link.fail(e)
            out.append(None)
    return out


class BucketSender:
    """One trainer rank's end of its group (``join_transfer_groups(..., source=r)``).

    ``send(version, regions, tensors)``: ``regions`` the :class:`Piece` s this rank owns (unsplit),
    ``tensors`` their data in the same order (any float dtype, cast / quantized here; consumed lazily,
    so a gather behind it runs while earlier buckets are on the wire). ``delta``: keep every bucket's
    raw bytes as the next version's base and send xor + zstd when every receiver holds it.

    ``send(..., groups=[...])``: this version goes to several groups (a pool: one two-rank group per
    server, ``pool_broadcast``), each bucket packed once and posted to every group. Each group is a
    link of its own: it gets the delta or the full version by what its receivers hold, a failed
    checksum is repaired on it alone, and a group whose receiver dies or times out is dropped
    (``failed``: its index -> the error) while the others go on. With the sender's own group
    (``groups`` left out) a failure raises."""

    def __init__(self, group, *, bucket_bytes: int, delta: bool = False, full_every: int = 10, window: int = 2):
        self.group, self.bucket_bytes, self.delta, self.full_every = group, int(bucket_bytes), delta, full_every
        self.window = max(1, window)
        self.prev_version: int | None = None
        self._base: list[np.ndarray] | None = None
        self._layout: list | None = None
        self.stats = TransferStats()
        self.failed: dict[int, BaseException] = {}
        self.corrupt_hook = None  # tests: (bucket index, payload bytes) -> payload bytes on the wire

    def _post_header(self, link: _Link, version: int, mode: int, layout_json: list) -> None:
        raw = header_bytes({"version": int(version), "mode": mode, "delta": self.delta, "layout": layout_json})
        dev = _device_of(link.group)
        for t in (torch.tensor([len(raw)], dtype=torch.int64, device=dev),
                  torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(dev)):
            self._post_one(link, t)

    def _post_one(self, link: _Link, t: torch.Tensor) -> None:
        if not link.live:
            return
        try:
            link.post(_bcast(link.group, t), t)
        except Exception as e:  # noqa: BLE001 - the group is broken: this link stops
            link.fail(e)

    def _post(self, link: _Link, kind: int, payload: torch.Tensor, crc: int, raw_n: int) -> None:
        dev = _device_of(link.group)
        self._post_one(link, torch.tensor([kind, payload.numel(), crc, raw_n], dtype=torch.int64, device=dev))
        self._post_one(link, payload if payload.device.type == dev else payload.to(dev))
        link.wait_to(self.window)

    def _post_pieces(self, link: _Link, wires: list[torch.Tensor], raw_n: int) -> None:
        """A :data:`PIECES` bucket: its meta, then every piece's messages (``piece_wire``), no packing."""
        dev = _device_of(link.group)
        self._post_one(link, torch.tensor([PIECES, raw_n, 0, raw_n], dtype=torch.int64, device=dev))
        for w in wires:
            if w.numel():
                self._post_one(link, w)
        link.wait_to(self.window)

    def send(self, version: int, regions: list[Piece], tensors: Iterable[torch.Tensor], *,
             groups: list | None = None) -> dict:
        import torch.distributed as dist

        t0 = time.perf_counter()
        single = groups is None
        links = [_Link(g, i) for i, g in enumerate([self.group] if single else groups)]
        subs = [(s, r_i) for r_i, r in enumerate(regions) for s in split_pieces(r, self.bucket_bytes)]
        buckets = plan_buckets([s for s, _ in subs], self.bucket_bytes)
        layout = layout_to_json(buckets)
        held = _allreduce_links(links, _NO_VERSION, dist.ReduceOp.MIN)
        can_delta = (self.delta and self.prev_version is not None and layout == self._layout
                     and self.stats.versions % self.full_every != 0)
        for link, h in zip(links, held):
            link.use_delta = can_delta and h == self.prev_version
            self._post_header(link, version, DELTA if link.use_delta else FULL, layout)
        raw_total = 0
        bases: list[np.ndarray] = []
        pieces = self._piece_tensors(regions, subs, tensors)
        for i, bucket in enumerate(buckets):
            if not any(link.live for link in links):  # nobody to send to: take the rest without packing it
                for _ in pieces:
                    pass
                break
            data = [next(pieces)[1] for _ in bucket]
            if not self.delta and self.corrupt_hook is None:  # each piece as itself: no packing copy
                raw_n = wire_bytes(bucket)
                wires = [w for (p, _), t in zip(bucket, data) for w in piece_wire(p, t, self.device_for(links))]
                for link in links:
                    if link.live:
                        link.wire += raw_n
                        self._post_pieces(link, wires, raw_n)
                raw_total += raw_n
                continue
            buf = encode_bucket(bucket, data, device=self.device_for(links))
            raw = buf.cpu().numpy() if (self.delta or self.corrupt_hook) else None
            crc = checksum(raw) if self.delta else 0
            if self.delta:
                bases.append(raw)
            delta_payload = None
            for link in links:
                if not link.live:
                    continue
                if link.use_delta:
                    if delta_payload is None:
                        delta_payload = torch.frombuffer(bytearray(encode_delta(raw, self._base[i])), dtype=torch.uint8)
                    payload = delta_payload
                else:
                    payload = buf
                if self.corrupt_hook is not None:
                    payload = torch.frombuffer(bytearray(self.corrupt_hook(i, payload.cpu().numpy().tobytes())),
                                               dtype=torch.uint8)
                link.wire += payload.numel()
                self._post(link, DELTA if link.use_delta else FULL, payload, crc, buf.numel())
            raw_total += buf.numel()
        else:
            if next(pieces, None) is not None:
                raise ValueError("BucketSender.send: more tensors than regions")
        for link in links:
            link.wait_to(0)
        bad = _allreduce_links(links, 0, dist.ReduceOp.SUM)
        modes = []
        for link, b in zip(links, bad):
            if not link.live:
                continue
            mode = "delta" if link.use_delta else "full"
            if b:
                if not self.delta:
                    link.fail(RuntimeError(f"weights version {version}: {b} bucket(s) failed at the receivers"))
                    continue
                self.stats.repairs += 1
                log.warning("weights version %d: %d bucket(s) failed their checksum at a receiver: sent again in full",
                            version, b)
                try:
                    link.wire += self._resend_full(link, version, buckets, bases)
                except Exception as e:  # noqa: BLE001
                    link.fail(e)
                    continue
                mode = "delta+repair"
            modes.append(mode)
        self.failed = {link.index: link.error for link in links if not link.live}
        if single and self.failed:
            raise self.failed[0]
        self.prev_version, self._layout = version, layout
        self._base = bases if self.delta else None
        self.stats.versions += 1
        self.stats.delta_versions += any(link.use_delta and link.live for link in links)
        wire = sum(link.wire for link in links)
        raw_sent = raw_total * len(links)
        self.stats.wire_bytes += wire
        self.stats.raw_bytes += raw_sent
        self.stats.last = {"wire_bytes": wire, "raw_bytes": raw_sent,
                           "mode": modes[0] if len(set(modes)) == 1 else "+".join(sorted(set(modes))) or "failed",
                           "seconds": time.perf_counter() - t0}
        return self.stats.last

    @staticmethod
    def device_for(links: list[_Link]) -> str:
        """Where a bucket is packed: the links' device (CUDA when the groups are NCCL)."""
        return _device_of(links[0].group) if links else "cpu"

    def _piece_tensors(self, regions, subs, tensors) -> Iterator[tuple[Piece, torch.Tensor]]:
        """The split pieces' data, each a dim-0 slice of its region's tensor."""
        it = iter(tensors)
        cur_i, cur = -1, None
        for sub, r_i in subs:
            while cur_i < r_i:
                cur, cur_i = next(it), cur_i + 1
            start = sub.offset[0] - regions[r_i].offset[0] if sub.size else 0
            yield sub, (cur[start:start + sub.size[0]] if sub.size and sub.size != regions[r_i].size else cur)
        for extra in it:
            yield None, extra

    def _resend_full(self, link: _Link, version: int, buckets, bases: list[np.ndarray]) -> int:
        import torch.distributed as dist

        _allreduce(link.group, _NO_VERSION, dist.ReduceOp.MIN)
        self._post_header(link, version, FULL, layout_to_json(buckets))
        for raw in bases:
            self._post(link, FULL, torch.from_numpy(raw), checksum(raw), raw.nbytes)
        link.wait_to(0)
        if link.error is not None:
            raise link.error
        bad = _allreduce(link.group, 0, dist.ReduceOp.SUM)
        if bad:
            raise RuntimeError(f"weights version {version}: the full resend failed its checksum at a receiver too")
        return sum(b.nbytes for b in bases)

    def close(self, groups: list | None = None) -> None:
        """Tell the receivers no version follows (the header of version -1)."""
        import torch.distributed as dist

        links = [_Link(g, i) for i, g in enumerate([self.group] if groups is None else groups)]
        _allreduce_links(links, _NO_VERSION, dist.ReduceOp.MIN)
        for link in links:
            self._post_header(link, END_OF_UPDATES, FULL, [])
            link.wait_to(0)
        if groups is None and links[0].error is not None:
            raise links[0].error
