"""Layer 1: parallelism on torch.distributed (DeviceMesh, FSDP2, DTensor): meshes, context and expert parallel.

The names below are imported from their modules on first access: a process that only reads a
layout (``ParallelDims`` in the launcher or the orchestrator) does not load FSDP2 and DTensor
(~1 CPU-s per process).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports as _lazy_exports

_EXPORTS = {
    **dict.fromkeys(("ContextShardPlan", "allgather_attention", "ring_attention"), "context"),
    "DeepEPDispatcher": "deepep",
    **dict.fromkeys(("AllToAllDispatcher", "apply_expert_parallel"), "expert"),
    **dict.fromkeys(("apply_activation_checkpointing", "apply_fsdp"), "fsdp"),
    **dict.fromkeys(("ParallelDims", "build_mesh"), "mesh"),
    **dict.fromkeys(("UlyssesAttention", "head_to_seq", "seq_to_head", "ulysses_attention", "ulysses_groups"),
                    "ulysses"),
}

__all__ = ["ContextShardPlan", "allgather_attention", "ring_attention", "DeepEPDispatcher", "AllToAllDispatcher",
           "apply_expert_parallel", "apply_activation_checkpointing", "apply_fsdp", "ParallelDims", "build_mesh",
           "UlyssesAttention", "head_to_seq", "seq_to_head", "ulysses_attention", "ulysses_groups"]

if TYPE_CHECKING:
    from .context import ContextShardPlan, allgather_attention, ring_attention  # noqa: F401
    from .deepep import DeepEPDispatcher  # noqa: F401
    from .expert import AllToAllDispatcher, apply_expert_parallel  # noqa: F401
    from .fsdp import apply_activation_checkpointing, apply_fsdp  # noqa: F401
    from .mesh import ParallelDims, build_mesh  # noqa: F401
    from .ulysses import UlyssesAttention, head_to_seq, seq_to_head, ulysses_attention, ulysses_groups  # noqa: F401

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
