"""Sharded trainer checkpoints with ``torch.distributed.checkpoint`` (DCP), resumable on any layout.

Layout: ``<root>/step_000012/{__0_0.distcp, ..., .metadata, train_state.pt, meta.json}``. Every
rank writes its own shard of the model and optimizer state (FSDP2 / DTensor shards as they are);
``train_state.pt`` (scheduler, counters, every rank's RNG) and ``meta.json`` come from rank 0.
As with ``checkpoint.save_checkpoint`` the files go into ``<root>/.tmp_step_000012.<pid>`` (rank
0's pid, shared by all ranks) and rank 0 renames the directory into place only after every rank's
shard and DCP's ``.metadata`` are written, so ``latest_checkpoint`` never picks a partial save.

Resuming on another layout (say saved on 4 ranks with cp=2, ep=2 and loaded on 2 ranks with
dp_shard=2, or in one process) works because every tensor is stored under its full global shape
and DCP reads each rank's slice of it. FSDP2 parameters are DTensors already. Expert parallelism
(``primerl.parallel.expert.apply_expert_parallel``) instead replaces each expert weight by a plain
local slice ``[E/ep, ...]`` of experts ``[ep_rank*E/ep, (ep_rank+1)*E/ep)``, which FSDP2 then
shards over ``efsdp``; on its own that tensor would clash with the other ep ranks' slices under
one name. :func:`_global_experts` re-describes it as a DTensor of the global shape ``[E, ...]`` on
a mesh ``(ep, *efsdp mesh)`` with ``Shard(0)`` on ``ep`` first, which is exactly where the slice
sits (DTensor's nested sharding splits dim 0 over ep, then each part over efsdp as FSDP2 did).

Plain tensors (buffers, which FSDP2 leaves whole) are taken to be the same on every rank and are
stored once, from whichever rank DCP picks: a per-rank accumulator such as MoE's
``tokens_per_expert`` keeps one rank's counts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import TMP_PREFIX, _step_dirs, latest_checkpoint, remove_stale_tmp_dirs
from ..transport import atomic_torch_save, atomic_write_bytes

log = logging.getLogger("primerl.checkpoint")

__all__ = ["save_dcp_checkpoint", "load_dcp_checkpoint", "wait_pending_save", "is_dcp_checkpoint", "latest_checkpoint"]

FORMAT = "dcp"
TRAIN_STATE = "train_state.pt"

_pending: list[Future] = []  # at most one async save in flight


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def is_dcp_checkpoint(path: str | Path) -> bool:
    meta = Path(path) / "meta.json"
    return meta.exists() and json.loads(meta.read_text()).get("format") == FORMAT


# ------------------------------------------------------------------------------------ expert layout
def _ep_expert_params(model: nn.Module) -> dict[str, tuple[Any, int]]:
    """FQN -> (ep process group, number of experts E) of every expert-parallel weight slice."""
    from .full_state import expert_param_names

    out = {}
    for fqn in sorted(expert_param_names(model)):
        moe = model.get_submodule(fqn.rsplit(".", 2)[0]) if fqn.count(".") >= 2 else model
        out[fqn] = (moe.dispatcher.group, moe.num_experts)
    return out


class _ExpertMeshes:
    """One DeviceMesh ``(ep, *the slice's own mesh dims)`` per (ep group, slice mesh) pair, built
    without new process groups (DCP only needs this rank's coordinate and the mesh sizes)."""

    def __init__(self):
        self._cache: dict[tuple, Any] = {}

    def get(self, group, local_mesh, device: torch.device):
        from torch.distributed.device_mesh import DeviceMesh

        key = (id(group), None if local_mesh is None else id(local_mesh))
        if key not in self._cache:
            if local_mesh is None:
                ranks, shape, names = torch.tensor([_rank()]), (), ()
            else:
                ranks, shape = local_mesh.mesh.reshape(-1), tuple(local_mesh.mesh.shape)
                names = tuple(f"_ckpt_{n}" for n in local_mesh.mesh_dim_names or range(local_mesh.ndim))
            parts = [torch.empty_like(ranks, device=device) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, ranks.to(device), group=group)  # every ep peer's own mesh, in ep order
            mesh = torch.stack(parts).cpu().reshape((len(parts), *shape))
            self._cache[key] = DeviceMesh(device.type, mesh, mesh_dim_names=("_ckpt_ep", *names), _init_backend=False)
        return self._cache[key]


def _global_experts(value: torch.Tensor, group, num_experts: int, meshes: _ExpertMeshes):
    """An expert-parallel slice (plain ``[E/ep, ...]`` or an FSDP2 DTensor of that shape) as a
    DTensor of the global ``[E, ...]`` over the same local tensor."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(value, DTensor):
        local, mesh, placements = value.to_local(), value.device_mesh, tuple(value.placements)
    else:
        local, mesh, placements = value, None, ()
    shape = torch.Size((num_experts, *value.shape[1:]))
    return DTensor.from_local(local, meshes.get(group, mesh, local.device), (Shard(0), *placements), run_check=False,
                              shape=shape, stride=_contiguous_stride(shape))


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def _global_view(model_sd: dict, optim_sd: dict, experts: dict) -> tuple[dict, dict, list]:
    """Shallow copies of both state dicts with every expert-parallel entry (the weight and its
    optimizer moments, same shape) as a global DTensor over the same storage, and the list of
    ``(dict, key, original)`` swaps that :func:`_restore_local` undoes."""
    if not experts:
        return model_sd, optim_sd, []
    meshes = _ExpertMeshes()
    model_g = dict(model_sd)
    optim_g = {**optim_sd, "state": {k: dict(v) for k, v in optim_sd.get("state", {}).items()}}
    swaps = []
    for fqn, (group, num_experts) in experts.items():
        local_shape = model_sd[fqn].shape
        swaps.append((model_g, fqn, model_sd[fqn]))
        model_g[fqn] = _global_experts(model_sd[fqn], group, num_experts, meshes)
        moments = optim_g["state"].get(fqn, {})
        for key, v in list(moments.items()):
            if torch.is_tensor(v) and v.shape == local_shape:
                swaps.append((moments, key, v))
                moments[key] = _global_experts(v, group, num_experts, meshes)
    return model_g, optim_g, swaps


def _restore_local(swaps: list) -> None:
    """After ``dcp.load`` into the global view: put the originals back, holding the loaded values
    (``from_local`` may wrap a copy rather than the same storage)."""
    for holder, key, original in swaps:
        loaded = holder[key].to_local()
        local = original.to_local() if hasattr(original, "to_local") else original
        if local.data_ptr() != loaded.data_ptr():
            with torch.no_grad():
                local.copy_(loaded)
        holder[key] = original


# ------------------------------------------------------------------------------------ save / load
def _dcp_state(model: nn.Module, optimizer) -> tuple[dict, list]:
    """The ``{"model", "optimizer"}`` dict that DCP saves / loads (global shapes throughout) and
    the expert-parallel swaps that turn it back into the model's own layout."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    model_g, optim_g, swaps = _global_view(model_sd, optim_sd, _ep_expert_params(model))
    return {"model": model_g, "optimizer": optim_g}, swaps


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every call without a process group that it assumes one process: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def wait_pending_save() -> None:
    """Block until an in-flight async save has been written and renamed into place (re-raises its error)."""
    while _pending:
        _pending.pop().result()


def save_dcp_checkpoint(root: str | Path, step: int, model: nn.Module, optimizer, train_state: dict[str, Any], *,
                        keep: int = 2, meta: dict | None = None, async_save: bool = False,
                        process_group=None) -> Path:
    """Save ``model`` and ``optimizer`` (sharded, every rank its part) plus ``train_state``
    (picklable: scheduler state, counters; rank 0's is kept, with every rank's RNG) after ``step``
    optimizer steps. Collective: every rank calls it. Returns the final directory.

    ``async_save``: stage a CPU copy, return at once and write in a background thread; the rename
    happens when every rank has written. At most one save is in flight: a second call (and
    :func:`wait_pending_save`) waits for the first. Give ``process_group`` (a gloo group used for
    nothing else) when training collectives may run meanwhile.
    """
    import torch.distributed.checkpoint as dcp

    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"save_dcp_checkpoint: step must be a non-negative int, got {step!r}")
    if keep < 1:
        raise ValueError(f"save_dcp_checkpoint: keep must be >= 1, got {keep}")
    wait_pending_save()
    root = Path(root)
    final = root / f"step_{step:06d}"
    rank, distributed = _rank(), _distributed()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    tag = [os.getpid()]  # one temporary directory for all ranks: rank 0's pid names it
    rngs = [_rng_state()]
    if distributed:
        dist.broadcast_object_list(tag, src=0)
        rngs = [None] * dist.get_world_size()
        dist.all_gather_object(rngs, _rng_state())
    tmp = root / f"{TMP_PREFIX}{step:06d}.{tag[0]}"  # remove_stale_tmp_dirs knows the pattern
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        # exist_ok: another rank's dcp.save may have created it already (it makes the directory
        # itself); seen when ranks on two "nodes" share the path: FileExistsError at step 1100
        tmp.mkdir(exist_ok=True)
        try:
            atomic_torch_save({**train_state, "rng": rngs, "step": step}, tmp / TRAIN_STATE)
        except BaseException:
            remove_stale_tmp_dirs(root)
            raise
    state, _ = _dcp_state(model, optimizer)
    world = dist.get_world_size() if distributed else 1
    info = {"step": step, "format": FORMAT, "world_size": world, **(meta or {})}

    def finish() -> None:
        if rank != 0:
            return
        atomic_write_bytes(tmp / "meta.json", json.dumps(info).encode())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for _, old in _step_dirs(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    kwargs = dict(checkpoint_id=str(tmp), process_group=process_group, no_dist=not distributed)
    if not async_save:
        try:
            with _quiet_single_process():
                dcp.save(state, **kwargs)
            finish()
        except BaseException:
            if rank == 0:
                remove_stale_tmp_dirs(root)
            raise
        if distributed:
            dist.barrier(group=process_group)  # nobody looks for the directory before it is renamed
        return final
    with _quiet_single_process():
        fut = dcp.async_save(state, **kwargs)
    done: Future = Future()

    def on_written(f: Future) -> None:
        try:
            f.result()
            finish()
            done.set_result(final)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            if rank == 0:
                remove_stale_tmp_dirs(root)
            done.set_exception(e)

    fut.add_done_callback(on_written)
    _pending.append(done)
    return final


def load_dcp_checkpoint(path: str | Path, model: nn.Module, optimizer, *, process_group=None) -> tuple[int, dict]:
    """Load a :func:`save_dcp_checkpoint` directory into ``model`` / ``optimizer`` as they are
    parallelized now (any layout: DCP reads each rank's slice). Collective. Restores this rank's
    RNG when the world size is the one saved (else rank ``r % saved_world``'s, logged). Returns
    ``(step, train_state)``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    if not is_dcp_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a complete DCP checkpoint (no meta.json with format {FORMAT!r})")
    meta = json.loads((path / "meta.json").read_text())
    state, swaps = _dcp_state(model, optimizer)
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(path), process_group=process_group, no_dist=not _distributed())
    _restore_local(swaps)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    train_state = torch.load(path / TRAIN_STATE, weights_only=False)
    rngs = train_state.pop("rng")
    rank = _rank()
    world = dist.get_world_size() if _distributed() else 1
    if world != len(rngs):
        log.info("resuming %d rank(s) from a %d-rank checkpoint: rank r takes the RNG of saved rank r %% %d",
                 world, len(rngs), len(rngs))
    rng = rngs[rank % len(rngs)]
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return int(meta["step"]), train_state
