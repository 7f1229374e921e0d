"""Both ends of the trainer -> inference weight transfer, below the channels.

Sending (trainer rank 0; used by the channels of ``weight_channels``):

- :class:`BroadcastWeightSender`: rank 0 of a ``torch.distributed`` group of its own with the
  receivers (``weight_broadcast``'s wire protocol), optionally asking a vLLM-protocol server to
  receive over ``POST /collective_rpc``; every step bounded by a timeout, a receiver that is gone
  makes the send raise :class:`WeightSyncError`, never hang.

Receiving: the orchestrator's ``WeightVersions`` (``versions()``, ``wait_version(min_version, *,
timeout, alive=None)``, ``close()``, ``alive``), made by the backend (``InferenceBackend.weight_receiver``):

- :class:`FileWeightVersions`: the ``STABLE`` markers the trainer writes in ``output_dir``;
- :class:`EngineWeightReceiver`: the embedded engine's end of the trainer's broadcast (a thread in
  the orchestrator process that receives every version and hands it to the engine);
- :class:`ServerWeightVersions`: the versions vLLM-protocol servers report holding, for broadcasts
  to servers on other nodes (no directory shared with the trainer).

Every wait names the trainer's node (``PRIMERL_TRAINER_NODE``) when it gives up.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ..config import VLLMConfig
from ..transport import ENGINE_HOST_ENV, TRAINER_NODE_ENV, FileTransport

log = logging.getLogger("primerl.weight_sync")


class WeightSyncError(RuntimeError):
    pass



def engine_broadcast_host() -> str:
    """Where the embedded engine's weight group meets (``inference.broadcast_port``): the node of
    the orchestrator, whose receiver hosts the group's store. That node is one known address in the
    plan, where trainer rank 0 may sit on any trainer node (c10d numbers the nodes by address)."""
    return os.environ.get(ENGINE_HOST_ENV, "127.0.0.1")


def _where(env: str, default: str) -> str:
    return os.environ.get(env) or default


class BroadcastWeightSender:
    """Trainer rank 0's end of the broadcast group (rank 0; receivers are ranks 1..n).

    With ``rpc_url`` (a vLLM server started with the worker extension), joining and every update
    are also requested from the server by ``POST /collective_rpc`` in a background thread while
    this side broadcasts; without it the receivers call ``receive_update`` in a loop themselves."""

    def __init__(self, host: str, port: int, num_receivers: int, *, timeout_s: float = 300.0,
                 rpc_url: str | None = None, backend: str | None = None, peer: str = "a receiver",
                 store_rank: int = 0):
        if num_receivers < 1:
            raise ValueError(f"num_receivers must be >= 1, got {num_receivers}")
        self.host, self.port, self.num_receivers, self.backend = host, port, num_receivers, backend
        self.timeout_s, self.rpc_url = timeout_s, rpc_url.rstrip("/") if rpc_url else None
        self.group, self.peer = None, peer  # peer: who receives, for the errors
        self.store_rank = store_rank  # who hosts the group's store at host:port (0: this side)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weight-rpc") if self.rpc_url else None

    @classmethod
    def from_config(cls, v: VLLMConfig) -> "BroadcastWeightSender":
        n = v.broadcast_receivers or v.data_parallel * v.tensor_parallel
        return cls(v.broadcast_host, v.broadcast_port, n, timeout_s=v.broadcast_timeout_s,
                   rpc_url=v.url if v.broadcast_rpc else None)

    def _rpc(self, method: str, *args, version: int | None = None):
        """``POST /collective_rpc`` in the background; for an update, every worker must answer
        ``version`` (a worker whose load failed raises, HTTP 500), then the prefix cache is reset."""
        from .vllm_client import InferenceServerError, http_json, rpc_versions, reset_prefix_cache

        if self._pool is None:
            return None
        t = self.timeout_s
        url = self.rpc_url

        def call():
            out = http_json(url + "/collective_rpc", {"method": method, "args": list(args)}, t)
            if version is not None:
                got = rpc_versions(out)
                if not got or any(v != version for v in got):
                    raise InferenceServerError(f"the workers report weights versions {got}, expected {version}")
                reset_prefix_cache(url, t)
            return out

        return self._pool.submit(call)

    def _finish(self, fut, what: str) -> None:
        if fut is None:
            return
        try:
            fut.result(self.timeout_s)
        except Exception as e:  # noqa: BLE001
            raise WeightSyncError(f"{what}: the inference server did not confirm ({e})") from e

    def connect(self) -> "BroadcastWeightSender":
        from .weight_broadcast import new_group

        if self.rpc_url:  # the trainer may come up before the server: wait for it (bounded)
            from ..transport import wait_for
            from .vllm_client import InferenceServerError, http_json

            def healthy():
                try:
                    http_json(self.rpc_url + "/health", None, timeout=5)
                    return True
                except InferenceServerError:
                    return False

            try:
                wait_for(healthy, timeout=self.timeout_s, what=f"the inference server at {self.rpc_url}", poll=0.2,
                         max_poll=1.0)
            except TimeoutError as e:
                raise WeightSyncError(str(e)) from e
        fut = self._rpc("init_broadcast", self.host, self.port, 1, self.num_receivers + 1, self.timeout_s)
        try:
            self.group = new_group(self.host, self.port, 0, self.num_receivers + 1, timeout_s=self.timeout_s,
                                   backend=self.backend, store_rank=self.store_rank)
        except Exception as e:  # noqa: BLE001 (the store raises a bare RuntimeError/DistNetworkError on timeout)
            raise WeightSyncError(f"weight broadcast group at {self.host}:{self.port}: {self.num_receivers} "
                                  f"receiver(s) ({self.peer}) did not join within {self.timeout_s} s ({e})") from e
        self._finish(fut, "joining the weight broadcast group")
        return self

    def send(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Broadcast ``tensors`` as ``version`` (joining the group first if needed)."""
        from .weight_broadcast import weight_specs

        self.send_stream(version, weight_specs(tensors), tensors.items())

    def send_stream(self, version: int, specs: list, tensors) -> None:
        """Broadcast ``version`` from a stream: ``specs`` (``[(name, dtype, shape)]``) in the header,
        then each ``(name, tensor)`` of ``tensors`` as it arrives (``weight_broadcast.send_update_stream``).
        Raises :class:`WeightSyncError` naming the receivers when they die or time out."""
        from .weight_broadcast import send_update_stream

        if self.group is None:
            self.connect()
        fut = self._rpc("update_weights_from_broadcast", version=version)
        try:
            send_update_stream(self.group, version, specs, tensors)
        except Exception as e:  # noqa: BLE001
            raise WeightSyncError(f"broadcast of weights version {version} failed ({self.peer} died or timed out "
                                  f"after {self.timeout_s} s): {e}") from e
        self._finish(fut, f"weights version {version}")

    def close(self, *, goodbye: bool = False) -> None:
        """``goodbye``: first tell receivers that loop on :func:`receive_update` that no version
        follows (version -1), so they stop instead of waiting out the timeout."""
        if goodbye and self.group is not None:
            from .weight_broadcast import send_update

            try:
                send_update(self.group, END_OF_UPDATES, {})
            except Exception as e:  # noqa: BLE001 - a receiver that is already gone
                log.warning("weight broadcast: the end-of-updates message failed: %s", e)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if goodbye:
            _shutdown(self.group)
        self.group = None


END_OF_UPDATES = -1  # the version of the goodbye message


def _shutdown(group) -> None:
    """Leave a process group made by ``vllm_worker.new_group`` in order (its worker threads joined
    now, not in a destructor at the process's exit)."""
    if group is None:
        return
    try:
        group.shutdown()
    except Exception as e:  # noqa: BLE001 - a peer already gone: nothing left to tell it
        log.debug("weight broadcast: shutting the group down: %s", e)


class EngineWeightReceiver:
    """The embedded engine's end of the trainer's weight broadcast (rank 1 of a two-rank group,
    trainer rank 0 is rank 0): a daemon thread receives every version into fresh tensors on
    ``device`` and keeps them until :meth:`take` hands one over. It hosts the group's store at
    ``host:port`` (this process's node), and is the orchestrator's ``WeightVersions`` ("a new
    version exists": :meth:`versions`, :meth:`wait_version`): nothing of
    the weights goes through ``output_dir``, so the orchestrator may run on a node of its own.

    On a GPU the thread runs on a CUDA stream of its own: a broadcast it waits for must not hold
    up the engine's kernels on the default stream (the trainer only sends the next version after
    training on what the engine is generating)."""

    def __init__(self, host: str, port: int, *, backend: str, device: torch.device, timeout_s: float = 300.0):
        import threading

        self.host, self.port, self.backend, self.device, self.timeout_s = host, port, backend, device, timeout_s
        self._cv = threading.Condition()
        self._got: dict[int, dict[str, torch.Tensor]] = {}
        self._error: BaseException | None = None
        self._ended = self._draining = False
        self.last_version: int | None = None
        self._thread = threading.Thread(target=self._run, name="weight-receiver", daemon=True)

    def start(self) -> "EngineWeightReceiver":
        self._thread.start()
        return self

    def _join(self):
        """This receiver's group(s) (``_receive`` takes them; ``_leave`` shuts them)."""
        from .weight_broadcast import new_group

        return new_group(self.host, self.port, 1, 2, timeout_s=self.timeout_s, backend=self.backend, store_rank=1)

    def _receive(self, group) -> tuple[int, dict]:
        from .weight_broadcast import receive_update

        return receive_update(group, self.device)

    def _leave(self, group) -> None:
        _shutdown(group)

    def _run(self) -> None:
        group = None
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                torch.cuda.set_stream(torch.cuda.Stream(self.device))  # this thread's current stream
            group = self._join()
            while True:
                version, weights = self._receive(group)
                if version == END_OF_UPDATES:
                    break
                if self.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()  # the tensors are complete before the hand-over
                with self._cv:
                    self.last_version = version
                    if not self._draining:  # after close(): received (the trainer's send completes), not kept
                        self._got[version] = dict(weights)
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - reported by take() and close()
            with self._cv:
                self._error = e
                self._cv.notify_all()
            return
        finally:
            self._leave(group)
        with self._cv:
            self._ended = True
            self._cv.notify_all()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def close(self, timeout: float | None = None) -> None:
        """The job's end: receive (and drop) every version the trainer still sends until its
        end-of-updates message, then leave the group. The trainer sends each version (the last is
        ``max_steps``) whether or not the engine needs it, so the receiver must stay until the
        goodbye: gone earlier, the trainer's send fails; and a process that exits while this thread
        waits in a collective aborts (a joinable C++ thread destroyed at exit).

        Raises :class:`WeightSyncError` when the trainer neither says goodbye nor fails within
        ``timeout`` (default: the receiver's own timeout, plus a margin)."""
        timeout = self.timeout_s + 30.0 if timeout is None else timeout
        with self._cv:
            self._draining = True
            self._got.clear()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise WeightSyncError(f"weight broadcast: the trainer sent no end-of-updates message within {timeout} s "
                                  f"(last version received: {self.last_version})")
        if self._error is not None:
            raise WeightSyncError(f"weight broadcast: the receiver failed after version {self.last_version} "
                                  f"before the trainer's end-of-updates message: {self._error!r}") from self._error
        log.info("weight broadcast: the trainer ended its updates after version %s", self.last_version)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def versions(self) -> list[int]:
        """The versions received and not yet taken (or dropped), oldest first."""
        with self._cv:
            return sorted(self._got)

    def wait_version(self, min_version: int, *, timeout: float, alive=None) -> int:
        """Wait until a version >= ``min_version`` has arrived; return the newest received.
        Raises :class:`WeightSyncError` (naming the trainer's node) when the receiver failed (the
        trainer died: its connection closed), the trainer ended its updates, ``alive()`` turned
        False, or nothing came within ``timeout``."""
        import time

        deadline = time.monotonic() + timeout
        arrived = lambda: self.last_version is not None and self.last_version >= min_version  # noqa: E731
        with self._cv:
            while not (arrived() or self._error is not None or self._ended):
                left = deadline - time.monotonic()
                if left <= 0 or (alive is not None and not alive()):
                    break
                self._cv.wait(min(left, 0.5))
            if arrived():
                return self.last_version
            trainer = _where(TRAINER_NODE_ENV, "the trainer")
            why = (f"the receiver failed: {self._error!r}" if self._error is not None else
                   f"{trainer} ended its updates" if self._ended else
                   f"{trainer} is no longer running" if alive is not None and not alive() else
                   f"nothing arrived within {timeout:.0f} s")
            raise WeightSyncError(f"weights version >= {min_version} by broadcast from {trainer} (rank 0) to "
                                  f"{self.host}:{self.port}: {why} (last version received: {self.last_version})")

    def take(self, version: int, timeout: float | None = None) -> dict[str, torch.Tensor]:
        """The tensors of ``version`` (dropping any older version still held); waits for them."""
        timeout = self.timeout_s if timeout is None else timeout
        with self._cv:
            self._cv.wait_for(lambda: version in self._got or self._error is not None or self._ended, timeout)
            if version not in self._got:
                why = (f"the receiver failed: {self._error!r}" if self._error is not None else
                       "the trainer ended its updates" if self._ended else f"not received within {timeout} s")
                raise WeightSyncError(f"weights version {version} by broadcast from the trainer: {why}")
            weights = self._got.pop(version)
            for v in [v for v in self._got if v < version]:
                del self._got[v]
            return weights


class ServerWeightVersions:
    """The orchestrator's ``WeightVersions`` when trainer
    rank 0 broadcasts to inference servers (``inference.vllm.weight_update = "broadcast"``) on
    other nodes: the version every server's workers hold (``weights_version``), asked over HTTP,
    instead of the marker the trainer writes in its own ``output_dir``."""

    def __init__(self, client, poll_s: float = 0.2):
        self.client, self.poll_s = client, poll_s

    def versions(self) -> list[int]:
        from .vllm_client import InferenceServerError

        try:
            got = self.client.server_versions()
        except InferenceServerError:  # not up yet (the orchestrator may start first); a dead one times the wait out
            return []
        return [min(got)] if got and all(v is not None and v >= 0 for v in got) else []

    def wait_version(self, min_version: int, *, timeout: float, alive=None) -> int:
        import time

        deadline = time.monotonic() + timeout
        while True:
            held = self.versions()
            if held and held[0] >= min_version:
                return held[0]
            if alive is not None and not alive():
                raise WeightSyncError(f"weights version >= {min_version} on {self.client.url}: "
                                      f"{_where(TRAINER_NODE_ENV, 'the trainer')} is no longer running")
            if time.monotonic() > deadline:
                raise WeightSyncError(f"weights version >= {min_version}: the inference server at {self.client.url} "
                                      f"holds {held or 'none'} after {timeout:.0f} s (the trainer's broadcast from "
                                      f"{_where(TRAINER_NODE_ENV, 'the trainer')} did not arrive)")
            time.sleep(self.poll_s)

    @property
    def alive(self) -> bool:
        """No thread of its own: nothing that a process exit could interrupt."""
        return False

    def close(self, timeout: float | None = None) -> None:
        """Nothing held (the client's connections are the client's)."""


class FileWeightVersions:
    """The orchestrator's ``WeightVersions`` from the files the trainer publishes: the versions
    whose ``STABLE`` marker exists under ``transport.weights`` (``FileTransport.weight_versions``),
    whether the weights came as files or went by broadcast and the marker followed."""

    def __init__(self, transport: FileTransport):
        self.transport = transport

    def versions(self) -> list[int]:
        return self.transport.weight_versions()

    def wait_version(self, min_version: int, *, timeout: float, alive=None) -> int:
        """The newest version >= ``min_version`` once its marker exists; raises ``TransportTimeout``
        after ``timeout`` s, ``ProducerDied`` once ``alive()`` is False."""
        return self.transport.wait_weights(min_version, timeout=timeout, alive=alive)

    @property
    def alive(self) -> bool:
        return False

    def close(self, timeout: float | None = None) -> None:
        """Files hold nothing open."""
