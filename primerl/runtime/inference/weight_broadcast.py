"""Weights by ``torch.distributed`` broadcast, outside any training process group: the wire
protocol both ends speak, and the receiving end inside ``primerl inference``.

- :func:`new_group`: a two-sided group of its own (its own TCPStore rendezvous; rank 0 = trainer
  rank 0, the receivers after it), every collective bounded by a timeout;
- :func:`send_update` / :func:`send_update_stream` (trainer side) and :func:`receive_update`
  (receivers): one version = a header (``{"version": v, "specs": [[name, dtype, shape], ...]}`` as
  JSON bytes, its length first), then every tensor in the order of the specs, then an all-reduce
  acknowledgement (every receiver holds the bytes before the sender goes on);
- :class:`BroadcastReceiver`: one server's rank in the trainer's group (``EngineServer``'s
  ``/collective_rpc`` methods ``init_broadcast`` and ``update_weights_from_broadcast``, the protocol
  of vLLM's worker extension in ``vllm_worker``, which imports the receiving functions from here).

Tensors travel on the group's device (CUDA for NCCL, CPU for gloo); 1-byte float types move as
``uint8`` (gloo has no FP8 types). The trainer's end with its timeouts and RPCs is
``weight_sync.BroadcastWeightSender``.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable

import torch

__all__ = ["BroadcastReceiver", "new_group", "receive_update", "receive_weights", "send_update",
           "send_update_stream", "send_weights", "weight_specs"]


def new_group(host: str, port: int, rank: int, world_size: int, *, timeout_s: float = 300.0,
              backend: str | None = None, store_rank: int = 0, prefix: str = ""):
    """A process group outside vLLM's own (its own TCPStore rendezvous; rank 0 = the trainer).
    Joining and every collective give up after ``timeout_s`` (a dead peer raises, never hangs).
    ``backend``: "nccl" or "gloo" (default: NCCL when CUDA is available). ``store_rank``: the rank
    that hosts the TCPStore at ``host:port`` (the others connect there). ``prefix``: the group's
    keys in that store (a store that outlives one group: ``pool_broadcast`` forms a new group,
    under a new prefix, whenever a server of the pool is replaced)."""
    from datetime import timedelta

    import torch.distributed as dist

    if backend not in (None, "nccl", "gloo"):
        raise ValueError(f"new_group: backend must be 'nccl', 'gloo' or None, got {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=(rank == store_rank), timeout=timeout)
    if prefix:
        store = dist.PrefixStore(prefix, store)
    if backend == "nccl" or (backend is None and torch.cuda.is_available()):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def _group_device(group) -> str:
    import torch.distributed as dist

    nccl = getattr(dist, "ProcessGroupNCCL", None)
    return "cuda" if nccl is not None and isinstance(group, nccl) else "cpu"


def _broadcast(group, t: torch.Tensor) -> None:
    import torch.distributed as dist

    if t.is_floating_point() and t.element_size() == 1:  # gloo has no fp8 types: move the bytes
        t = t.view(torch.uint8)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([t], opts).wait()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def weight_specs(state_dict) -> list:
    """``[[name, dtype name, shape], ...]`` of a state dict, the header's ``specs``."""
    return [(k, _dtype_name(v.dtype), list(v.shape)) for k, v in state_dict.items()]


def send_weights(group, state_dict) -> None:
    """Trainer side (rank 0): broadcast every tensor in ``weight_specs`` order (no header)."""
    dev = _group_device(group)
    for _, v in state_dict.items():
        _broadcast(group, v.detach().to(dev).contiguous())


def send_update(group, version: int, state_dict) -> None:
    """Trainer side: a header (``version`` and the specs, as JSON bytes) then every tensor."""
    send_update_stream(group, version, weight_specs(state_dict), state_dict.items())


def send_update_stream(group, version: int, specs: list, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """:func:`send_update` from a stream: ``specs`` (``[(name, dtype, shape)]``, dtype a
    ``torch.dtype`` or its name) go in the header first, then each ``(name, tensor)`` of ``tensors``
    is broadcast as it arrives (the sender holds one at a time). A tensor that does not match its
    spec raises ``ValueError`` (the receivers then time out: the stream is broken either way)."""
    dev = _group_device(group)
    specs = [(name, dtype if isinstance(dtype, str) else _dtype_name(dtype), list(shape))
             for name, dtype, shape in specs]
    meta = json.dumps({"version": int(version), "specs": specs}).encode()
    _broadcast(group, torch.tensor([len(meta)], dtype=torch.int64, device=dev))
    _broadcast(group, torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(dev))
    expected = iter(specs)
    for name, t in tensors:
        want = next(expected, None)
        if want is None or want[0] != name or _dtype_name(t.dtype) != want[1] or list(t.shape) != want[2]:
            raise ValueError(f"send_update_stream: got {name!r} {_dtype_name(t.dtype)} {list(t.shape)}, "
                             f"the header says {want}")
        _broadcast(group, t.detach().to(dev).contiguous())
    left = next(expected, None)
    if left is not None:
        raise ValueError(f"send_update_stream: the stream ended before {left[0]!r}")
    _ack(group)


def _ack(group) -> None:
    """Every rank has finished receiving (a broadcast's root may return while the bytes are still in
    flight; the trainer writes the version's marker, or tears the group down, only after this)."""
    dev = _group_device(group)
    group.allreduce([torch.zeros(1, device=dev)]).wait()
    if dev == "cuda":  # NCCL's wait() only orders the stream: wait on the host for the bytes too
        torch.cuda.current_stream().synchronize()


def receive_update(group, device="cpu") -> tuple[int, list]:
    """Receiver side of :func:`send_update`: ``(version, [(name, tensor), ...])``."""
    dev = _group_device(group)
    n = torch.zeros(1, dtype=torch.int64, device=dev)
    _broadcast(group, n)
    meta = torch.zeros(int(n.item()), dtype=torch.uint8, device=dev)
    _broadcast(group, meta)
    head = json.loads(bytes(meta.cpu().tolist()))
    weights = receive_weights(group, head["specs"], device)
    _ack(group)
    return int(head["version"]), weights


def receive_weights(group, specs: list, device="cpu") -> list:
    """``[(name, tensor), ...]`` for ``specs`` (``[(name, dtype name, shape)]``), broadcast from rank 0."""
    out = []
    for name, dtype, shape in specs:
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        _broadcast(group, t)
        out.append((name, t))
    return out


class BroadcastReceiver:
    """One server's rank in the trainer's broadcast group. ``join()`` and ``receive(load)`` return
    futures run one at a time on a thread of this receiver (a join or a transfer waits on the
    trainer); ``load(version, [(name, tensor), ...])`` installs a received version."""

    def __init__(self, device: torch.device, host: str, port, rank_offset, world_size, timeout_s=300.0, prefix=""):
        self.device, self.prefix = device, str(prefix)
        self.host, self.port, self.rank, self.world_size = str(host), int(port), int(rank_offset), int(world_size)
        self.timeout_s = float(timeout_s)
        self.group = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weight-broadcast")

    def join(self) -> Future:
        def run():
            self.group = new_group(self.host, self.port, self.rank, self.world_size, timeout_s=self.timeout_s,
                                   backend="nccl" if self.device.type == "cuda" else "gloo", prefix=self.prefix)

        return self._pool.submit(run)

    def receive(self, load: Callable[[int, list], None]) -> Future:
        def run() -> int:
            if self.group is None:
                raise RuntimeError(f"no weight broadcast group: joining {self.host}:{self.port} failed or is not done")
            try:
                version, weights = receive_update(self.group, self.device)
            except Exception:
                # leave the group: a sender still sending to this rank (a peer died mid-send) then fails
                # at once instead of waiting out its timeout; the next init_broadcast forms a new one
                group, self.group = self.group, None
                try:
                    group.shutdown()
                except Exception:  # noqa: BLE001 - nothing left to close
                    pass
                raise
            load(version, weights)
            return version

        return self._pool.submit(run)
