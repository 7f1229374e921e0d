"""Layer 1: parallelism on torch.distributed (DeviceMesh, FSDP2, DTensor): meshes, context and expert parallel."""
from .context import ContextShardPlan, allgather_attention, ring_attention  # noqa: E402,F401
