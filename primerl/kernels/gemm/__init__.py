"""GEMMs for dense and MoE layers: ``D = A @ B.T`` (NT), FP8 block-scaled and bf16.

FP8 operands are ``(q, sf)`` pairs from :mod:`primerl.kernels.fp8`: A quantized per token group
(``quant_per_token_group(x, 128)``: sf ``[M, K/128]``), B per 128x128 block
(``quant_per_block(w)``: sf ``[(G,) ceil(N/128), K/128]``, recipe (1, 128, 128)) or per row
(``quant_per_token_group(w, 128)``, recipe (1, 1, 128)). Accumulation is float32. The FP8 ops take
DeepGEMM's arguments (output ``d``, accumulator ``c``, ``recipe``, packed UE8M0 scales, psum
layout, ``ks``): see :mod:`.fp8_gemm`; scale layouts: :mod:`.layout`.

Grouped layouts (see :mod:`.offsets`): ``offsets[G]`` cumulative end rows, ``m_indices[M]`` the
group of each row (-1 = padding; groups aligned to :func:`get_mk_alignment_for_contiguous_layout`,
128 unless set), DeepGEMM's ``psum[G]``, or masked ``[G, max_m, K]``.

Backends (``backend=None`` picks): CPU tensors -> ``"torch"`` (the reference: dequantize, fp32
GEMM). CUDA -> dense FP8 ``fp8_gemm_nt`` ``"cublas"`` (torch's cuBLAS blockwise ``F.scaled_mm``,
SM90, see :mod:`.cublas`) where it applies; FP8 ops ``"deep_gemm"`` when importable and the output
is bf16, else ``"triton"``;
bf16 ``gemm_nt`` / ``grouped_gemm_nt`` -> ``"torch"`` (cuBLAS, ``torch._grouped_mm``);
k-grouped ops and the colwise quantizer -> ``"triton"``.

>>> import torch
>>> from primerl.kernels.fp8 import quant_per_token_group, quant_per_block
>>> from primerl.kernels.gemm import fp8_gemm_nt, grouped_gemm_nt
>>> x, w = torch.randn(4, 256), torch.randn(128, 256)
>>> y = fp8_gemm_nt(quant_per_token_group(x, 128), quant_per_block(w))      # [4, 128] bf16
>>> offs = torch.tensor([1, 4], dtype=torch.int32)
>>> z = grouped_gemm_nt(x, torch.randn(2, 64, 256), offs)                   # [4, 64]
"""

from __future__ import annotations

import torch

from .._backend import resolve_backend
from . import reference
from .layout import (
    RECIPES,
    get_mn_major_tma_aligned_packed_ue8m0_tensor,
    get_mn_major_tma_aligned_tensor,
    get_tma_aligned_size,
    pack_ue8m0,
    transform_sf_into_required_layout,
    unpack_ue8m0,
)
from .offsets import (
    align_counts,
    counts_to_offsets,
    counts_to_psum,
    from_masked,
    get_m_alignment,
    get_mk_alignment_for_contiguous_layout,
    get_theoretical_mk_alignment_for_contiguous_layout,
    group_block_starts,
    m_indices_to_counts,
    max_group_blocks,
    max_padded_rows,
    offsets_to_counts,
    offsets_to_m_indices,
    offsets_to_starts,
    pad_to_contiguous,
    psum_to_m_indices,
    set_mk_alignment_for_contiguous_layout,
    to_masked,
    unpad_from_contiguous,
)

__all__ = [
    "fp8_gemm_nt",
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_offsets",
    "m_grouped_fp8_gemm_nt_masked",
    "k_grouped_fp8_gemm_tn_contiguous",
    "quant_per_group_colwise",
    "gemm_nt",
    "grouped_gemm_nt",
    "k_grouped_gemm_tn",
    "get_m_alignment",
    "get_mk_alignment_for_contiguous_layout",
    "set_mk_alignment_for_contiguous_layout",
    "get_theoretical_mk_alignment_for_contiguous_layout",
    "RECIPES",
    "get_tma_aligned_size",
    "get_mn_major_tma_aligned_tensor",
    "get_mn_major_tma_aligned_packed_ue8m0_tensor",
    "transform_sf_into_required_layout",
    "pack_ue8m0",
    "unpack_ue8m0",
    "counts_to_psum",
    "psum_to_m_indices",
    "counts_to_offsets",
    "offsets_to_counts",
    "offsets_to_starts",
    "offsets_to_m_indices",
    "m_indices_to_counts",
    "align_counts",
    "max_padded_rows",
    "pad_to_contiguous",
    "unpad_from_contiguous",
    "to_masked",
    "from_masked",
    "group_block_starts",
    "max_group_blocks",
]

from ._checks import (  # noqa: E402
    _FLOAT_DTYPES,
    FP8_DTYPES,  # noqa: F401
    _check_index,
    _check_offsets_content,
    _check_m_indices_content,
    _check_same_device,
    _check_tensor,
)
from .dispatch import CUBLAS_FIRST, PLAIN_BACKENDS, backend_module  # noqa: E402
from .layout import BLOCK  # noqa: E402
from .fp8_gemm import (  # noqa: E402
    fp8_gemm_nt,
    k_grouped_fp8_gemm_tn_contiguous,
    m_grouped_fp8_gemm_nt_contiguous,
    m_grouped_fp8_gemm_nt_masked,
    m_grouped_fp8_gemm_nt_offsets,
    quant_per_group_colwise,
)


# ------------------------------------------------------------------------------ bf16 twins


def gemm_nt(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype | None = None,
            backend: str | None = None) -> torch.Tensor:
    """``D[M, N] = a[M, K] @ b[N, K].T`` with float32 accumulation; differentiable."""
    op = "gemm_nt"
    _check_tensor(op, "a", a, 2, _FLOAT_DTYPES)
    _check_tensor(op, "b", b, 2, (a.dtype,))
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"{op}: K mismatch, a is {tuple(a.shape)} and b is {tuple(b.shape)}")
    out_dtype = a.dtype if out_dtype is None else out_dtype
    dev = _check_same_device(op, a=a, b=b)
    be = resolve_backend(op, backend, dev, supported=PLAIN_BACKENDS, preference=CUBLAS_FIRST)
    if be == "triton":
        from . import _triton_autograd

        return _triton_autograd.gemm_nt(a, b, out_dtype, backend_module(be))
    return reference.gemm_nt(a, b, out_dtype)


def _infer_layout(op: str, index: torch.Tensor, num_rows: int, num_groups: int, layout: str | None) -> str:
    if layout is not None:
        if layout not in ("offsets", "m_indices"):
            raise ValueError(f"{op}: layout must be 'offsets' or 'm_indices', got {layout!r}")
        want = num_groups if layout == "offsets" else num_rows
        if index.numel() != want:
            raise ValueError(f"{op}: {layout} must have {want} entries, got {index.numel()}")
        return layout
    if num_rows == num_groups:
        raise ValueError(f"{op}: M == G == {num_rows}: cannot tell offsets from m_indices; pass layout=")
    if index.numel() == num_groups:
        return "offsets"
    if index.numel() == num_rows:
        return "m_indices"
    raise ValueError(f"{op}: offsets_or_m_indices must have G={num_groups} (offsets) or M={num_rows} "
                     f"(m_indices) entries, got {index.numel()}")


def grouped_gemm_nt(a: torch.Tensor, b: torch.Tensor, offsets_or_m_indices: torch.Tensor, *,
                    layout: str | None = None, out_dtype: torch.dtype | None = None,
                    backend: str | None = None) -> torch.Tensor:
    """Grouped ``D[M, N]``: a ``[M, K]``, b ``[G, N, K]``; rows of group g use ``b[g]``.

    ``offsets_or_m_indices`` is ``offsets[G]`` (cumulative end rows; rows past ``offsets[-1]``
    give zero) or ``m_indices[M]`` (-1 = padding, zero output); told apart by length, or by
    ``layout="offsets" | "m_indices"`` (required when M == G). Differentiable in a and b."""
    op = "grouped_gemm_nt"
    _check_tensor(op, "a", a, 2, _FLOAT_DTYPES)
    _check_tensor(op, "b", b, 3, (a.dtype,))
    if a.shape[1] != b.shape[2]:
        raise ValueError(f"{op}: K mismatch, a is {tuple(a.shape)} and b is {tuple(b.shape)}")
    index = _check_index(op, "offsets_or_m_indices", offsets_or_m_indices)
    kind = _infer_layout(op, index, a.shape[0], b.shape[0], layout)
    if kind == "offsets":
        _check_offsets_content(op, index, a.shape[0])
    else:
        _check_m_indices_content(op, index, b.shape[0], one_group_per_block=False)
    out_dtype = a.dtype if out_dtype is None else out_dtype
    dev = _check_same_device(op, a=a, b=b, index=index)
    be = resolve_backend(op, backend, dev, supported=PLAIN_BACKENDS, preference=CUBLAS_FIRST)
    if be == "triton":
        from . import _triton_autograd

        if kind == "m_indices":
            if a.shape[0] % BLOCK:
                raise ValueError(f"{op}: the triton backend takes m_indices only in the aligned contiguous layout "
                                 f"(M a multiple of {BLOCK}, see pad_to_contiguous), got M={a.shape[0]}")
            _check_m_indices_content(op, index, b.shape[0], ascending=True)
        return _triton_autograd.grouped_gemm_nt(a, b, index, kind, out_dtype, backend_module(be))
    if kind == "offsets":
        return reference.grouped_gemm_nt_offsets(a, b, index, out_dtype)
    return reference.grouped_gemm_nt_m_indices(a, b, index, out_dtype)


def k_grouped_gemm_tn(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *,
                      out_dtype: torch.dtype = torch.float32, backend: str | None = None) -> torch.Tensor:
    """bf16 twin of :func:`k_grouped_fp8_gemm_tn_contiguous`: a ``[T, N]``, b ``[T, K]`` ->
    ``D[G, N, K]``, ``D[g] = a_g.T @ b_g`` (float32 accumulation); differentiable in a and b."""
    op = "k_grouped_gemm_tn"
    _check_tensor(op, "a", a, 2, _FLOAT_DTYPES)
    _check_tensor(op, "b", b, 2, (a.dtype,))
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"{op}: a and b must have the same rows T, got {a.shape[0]} and {b.shape[0]}")
    offsets = _check_index(op, "offsets", offsets)
    if offsets.numel() == 0:
        raise ValueError(f"{op}: offsets must have at least one group")
    _check_offsets_content(op, offsets, a.shape[0])
    dev = _check_same_device(op, a=a, b=b, offsets=offsets)
    be = resolve_backend(op, backend, dev, supported=PLAIN_BACKENDS, preference=("triton", "torch"))
    if be == "triton":
        from . import _triton_autograd

        return _triton_autograd.k_grouped_gemm_tn(a, b, offsets, out_dtype, backend_module(be))
    return reference.k_grouped_gemm_tn(a, b, offsets, out_dtype)
