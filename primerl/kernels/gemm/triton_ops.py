"""The GEMM Triton launchers (:mod:`.triton`, :mod:`.triton_fp8`) as ``torch.library`` custom ops,
so torch.compile and FakeTensorMode see each as one node with a fake kernel (the output shapes of
:mod:`.reference`) instead of tracing into a Triton launch. ``backend="triton"`` runs through this
module (see :func:`.dispatch.backend_module`); it has the interface of the launchers in :mod:`.triton`.

The 16/32-bit GEMMs are differentiated by the autograd Functions of :mod:`._triton_autograd`, whose
backwards call these ops too; the FP8 ops and the quantizer are not differentiable.

The FP8 GEMMs take DeepGEMM's output argument ``d``: their ops write it in place
(``mutates_args=("d",)``: no copy in eager; torch.compile functionalizes the write) and return
nothing, the wrappers return ``d``. ``c`` may be ``d`` itself (accumulate in place): the kernels read
each element of C before they write it.

Legend: M rows, N output features, K reduction, G groups, T rows of a K-grouped operand, R scale
blocks (``max_group_blocks(T, G)``).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import triton as T
from .layout import BLOCK
from .offsets import max_group_blocks

Tensor = torch.Tensor

# ------------------------------------------------------------------------------ 16/32-bit


@torch.library.custom_op("primerl::gemm_nt_triton", mutates_args=())
def _gemm_nt(a: Tensor, b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a [M, K], b [N, K] (any strides) -> [M, N]."""
    return T.gemm_nt(a, b, out_dtype)


@_gemm_nt.register_fake
def _(a, b, out_dtype):
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


@torch.library.custom_op("primerl::grouped_gemm_nt_offsets_triton", mutates_args=())
def _grouped_offsets(a: Tensor, b: Tensor, offsets: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a [M, K], b [G, N, K] (any strides), offsets [G] -> [M, N]."""
    return T.grouped_gemm_nt_offsets(a, b, offsets, out_dtype)


@torch.library.custom_op("primerl::grouped_gemm_nt_m_indices_triton", mutates_args=())
def _grouped_m_indices(a: Tensor, b: Tensor, m_indices: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a [M, K], b [G, N, K] (any strides), m_indices [M] -> [M, N]."""
    return T.grouped_gemm_nt_m_indices(a, b, m_indices, out_dtype)


@_grouped_offsets.register_fake
def _(a, b, offsets, out_dtype):
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)


@_grouped_m_indices.register_fake
def _(a, b, m_indices, out_dtype):
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)


@torch.library.custom_op("primerl::k_grouped_gemm_tn_triton", mutates_args=())
def _k_grouped(a: Tensor, b: Tensor, offsets: Tensor, m_indices: Optional[Tensor], out_dtype: torch.dtype) -> Tensor:
    """a [T, N], b [T, K], offsets [G] (m_indices [T]: -1 rows skipped) -> [G, N, K]."""
    return T.k_grouped_gemm_tn(a, b, offsets, out_dtype, m_indices)


@_k_grouped.register_fake
def _(a, b, offsets, m_indices, out_dtype):
    return a.new_empty(offsets.shape[0], a.shape[1], b.shape[1], dtype=out_dtype)


def gemm_nt(a, b, out_dtype):
    return _gemm_nt(a, b, out_dtype)


def grouped_gemm_nt_offsets(a, b, offsets, out_dtype):
    return _grouped_offsets(a, b, offsets, out_dtype)


def grouped_gemm_nt_m_indices(a, b, m_indices, out_dtype):
    return _grouped_m_indices(a, b, m_indices, out_dtype)


def k_grouped_gemm_tn(a, b, offsets, out_dtype, m_indices=None):
    return _k_grouped(a, b, offsets, m_indices, out_dtype)


# ------------------------------------------------------------------------------ FP8 GEMMs


@torch.library.custom_op("primerl::fp8_gemm_nt_triton", mutates_args=("d",))
def _fp8_gemm_nt(aq: Tensor, asf: Tensor, bq: Tensor, bsf: Tensor, d: Tensor, c: Optional[Tensor],
                 sb_gran: int) -> None:
    """d [M, N] = (aq [M, K], asf [M, K/128]) @ (bq [N, K], bsf).T (+ c [M, N] float32)."""
    T.fp8_gemm_nt((aq, asf), (bq, bsf), d, c, sb_gran)


@_fp8_gemm_nt.register_fake
def _(aq, asf, bq, bsf, d, c, sb_gran):
    return None


@torch.library.custom_op("primerl::m_grouped_fp8_gemm_nt_contiguous_triton", mutates_args=("d",))
def _fp8_contiguous(aq: Tensor, asf: Tensor, bq: Tensor, bsf: Tensor, m_indices: Tensor, d: Tensor,
                    sb_gran: int) -> None:
    """d [M, N]: row i = A[i] @ B[m_indices[i]].T, padding rows (-1) zero."""
    T.m_grouped_fp8_gemm_nt_contiguous((aq, asf), (bq, bsf), m_indices, d, sb_gran)


@_fp8_contiguous.register_fake
def _(aq, asf, bq, bsf, m_indices, d, sb_gran):
    return None


@torch.library.custom_op("primerl::m_grouped_fp8_gemm_nt_offsets_triton", mutates_args=())
def _fp8_offsets(aq: Tensor, asf: Tensor, bq: Tensor, bsf: Tensor, offsets: Tensor, out_dtype: torch.dtype) -> Tensor:
    """aq [M, K], bq [G, N, K] (block scales), offsets [G] -> [M, N] (rows past offsets[-1] zero)."""
    return T.m_grouped_fp8_gemm_nt_offsets((aq, asf), (bq, bsf), offsets, out_dtype)


@_fp8_offsets.register_fake
def _(aq, asf, bq, bsf, offsets, out_dtype):
    return aq.new_empty(aq.shape[0], bq.shape[1], dtype=out_dtype)


@torch.library.custom_op("primerl::m_grouped_fp8_gemm_nt_masked_triton", mutates_args=("d",))
def _fp8_masked(aq: Tensor, asf: Tensor, bq: Tensor, bsf: Tensor, masked_m: Tensor, expected_m: int, d: Tensor,
                sb_gran: int) -> None:
    """d [G, max_m, N]: rows past masked_m[g] neither read nor written."""
    T.m_grouped_fp8_gemm_nt_masked((aq, asf), (bq, bsf), masked_m, expected_m, d, sb_gran)


@_fp8_masked.register_fake
def _(aq, asf, bq, bsf, masked_m, expected_m, d, sb_gran):
    return None


@torch.library.custom_op("primerl::k_grouped_fp8_gemm_tn_triton", mutates_args=("d",))
def _fp8_k_grouped(aq: Tensor, asf: Tensor, bq: Tensor, bsf: Tensor, offsets: Tensor, d: Tensor,
                   c: Optional[Tensor]) -> None:
    """d [G, N, K] = A_g.T @ B_g (+ c): aq [T, N] or group blocks [R, N, 128], asf [R, N]; b likewise."""
    T.k_grouped_fp8_gemm_tn_contiguous((aq, asf), (bq, bsf), offsets, d.dtype, d, c)


@_fp8_k_grouped.register_fake
def _(aq, asf, bq, bsf, offsets, d, c):
    return None


def fp8_gemm_nt(a, b, d, c=None, sb_gran=BLOCK):
    _fp8_gemm_nt(a[0], a[1], b[0], b[1], d, c, sb_gran)
    return d


def m_grouped_fp8_gemm_nt_contiguous(a, b, m_indices, d, sb_gran=BLOCK):
    _fp8_contiguous(a[0], a[1], b[0], b[1], m_indices, d, sb_gran)
    return d


def m_grouped_fp8_gemm_nt_offsets(a, b, offsets, out_dtype):
    return _fp8_offsets(a[0], a[1], b[0], b[1], offsets, out_dtype)


def m_grouped_fp8_gemm_nt_masked(a, b, masked_m, expected_m, d, sb_gran=BLOCK):
    _fp8_masked(a[0], a[1], b[0], b[1], masked_m, expected_m, d, sb_gran)
    return d


def k_grouped_fp8_gemm_tn_contiguous(a, b, offsets, out_dtype, d=None, c=None):
    if d is None:
        d = torch.empty(offsets.shape[0], a[1].shape[1], b[1].shape[1], dtype=out_dtype, device=a[0].device)
    _fp8_k_grouped(a[0], a[1], b[0], b[1], offsets, d, c)
    return d


# ------------------------------------------------------------------------------ colwise quantizer


@torch.library.custom_op("primerl::quant_per_group_colwise_triton", mutates_args=())
def _colwise(x: Tensor, offsets: Tensor, dtype: torch.dtype, ue8m0: bool, rounding: str,
             layout: str) -> tuple[Tensor, Tensor]:
    """x [T, C], offsets [G] -> q [T, C] ("rows") or [R, C, 128] ("blocks") fp8, sf [R, C] float32."""
    return T.quant_per_group_colwise(x, offsets, dtype, ue8m0, rounding, layout)


@_colwise.register_fake
def _(x, offsets, dtype, ue8m0, rounding, layout):
    t, c = x.shape
    bound = max_group_blocks(t, offsets.shape[0])
    q = x.new_empty((bound, c, BLOCK) if layout == "blocks" else (t, c), dtype=dtype)
    return q, x.new_empty(bound, c, dtype=torch.float32)


def quant_per_group_colwise(x, offsets, dtype, ue8m0, rounding="reciprocal", layout="rows"):
    return _colwise(x, offsets, dtype, ue8m0, rounding, layout)
