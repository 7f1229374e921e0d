"""FP8 (block-scaled) expert MLP on rows grouped by expert, with autograd.

Recipes (the names of primerl's FP8 training recipes):
  ``"blockwise"``            forward and data gradients in FP8 (activations 1x128, weights 128x128
                             scales, e4m3), weight gradients in bf16 from the saved activations;
  ``"blockwise_fp8_wgrad"``  the weight gradients in FP8 too (128-row column-wise scales per group);
  ``"rowwise"``              every GEMM (forward, dgrad, wgrad) on ``torch._scaled_grouped_mm`` with
                             one scale per row along its contraction dim (torchao / torchtitan's
                             recipe; see :mod:`primerl.kernels.fp8_rowwise`), SwiGLU in bf16.

Forward: x -> FP8 grouped GEMM with w13 -> SwiGLU fused with the 1x128 quantization of its output
(never rounded to bf16 first) -> FP8 grouped GEMM with w2. D and I must be multiples of 128.
"""

from __future__ import annotations

import torch

from . import reference

RECIPES = ("blockwise", "blockwise_fp8_wgrad", "rowwise")
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


def _wgrad(dy, x, ends, fp8: bool, out_dtype: torch.dtype):
    """[E, N, K] = dy_g.T @ x_g per group, float32 accumulation written in ``out_dtype`` (the
    weight's: a float32 [E, N, K] buffer next to the bf16 gradient was most of the FP8 path's extra
    peak memory). With ``fp8``, x arrives already column-quantized (saved so by forward)."""
    from ..gemm import k_grouped_fp8_gemm_tn_contiguous, k_grouped_gemm_tn, quant_per_group_colwise

    direct = out_dtype if out_dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    if fp8:  # dy quantized here, x by the caller
        dw = k_grouped_fp8_gemm_tn_contiguous(
            quant_per_group_colwise(dy, ends, layout="blocks"), x, ends, out_dtype=direct
        )
    else:
        dw = k_grouped_gemm_tn(dy, x.to(dy.dtype), ends, out_dtype=direct)
    return dw.to(out_dtype)


def _transposed_block_quant(w: torch.Tensor):
    """Block quantization of ``w.transpose(1, 2)`` from that of w (128x128 blocks map onto
    themselves, so the bits equal quantizing the transposed copy), transposing the 1-byte FP8
    tensor instead of materialising a transposed bf16 copy of the weights."""
    from ..fp8 import quant_per_block

    q, sf = quant_per_block(w)
    return q.transpose(1, 2).contiguous(), sf.transpose(1, 2).contiguous()


class FP8GroupedExperts(torch.autograd.Function):
    """x_perm [M, D] grouped by expert (``ends`` [E] int32, ends[-1] == M) -> y_perm [M, D] (unweighted).

    Saved for backward: gu [M, 2I] (bf16, for SwiGLU's backward; the SwiGLU output is recomputed)
    and the input: bf16 x_perm for ``"blockwise"`` (its bf16 weight gradient), or for
    ``"blockwise_fp8_wgrad"`` only its column-wise FP8 quantization (half the bytes). The
    transposed weights of the data gradients are re-quantized in backward (never kept)."""

    @staticmethod
    def forward(ctx, x_perm, w13, w2, ends, recipe, impl):
        from ..fp8 import quant_per_block, quant_per_token_group
        from ..gemm import m_grouped_fp8_gemm_nt_offsets, quant_per_group_colwise

        out_dtype = x_perm.dtype if x_perm.dtype != torch.float32 else torch.float32
        gu = m_grouped_fp8_gemm_nt_offsets(
            quant_per_token_group(x_perm, BLOCK), quant_per_block(w13), ends, out_dtype=torch.bfloat16
        )
        swiglu_quant = getattr(impl, "swiglu_quant", reference.swiglu_quant)
        h_q = swiglu_quant(gu, BLOCK, torch.float8_e4m3fn, False)
        y = m_grouped_fp8_gemm_nt_offsets(h_q, quant_per_block(w2), ends, out_dtype=out_dtype)
        del h_q
        fp8_wgrad = recipe == "blockwise_fp8_wgrad"
        if fp8_wgrad and x_perm.shape[0] > 0:
            xq, xsf = quant_per_group_colwise(x_perm.to(torch.bfloat16), ends, layout="blocks")
            ctx.save_for_backward(xq, xsf, gu, w13, w2, ends)
        else:
            ctx.save_for_backward(x_perm, gu, w13, w2, ends)
        ctx.fp8_wgrad, ctx.x_dtype = fp8_wgrad and x_perm.shape[0] > 0, x_perm.dtype
        ctx.impl = impl
        return y

    @staticmethod
    def backward(ctx, dy):
        from ..fp8 import quant_per_token_group
        from ..gemm import m_grouped_fp8_gemm_nt_offsets, quant_per_group_colwise

        if ctx.fp8_wgrad:
            xq, xsf, gu, w13, w2, ends = ctx.saved_tensors
            x_saved = (xq, xsf)
        else:
            x_perm, gu, w13, w2, ends = ctx.saved_tensors
            x_saved = x_perm.to(torch.bfloat16)
        impl = ctx.impl
        dy = dy.contiguous().to(torch.bfloat16)
        swiglu = getattr(impl, "swiglu", reference.swiglu)
        swiglu_backward = getattr(impl, "swiglu_backward", reference.swiglu_backward)
        # data gradients in FP8: the weights' blocks transposed, so scales follow the new K
        dh = m_grouped_fp8_gemm_nt_offsets(
            quant_per_token_group(dy, BLOCK), _transposed_block_quant(w2), ends, out_dtype=torch.bfloat16,
        )
        dgu = swiglu_backward(gu, dh)
        del dh
        dx = m_grouped_fp8_gemm_nt_offsets(
            quant_per_token_group(dgu, BLOCK), _transposed_block_quant(w13), ends, out_dtype=ctx.x_dtype,
        )
        dw2 = dw13 = None
        if ctx.needs_input_grad[2]:
            h = swiglu(gu)
            h_w = quant_per_group_colwise(h, ends, layout="blocks") if ctx.fp8_wgrad else h
            dw2 = _wgrad(dy, h_w, ends, ctx.fp8_wgrad, w2.dtype)
            del h_w, h
        if ctx.needs_input_grad[1]:
            dw13 = _wgrad(dgu, x_saved, ends, ctx.fp8_wgrad, w13.dtype)
        return dx, dw13, dw2, None, None, None



class RowwiseGroupedExperts(torch.autograd.Function):
    """The ``"rowwise"`` recipe: x_perm [M, D] grouped by expert (``ends`` [E]) -> y_perm [M, D].

    Saved for backward: x_perm and the gate/up output gu (bf16), as the bf16 path saves them; the
    SwiGLU output is recomputed from gu in backward instead of being kept."""

    @staticmethod
    def forward(ctx, x_perm, w13, w2, ends, impl):
        from ..fp8_rowwise import grouped_forward

        gu = grouped_forward(x_perm, w13, ends)
        h = getattr(impl, "swiglu", reference.swiglu)(gu)
        y = grouped_forward(h, w2, ends).to(x_perm.dtype)
        ctx.save_for_backward(x_perm, gu, w13, w2, ends)
        ctx.impl = impl
        return y

    @staticmethod
    def backward(ctx, dy):
        from ..fp8_rowwise import grouped_dgrad, grouped_wgrad

        x_perm, gu, w13, w2, ends = ctx.saved_tensors
        impl = ctx.impl
        dy = dy.contiguous().to(torch.bfloat16)
        dh = grouped_dgrad(dy, w2, ends)
        dgu = getattr(impl, "swiglu_backward", reference.swiglu_backward)(gu, dh)
        dx = grouped_dgrad(dgu, w13, ends).to(x_perm.dtype) if ctx.needs_input_grad[0] else None
        dw2 = dw13 = None
        if ctx.needs_input_grad[2]:
            dw2 = grouped_wgrad(dy, getattr(impl, "swiglu", reference.swiglu)(gu), ends, tail=False).to(w2.dtype)
        if ctx.needs_input_grad[1]:
            dw13 = grouped_wgrad(dgu, x_perm, ends, tail=False).to(w13.dtype)
        return dx, dw13, dw2, None, None
