"""Layer 1: parallelism on torch.distributed (DeviceMesh, FSDP2, DTensor): meshes, context and expert parallel."""
