"""The "torch" backend: the float32 reference behind the common (spec-taking) interface.

``attention`` itself runs :func:`reference.attention_dense` (plain autograd). These two serve
``attention_forward`` / ``attention_backward`` (ring attention's blocks): in eager they walk the
batch sequence by sequence, trimmed to the visible rows and columns (a ring step with half its
keys in the future costs half; this reads the offsets on the host); while tracing
(torch.compile, FakeTensor, meta) they take the whole-block form, which needs no host read.
"""

from __future__ import annotations

import torch

from . import reference


def _tracing(q: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return torch.compiler.is_compiling() or q.is_meta or is_fake(q)


def _positions(spec, q, k):
    if spec.q_positions is not None:
        return spec.q_positions, spec.k_positions
    return reference.default_positions(spec.cu_seqlens_q, spec.cu_seqlens_k, q.shape[0], k.shape[0])



def forward(q, k, v, spec, out_dtype: torch.dtype):
    q_pos, k_pos = _positions(spec, q, k)
    fn = reference.attention_dense if _tracing(q) else reference.attention_forward
    return fn(q, k, v, spec.cu_seqlens_q, spec.cu_seqlens_k, spec.causal, spec.softmax_scale, q_pos, k_pos,
              out_dtype=out_dtype)


def backward(dout, q, k, v, out, lse, dlse, spec):
    q_pos, k_pos = _positions(spec, q, k)
    fn = reference.attention_backward_dense if _tracing(q) else reference.attention_backward
    return fn(dout, q, k, v, out, lse, dlse, spec.cu_seqlens_q, spec.cu_seqlens_k, spec.causal, spec.softmax_scale,
              q_pos, k_pos)
