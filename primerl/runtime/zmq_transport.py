"""Rollout batches over TCP (ZeroMQ), so the trainer nodes need no filesystem shared with the
orchestrator (``orchestrator.batch_transport = "zmq"``).

ZeroMQ (pyzmq) because it is what the reference framework uses by default for this hop (its
users found a shared disk slow across nodes), it needs no broker process, and its ROUTER/DEALER
pair gives the pull-based flow wanted here: the orchestrator binds one ROUTER socket
(``tcp://*:orchestrator.zmq_port``); each trainer data rank connects a DEALER and asks for
``(step, rank)``; the orchestrator answers with that rank's micro-batches only, once, as soon as
they exist. Nothing is sent before a rank asks, and the orchestrator holds at most
``max_async_level + 1`` steps of batches (it waits for weights before sampling further), so a
slow trainer cannot flood memory. A rank confirms each batch it received; the orchestrator's
process leaves only once every batch is confirmed (:meth:`ZmqTransport.wait_taken`).

A trainer rank watches its connection (a ZeroMQ socket monitor): once the orchestrator's end has
closed (its process exited or was killed; the kernel closes its sockets) and no reconnect
succeeds within ``LOST_AFTER_S``, a rank waiting for a batch raises ``ProducerDied`` naming the
orchestrator's node (``transport.ORCHESTRATOR_NODE_ENV``, set by ``primerl node``) at once,
instead of waiting out ``trainer.batch_timeout_s``.

Weights, metrics and checkpoints still go through ``FileTransport`` (this class subclasses it
and replaces only the batch methods); with the embedded engine's broadcast
(``inference.weight_update``), weights and their versions go over the network too.
"""

from __future__ import annotations

import io
import os
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .launch.kinds import get_launcher
from .transport import ORCHESTRATOR_NODE_ENV, FileTransport, ProducerDied, TransportTimeout

__all__ = ["ZmqTransport", "make_transport"]

_KEY = struct.Struct("!qq")  # (step, rank)
LOST_AFTER_S = 3.0  # disconnected this long without a reconnect: the orchestrator is gone (a blip reconnects)


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    import torch

    torch.save(obj, buf)
    return buf.getvalue()


class ZmqTransport(FileTransport):
    """``side = "orchestrator"``: serves ``put_batch`` payloads on ``tcp://*:port``;
    ``side = "trainer"``: ``get_batch`` fetches this rank's from ``tcp://host:port``."""

    def __init__(self, root: str | Path, *, side: str, host: str = "127.0.0.1", port: int = 29620):
        import zmq

        super().__init__(root)
        if side not in ("orchestrator", "trainer"):
            raise ValueError(f"side must be 'orchestrator' or 'trainer', got {side!r}")
        self.side, self.endpoint = side, f"tcp://{host}:{port}"
        self._ctx = zmq.Context.instance()
        self._lock = threading.Lock()
        if side == "orchestrator":
            self._ready: dict[tuple[int, int], bytes] = {}
            self._waiting: dict[tuple[int, int], bytes] = {}  # (step, rank) -> the asking rank's identity
            self._unacked: set[tuple[int, int]] = set()  # put, not yet confirmed received by its rank
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(f"tcp://*:{port}")
            self._wake_addr = f"inproc://primerl-batches-{id(self)}"
            self._wake_rx = self._ctx.socket(zmq.PAIR)
            self._wake_rx.bind(self._wake_addr)
            self._wake = self._ctx.socket(zmq.PAIR)
            self._wake.connect(self._wake_addr)
            self._stop = False
            self._thread = threading.Thread(target=self._serve, name="batch-server", daemon=True)
            self._thread.start()
        else:
            self._dealer = self._monitor = None
            self._connected, self._lost_since = False, None

    # ---- orchestrator side ----
    def put_batch(self, step: int, rank: int, payload: Any) -> str:
        if self.side != "orchestrator":
            raise RuntimeError("put_batch is the orchestrator's")
        data = _dumps(payload)
        with self._lock:
            self._ready[(step, rank)] = data
            self._unacked.add((step, rank))
            self._wake.send(b"")
        return f"{self.endpoint} (step {step}, rank {rank})"

    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while not self._stop:
            events = dict(poller.poll(500))
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            if self._router in events:
                while self._router.poll(0):
                    ident, _, key, *ack = self._router.recv_multipart()
                    with self._lock:
                        if ack:  # the rank has the batch (see get_batch)
                            self._unacked.discard(_KEY.unpack(key))
                        else:
                            self._waiting[_KEY.unpack(key)] = ident
            with self._lock:
                for k in [k for k in self._waiting if k in self._ready]:
                    self._router.send_multipart([self._waiting.pop(k), b"", _KEY.pack(*k), self._ready.pop(k)],
                                                copy=False)

    def drop_batches_from(self, step: int) -> None:
        super().drop_batches_from(step)
        if self.side == "orchestrator":
            with self._lock:
                for k in [k for k in self._ready if k[0] >= step]:
                    del self._ready[k]
                self._unacked = {k for k in self._unacked if k[0] < step}

    def wait_taken(self, timeout: float) -> None:
        """The orchestrator's end: wait until every batch put has reached its rank (each rank
        confirms receipt), so that exiting cannot drop a batch still in a socket's queue."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                left = sorted(self._unacked)
            if not left:
                return
            if time.monotonic() > deadline:
                raise TransportTimeout(f"timed out after {timeout:.0f} s waiting for the trainer ranks to take the "
                                       f"rollout batches (step, rank) {left} from {self.endpoint}")
            time.sleep(0.02)

    def close(self) -> None:
        if self.side == "orchestrator":
            self._stop = True
            self._thread.join(timeout=5)
            for s in (self._router, self._wake, self._wake_rx):
                s.close(0)
        elif self._dealer is not None:
            self._dealer.disable_monitor()
            self._monitor.close(0)
            self._dealer.close(0)

    # ---- trainer side ----
    def get_batch(self, step: int, rank: int, *, timeout: float, alive: Callable[[], bool] | None = None) -> Any:
        import zmq

        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._monitor = self._dealer.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            self._dealer.connect(self.endpoint)
        self._dealer.send_multipart([b"", _KEY.pack(step, rank)])
        deadline = time.monotonic() + timeout
        while not self._dealer.poll(100):
            if self._peer_lost():
                import os

                who = os.environ.get(ORCHESTRATOR_NODE_ENV) or "the orchestrator"
                raise ProducerDied(f"gave up waiting for the rollout batch of step {step} (rank {rank}): {who} at "
                                   f"{self.endpoint} closed the connection (its process exited or was killed) and "
                                   f"did not come back within {LOST_AFTER_S:g} s")
            if alive is not None and not alive():
                raise ProducerDied(f"gave up waiting for the rollout batch of step {step} (rank {rank}) from "
                                   f"{self.endpoint}: its producer is no longer running")
            if time.monotonic() > deadline:
                raise TransportTimeout(f"timed out after {timeout:.0f} s waiting for the rollout batch of step {step} "
                                       f"(rank {rank}) from the orchestrator at {self.endpoint}")
        _, key, data = self._dealer.recv_multipart()
        if _KEY.unpack(key) != (step, rank):
            raise RuntimeError(f"asked {self.endpoint} for (step, rank) ({step}, {rank}), got {_KEY.unpack(key)}")
        self._dealer.send_multipart([b"", key, b"ack"])  # the orchestrator may leave once every batch is acked
        import torch

        return torch.load(io.BytesIO(data), weights_only=False)

    def _peer_lost(self) -> bool:
        """True once the connection, made before, has been down for ``LOST_AFTER_S``."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._connected, self._lost_since = True, None
            elif event == zmq.EVENT_DISCONNECTED and self._connected:
                self._connected, self._lost_since = False, time.monotonic()
        return self._lost_since is not None and time.monotonic() - self._lost_since > LOST_AFTER_S

    def drop_batches_before(self, step: int) -> None:
        if self.side == "orchestrator":
            super().drop_batches_before(step)


def batch_transport(cfg) -> str:
    """How rollout batches travel: ``orchestrator.batch_transport``, with "auto" resolved to "zmq"
    when the deployment spans nodes (the launcher's ``capabilities.spans_nodes``: no filesystem need
    be shared) and to "filesystem" on one machine (the single-machine default, as fast as before)."""
    t = cfg.orchestrator.batch_transport
    if t == "auto":
        return "zmq" if get_launcher(cfg).capabilities.spans_nodes else "filesystem"
    return t


def make_transport(cfg, root: str | Path, side: str) -> FileTransport:
    """The job's transport for ``side`` ("orchestrator" or "trainer"): files, or rollout batches
    over ZeroMQ (:func:`batch_transport` "zmq", ``zmq_transport.ZmqTransport``)."""
    o = cfg.orchestrator
    if batch_transport(cfg) != "zmq":
        return FileTransport(root)
    host = o.zmq_host or os.environ.get("PRIMERL_BATCH_HOST", "127.0.0.1")  # set by `primerl node` from the plan
    return ZmqTransport(root, side=side, host=host, port=o.zmq_port)
