"""The attention Triton launchers (:mod:`.triton`, :mod:`.mla_triton`) as ``torch.library`` custom
ops, so torch.compile, FakeTensorMode and meta tensors see each launch as one node with a fake
kernel (the launcher's output shapes and dtypes) instead of tracing into Triton.
``backend="triton"`` / ``"mla_triton"`` run these (:func:`primerl.kernels.attention.ops._impl`); under
AOT capture (:func:`primerl.kernels._opaque.launching_directly`) the raw launchers run instead.

The grids are sized by the longest sequence. ``max_seqlen_q`` / ``max_seqlen_k`` (the public ops'
``max_seqlen=`` / ``max_seqlen_k=``, flash-attn style) give it; when one is None the op reads
``cu_seqlens`` on the host itself, once per offsets tensor (cached,
:func:`primerl.kernels.attention.spec._host_spec`): that read stays inside the opaque op, so a traced
graph holds no data-dependent Python int and no graph break, and a caller that knows the lengths
(the batch builder) passes them and has no host read at all.

No autograd here: :class:`primerl.kernels.attention.ops._AttentionFn` calls the forward op and, in its
backward, the backward op.

Legend: T query tokens, Tk key tokens, Hq / Hkv query / key-value heads, D query/key width, Dv
value width (D except in the mla ops).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import mla_triton as M
from . import triton as T
from .spec import AttentionSpec, _host_spec


def _spec(cu_q, cu_k, q_pos, k_pos, causal, scale, max_q, max_k):
    spec = AttentionSpec(cu_q, cu_k, causal, scale, q_pos, k_pos, max_q, max_k)
    return _host_spec(spec, need_offsets=False)  # a host read of cu_seqlens only when a max_seqlen is None


def _fake_forward(q, k, v, out_dtype):
    return (q.new_empty(q.shape[0], q.shape[1], v.shape[2], dtype=out_dtype),
            q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32))


def _fake_backward(q, k, v):
    return tuple(t.new_empty(t.shape, dtype=torch.float32) for t in (q, k, v))


def _register_pair(name: str, kernels):
    """The forward and backward ops ``primerl::<name>_fwd_triton`` / ``_bwd_triton`` over the
    launchers of ``kernels`` (:mod:`.triton` or :mod:`.mla_triton`: the same interface)."""

    @torch.library.custom_op(f"primerl::{name}_fwd_triton", mutates_args=())
    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor, q_positions: Optional[torch.Tensor], k_positions: Optional[torch.Tensor],
            causal: bool, softmax_scale: float, max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
            out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        spec = _spec(cu_seqlens_q, cu_seqlens_k, q_positions, k_positions, causal, softmax_scale, max_seqlen_q,
                     max_seqlen_k)
        return kernels.forward(q, k, v, spec, out_dtype)

    @fwd.register_fake
    def _(q, k, v, cu_seqlens_q, cu_seqlens_k, q_positions, k_positions, causal, softmax_scale, max_seqlen_q,
          max_seqlen_k, out_dtype):
        return _fake_forward(q, k, v, out_dtype)

    @torch.library.custom_op(f"primerl::{name}_bwd_triton", mutates_args=())
    def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, dlse: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor, q_positions: Optional[torch.Tensor], k_positions: Optional[torch.Tensor],
            causal: bool, softmax_scale: float, max_seqlen_q: Optional[int],
            max_seqlen_k: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        spec = _spec(cu_seqlens_q, cu_seqlens_k, q_positions, k_positions, causal, softmax_scale, max_seqlen_q,
                     max_seqlen_k)
        return kernels.backward(dout, q, k, v, out, lse, dlse, spec)

    @bwd.register_fake
    def _(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, q_positions, k_positions, causal,
          softmax_scale, max_seqlen_q, max_seqlen_k):
        return _fake_backward(q, k, v)

    return fwd, bwd


_attention_fwd, _attention_bwd = _register_pair("attention", T)
_mla_fwd, _mla_bwd = _register_pair("mla_attention", M)


@torch.library.custom_op("primerl::merge_attn_states_triton", mutates_args=())
def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return T.merge_attn_states(out_a, lse_a, out_b, lse_b, inplace=False)


@_merge.register_fake
def _(out_a, lse_a, out_b, lse_b):
    return (torch.empty_like(T._last_dim_contiguous(out_a)),
            lse_a.new_empty(out_a.shape[1], out_a.shape[0], dtype=torch.float32))


@torch.library.custom_op("primerl::merge_attn_states_triton_", mutates_args=("out", "lse"))
def _merge_(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    T.merge_attn_states(out, lse, out_b, lse_b, inplace=True)


@_merge_.register_fake
def _(out, lse, out_b, lse_b):
    return None


# ------------------------------------------------------------------------------------------------
# The spec-taking backend interface of primerl.kernels.attention (forward / backward / merge)

def _flat(spec):
    return (spec.cu_seqlens_q, spec.cu_seqlens_k, spec.q_positions, spec.k_positions, spec.causal,
            spec.softmax_scale, spec.max_seqlen_q, spec.max_seqlen_k)


def forward(q, k, v, spec, out_dtype: torch.dtype):
    """q ``[T, Hq, D]``, k/v ``[Tk, Hkv, D]`` -> out ``[T, Hq, D]`` (out_dtype), lse ``[Hq, T]`` float32."""
    return _attention_fwd(q, k, v, *_flat(spec), out_dtype)


def backward(dout, q, k, v, out, lse, dlse, spec):
    """dq ``[T, Hq, D]``, dk/dv ``[Tk, Hkv, D]``, all float32."""
    return _attention_bwd(dout, q, k, v, out, lse, dlse, *_flat(spec))


def merge_attn_states(out_a, lse_a, out_b, lse_b, *, inplace: bool):
    if inplace:
        _merge_(out_a, lse_a, out_b, lse_b)
        return out_a, lse_a
    return _merge(out_a, lse_a, out_b, lse_b)


class MLA:
    """The same interface over the two-width kernels (:mod:`.mla_triton`, Dv != D)."""

    @staticmethod
    def forward(q, k, v, spec, out_dtype: torch.dtype):
        return _mla_fwd(q, k, v, *_flat(spec), out_dtype)

    @staticmethod
    def backward(dout, q, k, v, out, lse, dlse, spec):
        return _mla_bwd(dout, q, k, v, out, lse, dlse, *_flat(spec))

