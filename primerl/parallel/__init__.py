"""Layer 1: parallelism on torch.distributed (DeviceMesh, FSDP2, DTensor): meshes, context and expert parallel."""
from .context import ContextShardPlan, allgather_attention, ring_attention  # noqa: E402,F401
from .deepep import DeepEPDispatcher  # noqa: E402,F401
from .expert import AllToAllDispatcher, apply_expert_parallel  # noqa: E402,F401
from .fsdp import apply_activation_checkpointing, apply_fsdp  # noqa: E402,F401
from .mesh import ParallelDims, build_mesh  # noqa: E402,F401

__all__ = ["ContextShardPlan", "allgather_attention", "ring_attention", "DeepEPDispatcher", "AllToAllDispatcher",
           "apply_expert_parallel", "apply_activation_checkpointing", "apply_fsdp", "ParallelDims", "build_mesh"]
