"""The frozen FP8 base GEMM of :func:`primerl.kernels.lora.lora_linear`: ``y = x @ W.T`` with W
stored in the GEMM layer's FP8 form ``(wq [n, d] e4m3, wsf [n/128, d/128] float32)`` (what
:func:`primerl.kernels.fp8.quant_per_block` returns; DeepSeek-V3's 128x128 block recipe, a
checkpoint's ``weight`` + ``weight_scale_inv``).

DeepSeek-V3's blockwise recipe for the two GEMMs a frozen weight takes part in: forward with x
quantized per 1x128 token group, dgrad ``dx = dy @ W`` with dy quantized likewise and W's 128x128
blocks transposed (a block of W.T is the transpose of a block of W: no requantization). No weight
gradient: an FP8 weight is frozen. One ``torch.library`` op each way, with fake kernels, so
torch.compile sees single nodes.

Legend: M rows, d input features, n output features.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..fp8 import quant_per_token_group
from ..gemm import fp8_gemm_nt

BLOCK = 128


def _quant_backend(backend: Optional[str]) -> Optional[str]:
    return backend if backend in ("torch", "triton") else None


@torch.library.custom_op("primerl::lora_fp8_base_fwd", mutates_args=())
def fp8_base_fwd(x: torch.Tensor, wq: torch.Tensor, wsf: torch.Tensor, backend: Optional[str]) -> torch.Tensor:
    """x [M, d] (16/32-bit), wq [n, d] fp8, wsf [n/128, d/128] -> [M, n] in x's dtype."""
    a = quant_per_token_group(x, BLOCK, backend=_quant_backend(backend))
    return fp8_gemm_nt(a, (wq, wsf), out_dtype=x.dtype, backend=backend)


@fp8_base_fwd.register_fake
def _(x, wq, wsf, backend):
    return x.new_empty(x.shape[0], wq.shape[0])


@torch.library.custom_op("primerl::lora_fp8_base_bwd", mutates_args=())
def fp8_base_bwd(grad: torch.Tensor, wq: torch.Tensor, wsf: torch.Tensor, backend: Optional[str]) -> torch.Tensor:
    """grad [M, n] -> dx [M, d] = grad @ W (FP8, transposed blocks)."""
    g = quant_per_token_group(grad, BLOCK, backend=_quant_backend(backend))
    wt = (wq.t().contiguous(), wsf.t().contiguous())
    return fp8_gemm_nt(g, wt, out_dtype=grad.dtype, backend=backend)


@fp8_base_bwd.register_fake
def _(grad, wq, wsf, backend):
    return grad.new_empty(grad.shape[0], wq.shape[1])


def _setup(ctx, inputs, output):
    x, wq, wsf, backend = inputs
    ctx.save_for_backward(wq, wsf)
    ctx.backend, ctx.x_dtype = backend, x.dtype


def _backward(ctx, grad):
    wq, wsf = ctx.saved_tensors
    dx = None
    if ctx.needs_input_grad[0]:
        dx = torch.ops.primerl.lora_fp8_base_bwd(grad.contiguous().to(ctx.x_dtype), wq, wsf, ctx.backend)
    return dx, None, None, None


fp8_base_fwd.register_autograd(_backward, setup_context=_setup)


def fp8_base(x: torch.Tensor, wq: torch.Tensor, wsf: torch.Tensor, backend: Optional[str]) -> torch.Tensor:
    """x [M, d], (wq [n, d], wsf) -> [M, n]; differentiable in x; no rows: an empty product."""
    if x.shape[0] == 0:
        return x.new_zeros(0, wq.shape[0])
    return fp8_base_fwd(x.contiguous(), wq, wsf.contiguous(), backend)
