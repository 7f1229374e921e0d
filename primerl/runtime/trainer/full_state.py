"""Full (unsharded) tensors of a parallelised policy and its AdamW state, and the way back.

After ``primerl.models.parallelize`` a parameter is a DTensor shard (FSDP2 over ``dp_shard_cp`` or
``efsdp``) and, under expert parallelism, an expert weight holds only this ep rank's experts
``[E/ep, ...]``. :func:`gather_full` rebuilds one tensor at its global shape (``full_tensor`` of
the FSDP shard, then an all-gather over the ep group in ep-rank order); :func:`local_part` cuts a
global tensor back to what this rank holds. Both run one tensor at a time, so a rank never holds
more than one extra full tensor besides what it keeps.

The optimizer state is keyed by parameter name (``{"state": {fqn: {"step", "exp_avg",
"exp_avg_sq"}}, "param_groups": [...]}``), so a state saved on one layout loads on any other.
Every function here is collective when the model is distributed: all ranks call it, in the
same order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["expert_param_names", "gather_full", "local_part", "full_model_state", "load_model_state",
           "full_optimizer_state", "load_optimizer_state"]


def expert_param_names(model: nn.Module) -> set[str]:
    """Names of the parameters that expert parallelism cut to this rank's experts (empty at ep=1)."""
    out = set()
    for name, module in model.named_modules():
        disp = getattr(module, "dispatcher", None)
        if disp is None or getattr(disp, "ep_size", 1) <= 1:
            continue
        local = module.num_experts // disp.ep_size
        for pname, p in module.experts.named_parameters(recurse=False):
            if p.dim() >= 1 and p.shape[0] == local:
                out.add(f"{name}.experts.{pname}" if name else f"experts.{pname}")
    return out


def gather_full(t: torch.Tensor, ep_group=None) -> torch.Tensor:
    """The global tensor of ``t`` (a DTensor shard and/or an ep slice when ``ep_group`` is given)."""
    full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
    if ep_group is None:
        return full
    parts = [torch.zeros_like(full) for _ in range(dist.get_world_size(ep_group))]
    dist.all_gather(parts, full.contiguous(), group=ep_group)
    return torch.cat(parts)


def local_part(full: torch.Tensor, like: torch.Tensor, ep_group=None) -> torch.Tensor:
    """This rank's part of global tensor ``full``, shaped and placed like ``like`` (no communication)."""
    if ep_group is not None:
        full = full.chunk(dist.get_world_size(ep_group))[dist.get_rank(ep_group)]
    full = full.to(dtype=like.dtype, device=like.device)
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    if full.shape != like.shape:
        raise ValueError(f"local_part: checkpoint tensor {tuple(full.shape)} does not fit {tuple(like.shape)}")
    return full


def _ep_group_of(name: str, experts: set[str], ep_group):
    return ep_group if name in experts else None


def full_model_state(model: nn.Module, *, ep_group=None, keep: bool = True) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` at global shapes on CPU; ``keep=False`` (ranks other than the
    writer) joins the collectives and returns {}."""
    experts = expert_param_names(model)
    out = {}
    for name, t in model.state_dict().items():
        full = gather_full(t, _ep_group_of(name, experts, ep_group))
        if keep:
            out[name] = full.cpu()
    return out


@torch.no_grad()
def load_model_state(model: nn.Module, state: dict[str, torch.Tensor], *, ep_group=None) -> None:
    experts = expert_param_names(model)
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise KeyError(f"load_model_state: the checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    for name, t in own.items():
        part = local_part(state[name], t, _ep_group_of(name, experts, ep_group))
        _copy_into(t, part)


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    if isinstance(dst, DTensor):
        dst.to_local().copy_(src.to_local())
    else:
        dst.copy_(src)


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, *, ep_group=None,
                         keep: bool = True) -> dict[str, Any]:
    experts = expert_param_names(model)
    state: dict[str, dict[str, Any]] = {}
    for name, p in model.named_parameters():
        entry = {}
        for key, v in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                v = gather_full(v, _ep_group_of(name, experts, ep_group)).cpu()
            elif isinstance(v, DTensor):
                v = v.full_tensor()
            entry[key] = v
        if keep and entry:
            state[name] = entry
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups} if keep else {}


@torch.no_grad()
def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any], *,
                         ep_group=None) -> None:
    experts = expert_param_names(model)
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"load_optimizer_state: {len(saved['param_groups'])} saved param groups, the optimizer "
                         f"has {len(optimizer.param_groups)}")
    for group, hyper in zip(optimizer.param_groups, saved["param_groups"]):
        group.update(hyper)
    for name, p in model.named_parameters():
        entry = saved["state"].get(name)
        if entry is None:
            continue
        optimizer.state[p] = {
            key: local_part(v, p, _ep_group_of(name, experts, ep_group)) if isinstance(v, torch.Tensor) and v.dim() > 0
            else (v.clone() if isinstance(v, torch.Tensor) else v)
            for key, v in entry.items()}
