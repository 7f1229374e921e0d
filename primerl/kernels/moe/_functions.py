"""Autograd Functions of the MoE ops, generic over a backend module (reference / triton / cuda).

A backend module provides ``align``, ``scatter_rows``, ``combine_rows``, ``swiglu``,
``swiglu_backward`` and ``swiglu_quant`` with the signatures of :mod:`.reference`; a backend that
lacks one of them borrows the reference's (the CUDA backend only has align and scatter_rows).
Backward passes are built from the same deterministic kernels as forward passes:
permute's backward is a combine with unit weights, combine's backward is a weighted scatter.
"""

from __future__ import annotations

import torch

from .._opaque import tracing
from . import cpu_experts, reference


def backend_impl(backend: str):
    """The module implementing ``backend`` ("torch" -> the reference)."""
    if backend == "triton":
        from .._opaque import launching_directly

        if launching_directly():
            from . import triton as impl
        else:
            from . import triton_ops as impl  # the Triton launchers as custom ops (traceable)
    elif backend == "cuda":
        from . import cuda as impl
    else:
        impl = reference
    return impl


def op(impl, name: str):
    return getattr(impl, name, None) or getattr(reference, name)


class Permute(torch.autograd.Function):
    """x [T, D] -> x_perm [M, D]: row ``row_map[t, j]`` holds x[t]; padding rows are zero."""

    @staticmethod
    def forward(ctx, x, row_map, num_rows, impl):
        ctx.save_for_backward(row_map)
        ctx.impl = impl
        return op(impl, "scatter_rows")(x, row_map, None, num_rows)

    @staticmethod
    def backward(ctx, grad_perm):
        (row_map,) = ctx.saved_tensors
        return op(ctx.impl, "combine_rows")(grad_perm.contiguous(), row_map, None), None, None, None


class Combine(torch.autograd.Function):
    """y_perm [M, D], weights [T, k] -> y [T, D] = sum_j weights[t, j] * y_perm[row_map[t, j]]."""

    @staticmethod
    def forward(ctx, y_perm, row_map, weights, impl):
        ctx.save_for_backward(y_perm, row_map, weights)
        ctx.impl = impl
        return op(impl, "combine_rows")(y_perm, row_map, weights)

    @staticmethod
    def backward(ctx, grad_y):
        y_perm, row_map, weights = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_perm = grad_w = None
        if op(ctx.impl, "scatter_rows") is reference.scatter_rows and weights is not None \
                and y_perm.shape[0] == row_map.numel():
            grad_perm, grad_w = reference.combine_backward(
                grad_y, y_perm, row_map, weights, ctx.needs_input_grad[0], ctx.needs_input_grad[2])
            return grad_perm, None, grad_w, None
        if ctx.needs_input_grad[0]:
            grad_perm = op(ctx.impl, "scatter_rows")(grad_y, row_map, weights, y_perm.shape[0])
        if ctx.needs_input_grad[2]:
            grad_w = reference.combine_weight_grad(grad_y, y_perm, row_map)
        return grad_perm, None, grad_w, None


class SwiGLU(torch.autograd.Function):
    """gu [M, 2I] -> silu(gu[:, :I]) * gu[:, I:]."""

    @staticmethod
    def forward(ctx, gu, impl):
        ctx.save_for_backward(gu)
        ctx.impl = impl
        return op(impl, "swiglu")(gu)

    @staticmethod
    def backward(ctx, grad_h):
        (gu,) = ctx.saved_tensors
        return op(ctx.impl, "swiglu_backward")(gu, grad_h.contiguous()), None


def grouped_mm(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """a [M, K] rows grouped by expert (group e ends at ``ends[e]``), w [E, N, K] -> [M, N]."""
    from ..gemm import grouped_gemm_nt  # same layer; imported late to keep the packages independent

    return grouped_gemm_nt(a, w, ends, layout="offsets")


def experts_on_grouped_rows(x_perm, w13, w2, ends, impl, fp8_recipe=None):
    """The expert MLP on rows already grouped by expert: x_perm [M, D] -> y_perm [M, D] (unweighted).

    ``fp8_recipe``: None (bf16 grouped GEMMs) or an FP8 recipe of :mod:`.fp8`."""
    if fp8_recipe is not None:
        from .fp8 import FP8GroupedExperts, RowwiseGroupedExperts, recipe_name

        name = recipe_name(fp8_recipe)
        if name == "rowwise":
            return RowwiseGroupedExperts.apply(x_perm, w13, w2, ends, impl)
        return FP8GroupedExperts.apply(x_perm, w13, w2, ends, name, impl)
    if impl is reference and cpu_experts.supported(x_perm, w13, w2, fp8_recipe) \
            and cpu_experts.worthwhile(x_perm.shape[0], w13) and not tracing(x_perm, ends):
        ends_list = ends.tolist()  # host sync: free on CPU
        if ends_list and ends_list[-1] == x_perm.shape[0]:
            return cpu_experts.grouped_experts(x_perm, w13, w2, ends_list)
    gu = grouped_mm(x_perm, w13, ends)
    h = SwiGLU.apply(gu, impl)
    return grouped_mm(h, w2, ends)


def fused_experts(x, w13, w2, topk_ids, topk_weights, impl, fp8_recipe=None):
    t, k = topk_ids.shape
    with torch.no_grad():
        row_of_slot, _, _, _, ends = op(impl, "align")(topk_ids, w13.shape[0], 1)
    row_map = row_of_slot.view(t, k)
    # the by-expert CPU path loops over host ends; traced, the composition below runs instead (the
    # same forward values; d x summed in k order instead of expert order, see cpu_experts)
    if impl is reference and cpu_experts.supported(x, w13, w2, fp8_recipe) and cpu_experts.worthwhile(t * k, w13) \
            and not tracing(x, topk_ids):
        return cpu_experts.routed_experts(x, w13, w2, topk_weights, row_map, ends)
    x_perm = Permute.apply(x, row_map, t * k, impl)
    y_perm = experts_on_grouped_rows(x_perm, w13, w2, ends, impl, fp8_recipe)
    return Combine.apply(y_perm, row_map, topk_weights, impl)
