"""The "torch" backend: the float32 reference behind the common (spec-taking) interface."""

from __future__ import annotations

import torch

from . import reference


def forward(q, k, v, spec, out_dtype: torch.dtype):
    q_pos, k_pos = spec.positions()
    return reference.attention_forward(
        q, k, v, spec.cu_seqlens_q, spec.cu_seqlens_k, spec.causal, spec.softmax_scale, q_pos, k_pos,
        out_dtype=out_dtype,
    )


def backward(dout, q, k, v, out, lse, dlse, spec):
    q_pos, k_pos = spec.positions()
    return reference.attention_backward(
        dout, q, k, v, out, lse, dlse, spec.cu_seqlens_q, spec.cu_seqlens_k, spec.causal, spec.softmax_scale,
        q_pos, k_pos,
    )
