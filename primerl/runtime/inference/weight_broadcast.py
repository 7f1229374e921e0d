"""The receiving end of trainer rank 0's weight broadcast inside ``primerl inference``
(``EngineServer``'s ``/collective_rpc`` methods ``init_broadcast`` and
``update_weights_from_broadcast``, the protocol of vLLM's worker extension in ``vllm_worker``):
weights reach a server on another node over the network, with no shared directory."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

__all__ = ["BroadcastReceiver"]


class BroadcastReceiver:
    """One server's rank in the trainer's broadcast group. ``join()`` and ``receive(load)`` return
    futures run one at a time on a thread of this receiver (a join or a transfer waits on the
    trainer); ``load(version, [(name, tensor), ...])`` installs a received version."""

    def __init__(self, device: torch.device, host: str, port, rank_offset, world_size, timeout_s=300.0):
        self.device = device
        self.host, self.port, self.rank, self.world_size = str(host), int(port), int(rank_offset), int(world_size)
        self.timeout_s = float(timeout_s)
        self.group = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weight-broadcast")

    def join(self) -> Future:
        from .vllm_worker import new_group

        def run():
            self.group = new_group(self.host, self.port, self.rank, self.world_size, timeout_s=self.timeout_s,
                                   backend="nccl" if self.device.type == "cuda" else "gloo")

        return self._pool.submit(run)

    def receive(self, load: Callable[[int, list], None]) -> Future:
        from .vllm_worker import receive_update

        def run() -> int:
            if self.group is None:
                raise RuntimeError(f"no weight broadcast group: joining {self.host}:{self.port} failed or is not done")
            version, weights = receive_update(self.group, self.device)
            load(version, weights)
            return version

        return self._pool.submit(run)
