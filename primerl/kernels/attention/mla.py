"""Attention whose value heads are narrower or wider than its query/key heads (multi-head latent
attention: DeepSeek-V3 192/128, GLM-5 256/256).

``mla_attention`` reduces the case to the square op :func:`primerl.kernels.attention.attention`
by zero-padding the narrower side (v to Dqk, or q and k to Dv with the softmax scale kept at
``Dqk ** -0.5``) and slicing the output: exact (the padded columns add 0 to every score and every
output column beyond Dv is dropped; their gradients are sliced away), and every backend of the
square op (reference, Triton, SDPA, ring attention under context parallelism via
:func:`pad_for_square` / the slice) serves MLA unchanged. The cost is the padded width in the
P @ V product (1.5x on that product at 192/128). The sparse form (DeepSeek sparse attention)
takes Dv != Dqk natively: :mod:`primerl.kernels.sparse_attention`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def pad_for_square(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(q, k, v, Dv) with the narrower side zero-padded so all three share a head dim."""
    dqk, dv = q.shape[-1], v.shape[-1]
    if dv < dqk:
        v = F.pad(v, (0, dqk - dv))
    elif dv > dqk:
        q, k = F.pad(q, (0, dv - dqk)), F.pad(k, (0, dv - dqk))
    return q, k, v, dv


def mla_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                  causal: bool = True, softmax_scale: float | None = None, return_lse: bool = False,
                  backend: str | None = None, **kwargs):
    """q ``[T, Hq, Dqk]``, k ``[Tk, Hkv, Dqk]``, v ``[Tk, Hkv, Dv]`` -> out ``[T, Hq, Dv]`` (and lse
    ``[Hq, T]`` float32). ``softmax_scale`` defaults to ``Dqk ** -0.5``; other keywords as
    :func:`primerl.kernels.attention.attention` (``cu_seqlens_k``, positions)."""
    from . import attention

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"mla_attention: {name} must be a 3-D tensor [tokens, heads, head_dim], got "
                             f"{tuple(getattr(t, 'shape', ())) or type(t)}")
    if k.shape[-1] != q.shape[-1] or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"mla_attention: k must be [Tk, Hkv, Dqk={q.shape[-1]}] and v [Tk, Hkv, Dv]; got k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    qp, kp, vp, dv = pad_for_square(q, k, v)
    res = attention(qp, kp, vp, cu_seqlens=cu_seqlens, causal=causal, softmax_scale=scale, return_lse=return_lse,
                    backend=backend, **kwargs)
    if return_lse:
        return res[0][..., :dv], res[1]
    return res[..., :dv]
