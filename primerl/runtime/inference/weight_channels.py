"""Weight channels: how one policy version goes from the trainer to inference.

The trainer makes its channel on every rank from the backend
(``get_backend(cfg).weight_channel(cfg, model=..., transport=..., rank=...)``) and calls
``channel.publish(version, WeightStream(model))`` after every step, then ``channel.close()``; it
never knows which channel it has. ``publish`` is collective: every rank calls it in step and takes
part in the gather of each full tensor (``trainer.publish.iter_full_weights``); rank 0's channel
sends, one full tensor at a time where the destination allows it (never a second copy of the
model on rank 0).

Channels (one class each, chosen by the backend):

=========================  =====================================================================
:class:`FileChannel`       ``model.safetensors`` under primerl's names + the ``STABLE`` marker
                           (the embedded engine reads it), streamed to disk
:class:`HFFileChannel`     the Hugging Face layout + ``config.json`` (vLLM's
                           ``update_weights_from_path``), streamed; ``fp8``: experts block-FP8
:class:`EngineBroadcast`   ``torch.distributed`` broadcast to the embedded engine's receiver in
                           the orchestrator process (in the engine's dtype), then a marker
:class:`ServerBroadcast`   broadcast of the Hugging Face tensors (``fp8`` optional) to vLLM-protocol
                           workers, then a marker once every receiver acknowledged
:class:`BucketedBroadcast` ``inference.weight_transfer``: buckets, pipelined, sharded (every rank
                           sends its shards), FP8 in transit, deltas (``weight_transfer``)
:class:`LoRAChannel`       ``trainer.lora``: the adapters alone, each version a PEFT adapter
                           directory (``adapter_config.json`` + ``adapter_model.safetensors``)
                           + the marker; the embedded engine applies them, vLLM loads the
                           directory as a LoRA adapter
=========================  =====================================================================

The receiving side is a ``WeightVersions`` (``weight_sync``): ``versions()``,
``wait_version(min_version, *, timeout, alive=None)``, ``close()``, made by the backend's
``weight_receiver``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from ..trainer.publish import WeightStream
    from ..transport import FileTransport
    from .weight_sync import BroadcastWeightSender

log = logging.getLogger("primerl.weight_sync")

__all__ = ["BucketedBroadcast", "EngineBroadcast", "FileChannel", "HFFileChannel", "LoRAChannel", "ServerBroadcast",
           "WeightChannel", "WeightVersions", "fp8_stream", "write_lora_version"]


@runtime_checkable
class WeightVersions(Protocol):
    """The orchestrator's view of the versions inference can load (receiving side of a channel).

    ``alive``: a receiving thread of this object is inside the trainer's group (a process that exits
    then aborts; ``orchestrator.main`` exits at once instead)."""

    def versions(self) -> list[int]: ...

    def wait_version(self, min_version: int, *, timeout: float, alive: Callable[[], bool] | None = None) -> int: ...

    def close(self, timeout: float | None = None) -> None: ...

    @property
    def alive(self) -> bool: ...


class WeightChannel(ABC):
    """Trainer side of one way to hand over versions; made on every rank (``rank``: this process's
    trainer rank). Subclasses implement :meth:`send` (rank 0 only) and say whether rank 0's full
    tensors go to the CPU first (``to_cpu``)."""

    to_cpu: bool = True

    def __init__(self, *, rank: int):
        self.rank = rank

    def publish(self, version: int, weights: "WeightStream") -> None:
        """Publish ``weights`` as ``version``. Collective: every rank calls it with its own stream of
        the same model; the ranks other than 0 only take part in the gathers."""
        if self.rank != 0:
            weights.drain()
            return
        self.send(version, weights, weights.tensors(to_cpu=self.to_cpu))

    @abstractmethod
    def send(self, version: int, weights: "WeightStream",
             tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Rank 0: deliver ``tensors`` (``(name, full tensor)`` in the order of ``weights.specs``),
        exhausting the iterator (the other ranks gather in step with it)."""

    def metrics(self) -> dict:
        """This rank's figures of the last version sent, for the trainer's metrics row ({}: none)."""
        return {}

    def close(self) -> None:
        """The end of the updates (the trainer's ``finally``)."""


def _write_stream(transport: "FileTransport", version: int, specs: list, tensors: Iterable,
                  config: dict | None = None) -> None:
    from ..trainer.publish import write_safetensors_stream

    meta = {"version": str(version)}
    transport.publish_weights(version, None, config=config,
                              write=lambda path: write_safetensors_stream(path, specs, tensors, metadata=meta))


def fp8_stream(specs: list, tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list, Iterator]:
    """``(specs, stream)`` with the expert weights block-FP8 (``vllm_client.quantize_for_transfer``,
    one tensor at a time: ``<name>`` e4m3 + ``<name>_scale_inv`` float32 follow each other)."""
    from .hf_weights import FP8_BLOCK
    from .vllm_client import quantize_one_for_transfer, transfer_specs

    def quantized():
        for name, t in tensors:
            yield from quantize_one_for_transfer(name, t, block=FP8_BLOCK)

    return transfer_specs(specs, block=FP8_BLOCK), quantized()


class FileChannel(WeightChannel):
    """``<transport>/weights/step_<v>/model.safetensors`` under primerl's names, then the marker;
    written as the tensors arrive (rank 0 holds one full tensor at a time)."""

    def __init__(self, transport: "FileTransport", *, rank: int):
        super().__init__(rank=rank)
        self.transport = transport

    def send(self, version, weights, tensors) -> None:
        _write_stream(self.transport, version, weights.specs, tensors)


class HFFileChannel(WeightChannel):
    """The Hugging Face layout (``hf_weights.hf_stream``) + ``config.json``, then the marker; the
    file vLLM's worker extension loads (``update_weights_from_path``). ``fp8``: expert weights
    block-FP8 with ``*_scale_inv`` (``inference.vllm.update_fp8``). Streamed either way."""

    def __init__(self, transport: "FileTransport", *, rank: int, fp8: bool = False):
        super().__init__(rank=rank)
        self.transport, self.fp8 = transport, fp8

    def send(self, version, weights, tensors) -> None:
        from .hf_weights import hf_stream

        specs, hf = hf_stream(weights.model, weights.specs, tensors)
        if self.fp8:
            specs, hf = fp8_stream(specs, hf)
        _write_stream(self.transport, version, specs, hf, config=weights.model.config.to_hf())


class EngineBroadcast(WeightChannel):
    """Broadcast to the embedded engine's receiver (``weight_sync.EngineWeightReceiver``, in the
    orchestrator process), every floating tensor cast to the engine's ``dtype`` on the trainer's
    device (GPU to GPU over NCCL, or gloo on the CPU), then a marker-only version directory (the
    orchestrator's files, if it reads any, say the version exists). ``close()`` sends the
    end-of-updates message so the receiver leaves the group."""

    to_cpu = False

    def __init__(self, sender: "BroadcastWeightSender | None", transport: "FileTransport", *, rank: int,
                 dtype: torch.dtype):
        super().__init__(rank=rank)
        if rank == 0 and sender is None:
            raise ValueError("EngineBroadcast: rank 0 needs its BroadcastWeightSender")
        self.sender, self.transport, self.dtype = sender, transport, dtype

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype) if t.is_floating_point() else t

    def send(self, version, weights, tensors) -> None:
        specs = [(n, self.dtype if d.is_floating_point else d, s) for n, d, s in weights.specs]
        self.sender.send_stream(version, specs, ((n, self._cast(t)) for n, t in tensors))
        self.transport.publish_weights(version, None)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close(goodbye=True)


class ServerBroadcast(WeightChannel):
    """Broadcast of the Hugging Face tensors (``fp8``: experts block-FP8) to vLLM-protocol workers
    (``weight_sync.BroadcastWeightSender``, ``inference.vllm.broadcast_*``), streamed with the
    specs in the header; the marker-only version directory is written once every receiver (and,
    with ``broadcast_rpc``, every worker through the server) acknowledged the version."""

    def __init__(self, sender: "BroadcastWeightSender | None", transport: "FileTransport", *, rank: int,
                 fp8: bool = False):
        super().__init__(rank=rank)
        if rank == 0 and sender is None:
            raise ValueError("ServerBroadcast: rank 0 needs its BroadcastWeightSender")
        self.sender, self.transport, self.fp8 = sender, transport, fp8

    def send(self, version, weights, tensors) -> None:
        from .hf_weights import hf_stream

        specs, hf = hf_stream(weights.model, weights.specs, tensors)
        if self.fp8:
            specs, hf = fp8_stream(specs, hf)
        self.sender.send_stream(version, specs, hf)
        self.transport.publish_weights(version, None)
        log.info("weights version %d broadcast to %d receiver(s)", version, self.sender.num_receivers)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


class BucketedBroadcast(WeightChannel):
    """The bucketed transfer (``inference.weight_transfer``, protocol in ``weight_transfer``): pieces
    packed into buckets of ``bucket_bytes``, bucket i+1 packed while bucket i is on the wire, in the
    engine's ``dtype`` or block-FP8 (``fp8``), whole or as deltas (``delta``, ``full_every``).
    ``sharded``: every trainer rank sends the regions it owns (``WeightStream.owned``: FSDP2 / EP
    shards, replicated tensors shared out) to the receivers over a group of its own; otherwise rank 0
    gathers one full tensor at a time and sends everything. ``join(source)`` gives the group a rank's
    ``BucketSender`` sends on. ``sender``: rank 0's sender made elsewhere instead (``pool_broadcast.
    PoolBroadcastSender``: a pool, one link per server; with ``sharded=False``), anything with
    ``send(version, regions, tensors)``, ``stats`` and ``close()``. ``close()`` ends the updates."""

    to_cpu = False

    def __init__(self, join: Callable[[int], object] | None, transport: "FileTransport | None", *, rank: int,
                 dtype: torch.dtype, bucket_bytes: int, fp8: bool = False, delta: bool = False, full_every: int = 10,
                 sharded: bool = True, peer: str = "the receivers", sender=None):
        super().__init__(rank=rank)
        if join is None and sender is None and (sharded or rank == 0):
            raise ValueError("BucketedBroadcast: give join (a group per sending rank) or rank 0's sender")
        self.peer = peer
        self._join, self.transport, self.dtype, self.fp8 = join, transport, dtype, fp8
        self.bucket_bytes, self.delta, self.full_every, self.sharded = bucket_bytes, delta, full_every, sharded
        self.sender = sender

    def _sender(self):
        if self.sender is None:
            from .weight_transfer import BucketSender

            group = self._join(self.rank)
            self.sender = BucketSender(group, bucket_bytes=self.bucket_bytes, delta=self.delta,
                                       full_every=self.full_every)
        return self.sender

    def piece(self, name: str, dtype: torch.dtype, shape, offset, size):
        from .weight_buckets import Piece, fp8_transferable

        out = self.dtype if dtype.is_floating_point else dtype
        return Piece(name, str(out).removeprefix("torch."), tuple(shape), tuple(offset), tuple(size),
                     self.fp8 and fp8_transferable(name, dtype, shape))

    def publish(self, version: int, weights: "WeightStream") -> None:
        from .weight_sync import WeightSyncError

        if not self.sharded and self.rank != 0:
            weights.drain()
            return
        owned = weights.owned() if self.sharded else None  # collective: before anything that can fail alone
        sender = self._sender()
        try:
            if owned is not None:
                regions = [self.piece(n, d, s, o, tuple(t.shape)) for n, d, s, o, t in owned]
                sender.send(version, regions, (t for *_, t in owned))
            else:
                self.send(version, weights, weights.tensors(to_cpu=self.to_cpu))
        except WeightSyncError:
            raise
        except Exception as e:  # noqa: BLE001 - a receiver that died or timed out
            raise WeightSyncError(f"broadcast of weights version {version} from trainer rank {self.rank} failed (the "
                                  f"receivers, {self.peer}, died or timed out): {e}") from e
        if self.rank == 0 and self.transport is not None:
            self.transport.publish_weights(version, None)

    def send(self, version, weights, tensors) -> None:
        regions = [self.piece(n, d, s, (0,) * len(s), s) for n, d, s in weights.specs]
        self._sender().send(version, regions, (t for _, t in tensors))

    @property
    def stats(self):
        return None if self.sender is None else self.sender.stats

    def metrics(self) -> dict:
        """``weights/wire_mb`` and ``weights/raw_mb`` (this rank's last version, on the wire and whole),
        ``weights/wire_fraction`` (their ratio: what a delta saves), ``weights/send_s``, and the running
        counts ``weights/delta_versions`` and ``weights/repairs`` (a pool: over every server's link, and
        ``weights/servers_lost``, servers dropped in the middle of a version)."""
        if self.sender is None or not self.sender.stats.last:
            return {}
        s = self.sender.stats
        last = s.last
        return {"weights/wire_mb": last["wire_bytes"] / 2**20, "weights/raw_mb": last["raw_bytes"] / 2**20,
                "weights/wire_fraction": last["wire_bytes"] / max(1, last["raw_bytes"]),
                "weights/send_s": last["seconds"], "weights/delta_versions": s.delta_versions,
                "weights/repairs": s.repairs,
                **({"weights/servers_lost": self.sender.lost} if hasattr(self.sender, "lost") else {})}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


def write_lora_version(model, path, *, base_model_name_or_path: str | None = None) -> int | None:
    """Collective (every trainer rank): gather ``model``'s adapters (``trainer.publish.iter_lora_weights``)
    and, on rank 0, write them to ``path`` as a PEFT adapter directory; -> the tensors' bytes on
    rank 0, None elsewhere."""
    from primerl.models.lora_io import peft_state, write_peft_dir

    from ..trainer.publish import iter_lora_weights

    full = {n: t for n, t in iter_lora_weights(model)}
    if any(t is None for t in full.values()):
        return None
    return write_peft_dir(model, path, peft_state(model, full), base_model_name_or_path=base_model_name_or_path)


class LoRAChannel(WeightChannel):
    """``trainer.lora``: each version is the adapters alone, a PEFT adapter directory at
    ``<transport>/weights/step_<v>/`` (``adapter_config.json`` + ``adapter_model.safetensors``, Hugging
    Face names) + the marker. ``last_bytes``: the adapter bytes of the last version (what an update
    moves; the trainer logs it as ``weights/update_bytes``)."""

    def __init__(self, transport: "FileTransport", *, rank: int, base_model_name_or_path: str | None = None):
        super().__init__(rank=rank)
        self.transport, self.base = transport, base_model_name_or_path
        self.last_bytes: int | None = None

    def publish(self, version: int, weights: "WeightStream") -> None:
        from pathlib import Path

        if self.rank != 0:
            write_lora_version(weights.model, None)
            return
        sizes = []

        def write(model_file: Path) -> None:  # the version directory is the adapter directory
            sizes.append(write_lora_version(weights.model, model_file.parent, base_model_name_or_path=self.base))

        self.transport.publish_weights(version, None, write=write)
        self.last_bytes = sizes[0]
        log.info("weights version %d: LoRA adapters, %d bytes", version, self.last_bytes)

    def send(self, version, weights, tensors) -> None:  # publish() does the whole update
        raise NotImplementedError("LoRAChannel.publish sends the adapters itself")
