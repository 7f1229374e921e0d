"""The DeepSeek-sparse-attention Triton launchers (:mod:`.triton`) as ``torch.library`` custom ops,
so torch.compile, FakeTensorMode and meta tensors see one node with a fake kernel per launch
instead of tracing into Triton. ``backend="triton"`` runs these; under AOT capture
(:func:`primerl.kernels._opaque.launching_directly`) the raw launchers run instead.

- ``primerl::indexer_topk_triton``: the indexer's score chunks (:func:`.triton.indexer_scores_chunk`)
  and the top-k of each chunk (:func:`.triton.indexer_topk`) as one op, whose output ``[T, topk]``
  has a static shape (a chunk's scores are ``[chunk, max_seqlen]``: data-dependent). The grids
  and the chunking need the longest sequence: given (``max_seqlen`` / ``max_seqlen_k``), or read
  from ``cu_seqlens`` on the host inside the op.
- ``primerl::sparse_attention_fwd_triton`` / ``_bwd_triton``: attention over the gathered keys and
  its recomputing backward. ``fuse_kv`` (k and v are views of one tensor, the absorbed MLA form)
  with v in fact k's first Dv columns (checked on the real tensors inside the op): the backward
  returns dK + [dV, 0] as dk and zeros as dv (the gradient of the one tensor both view).

Legend: T query tokens, Tk key tokens, Hq / Hkv heads, Dqk / Dv widths, K selected keys, Hi / Di
the indexer's heads and width.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import triton as S


@torch.library.custom_op("primerl::indexer_topk_triton", mutates_args=())
def _indexer_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, cu_seqlens: torch.Tensor,
                  cu_seqlens_k: Optional[torch.Tensor], q_positions: Optional[torch.Tensor],
                  k_positions: Optional[torch.Tensor], topk: int, softmax_scale: float, max_seqlen: Optional[int],
                  max_seqlen_k: Optional[int]) -> torch.Tensor:
    return S.indexer_topk(q, k, weights, cu_seqlens, topk, softmax_scale, cu_seqlens_k, q_positions, k_positions,
                          max_seqlen, max_seqlen_k)


@_indexer_topk.register_fake
def _(q, k, weights, cu_seqlens, cu_seqlens_k, q_positions, k_positions, topk, softmax_scale, max_seqlen,
      max_seqlen_k):
    return q.new_empty(q.shape[0], topk, dtype=torch.int32)


@torch.library.custom_op("primerl::sparse_attention_fwd_triton", mutates_args=())
def _sparse_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return S.sparse_forward(q, k, v, indices, softmax_scale, out_dtype)


@_sparse_fwd.register_fake
def _(q, k, v, indices, softmax_scale, out_dtype):
    return (q.new_empty(q.shape[0], q.shape[1], v.shape[2], dtype=out_dtype),
            q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32))


@torch.library.custom_op("primerl::sparse_attention_bwd_triton", mutates_args=())
def _sparse_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor], softmax_scale: float,
                fuse_kv: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = S.sparse_backward(dout, q, k, v, indices, out, lse, dlse, softmax_scale, fuse_kv=fuse_kv)
    # fused (k and v share storage: decided here, on the real tensors): dk holds both gradients and
    # v's is zero, which autograd adds into the same tensor's gradient (a fake kernel cannot know
    # the storage, so the output always has v's shape)
    return dq, dk, torch.zeros_like(v, dtype=torch.float32) if dv is None else dv


@_sparse_bwd.register_fake
def _(dout, q, k, v, indices, out, lse, dlse, softmax_scale, fuse_kv):
    return tuple(t.new_empty(t.shape, dtype=torch.float32) for t in (q, k, v))


def indexer_topk(q, k, weights, cu_seqlens, topk, softmax_scale, cu_seqlens_k=None, q_positions=None,
                 k_positions=None, max_seqlen=None, max_seqlen_k=None) -> torch.Tensor:
    return _indexer_topk(q, k, weights, cu_seqlens, cu_seqlens_k, q_positions, k_positions, topk, softmax_scale,
                         max_seqlen, max_seqlen_k)


def sparse_forward(q, k, v, indices, softmax_scale: float, out_dtype: torch.dtype):
    return _sparse_fwd(q, k, v, indices, softmax_scale, out_dtype)


def sparse_backward(dout, q, k, v, indices, out, lse, dlse, softmax_scale: float, fuse_kv: bool = False):
    """As :func:`.triton.sparse_backward`, but dv is zeros (not None) where the kernel fused it into dk."""
    return _sparse_bwd(dout, q, k, v, indices, out, lse, dlse, softmax_scale, fuse_kv)
