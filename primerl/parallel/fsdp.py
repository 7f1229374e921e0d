"""FSDP2 (``fully_shard``) for MoE transformers, and activation checkpointing.

The model is expected to look like a decoder: ``model.layers`` (a ModuleList/ModuleDict of
transformer blocks) and optionally an embedding (``embed`` / ``tok_embeddings``), a final norm
(``norm``) and a head (``lm_head`` / ``output``). Expert weights are found as the submodules
named ``experts`` (not ``shared_experts``) unless ``is_experts`` says otherwise.

Sharding: each block on ``dp_shard_cp`` (HSDP with ``dp_replicate`` when it is > 1); the experts
inside a block on ``efsdp`` (the ranks that hold the same experts), as their own FSDP unit;
the embedding alone; the final norm and the head together (they run back to back); the root
last for whatever remains. Gradients are summed, never averaged: the loss divides by the
global token count, which is the right normaliser for every layout, so every FSDP unit has its
gradient divide factor set to 1.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
                                    register_fsdp_forward_method)
from torch.distributed.tensor import Shard

__all__ = ["apply_fsdp", "apply_activation_checkpointing", "find_blocks", "default_is_experts"]


EXPERT_FORWARD_METHODS = ("forward_grouped",)


def default_is_experts(name: str, module: nn.Module) -> bool:
    return name.rsplit(".", 1)[-1] == "experts"


def find_blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    raise ValueError(f"{type(model).__name__} has no `layers` ModuleList/ModuleDict of transformer blocks")


def _first_attr(model: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    for n in names:
        m = getattr(model, n, None)
        if isinstance(m, nn.Module):
            return m
    return None


def _dp_mesh(mesh: DeviceMesh, shard_view: str) -> DeviceMesh:
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", shard_view]
    return mesh[shard_view]


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    is_experts: Callable[[str, nn.Module], bool] = default_is_experts,
) -> nn.Module:
    """Shard ``model`` in place (see the module docstring) on a mesh from ``build_mesh``.

    Call after expert parallelism has cut the expert weights to the local experts and after
    activation checkpointing. Expert weights are sharded on dim 1 when ``efsdp`` has more ranks
    than there are local experts (dim 0 would leave ranks empty) and divides dim 1, else on
    dim 0. Forward and backward prefetch the next block (and its experts) explicitly.
    """
    blocks = find_blocks(model)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # An experts unit's inputs arrive in param_dtype already (its block casts them); casting them
    # again would turn the router's float32 top-k weights into bf16, which the kernels refuse.
    mp_experts = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    # On a CPU mesh the parameters already live in host memory: the offload path runs unpinned
    # (pinning needs an accelerator) and saves nothing; the tests use it for equality.
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if cpu_offload else OffloadPolicy()
    dense_mesh = _dp_mesh(mesh, "dp_shard_cp")
    expert_mesh = _dp_mesh(mesh, "efsdp")
    efsdp = mesh["efsdp"].size()
    units: list[nn.Module] = []

    embed = _first_attr(model, ("embed", "tok_embeddings", "embed_tokens"))
    if embed is not None:
        fully_shard(embed, mesh=dense_mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=reshard_after_forward)
        units.append(embed)
    sharded_blocks, block_experts = [], []
    for i, block in enumerate(blocks):
        block_experts.append([])
        for name, sub in block.named_modules():
            if name and is_experts(name, sub):
                local_experts = min((p.shape[0] for p in sub.parameters(recurse=False) if p.dim() >= 2), default=0)

                def placement(p, n=local_experts):
                    # FSDP2 shards dims other than 0 only evenly
                    dim1 = p.dim() >= 2 and efsdp > n and p.shape[1] % efsdp == 0
                    return Shard(1) if dim1 else Shard(0)

                fully_shard(sub, mesh=expert_mesh, mp_policy=mp_experts, offload_policy=offload,
                            reshard_after_forward=reshard_after_forward, shard_placement_fn=placement)
                # Under expert parallelism the MoE calls experts.forward_grouped, not forward:
                # it needs FSDP's unshard/reshard hooks too.
                for method in EXPERT_FORWARD_METHODS:
                    if callable(getattr(sub, method, None)):
                        register_fsdp_forward_method(sub, method)
                units.append(sub)
                block_experts[-1].append(sub)
        # The last block's parameters are needed again at once by the backward.
        reshard = reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, mesh=dense_mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
        units.append(block)
        sharded_blocks.append(block)
    tail = [m for m in (_first_attr(model, ("norm",)), _first_attr(model, ("lm_head", "output"))) if m is not None]
    if tail:
        fully_shard(tail, mesh=dense_mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)
        units.extend(tail[:1])
    fully_shard(model, mesh=dense_mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)
    units.append(model)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        # With a factor of 1 plain SUM is exact; without this FSDP asks for PREMUL_SUM(1.0),
        # which gloo does not implement.
        unit.set_force_sum_reduction_for_comms(True)
    for i in range(len(sharded_blocks) - 1):
        a, b = sharded_blocks[i], sharded_blocks[i + 1]
        a.set_modules_to_forward_prefetch([b, *block_experts[i + 1]])
        b.set_modules_to_backward_prefetch([a, *block_experts[i]])
    return model


def apply_activation_checkpointing(model: nn.Module, mode: str = "full", *, every: int = 1,
                                   offload: bool = False) -> nn.Module:
    """Recompute block activations in the backward: ``mode="full"`` checkpoints every block,
    ``mode="selective"`` every ``every``-th block (blocks 0, every, 2*every, ...).

    Each block's ``forward`` is wrapped in place (parameter names do not change), with
    non-reentrant ``torch.utils.checkpoint``, so FSDP, hooks and nested FSDP units still work.
    ``offload``: the checkpointed blocks' saved inputs live in host memory between forward and
    backward (:class:`primerl.parallel.offload.OffloadActivations`).
    """
    if mode not in ("full", "selective"):
        raise ValueError(f"apply_activation_checkpointing: mode must be 'full' or 'selective', got {mode!r}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"apply_activation_checkpointing: every must be a positive int, got {every!r}")
    step = 1 if mode == "full" else every
    for i, block in enumerate(find_blocks(model)):
        if i % step == 0 and not getattr(block, "_primerl_checkpointed", False):
            _checkpoint_forward(block, offload)
    return model


def _checkpoint_forward(block: nn.Module, offload: bool = False) -> None:
    from .offload import OffloadActivations

    inner = block.forward

    def forward(*args, **kwargs):
        if offload:  # outside the checkpoint's own hooks: they catch only the block's saved inputs
            with OffloadActivations():
                return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)

    block.forward = forward
    block._primerl_checkpointed = True
