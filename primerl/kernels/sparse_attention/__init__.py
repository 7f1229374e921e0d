"""DeepSeek sparse attention (DSA, GLM-5 / DeepSeek-V3.2): the lightning indexer's top-k key
selection and softmax attention restricted to the selected keys.

>>> import torch
>>> from primerl.kernels.sparse_attention import indexer_topk, sparse_attention
>>> cu = torch.tensor([0, 5, 12], dtype=torch.int32)                 # two sequences: 5 and 7 tokens
>>> qi, ki, w = torch.randn(12, 4, 32), torch.randn(12, 32), torch.randn(12, 4)
>>> idx = indexer_topk(qi, ki, w, cu_seqlens=cu, topk=4)             # [12, 4] int32 rows, -1 = none
>>> q, kv = torch.randn(12, 16, 48), torch.randn(12, 1, 48)          # absorbed MLA: 1 shared kv head
>>> out, lse = sparse_attention(q, kv, kv[..., :32], idx, return_lse=True)   # [12, 16, 32], [16, 12]

Semantics in :mod:`.reference`. Backends: ``"torch"`` (the reference; differentiable through
autograd), ``"triton"`` (the kernels in :mod:`.triton`, run as ``primerl::`` custom ops from
:mod:`.triton_ops`, traceable by torch.compile and FakeTensor; CUDA, or CPU under TRITON_INTERPRET=1).
``backend=None`` picks Triton on CUDA and the reference on CPU. The indexer is not
differentiable (an index is a discrete choice; see ``primerl/models/mla.py`` for the training
choice).
"""

from __future__ import annotations

import math

import torch

from .._args import check_int
from .._backend import resolve_backend
from .._value_checks import check_values
from . import reference

__all__ = ["indexer_topk", "sparse_attention"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SUPPORTED = ("torch", "triton")


def _check_float(op, name, t, ndim):
    if not isinstance(t, torch.Tensor) or t.dim() != ndim:
        raise ValueError(f"{op}: {name} must be a {ndim}-D tensor, got {tuple(getattr(t, 'shape', ())) or type(t)}")
    if t.dtype not in _DTYPES:
        raise ValueError(f"{op}: {name} dtype must be one of {_DTYPES}, got {t.dtype}")


def _check_cu(op, cu, total, device):
    """Shape, dtype and device in Python; the values on the device (no host read outside debug mode)."""
    if (not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2
            or cu.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"{op}: cu_seqlens must be an int32 tensor [B+1] with B >= 1, got "
                         f"{getattr(cu, 'dtype', type(cu))} {tuple(getattr(cu, 'shape', ()))}")
    if cu.device != device:
        raise ValueError(f"{op}: cu_seqlens is on {cu.device}, the tensors on {device}")
    ok = (cu[0] == 0) & (cu[-1] == total) & (cu.diff() >= 0).all()
    check_values(ok, f"{op}: cu_seqlens must start at 0, be non-decreasing and end at the token count",
                 lambda: f"end {total}; got {cu.tolist()[:8]}")
    return cu.to(torch.int32).contiguous()


def _triton_impl():
    """The Triton launchers as custom ops (traceable), or the raw launchers under AOT capture."""
    from .._opaque import launching_directly

    if launching_directly():
        from . import triton as impl
    else:
        from . import triton_ops as impl
    return impl


def indexer_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                 topk: int, softmax_scale: float | None = None, backend: str | None = None,
                 cu_seqlens_k: torch.Tensor | None = None, q_positions: torch.Tensor | None = None,
                 k_positions: torch.Tensor | None = None, max_seqlen: int | None = None,
                 max_seqlen_k: int | None = None) -> torch.Tensor:
    """The ``topk`` best causal keys per query by ``sum_h weights[t, h] * relu(scale * q[t, h] . k[s])``.

    q ``[T, Hi, Di]``, k ``[T, Di]`` (one key head shared by the indexer heads), weights ``[T, Hi]``
    -> int32 ``[T, topk]`` packed key rows, best first, -1 past the visible keys. ``softmax_scale``
    defaults to ``Di ** -0.5``. Not differentiable.

    Non-square form (context parallelism: a rank's queries against every rank's keys): pass
    ``cu_seqlens_k`` for k ``[Tk, Di]`` and both ``q_positions [T]`` / ``k_positions [Tk]``; query i
    of sequence b sees key j of sequence b iff ``0 <= k_positions[j] <= q_positions[i]``.

    ``max_seqlen`` (``max_seqlen_k``): the longest query (key) sequence, flash-attn style. Only the
    Triton backend needs it (grids and chunking); given, it runs without a host read, else its
    custom op reads ``cu_seqlens`` once inside (opaque to torch.compile, no graph break). The torch
    backend never reads the host.
    """
    op = "indexer_topk"
    _check_float(op, "q", q, 3)
    _check_float(op, "k", k, 2)
    _check_float(op, "weights", weights, 2)
    T, Hi, Di = q.shape
    Tk = T if cu_seqlens_k is None else k.shape[0]
    if k.shape != (Tk, Di):
        raise ValueError(f"{op}: k must have shape [T, Di]=({Tk}, {Di}), got {tuple(k.shape)}")
    if weights.shape != (T, Hi):
        raise ValueError(f"{op}: weights must have shape [T, Hi]=({T}, {Hi}), got {tuple(weights.shape)}")
    if not (q.device == k.device == weights.device):
        raise ValueError(f"{op}: q, k, weights must be on one device, got {q.device}, {k.device}, {weights.device}")
    topk = check_int(op, "topk", topk, min_value=1)
    for name, m in (("max_seqlen", max_seqlen), ("max_seqlen_k", max_seqlen_k)):
        if m is not None and not (isinstance(m, int) and m >= 0):
            raise ValueError(f"{op}: {name} must be a non-negative int (the longest sequence), got {m!r}")
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T], dtype=torch.int32, device=q.device)
    cu = _check_cu(op, cu_seqlens, T, q.device)
    q_pos = k_pos = cu_k = None
    if cu_seqlens_k is not None or q_positions is not None or k_positions is not None:
        if cu_seqlens_k is None or q_positions is None or k_positions is None:
            raise ValueError(f"{op}: the non-square form needs cu_seqlens_k, q_positions and k_positions together")
        cu_k = _check_cu(op, cu_seqlens_k, Tk, q.device)
        if cu_k.numel() != cu.numel():
            raise ValueError(f"{op}: cu_seqlens ({cu.numel() - 1} sequences) and "
                             f"cu_seqlens_k ({cu_k.numel() - 1}) differ")
        for name, pos, n in (("q_positions", q_positions, T), ("k_positions", k_positions, Tk)):
            if not isinstance(pos, torch.Tensor) or pos.shape != (n,) or pos.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{op}: {name} must be an int32 tensor [{n}], got {getattr(pos, 'dtype', type(pos))} "
                                 f"{tuple(getattr(pos, 'shape', ()))}")
        q_pos, k_pos = q_positions.to(torch.int32).contiguous(), k_positions.to(torch.int32).contiguous()
    scale = Di ** -0.5 if softmax_scale is None else float(softmax_scale)
    if not scale > 0:
        raise ValueError(f"{op}: softmax_scale must be positive, got {softmax_scale!r}")
    be = resolve_backend(op, backend, q.device, supported=_SUPPORTED, preference=("triton", "torch"))
    with torch.no_grad():
        if be == "torch":
            return reference.indexer_topk(q, k, weights, cu, topk, scale, cu_k, q_pos, k_pos)
        return _triton_impl().indexer_topk(q, k, weights, cu, topk, scale, cu_k, q_pos, k_pos, max_seqlen,
                                           max_seqlen_k)


class _SparseAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, scale):
        out, lse = _triton_impl().sparse_forward(q, k, v, indices, scale, q.dtype)
        ctx.save_for_backward(q, k, v, indices, out, lse)
        ctx.scale = scale
        # v a view of k's first columns (the absorbed MLA form): one fused dK/dV accumulation (the
        # backward checks the storage: a data pointer, which torch.compile cannot see here)
        ctx.fuse_kv = v._base is not None and (v._base is k or v._base is k._base)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, indices, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _triton_impl().sparse_backward(dout.contiguous(), q, k, v, indices, out, lse, dlse, ctx.scale,
                                          fuse_kv=ctx.fuse_kv)
        # dv None: v is a view of k's first columns and dk already holds its gradient there
        return dq.to(q.dtype), dk.to(k.dtype), (None if dv is None else dv.to(v.dtype)), None, None


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, *,
                     softmax_scale: float | None = None, return_lse: bool = False, backend: str | None = None):
    """Attention of each query over the keys it selected, differentiable in q, k, v (and through lse).

    q ``[T, Hq, Dqk]``, k ``[Tk, Hkv, Dqk]``, v ``[Tk, Hkv, Dv]`` (Hq a multiple of Hkv; Dv may
    differ from Dqk), indices int32 ``[T, K]`` rows of k/v (-1 = none; a row must not repeat a key)
    -> out ``[T, Hq, Dv]`` (q.dtype), and lse ``[Hq, T]`` float32 when ``return_lse``.
    ``softmax_scale`` defaults to ``Dqk ** -0.5``.
    """
    op = "sparse_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_float(op, name, t, 3)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{op}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device == getattr(indices, "device", None)):
        raise ValueError(f"{op}: q, k, v, indices must be on one device")
    T, Hq, D = q.shape
    Tk, Hkv, Dk = k.shape
    if v.shape[:2] != (Tk, Hkv) or Dk != D:
        raise ValueError(f"{op}: k must be [Tk, Hkv, Dqk={D}] and v [Tk, Hkv, Dv]; "
                         f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"{op}: query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if indices.dim() != 2 or indices.shape[0] != T or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: indices must be an int32 tensor [T={T}, K], "
                         f"got {indices.dtype} {tuple(indices.shape)}")
    if indices.numel():
        check_values(((indices >= -1) & (indices < Tk)).all(), f"{op}: indices must be in [-1, Tk)",
                     lambda: f"Tk={Tk}, got [{int(indices.min())}, {int(indices.max())}]")
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    if not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"{op}: softmax_scale must be a positive float, got {softmax_scale!r}")
    indices = indices.to(torch.int32).contiguous()
    be = resolve_backend(op, backend, q.device, supported=_SUPPORTED, preference=("triton", "torch"))
    if be == "torch":
        out, lse = reference.sparse_attention(q, k, v, indices, float(scale))
    else:
        out, lse = _SparseAttentionFn.apply(q, k, v, indices, float(scale))
    return (out, lse) if return_lse else out
