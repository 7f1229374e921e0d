"""The block forward / backward of the backends that read the offsets on the host ("sdpa": runs of
equal-length sequences; "torch": ``attention_forward`` / ``attention_backward`` walking the batch
sequence by sequence) as ``torch.library`` custom ops. The host read (``cu_seqlens.tolist()``)
happens inside the op's own body, so torch.compile (fullgraph), FakeTensorMode and meta tensors see
one node with a fake kernel (the output shapes and dtypes) and no data-dependent Python int, and a
compiled graph runs the very same eager code: bitwise the eager results.

``primerl::attention_fwd_<backend>`` -> (out ``[T, Hq, D]`` in ``out_dtype``, lse ``[Hq, T]``
float32); ``primerl::attention_bwd_<backend>`` -> (dq ``[T, Hq, D]``, dk, dv ``[Tk, Hkv, D]``),
float32. No autograd here (``ops._AttentionFn`` calls the backward op in its backward).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _torch_impl, sdpa
from .spec import AttentionSpec

__all__ = ["SDPA", "TORCH"]


def _register(backend: str, impl):
    @torch.library.custom_op(f"primerl::attention_fwd_{backend}", mutates_args=())
    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor, q_positions: Optional[torch.Tensor], k_positions: Optional[torch.Tensor],
            causal: bool, softmax_scale: float, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        spec = AttentionSpec(cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, q_positions, k_positions)
        out, lse = impl.forward(q, k, v, spec, out_dtype)
        return out.contiguous(), lse.contiguous()

    @fwd.register_fake
    def _(q, k, v, cu_seqlens_q, cu_seqlens_k, q_positions, k_positions, causal, softmax_scale, out_dtype):
        return (q.new_empty(q.shape[0], q.shape[1], v.shape[2], dtype=out_dtype),
                q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32))

    @torch.library.custom_op(f"primerl::attention_bwd_{backend}", mutates_args=())
    def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, dlse: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor, q_positions: Optional[torch.Tensor], k_positions: Optional[torch.Tensor],
            causal: bool, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        spec = AttentionSpec(cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, q_positions, k_positions)
        return tuple(g.float().contiguous() for g in impl.backward(dout, q, k, v, out, lse, dlse, spec))

    @bwd.register_fake
    def _(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, q_positions, k_positions, causal,
          softmax_scale):
        return tuple(t.new_empty(t.shape, dtype=torch.float32) for t in (q, k, v))

    return fwd, bwd


def _flat(spec):
    return (spec.cu_seqlens_q, spec.cu_seqlens_k, spec.q_positions, spec.k_positions, spec.causal,
            spec.softmax_scale)


class _Backend:
    """The spec-taking interface of ``ops._impl`` (forward / backward) over one backend's ops."""

    def __init__(self, backend: str, impl):
        self.name = backend
        self._fwd, self._bwd = _register(backend, impl)

    def forward(self, q, k, v, spec, out_dtype: torch.dtype):
        return self._fwd(q, k, v, *_flat(spec), out_dtype)

    def backward(self, dout, q, k, v, out, lse, dlse, spec):
        return self._bwd(dout, q, k, v, out, lse, dlse, *_flat(spec))


SDPA = _Backend("sdpa", sdpa)
TORCH = _Backend("torch", _torch_impl)
