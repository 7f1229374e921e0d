"""Streaming the trainer's full weights to one rank, one parameter at a time.

``iter_full_weights(model)`` is collective: every rank iterates it in step. For each entry of
``model.state_dict()`` it gathers that one tensor (an FSDP2 DTensor over its mesh; an expert
-parallel slice ``[E/ep, ...]`` also over its ep group, into one ``[E, ...]`` tensor) and yields
``(name, full tensor)`` on the destination rank and ``(name, None)`` on the others. The
destination thus holds its own shard plus one full parameter at a time, never a second copy of
the model, provided the consumer does not keep what it gets: :func:`write_safetensors_stream`
writes each tensor to disk as it arrives (the header comes first, from :func:`weight_specs`,
which knows every global shape without gathering anything).

:class:`WeightStream` packages one version's gather for the trainer's ``WeightChannel``
(``inference.weight_channels``), which decides where the tensors go.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["WeightStream", "iter_full_weights", "iter_lora_weights", "local_regions", "owned_regions", "weight_specs",
           "write_safetensors_stream"]

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _ep_slices(model: nn.Module) -> dict[str, tuple]:
    """state-dict name -> (ep group, ep size, E) of every expert-parallel weight slice."""
    from .dcp_checkpoint import _ep_expert_params

    return {name: (group, dist.get_world_size(group), num_experts)
            for name, (group, num_experts) in _ep_expert_params(model).items()}


def _is_lora(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith("lora_")


def _lora_bases(model: nn.Module) -> dict[str, tuple[str, str, float]]:
    """Under LoRA (``primerl.models.apply_lora``): base weight name -> (its lora_A name, lora_B
    name, scale) for every unmerged adapter (linear ``weight``; experts ``w13`` / ``w2``)."""
    out = {}
    for mname, m in model.named_modules():
        if not hasattr(m, "lora_scale") or m.lora_merged:
            continue
        pre = f"{mname}." if mname else ""
        if hasattr(m, "w13"):
            out[pre + "w13"] = (pre + "lora_A13", pre + "lora_B13", m.lora_scale)
            out[pre + "w2"] = (pre + "lora_A2", pre + "lora_B2", m.lora_scale)
        else:
            out[pre + "weight"] = (pre + "lora_A", pre + "lora_B", m.lora_scale)
    return out


def weight_specs(model: nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``[(name, dtype, global shape)]`` of ``model.state_dict()`` in order (the LoRA adapters left
    out: their deltas are merged into the published base weights); no communication."""
    ep = _ep_slices(model)
    out = []
    for name, t in model.state_dict().items():
        if _is_lora(name):
            continue
        shape = tuple(t.shape)
        if name in ep:
            shape = (ep[name][2], *shape[1:])
        out.append((name, t.dtype, shape))
    return out


def iter_full_weights(model: nn.Module, *, dst: int = 0,
                      to_cpu: bool = True) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Yield ``(name, full CPU tensor)`` on rank ``dst`` (``(name, None)`` elsewhere) for every
    entry of ``model.state_dict()``, in order. Collective: all ranks must exhaust the iterator.
    Without torch.distributed it yields the model's own tensors (detached, on CPU).
    ``to_cpu=False``: the full tensors stay on the model's device (for a GPU broadcast).
    Under LoRA the adapters are not yielded: each adapted weight comes as ``W + scale * B @ A``
    (the policy inference must run), the model's own weights untouched."""
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    ep = _ep_slices(model) if distributed else {}
    state = model.state_dict()
    lora = _lora_bases(model)

    def full(name):
        t = state[name].detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()  # every rank of the tensor's mesh holds it until the next one
        if name in ep:
            t = _gather_experts(t, *ep[name], rank=rank, dst=dst)
        return t

    for name in state:
        if _is_lora(name):
            continue
        t = full(name)
        if name in lora:
            a_name, b_name, scale = lora[name]
            a, b = full(a_name), full(b_name)
            if rank == dst:
                t = (t.float() + scale * torch.matmul(b.float(), a.float())).to(t.dtype)
            del a, b
        yield name, ((t.cpu() if to_cpu else t) if rank == dst else None)
        del t


def local_regions(model: nn.Module) -> list[tuple[str, torch.dtype, tuple, tuple, torch.Tensor, bool]]:
    """What this rank holds of every ``model.state_dict()`` entry, without communication:
    ``(name, dtype, global shape, global offset, local tensor, replicated)``. An FSDP2 / TP DTensor's
    local shard sits where ``compute_local_shape_and_global_offset`` says (``replicated``: this
    rank's copy is one of several, a Replicate mesh dim); an expert-parallel slice ``[E/ep, ...]``
    at ``ep rank * E/ep`` of dim 0; any other tensor is all of it (``replicated`` with several ranks)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    distributed = dist.is_available() and dist.is_initialized()
    ep = _ep_slices(model) if distributed else {}
    out = []
    for name, t in model.state_dict().items():
        t = t.detach()
        if hasattr(t, "to_local"):
            local = t.to_local()
            _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            offset = list(offset)
            replicated = any(not p.is_shard() for p in t.placements)
            shape = list(t.shape)
        else:
            local, offset, shape = t, [0] * t.dim(), list(t.shape)
            replicated = distributed and dist.get_world_size() > 1 and name not in ep
        if name in ep:
            group, ep_size, num_experts = ep[name]
            offset[0] += dist.get_rank(group) * (num_experts // ep_size)
            shape[0] = num_experts
        out.append((name, local.dtype, tuple(shape), tuple(offset), local, replicated))
    return out


def owned_regions(model: nn.Module) -> list[tuple[str, torch.dtype, tuple, tuple, torch.Tensor]]:
    """This rank's share of the sending: ``(name, dtype, global shape, offset, local tensor)`` for
    every region it holds; exactly one rank sends each distinct region:
    the holders of a region (every rank, for a replicated tensor) take turns by the region's index.
    Collective (one ``all_gather_object`` of the regions' keys) when torch.distributed is up."""
    mine = [r for r in local_regions(model) if r[4].numel()]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [r[:5] for r in mine]
    keys = [(n, off, tuple(t.shape)) for n, _, _, off, t, _ in mine]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, keys)
    holders: dict = {}
    for rank, ks in enumerate(every):
        for k in ks:
            holders.setdefault(k, []).append(rank)
    order = {k: i for i, k in enumerate(sorted(holders))}
    me = dist.get_rank()
    return [r[:5] for r, k in zip(mine, keys) if holders[k][order[k] % len(holders[k])] == me]


def iter_lora_weights(model: nn.Module, *, dst: int = 0) -> Iterator[tuple[str, torch.Tensor | None]]:
    """The LoRA adapters alone, ``(model name, full CPU tensor)`` on ``dst`` (``(name, None)``
    elsewhere), gathered like :func:`iter_full_weights` (collective)."""
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    ep = _ep_slices(model) if distributed else {}
    for name, t in model.state_dict().items():
        if not _is_lora(name):
            continue
        t = t.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        if name in ep:
            t = _gather_experts(t, *ep[name], rank=rank, dst=dst)
        yield name, (t.cpu() if rank == dst else None)


def _gather_experts(block: torch.Tensor, group, ep_size: int, num_experts: int, *, rank: int, dst: int):
    """The ep group that holds ``dst`` sends its ``[E/ep, ...]`` blocks there; ``dst`` gets ``[E, ...]``."""
    ranks = dist.get_process_group_ranks(group)
    if dst not in ranks:
        return None
    if rank != dst:
        dist.gather(block.contiguous(), None, group_dst=ranks.index(dst), group=group)
        return None
    full = block.new_empty((num_experts, *block.shape[1:]))
    dist.gather(block.contiguous(), list(full.chunk(ep_size)), group_dst=ranks.index(dst), group=group)
    return full


def write_safetensors_stream(path: str | os.PathLike, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                             tensors: Iterable[tuple[str, torch.Tensor | None]], *,
                             metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file from ``tensors`` (``(name, tensor)`` in the order of ``specs``)
    without holding more than one of them: the header is computed from ``specs`` up front. Call
    it on the receiving rank of :func:`iter_full_weights` (the other ranks exhaust the iterator)."""
    header: dict = {"__metadata__": dict(metadata or {})} if metadata else {}
    offset = 0
    for name, dtype, shape in specs:
        if dtype not in _ST_DTYPES:
            raise ValueError(f"write_safetensors_stream: {name} has dtype {dtype}, which safetensors cannot store")
        n = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    expected = iter(specs)
    path = Path(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, t in tensors:
            want = next(expected, None)
            if want is None or want[0] != name:
                raise ValueError(f"write_safetensors_stream: got {name!r}, expected {want and want[0]!r}")
            if t is None or t.dtype != want[1] or tuple(t.shape) != want[2]:
                got = None if t is None else (t.dtype, tuple(t.shape))
                raise ValueError(f"write_safetensors_stream: {name} is {got}, the header says {want[1:]}")
            if t.numel():
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # the buffer, not a copy
        left = next(expected, None)
        if left is not None:
            raise ValueError(f"write_safetensors_stream: the stream ended before {left[0]!r}")
        f.flush()
        os.fsync(f.fileno())


class WeightStream:
    """One version of ``model``'s full weights, gathered one tensor at a time: what the trainer hands
    to its ``WeightChannel`` (``channel.publish(version, WeightStream(model))``), every rank alike.

    ``specs``: ``[(name, dtype, global shape)]`` of ``model.state_dict()``, known without any
    communication (a streamed writer puts them in its header first). ``tensors(to_cpu=...)``: the
    collective iterator of :func:`iter_full_weights` (``(name, full tensor)`` on rank 0, ``(name,
    None)`` elsewhere); every rank must exhaust it exactly once, in step. ``model`` supplies the
    structure (Hugging Face layout, ``config.to_hf()``)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._specs: list | None = None
        self._taken = False

    @property
    def specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        if self._specs is None:
            self._specs = weight_specs(self.model)
        return self._specs

    def tensors(self, *, to_cpu: bool = True) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The gather, once: ``to_cpu=False`` keeps rank 0's full tensors on the model's device (a GPU
        broadcast). A second call raises (the ranks would no longer be in step)."""
        if self._taken:
            raise RuntimeError("WeightStream.tensors: a stream is gathered once (make a new WeightStream per version)")
        self._taken = True
        return iter_full_weights(self.model, to_cpu=to_cpu)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        return self.tensors()

    def owned(self) -> list[tuple[str, torch.dtype, tuple, tuple, torch.Tensor]]:
        """The regions this rank sends in a sharded transfer (:func:`owned_regions`; collective), instead
        of :meth:`tensors`'s gather."""
        if self._taken:
            raise RuntimeError("WeightStream.owned: a stream is taken once (make a new WeightStream per version)")
        self._taken = True
        return owned_regions(self.model)

    def drain(self) -> None:
        """Take part in the gather without keeping anything (the ranks that do not send)."""
        for _ in self.tensors():
            pass


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
