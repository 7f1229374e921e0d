"""FP8 (block-scaled) expert MLP on rows grouped by expert, with autograd.

Recipes (the names of primerl's FP8 training recipes):
  ``"blockwise"``            forward and data gradients in FP8 (activations 1x128, weights 128x128
                             scales, e4m3), weight gradients in bf16 from the saved activations;
  ``"blockwise_fp8_wgrad"``  the weight gradients in FP8 too (128-row column-wise scales per group).

Forward: x -> FP8 grouped GEMM with w13 -> SwiGLU fused with the 1x128 quantization of its output
(never rounded to bf16 first) -> FP8 grouped GEMM with w2. D and I must be multiples of 128.
"""

from __future__ import annotations

import torch

from . import reference

RECIPES = ("blockwise", "blockwise_fp8_wgrad")
BLOCK = 128


def recipe_name(recipe) -> str:
    """A recipe is its name or an object with a ``name`` attribute."""
    name = recipe if isinstance(recipe, str) else getattr(recipe, "name", None)
    if name not in RECIPES:
        raise ValueError(f"fp8 experts: recipe must be one of {RECIPES} (or have .name in them), got {recipe!r}")
    return name


def check_shapes(op: str, dim: int, moe_dim: int) -> None:
    if dim % BLOCK or moe_dim % BLOCK:
        raise ValueError(f"{op}: FP8 experts need D and I to be multiples of {BLOCK}, got D={dim}, I={moe_dim}")


def _wgrad(dy, x, ends, fp8: bool):
    """[E, N, K] = dy_g.T @ x_g per group, float32."""
    from ..gemm import k_grouped_fp8_gemm_tn_contiguous, k_grouped_gemm_tn, quant_per_group_colwise

    if fp8 and dy.shape[0] > 0:
        return k_grouped_fp8_gemm_tn_contiguous(
            quant_per_group_colwise(dy, ends), quant_per_group_colwise(x, ends), ends, out_dtype=torch.float32
        )
    return k_grouped_gemm_tn(dy, x.to(dy.dtype), ends, out_dtype=torch.float32)


class FP8GroupedExperts(torch.autograd.Function):
    """x_perm [M, D] grouped by expert (``ends`` [E] int32, ends[-1] == M) -> y_perm [M, D] (unweighted)."""

    @staticmethod
    def forward(ctx, x_perm, w13, w2, ends, recipe, impl):
        from ..fp8 import quant_per_block, quant_per_token_group
        from ..gemm import m_grouped_fp8_gemm_nt_offsets

        out_dtype = x_perm.dtype if x_perm.dtype != torch.float32 else torch.float32
        gu = m_grouped_fp8_gemm_nt_offsets(
            quant_per_token_group(x_perm, BLOCK), quant_per_block(w13), ends, out_dtype=torch.bfloat16
        )
        swiglu_quant = getattr(impl, "swiglu_quant", reference.swiglu_quant)
        h_q = swiglu_quant(gu, BLOCK, torch.float8_e4m3fn, False)
        y = m_grouped_fp8_gemm_nt_offsets(h_q, quant_per_block(w2), ends, out_dtype=out_dtype)
        ctx.save_for_backward(x_perm, gu, w13, w2, ends)
        ctx.recipe, ctx.impl = recipe, impl
        return y

    @staticmethod
    def backward(ctx, dy):
        from ..fp8 import quant_per_block, quant_per_token_group
        from ..gemm import m_grouped_fp8_gemm_nt_offsets

        x_perm, gu, w13, w2, ends = ctx.saved_tensors
        impl = ctx.impl
        fp8_wgrad = ctx.recipe == "blockwise_fp8_wgrad"
        dy = dy.contiguous().to(torch.bfloat16)
        swiglu = getattr(impl, "swiglu", reference.swiglu)
        swiglu_backward = getattr(impl, "swiglu_backward", reference.swiglu_backward)
        # data gradients in FP8: the weights re-quantized transposed, so scales follow the new K
        dh = m_grouped_fp8_gemm_nt_offsets(
            quant_per_token_group(dy, BLOCK), quant_per_block(w2.transpose(1, 2).contiguous()), ends,
            out_dtype=torch.bfloat16,
        )
        dgu = swiglu_backward(gu, dh)
        dx = m_grouped_fp8_gemm_nt_offsets(
            quant_per_token_group(dgu, BLOCK), quant_per_block(w13.transpose(1, 2).contiguous()), ends,
            out_dtype=x_perm.dtype,
        )
        dw2 = dw13 = None
        if ctx.needs_input_grad[2]:
            dw2 = _wgrad(dy, swiglu(gu), ends, fp8_wgrad).to(w2.dtype)
        if ctx.needs_input_grad[1]:
            dw13 = _wgrad(dgu, x_perm.to(torch.bfloat16), ends, fp8_wgrad).to(w13.dtype)
        return dx, dw13, dw2, None, None, None
