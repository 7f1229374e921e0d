"""The receiving end of the bucketed weight transfer (issue 42; the protocol and the sender are
``weight_transfer``'s).

- :class:`SourceReceiver`: a receiver's end of one source's group (one trainer rank's), the raw
  buckets of the version it holds kept as the next delta's base;
- :func:`receive_version`: every source's receiver (a thread each) into one version: full tensors of
  the global shapes in the engine's dtype; the sources must agree on the version and cover every
  element of every tensor, or nothing is handed over;
- :class:`PairReceiver`: a pool server's end of its own two-rank group with trainer rank 0
  (``pool_broadcast``), driven by ``/collective_rpc``;
- :func:`bucketed_engine_receiver`: the embedded engine's receiver in the orchestrator's process.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .weight_buckets import (
    DELTA, PIECES, DeltaDecodeError, Piece, checksum, contiguous_in_full, decode_bucket, decode_delta, decode_piece,
    layout_from_json
)
from .weight_transfer import END_OF_UPDATES, _allreduce, _bcast, _device_of, join_transfer_groups

log = logging.getLogger("primerl.weight_sync")

__all__ = ["PairReceiver", "SourceReceiver", "bucketed_engine_receiver", "receive_version"]


class _Assembly:
    """The full tensors of one version, filled region by region from every source."""

    def __init__(self, device):
        self.device, self.tensors, self.filled = device, {}, {}
        self._lock = threading.Lock()

    def region(self, p: Piece) -> torch.Tensor:
        """``p``'s region of its full tensor (allocated at its first piece), a view to fill."""
        with self._lock:
            full = self.tensors.get(p.name)
            if full is None:
                full = self.tensors[p.name] = torch.empty(p.shape, dtype=getattr(torch, p.dtype), device=self.device)
        return full[p.index]

    def put(self, p: Piece, region: torch.Tensor) -> None:
        self.region(p).copy_(region)

    def count(self, counts: dict) -> None:
        with self._lock:
            for k, n in counts.items():
                self.filled[k] = self.filled.get(k, 0) + n

    def check(self, version: int) -> None:
        short = [f"{k} ({self.filled.get(k, 0)}/{t.numel()} elements)" for k, t in self.tensors.items()
                 if self.filled.get(k, 0) != t.numel()]
        if short:
            raise RuntimeError(f"weights version {version}: the sources did not cover {short[:5]}: not loaded")


class SourceReceiver:
    """A receiver's end of one source's group: keeps the raw buckets of the version it holds (the
    base of the next delta) when the sender sends deltas. ``corrupt``: buckets that failed their
    checksum (each repaired by a full resend, never loaded)."""

    def __init__(self, group, source: int):
        self.group, self.source, self.device = group, source, _device_of(group)
        self.held = -1
        self._base: list[np.ndarray] = []
        self.corrupt = 0

    def _recv(self, n: int, dtype=torch.uint8) -> torch.Tensor:
        t = torch.empty(n, dtype=dtype, device=self.device)
        _bcast(self.group, t).wait()
        return t

    def _recv_piece(self, p: Piece, out: "_Assembly | None") -> None:
        """One piece of a :data:`PIECES` bucket: straight into its region of the assembled tensor when
        that is contiguous there (raw pieces), else through a buffer (FP8: dequantized); ``out`` None:
        received and dropped."""
        if out is not None and not p.fp8 and contiguous_in_full(p):
            dst = out.region(p)
            if dst.numel():
                _bcast(self.group, dst.reshape(-1).view(torch.uint8)).wait()
            return
        buf = torch.empty(p.nbytes, dtype=torch.uint8, device=self.device)
        parts = (buf[:p.numel], buf[p.numel:]) if p.fp8 else (buf,)
        for part in parts:
            if part.numel():
                _bcast(self.group, part).wait()
        if out is not None:
            out.put(p, decode_piece(p, buf))

    def receive(self, out: _Assembly) -> int:
        """One version from this source into ``out``; returns it (-1: the end of updates)."""
        import json

        import torch.distributed as dist

        while True:
            _allreduce(self.group, self.held, dist.ReduceOp.MIN)
            n = int(self._recv(1, torch.int64).item())
            head = json.loads(bytes(self._recv(n).cpu().numpy()))
            version = int(head["version"])
            if version == END_OF_UPDATES:
                return version
            keep = bool(head["delta"])
            bad, bases, counts = 0, [], {}
            for i, bucket in enumerate(layout_from_json(head["layout"])):
                kind, wire_n, crc, raw_n = (int(x) for x in self._recv(4, torch.int64).cpu())
                if kind == PIECES:
                    for p, _ in bucket:
                        self._recv_piece(p, None if bad else out)
                        counts[p.name] = counts.get(p.name, 0) + p.numel
                    continue
                payload = self._recv(wire_n)
                if bad:
                    continue
                try:
                    if kind == DELTA:
                        if i >= len(self._base):
                            raise DeltaDecodeError(f"delta for bucket {i}, but no base is held")
                        raw = decode_delta(payload.cpu().numpy(), self._base[i], crc)
                        buf = torch.from_numpy(raw).to(self.device)
                    else:
                        buf = payload
                        if keep:
                            raw = payload.cpu().numpy()
                            if checksum(raw) != crc:
                                raise DeltaDecodeError(f"bucket {i}: checksum mismatch")
                    if buf.numel() != raw_n:
                        raise DeltaDecodeError(f"bucket {i}: {buf.numel()} bytes, the sender says {raw_n}")
                except DeltaDecodeError as e:
                    log.warning("weights version %d from source %d: %s (not loaded; asking for a full resend)",
                                version, self.source, e)
                    bad = 1
                    continue
                if keep:
                    bases.append(raw)
                for p, region in decode_bucket(bucket, buf):
                    out.put(p, region)
                    counts[p.name] = counts.get(p.name, 0) + p.numel
            failed = _allreduce(self.group, bad, dist.ReduceOp.SUM)
            if bad:
                self.corrupt += 1
                self.held, self._base = -1, []
            elif not failed:
                self.held, self._base = version, bases
                out.count(counts)
                return version
            else:  # another receiver failed: the same version comes again in full
                self.held, self._base = -1, []


def receive_version(receivers: list[SourceReceiver], device, pool: ThreadPoolExecutor | None = None):
    """``(version, {name: full tensor})`` from every source (one thread each), or ``(-1, {})`` at
    the end of updates. Raises when the sources disagree on the version or leave elements out."""
    out = _Assembly(device)
    if len(receivers) == 1:
        versions = [receivers[0].receive(out)]
    else:
        own = pool is None
        pool = pool or ThreadPoolExecutor(len(receivers), thread_name_prefix="weight-source")
        try:
            versions = [f.result() for f in [pool.submit(r.receive, out) for r in receivers]]
        finally:
            if own:
                pool.shutdown()
    if len(set(versions)) != 1:
        raise RuntimeError(f"weight transfer: the sources sent versions {versions}: not loaded")
    version = versions[0]
    if version == END_OF_UPDATES:
        return version, {}
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.current_stream().synchronize()
    out.check(version)
    return version, out.tensors


class PairReceiver:
    """A server's end of its own two-rank group with trainer rank 0 (rank 1; ``pool_broadcast``: one
    group per server of a pool), speaking this module's protocol. ``join()`` and ``receive(load)``
    return futures run one at a time on a thread of this receiver; ``load(version, {name: tensor})``
    installs a received version. The :class:`SourceReceiver` lives as long as the group, so the raw
    buckets of the version it holds are the base of the next delta; a new group (a replaced server)
    holds none and gets the next version in full."""

    def __init__(self, device: torch.device, host: str, port, timeout_s=300.0, prefix=""):
        self.device, self.host, self.port, self.prefix = device, str(host), int(port), str(prefix)
        self.timeout_s = float(timeout_s)
        self.receiver: SourceReceiver | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weight-transfer")

    def join(self):
        from .weight_broadcast import new_group

        def run():
            group = new_group(self.host, self.port, 1, 2, timeout_s=self.timeout_s,
                              backend="nccl" if self.device.type == "cuda" else "gloo", prefix=self.prefix)
            self.receiver = SourceReceiver(group, 0)

        return self._pool.submit(run)

    def receive(self, load):
        def run() -> int:
            if self.receiver is None:
                raise RuntimeError(f"no weight transfer group: joining {self.host}:{self.port} failed or is not done")
            try:
                version, weights = receive_version([self.receiver], self.device)
            except Exception:
                # leave the group: trainer rank 0 then fails on this link at once, not at its timeout
                receiver, self.receiver = self.receiver, None
                try:
                    receiver.group.shutdown()
                except Exception:  # noqa: BLE001 - nothing left to close
                    pass
                raise
            if version == END_OF_UPDATES:
                return version
            load(version, weights)
            return version

        return self._pool.submit(run)


def _engine_receiver_class():
    from .weight_sync import EngineWeightReceiver, _shutdown

    class BucketedEngineReceiver(EngineWeightReceiver):
        """The embedded engine's end of the bucketed transfer: receiver 0 of every source's group
        (it hosts the store), a thread per source; each version is assembled into fresh tensors
        while the engine serves the previous one, handed over whole (``take``), never mixed."""

        def __init__(self, host: str, port: int, *, sources: int, backend: str, device: torch.device,
                     timeout_s: float = 300.0):
            super().__init__(host, port, backend=backend, device=device, timeout_s=timeout_s)
            self.sources = sources
            self.receivers: list[SourceReceiver] = []
            self._pool = ThreadPoolExecutor(sources, thread_name_prefix="weight-source") if sources > 1 else None

        def _join(self):
            groups = join_transfer_groups(self.host, self.port, sources=self.sources, receivers=1, receiver=0,
                                          store_master=True, timeout_s=self.timeout_s, backend=self.backend)
            self.receivers = [SourceReceiver(groups[r], r) for r in range(self.sources)]
            return groups

        def _receive(self, groups) -> tuple[int, dict]:
            return receive_version(self.receivers, self.device, self._pool)

        def _leave(self, groups) -> None:
            for g in (groups or {}).values():
                _shutdown(g)
            if self._pool is not None:
                self._pool.shutdown(wait=False)

        @property
        def corrupt(self) -> int:
            """Buckets that failed their checksum (each repaired by a full resend, none loaded)."""
            return sum(r.corrupt for r in self.receivers)

    return BucketedEngineReceiver


def bucketed_engine_receiver(host: str, port: int, *, sources: int, backend: str, device, timeout_s: float = 300.0):
    """A started ``BucketedEngineReceiver`` (an ``EngineWeightReceiver`` over the bucketed transfer)."""
    return _engine_receiver_class()(host, port, sources=sources, backend=backend, device=torch.device(device),
                                    timeout_s=timeout_s).start()
