"""Attention whose value heads are narrower or wider than its query/key heads (multi-head latent
attention: DeepSeek-V3 192/128, GLM-5 256/256).

The Triton backend (``backend="triton"``) runs kernels made for the two widths (:mod:`.mla_triton`:
each width split into two column parts of at most 128, 192 = 128 + 64, no tile padded). Every
other backend, and ring attention under context parallelism (:func:`pad_for_square` then a
slice), reduces the case to the square op :func:`primerl.kernels.attention.attention` by
zero-padding the narrower side (v to Dqk, or q and k to Dv with the softmax scale kept at
``Dqk ** -0.5``) and slicing the output: exact (the padded columns add 0 to every score; output
columns beyond Dv and their gradients are dropped), at the cost of the padded width in P @ V.
(The square op's Triton backend runs the same two-part kernels above head dim 128.) The sparse
form (DeepSeek sparse attention) takes Dv != Dqk natively: :mod:`primerl.kernels.sparse_attention`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .ops import _AttentionFn, _resolve, attention
from .spec import _make_spec


def pad_for_square(q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
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
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"mla_attention: {name} must be a 3-D tensor [tokens, heads, head_dim], got "
                             f"{tuple(getattr(t, 'shape', ())) or type(t)}")
    if k.shape[-1] != q.shape[-1] or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"mla_attention: k must be [Tk, Hkv, Dqk={q.shape[-1]}] and v [Tk, Hkv, Dv]; got k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    if v.shape[-1] != q.shape[-1] and backend == "triton":
        if v.dtype != q.dtype or v.device != q.device:
            raise ValueError(f"mla_attention: v must share q's dtype and device, got {v.dtype} on {v.device}")
        # validated as the square op validates (k stands in for v: same tokens and heads, checked above)
        spec = _make_spec("mla_attention", q, k, k, cu_seqlens, kwargs.get("cu_seqlens_k"), causal, scale,
                          kwargs.get("q_positions"), kwargs.get("k_positions"), kwargs.get("max_seqlen"),
                          kwargs.get("max_seqlen_k"))
        _, spec = _resolve("mla_attention", backend, q, spec)
        out, lse = _AttentionFn.apply(q, k, v, spec, "mla_triton")
        return (out, lse) if return_lse else out
    qp, kp, vp, dv = pad_for_square(q, k, v)
    res = attention(qp, kp, vp, cu_seqlens=cu_seqlens, causal=causal, softmax_scale=scale, return_lse=return_lse,
                    backend=backend, **kwargs)
    if return_lse:
        return res[0][..., :dv], res[1]
    return res[..., :dv]
