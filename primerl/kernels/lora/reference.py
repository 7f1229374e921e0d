"""Plain-PyTorch LoRA: the definition of what every backend computes (autograd through torch).

Legend: M rows (tokens), d input features, n output features, r rank, E experts (groups).

* ``lora_linear``: ``y[M, n] = x @ W.T + scale * (x @ A.T) @ B.T`` (+ bias), x [M, d], W [n, d],
  A [r, d], B [n, r]. The low-rank product is computed in x's dtype (``x @ A.T`` rounded to it,
  as an ``nn.Linear`` stack of A then B does).
* ``grouped_lora``: ``delta[M, n]``, rows of expert e: ``scale * (x_e @ A[e].T) @ B[e].T``, A
  [E, r, d], B [E, n, r]; rows in no group (past ``offsets[-1]``, or ``m_indices`` -1) are zero and
  their input is never read. The grouped products are the GEMM layer's reference grouped GEMM.

Inputs are assumed valid (the public functions in ``__init__`` check them).
"""

from __future__ import annotations

import torch

from ..gemm import reference as gemm_ref


def lora_delta(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """x [M, d], A [r, d], B [n, r] -> ``scale * (x @ A.T) @ B.T`` [M, n] in x's dtype."""
    return ((x @ lora_a.t()) @ lora_b.t()) * scale


def lora_linear(x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                scale: float) -> torch.Tensor:
    """x [M, d], weight [n, d] (x's dtype), A [r, d], B [n, r] -> [M, n]."""
    return x @ weight.t() + lora_delta(x, lora_a, lora_b, scale)


def grouped_lora(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                 index: torch.Tensor, kind: str) -> torch.Tensor:
    """x [M, d], A [E, r, d], B [E, n, r], index offsets [E] (``kind="offsets"``) or m_indices [M]
    (``kind="m_indices"``) -> delta [M, n] (scale included)."""
    if kind == "offsets":
        xa = gemm_ref.grouped_gemm_nt_offsets(x, lora_a, index, x.dtype)
        return gemm_ref.grouped_gemm_nt_offsets(xa, lora_b, index, x.dtype) * scale
    xa = gemm_ref.grouped_gemm_nt_m_indices(x, lora_a, index, x.dtype)
    return gemm_ref.grouped_gemm_nt_m_indices(xa, lora_b, index, x.dtype) * scale


def grouped_lora_loop(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                      offsets: torch.Tensor) -> torch.Tensor:
    """The per-expert loop (host offsets): the spec :func:`grouped_lora` is tested against, and the
    baseline of ``python -m bench lora_kernels``."""
    out = x.new_zeros(x.shape[0], lora_b.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = lora_delta(x[start:end], lora_a[e], lora_b[e], scale)
        start = end
    return out
