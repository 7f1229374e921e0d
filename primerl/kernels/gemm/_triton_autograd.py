"""Autograd of the 16/32-bit Triton GEMMs (``backend="triton"`` of :func:`gemm_nt`,
:func:`grouped_gemm_nt`, :func:`k_grouped_gemm_tn`): every product, forward and backward, is one of
the four 16/32-bit entry points of ``impl``, which is :mod:`.triton_ops` (the launchers as custom
ops: traceable) or, during AOT capture (:func:`primerl.kernels._opaque.launching_directly`),
:mod:`.triton` itself.

Legend: M rows, N output features, K reduction, G groups, T rows of a K-grouped operand.
The gradient arriving in backward is cast to the operands' dtype (a 16-bit GEMM's gradient is
16-bit) and accumulated in float32.
"""

from __future__ import annotations

import torch

from .layout import BLOCK


def _m_indices_segments(m_indices: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Aligned contiguous layout (groups in ascending order) -> padded segment end offsets[G].
    An all-padding block is owned by the group before it (its rows are masked anyway). Counted
    with index_add (bincount's output length depends on the values: a host read)."""
    block_group = m_indices.view(-1, BLOCK).amax(dim=1)
    owner = torch.cummax(block_group, 0).values.clamp_min(0).long()
    blocks = torch.zeros(num_groups, dtype=torch.int64, device=m_indices.device)
    blocks.index_add_(0, owner, torch.ones_like(owner))
    return (torch.cumsum(blocks, 0) * BLOCK).to(torch.int32)


class _GroupedGemmNT(torch.autograd.Function):
    """D = a @ b.T (kind "dense": b [N, K]) or grouped by ``index`` (offsets / m_indices: b [G, N, K])."""

    @staticmethod
    def forward(ctx, a, b, index, kind, out_dtype, impl):
        ctx.save_for_backward(a, b, index)
        ctx.kind, ctx.impl = kind, impl
        if kind == "offsets":
            return impl.grouped_gemm_nt_offsets(a, b, index, out_dtype)
        if kind == "m_indices":
            return impl.grouped_gemm_nt_m_indices(a, b, index, out_dtype)
        return impl.gemm_nt(a, b, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        a, b, index = ctx.saved_tensors
        impl = ctx.impl
        grad = grad.contiguous().to(a.dtype)
        grad_a = grad_b = None
        if ctx.kind == "dense":
            if ctx.needs_input_grad[0]:
                grad_a = impl.gemm_nt(grad, b.t(), a.dtype)
            if ctx.needs_input_grad[1]:
                whole = torch.full((1,), a.shape[0], dtype=torch.int32, device=a.device)
                grad_b = impl.k_grouped_gemm_tn(grad, a, whole, torch.float32)[0].to(b.dtype)
            return grad_a, grad_b, None, None, None, None
        b_t = b.transpose(1, 2)
        if ctx.needs_input_grad[0]:
            if ctx.kind == "offsets":
                grad_a = impl.grouped_gemm_nt_offsets(grad, b_t, index, a.dtype)
            else:
                grad_a = impl.grouped_gemm_nt_m_indices(grad, b_t, index, a.dtype)
        if ctx.needs_input_grad[1]:
            if ctx.kind == "offsets":
                grad_b = impl.k_grouped_gemm_tn(grad, a, index, torch.float32)
            else:
                segments = _m_indices_segments(index, b.shape[0])
                grad_b = impl.k_grouped_gemm_tn(grad, a, segments, torch.float32, index)
            grad_b = grad_b.to(b.dtype)
        return grad_a, grad_b, None, None, None, None


class _KGroupedGemmTN(torch.autograd.Function):
    """D[g] = a_g.T @ b_g (a [T, N], b [T, K], groups of rows by offsets[G]) -> [G, N, K]. Its
    gradients are M-grouped NT products over the same rows: da = b @ dD[g].T, db = a @ dD[g]
    (rows past offsets[-1] get zero)."""

    @staticmethod
    def forward(ctx, a, b, offsets, out_dtype, impl):
        ctx.save_for_backward(a, b, offsets)
        ctx.impl = impl
        return impl.k_grouped_gemm_tn(a, b, offsets, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        a, b, offsets = ctx.saved_tensors
        grad = grad.contiguous().to(a.dtype)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = ctx.impl.grouped_gemm_nt_offsets(b, grad, offsets, a.dtype)
        if ctx.needs_input_grad[1]:
            grad_b = ctx.impl.grouped_gemm_nt_offsets(a, grad.transpose(1, 2), offsets, b.dtype)
        return grad_a, grad_b, None, None, None


def _distinct(a, b):
    """b, or a view of it when it is a itself (e.g. a Gram matrix a @ a.T): dynamo cannot trace an
    autograd.Function given one tensor twice; the view's gradient still reaches a."""
    return b.view_as(b) if b is a else b


def gemm_nt(a, b, out_dtype, impl):
    """a [M, K], b [N, K] -> [M, N]; differentiable in a and b."""
    no_index = torch.empty(0, dtype=torch.int32, device=a.device)
    return _GroupedGemmNT.apply(a, _distinct(a, b), no_index, "dense", out_dtype, impl)


def grouped_gemm_nt(a, b, index, kind, out_dtype, impl):
    """a [M, K], b [G, N, K], index offsets [G] or m_indices [M] (``kind``) -> [M, N]; differentiable."""
    return _GroupedGemmNT.apply(a, b, index, kind, out_dtype, impl)


def k_grouped_gemm_tn(a, b, offsets, out_dtype, impl):
    """a [T, N], b [T, K], offsets [G] -> [G, N, K]; differentiable in a and b."""
    return _KGroupedGemmTN.apply(a, _distinct(a, b), offsets, out_dtype, impl)
