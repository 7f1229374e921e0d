"""The grouped GEMM references as custom ops (see :mod:`primerl.kernels._opaque`): their eager code
loops over host offsets (CPU) or runs ``torch._grouped_mm`` on float32, which torch.compile and
FakeTensorMode cannot trace; as ``primerl::`` ops they are one node with a fake kernel, the same
code runs traced or not, and the backward is its own op (the CPU float32 per-group loop's explicit
backward, else autograd through the eager code).

Legend: M rows, N output features, K reduction, G groups, T rows of a K-grouped operand.
"""

from __future__ import annotations

from typing import Callable

import torch

from .._opaque import recompute_grads
from . import grouped_eager as E

Tensor = torch.Tensor


def _per_group_case(a: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """The CPU float32/64 path of grouped_gemm_nt_offsets_eager (explicit backward)."""
    return a.device.type == "cpu" and a.dtype in (torch.float32, torch.float64) and out_dtype == a.dtype


# ------------------------------------------------------------------------------ m-grouped NT, k-grouped TN


def _grouped_op(name: str, eager: Callable, out_shape: Callable, explicit_backward: Callable | None = None):
    """Registers ``primerl::<name>(a, b, offsets, out_dtype)`` running ``eager`` (shape from
    ``out_shape(a, b, offsets)``) and its backward op ``primerl::<name>_bwd(grad, a, b, offsets,
    need_a, need_b) -> (da, db)``: ``explicit_backward``'s result where it gives one, else autograd
    through ``eager``; a gradient not needed comes back empty. Returns the forward op."""

    @torch.library.custom_op(f"primerl::{name}", mutates_args=())
    def forward(a: Tensor, b: Tensor, offsets: Tensor, out_dtype: torch.dtype) -> Tensor:
        with torch.no_grad():
            return eager(a, b, offsets, out_dtype)

    @forward.register_fake
    def _(a, b, offsets, out_dtype):
        return a.new_empty(out_shape(a, b, offsets), dtype=out_dtype)

    @torch.library.custom_op(f"primerl::{name}_bwd", mutates_args=())
    def backward_op(grad: Tensor, a: Tensor, b: Tensor, offsets: Tensor, need_a: bool,
                    need_b: bool) -> tuple[Tensor, Tensor]:
        grads = None if explicit_backward is None else explicit_backward(grad, a, b, offsets, need_a, need_b)
        if grads is None:
            grads = recompute_grads(lambda x, y: eager(x, y, offsets, grad.dtype), (a, b), (need_a, need_b), grad)
        return tuple(grads)

    @backward_op.register_fake
    def _(grad, a, b, offsets, need_a, need_b):
        return (torch.empty_like(a) if need_a else a.new_empty(0)), (torch.empty_like(b) if need_b else b.new_empty(0))

    def setup_context(ctx, inputs, output):
        a, b, offsets, out_dtype = inputs
        ctx.save_for_backward(a, b, offsets)

    def backward(ctx, grad):
        a, b, offsets = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        da, db = backward_op(grad, a, b, offsets, need_a, need_b)
        return (da if need_a else None), (db if need_b else None), None, None

    forward.register_autograd(backward, setup_context=setup_context)
    return forward


def _grouped_per_group_backward(grad, a, b, offsets, need_a, need_b):
    """The CPU float32/64 path of grouped_gemm_nt_offsets_eager has its own backward (None elsewhere)."""
    if not _per_group_case(a, grad.dtype):
        return None
    da, db = E.per_group_backward(grad.contiguous(), a, b, offsets.tolist(), need_a, need_b)
    return (a.new_empty(0) if da is None else da), (b.new_empty(0) if db is None else db)


# a [M, K], b [G, N, K], offsets [G] int32 -> [M, N] out_dtype (rows past offsets[-1] zero)
grouped_gemm_nt_offsets = _grouped_op("grouped_gemm_nt_offsets", E.grouped_gemm_nt_offsets_eager,
                                      lambda a, b, offsets: (a.shape[0], b.shape[1]), _grouped_per_group_backward)
# a [T, N], b [T, K], offsets [G] -> [G, N, K] out_dtype
k_grouped_gemm_tn = _grouped_op("k_grouped_gemm_tn", E.k_grouped_gemm_tn_eager,
                                lambda a, b, offsets: (offsets.shape[0], a.shape[1], b.shape[1]))


# ------------------------------------------------------------------------------ torch._grouped_mm


@torch.library.custom_op("primerl::grouped_mm", mutates_args=())
def _gmm_fwd(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)`` for any dtype its CPU kernel takes (its meta kernel
    takes bf16 only): 2D x 3D -> [M, N], 2D x 2D -> [G, M, N]."""
    return torch._grouped_mm(a, b, offs=offs)


@_gmm_fwd.register_fake
def _(a, b, offs):
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[2])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])


@torch.library.custom_op("primerl::grouped_mm_bwd", mutates_args=())
def _gmm_bwd(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, need_a: bool,
             need_b: bool) -> tuple[torch.Tensor, torch.Tensor]:
    da, db = recompute_grads(lambda x, y: torch._grouped_mm(x, y, offs=offs), (a, b), (need_a, need_b), grad)
    return da, db


@_gmm_bwd.register_fake
def _(grad, a, b, offs, need_a, need_b):
    return (torch.empty_like(a) if need_a else a.new_empty(0)), (torch.empty_like(b) if need_b else b.new_empty(0))


def _gmm_setup(ctx, inputs, output):
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _gmm_backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    da, db = torch.ops.primerl.grouped_mm_bwd(grad, a, b, offs, need_a, need_b)
    return (da if need_a else None), (db if need_b else None), None


_gmm_fwd.register_autograd(_gmm_backward, setup_context=_gmm_setup)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``, traceable for every dtype: direct where its meta
    kernel takes the dtype (bf16), else through ``primerl::grouped_mm``."""
    if a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs)
    return _gmm_fwd(a, b, offs)
