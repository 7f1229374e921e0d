"""The MoE Triton launchers (:mod:`.triton`) as ``torch.library`` custom ops, so torch.compile and
FakeTensorMode see each as one node with a fake kernel (the output shapes of :mod:`.reference`)
instead of tracing into a Triton launch. ``backend_impl("triton")`` returns this module; it has the
backend interface of :mod:`.reference` (align, expert_counts, scatter_rows, combine_rows, swiglu,
swiglu_backward, swiglu_quant). No autograd here: the ops are called inside the autograd Functions
of :mod:`._functions`, whose backwards call these ops too.

Legend: T tokens, k experts per token, n = T*k slots, E experts, D model dim, I expert dim.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import triton as T
from .reference import max_padded_rows


@torch.library.custom_op("primerl::moe_align_triton", mutates_args=())
def _align(topk_ids: torch.Tensor, num_experts: int, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                          torch.Tensor, torch.Tensor]:
    return tuple(t.clone() if t._base is not None else t for t in T.align(topk_ids, num_experts, block))


@_align.register_fake
def _(topk_ids, num_experts, block):
    n = topk_ids.numel()
    p = max_padded_rows(n, num_experts, block)
    new = lambda *shape: topk_ids.new_empty(shape, dtype=torch.int32)  # noqa: E731
    return new(n), new(p), new(-(-p // block)), new(1), new(num_experts)


@torch.library.custom_op("primerl::moe_expert_counts_triton", mutates_args=())
def _expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    return T.expert_counts(topk_ids, num_experts)


@_expert_counts.register_fake
def _(topk_ids, num_experts):
    return topk_ids.new_empty(num_experts, dtype=torch.int32)


@torch.library.custom_op("primerl::moe_scatter_rows_triton", mutates_args=())
def _scatter_rows(src: torch.Tensor, row_map: torch.Tensor, scale: Optional[torch.Tensor],
                  num_rows: int) -> torch.Tensor:
    return T.scatter_rows(src, row_map, scale, num_rows)


@_scatter_rows.register_fake
def _(src, row_map, scale, num_rows):
    return src.new_empty(num_rows, src.shape[1])


@torch.library.custom_op("primerl::moe_combine_rows_triton", mutates_args=())
def _combine_rows(y_perm: torch.Tensor, row_map: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    return T.combine_rows(y_perm, row_map, weights)


@_combine_rows.register_fake
def _(y_perm, row_map, weights):
    return y_perm.new_empty(row_map.shape[0], y_perm.shape[1])


@torch.library.custom_op("primerl::moe_swiglu_triton", mutates_args=())
def _swiglu(gu: torch.Tensor) -> torch.Tensor:
    return T.swiglu(gu)


@_swiglu.register_fake
def _(gu):
    return gu.new_empty(gu.shape[0], gu.shape[1] // 2)


@torch.library.custom_op("primerl::moe_swiglu_backward_triton", mutates_args=())
def _swiglu_backward(gu: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    return T.swiglu_backward(gu, dh)


@_swiglu_backward.register_fake
def _(gu, dh):
    return torch.empty_like(gu)


@torch.library.custom_op("primerl::moe_swiglu_quant_triton", mutates_args=())
def _swiglu_quant(gu: torch.Tensor, group_size: int, dtype: torch.dtype, ue8m0: bool,
                  rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    return T.swiglu_quant(gu, group_size, dtype, ue8m0, rounding)


@_swiglu_quant.register_fake
def _(gu, group_size, dtype, ue8m0, rounding):
    i = gu.shape[1] // 2
    return gu.new_empty(gu.shape[0], i, dtype=dtype), gu.new_empty(gu.shape[0], i // group_size, dtype=torch.float32)


def align(topk_ids: torch.Tensor, num_experts: int, block: int):
    return _align(topk_ids, num_experts, block)


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    return _expert_counts(topk_ids, num_experts)


def scatter_rows(src: torch.Tensor, row_map: torch.Tensor, scale: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    return _scatter_rows(src, row_map, scale, num_rows)


def combine_rows(y_perm: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    return _combine_rows(y_perm, row_map, weights)


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    return _swiglu(gu)


def swiglu_backward(gu: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    return _swiglu_backward(gu, dh)


def swiglu_quant(gu: torch.Tensor, group_size: int, dtype: torch.dtype, ue8m0: bool, rounding: str = "reciprocal"):
    from ..fp8.reference import ROUNDINGS

    if rounding not in ROUNDINGS:
        raise ValueError(f"swiglu_quant: rounding must be one of {ROUNDINGS}, got {rounding!r}")
    return _swiglu_quant(gu, group_size, dtype, ue8m0, rounding)
