"""parallelize(model, parallel_dims, mesh): expert parallel, context parallel, activation
checkpointing and FSDP2 from ``primerl.parallel``, applied to a MoETransformer in the order they
compose: EP first (it cuts the expert weights to the local experts), then CP (ring attention, or
Ulysses / Ulysses x ring with ``cp_kind``, in every attention layer), then activation checkpointing
(wraps each block's forward), FSDP last (it shards whatever parameters exist by then).

With context parallelism the caller builds one ``ContextShardPlan`` per packed batch over
``mesh["cp"]`` and runs the model on this rank's shard::

    plan = ContextShardPlan(cu_seqlens, mesh["cp"].get_group())
    h_local = model(plan.shard(input_ids), plan.shard(position_ids), plan)   # [t, D]
"""

from __future__ import annotations

import torch
from torch import nn


def parallelize(model: nn.Module, parallel_dims, mesh, *, activation_checkpointing: str | None = None,
                ac_every: int = 1, fsdp: bool | None = None, param_dtype: torch.dtype = torch.bfloat16,
                reduce_dtype: torch.dtype = torch.float32, reshard_after_forward: bool = True,
                cpu_offload: bool = False, fp8_dispatch: bool = False, cp_kind: str = "ring",
                cp_ulysses: int = 0, activation_offload: bool = False) -> nn.Module:
    """Apply EP, CP, activation checkpointing and FSDP to ``model`` in place and return it.

    Args:
        parallel_dims: ``primerl.parallel.mesh.ParallelDims``; ``mesh`` its ``build_mesh`` result.
        activation_checkpointing: None, ``"full"`` (every block) or ``"selective"`` (every
            ``ac_every``-th block).
        fsdp: shard with FSDP2 (default: whenever there is more than one rank).
        param_dtype / reduce_dtype / reshard_after_forward / cpu_offload: FSDP2 settings.
        fp8_dispatch: send tokens to the experts in FP8 (the dispatcher's option).
        cp_kind: ``"ring"``, ``"ulysses"`` (head all-to-all over the cp group) or ``"ulysses_ring"``
            (Ulysses degree ``cp_ulysses`` inside, ring across); ``cp_ulysses`` 0 means cp for "ulysses".
        activation_offload: keep the checkpointed blocks' saved inputs in host memory (needs
            ``activation_checkpointing``).
    """
    from primerl.parallel.expert import apply_expert_parallel
    from primerl.parallel.fsdp import apply_activation_checkpointing, apply_fsdp

    from .layers import Attention
    from .mla import MLAttention

    cfg = getattr(model, "config", None)
    if cfg is not None and cfg.moe_layer_ids:
        parallel_dims.check_num_experts(cfg.num_experts)
    if activation_checkpointing not in (None, "full", "selective"):
        raise ValueError(f"parallelize: activation_checkpointing must be None, 'full' or 'selective', "
                         f"got {activation_checkpointing!r}")
    if parallel_dims.ep > 1:
        apply_expert_parallel(model, mesh["ep"], fp8_dispatch=fp8_dispatch)
    if cp_kind not in ("ring", "ulysses", "ulysses_ring"):
        raise ValueError(f"parallelize: cp_kind must be 'ring', 'ulysses' or 'ulysses_ring', got {cp_kind!r}")
    if activation_offload and activation_checkpointing is None:
        raise ValueError("parallelize: activation_offload needs activation_checkpointing ('full' or 'selective')")
    if parallel_dims.cp > 1:
        from primerl.parallel.context import ring_attention

        fn = ring_attention
        if cp_kind != "ring":
            from primerl.parallel.ulysses import UlyssesAttention, ulysses_groups

            degree = cp_ulysses or (parallel_dims.cp if cp_kind == "ulysses" else 0)
            if degree < 2 or parallel_dims.cp % degree or (cp_kind == "ulysses" and degree != parallel_dims.cp):
                raise ValueError(f"parallelize: cp_kind={cp_kind!r} with cp_ulysses={cp_ulysses} does not split "
                                 f"cp={parallel_dims.cp}")
            heads = cfg.n_heads if cfg is not None else None
            if heads is not None and heads % degree:
                raise ValueError(f"parallelize: the model's {heads} heads do not divide by the Ulysses degree {degree}")
            fn = UlyssesAttention(*ulysses_groups(mesh["cp"].get_group(), degree))
        for module in model.modules():
            if isinstance(module, (Attention, MLAttention)):
                module.context_attention = fn
    if activation_checkpointing is not None:
        apply_activation_checkpointing(model, activation_checkpointing, every=ac_every, offload=activation_offload)
    if fsdp is None:
        fsdp = parallel_dims.world_size > 1
    if fsdp and cfg is not None and cfg.tie_word_embeddings:
        raise NotImplementedError("parallelize: FSDP of a model with tied embeddings is not supported (the embedding "
                                  "and the head are separate FSDP units)")
    if fsdp:
        apply_fsdp(model, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload)
    return model
