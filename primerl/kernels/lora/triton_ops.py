"""``backend="triton"`` of :func:`lora_linear` and :func:`grouped_lora`: one ``torch.library`` op
for each forward and each backward (fake kernels give the shapes; ``register_autograd`` ties them),
so torch.compile and FakeTensorMode see single nodes instead of Triton launches.

Legend: M rows, d input features, n output features, r rank, E experts.

Forward: ``xa = x @ A.T`` (shrink), then ``y = base + scale * xa @ B.T`` (expand, adding into the
base output in place); ``xa`` [M, r] is saved for the backward (``dB``). Backward:
``dxa = scale * dy @ B`` (shrink by B.T), ``dx = dy @ W + dxa @ A`` (expand by A.T into the dgrad),
``dA = dxa.T @ x``, ``dB = scale * dy.T @ xa`` (dense: cuBLAS; grouped: the k-grouped Triton GEMM of
:mod:`primerl.kernels.gemm.triton`). The dense base GEMMs stay on cuBLAS (``torch.mm``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..gemm import triton as gemm_triton
from ..gemm._triton_autograd import _m_indices_segments
from . import triton as T

Tensor = torch.Tensor


def _dense(t: Tensor) -> Tensor:
    """A [.., ..] 2-D operand as a one-group [1, .., ..] view."""
    return t.unsqueeze(0)


# ------------------------------------------------------------------------------ lora_linear


@torch.library.custom_op("primerl::lora_linear_triton", mutates_args=())
def _lora_linear_fwd(x: Tensor, weight: Optional[Tensor], base: Optional[Tensor], lora_a: Tensor, lora_b: Tensor,
                     scale: float) -> tuple[Tensor, Tensor]:
    """x [M, d], weight [n, d] or base [M, n] (the FP8 base's output), A [r, d], B [n, r] ->
    (y [M, n], xa [M, r])."""
    xa = T.shrink(x, _dense(lora_a), None, "dense", 1.0, x.dtype)
    if weight is not None:
        c = x @ weight.t()
        return T.expand(xa, _dense(lora_b), None, "dense", scale, c=c, out=c), xa
    return T.expand(xa, _dense(lora_b), None, "dense", scale, c=base.contiguous(), out_dtype=x.dtype), xa


@_lora_linear_fwd.register_fake
def _(x, weight, base, lora_a, lora_b, scale):
    return x.new_empty(x.shape[0], lora_b.shape[0]), x.new_empty(x.shape[0], lora_a.shape[0])


@torch.library.custom_op("primerl::lora_linear_triton_bwd", mutates_args=())
def _lora_linear_bwd(grad: Tensor, x: Tensor, weight: Optional[Tensor], lora_a: Tensor, lora_b: Tensor, xa: Tensor,
                     scale: float, need_x: bool, need_w: bool, need_a: bool,
                     need_b: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """grad [M, n] -> (dx [M, d], dw [n, d], dA [r, d], dB [n, r]); one not needed comes back empty."""
    dx, dw, da, db = (x.new_empty(0) for _ in range(4))  # distinct: a custom op's outputs may not alias
    if need_x or need_a:
        dxa = T.shrink(grad, _dense(lora_b.t()), None, "dense", scale, x.dtype)
        if need_x:
            if weight is not None:
                c = grad @ weight
                dx = T.expand(dxa, _dense(lora_a.t()), None, "dense", 1.0, c=c, out=c)
            else:
                dx = T.expand(dxa, _dense(lora_a.t()), None, "dense", 1.0)
        if need_a:
            da = dxa.t() @ x
    if need_w:
        dw = grad.t() @ x
    if need_b:
        db = (grad.t() @ xa).mul_(scale)
    return dx, dw, da, db


@_lora_linear_bwd.register_fake
def _(grad, x, weight, lora_a, lora_b, xa, scale, need_x, need_w, need_a, need_b):
    dx = torch.empty_like(x) if need_x else x.new_empty(0)
    dw = torch.empty_like(weight) if (need_w and weight is not None) else x.new_empty(0)
    da = torch.empty_like(lora_a) if need_a else x.new_empty(0)
    db = torch.empty_like(lora_b) if need_b else x.new_empty(0)
    return dx, dw, da, db


def _linear_setup(ctx, inputs, output):
    x, weight, base, lora_a, lora_b, scale = inputs
    ctx.save_for_backward(x, weight, lora_a, lora_b, output[1])
    ctx.scale = scale


def _linear_backward(ctx, grad, grad_xa):
    x, weight, lora_a, lora_b, xa = ctx.saved_tensors
    need_x, need_w, need_base, need_a, need_b = ctx.needs_input_grad[:5]
    need_w = need_w and weight is not None
    grad = grad.contiguous().to(x.dtype)
    dx, dw, da, db = torch.ops.primerl.lora_linear_triton_bwd(grad, x, weight, lora_a, lora_b, xa, ctx.scale,
                                                              need_x, need_w, need_a, need_b)
    return ((dx if need_x else None), (dw if need_w else None), (grad if need_base else None),
            (da if need_a else None), (db if need_b else None), None)


_lora_linear_fwd.register_autograd(_linear_backward, setup_context=_linear_setup)


def lora_linear(x: Tensor, weight: Optional[Tensor], lora_a: Tensor, lora_b: Tensor, scale: float,
                base: Optional[Tensor]) -> Tensor:
    """x [M, d] with weight [n, d] (base computed here, cuBLAS) or base [M, n] (computed by the
    caller, e.g. FP8) -> y [M, n]."""
    return _lora_linear_fwd(x.contiguous(), weight, base, lora_a.contiguous(), lora_b.contiguous(), scale)[0]


# ------------------------------------------------------------------------------ grouped_lora


def _wgrad(a: Tensor, b: Tensor, index: Tensor, kind: str, num_experts: int) -> Tensor:
    """[E, a cols, b cols] float32: a_e.T @ b_e over each expert's rows."""
    if kind == "offsets":
        return gemm_triton.k_grouped_gemm_tn(a, b, index, torch.float32)
    return gemm_triton.k_grouped_gemm_tn(a, b, _m_indices_segments(index, num_experts), torch.float32, index)


@torch.library.custom_op("primerl::grouped_lora_triton", mutates_args=())
def _grouped_fwd(x: Tensor, lora_a: Tensor, lora_b: Tensor, index: Tensor, kind: str,
                 scale: float) -> tuple[Tensor, Tensor]:
    """x [M, d], A [E, r, d], B [E, n, r], index offsets [E] / m_indices [M] -> (delta [M, n], xa [M, r])."""
    xa = T.shrink(x, lora_a, index, kind, 1.0, x.dtype)
    return T.expand(xa, lora_b, index, kind, scale), xa


@_grouped_fwd.register_fake
def _(x, lora_a, lora_b, index, kind, scale):
    return x.new_empty(x.shape[0], lora_b.shape[1]), x.new_empty(x.shape[0], lora_a.shape[1])


@torch.library.custom_op("primerl::grouped_lora_triton_bwd", mutates_args=())
def _grouped_bwd(grad: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, xa: Tensor, index: Tensor, kind: str,
                 scale: float, need_x: bool, need_a: bool, need_b: bool) -> tuple[Tensor, Tensor, Tensor]:
    """grad [M, n] -> (dx [M, d], dA [E, r, d], dB [E, n, r]); one not needed comes back empty."""
    dx, da, db = (x.new_empty(0) for _ in range(3))
    experts = lora_a.shape[0]
    if need_x or need_a:
        dxa = T.shrink(grad, lora_b.transpose(1, 2), index, kind, scale, x.dtype)
        if need_x:
            dx = T.expand(dxa, lora_a.transpose(1, 2), index, kind, 1.0)
        if need_a:
            da = _wgrad(dxa, x, index, kind, experts).to(lora_a.dtype)
    if need_b:
        db = _wgrad(grad, xa, index, kind, experts).mul_(scale).to(lora_b.dtype)
    return dx, da, db


@_grouped_bwd.register_fake
def _(grad, x, lora_a, lora_b, xa, index, kind, scale, need_x, need_a, need_b):
    dx = torch.empty_like(x) if need_x else x.new_empty(0)
    da = torch.empty_like(lora_a) if need_a else x.new_empty(0)
    return dx, da, (torch.empty_like(lora_b) if need_b else x.new_empty(0))


def _grouped_setup(ctx, inputs, output):
    x, lora_a, lora_b, index, kind, scale = inputs
    ctx.save_for_backward(x, lora_a, lora_b, output[1], index)
    ctx.kind, ctx.scale = kind, scale


def _grouped_backward(ctx, grad, grad_xa):
    x, lora_a, lora_b, xa, index = ctx.saved_tensors
    need_x, need_a, need_b = ctx.needs_input_grad[:3]
    dx, da, db = torch.ops.primerl.grouped_lora_triton_bwd(grad.contiguous().to(x.dtype), x, lora_a, lora_b, xa,
                                                           index, ctx.kind, ctx.scale, need_x, need_a, need_b)
    return (dx if need_x else None), (da if need_a else None), (db if need_b else None), None, None, None


_grouped_fwd.register_autograd(_grouped_backward, setup_context=_grouped_setup)


def grouped_lora(x: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float, index: Tensor, kind: str) -> Tensor:
    """x [M, d], A [E, r, d], B [E, n, r], index offsets [E] / m_indices [M] -> delta [M, n]."""
    return _grouped_fwd(x.contiguous(), lora_a.contiguous(), lora_b.contiguous(), index, kind, scale)[0]
