"""Activation offloading: the tensors a checkpointed block keeps for its backward, in host memory.

With non-reentrant activation checkpointing a block keeps only its inputs (the hidden states
``[t, D]``, positions, replayed expert ids); everything inside is recomputed. Those inputs are
saved through autograd's saved-tensors hooks *outside* the checkpoint's own hooks, so wrapping the
checkpointed call in :class:`OffloadActivations` moves exactly them to the host: per block, one
``t x D`` tensor leaves accelerator memory from its forward to its recomputation.

On CUDA the copy to pinned host memory runs on a side stream (waiting for the producing stream,
then overlapping the next block's compute) and the tensor is kept alive until it finishes
(``record_stream``); the copy back is issued on the current stream when the backward first
needs the tensor. On a CPU device the hooks copy into a separate host buffer: the same path and
the same numbers, no memory saved (the tests use this for equality).
"""

from __future__ import annotations

import torch

__all__ = ["OffloadActivations"]


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensors hooks that keep every tensor saved inside the context in host memory.

    >>> with OffloadActivations():
    ...     y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    """

    _streams: dict[torch.device, torch.cuda.Stream] = {}

    def __init__(self, min_bytes: int = 0):
        self.min_bytes = min_bytes
        super().__init__(self._pack, self._unpack)

    @classmethod
    def _side_stream(cls, device):
        if device not in cls._streams:
            cls._streams[device] = torch.cuda.Stream(device)
        return cls._streams[device]

    def _pack(self, t: torch.Tensor):
        if t.device.type == "meta" or t.numel() * t.element_size() < self.min_bytes:
            return t
        if t.device.type == "cuda":
            stream = self._side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            t.record_stream(stream)  # the caching allocator keeps t's memory until the copy is done
            return _Offloaded(host, t.device, event)
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        host.copy_(t)
        return _Offloaded(host, t.device, None)

    @staticmethod
    def _unpack(packed):
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.event is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.event)
            return packed.host.to(packed.device, non_blocking=True)
        return packed.host.clone() if packed.device.type == "cpu" else packed.host.to(packed.device)


class _Offloaded:
    __slots__ = ("host", "device", "event")

    def __init__(self, host, device, event):
        self.host, self.device, self.event = host, device, event
