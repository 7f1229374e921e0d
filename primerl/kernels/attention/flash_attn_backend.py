"""Optional backend: flash-attn's ``flash_attn_varlen_func`` (CUDA only, built by the user).

Covers what flash-attn covers: default positions (its causal mask is bottom-right aligned, as
ours), GQA, out and lse. Its lse is not differentiable and it has no block-backward entry point
with an external lse, so ``attention_backward`` and gradients through lse need another backend.
"""

from __future__ import annotations

import torch


def _call(q, k, v, spec):
    from flash_attn import flash_attn_varlen_func

    out, lse, _ = flash_attn_varlen_func(
        q, k, v, spec.cu_seqlens_q, spec.cu_seqlens_k, spec.max_seqlen_q, spec.max_seqlen_k,
        softmax_scale=spec.softmax_scale, causal=spec.causal, return_attn_probs=True,
    )
    if lse.shape != (q.shape[1], q.shape[0]):  # flash-attn < 2.5 returned a padded [B, H, max_seqlen] lse
        raise ValueError(f"flash_attn backend: softmax_lse has shape {tuple(lse.shape)}, expected "
                         f"{(q.shape[1], q.shape[0])}; upgrade flash-attn (>= 2.5)")
    return out, lse.float()


def forward(q, k, v, spec, out_dtype: torch.dtype):
    out, lse = _call(q, k, v, spec)
    return out.to(out_dtype), lse


def differentiable(q, k, v, spec):
    """(out, lse) with flash-attn's own autograd for out; lse is detached."""
    out, lse = _call(q, k, v, spec)
    return out, lse.detach()


def backward(dout, q, k, v, out, lse, dlse, spec):
    raise ValueError("attention_backward: backend 'flash_attn' has no block backward with an external lse; "
                     "use backend='triton' or 'torch'")
