"""CUDA MoE layout and row scatter: thin calls into ``torch.ops.primerl.moe_*`` (csrc/moe/align.cu).

Only ``align`` (behind moe_align / permute / expert_counts) and ``scatter_rows`` (permute's forward)
exist in CUDA. ``permute(..., backend="cuda")``'s backward is a combine, which runs the torch
reference; the public ops built around combine or SwiGLU (unpermute_combine, fused_experts)
accept ``backend="triton"`` or ``"torch"`` only.

Schemas and fake kernels of the ops: :mod:`primerl.kernels._ext` (each call is one opaque node
under torch.compile / FakeTensorMode, with or without the extension).
"""

from __future__ import annotations

import torch

from .. import _ext  # noqa: F401  (defines torch.ops.primerl.moe_*)


def align(topk_ids: torch.Tensor, num_experts: int, block: int):
    """Same outputs as :func:`primerl.kernels.moe.reference.align`, bitwise."""
    return torch.ops.primerl.moe_align(topk_ids, num_experts, block)


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    ends = align(topk_ids, num_experts, 1)[4]
    return torch.diff(ends, prepend=ends.new_zeros(1))


def scatter_rows(src: torch.Tensor, row_map: torch.Tensor, scale: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    return torch.ops.primerl.moe_scatter_rows(src.contiguous(), row_map.contiguous(), scale, num_rows)
