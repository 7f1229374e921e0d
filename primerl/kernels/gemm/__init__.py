"""GEMMs for dense and MoE layers: ``D = A @ B.T`` (NT), FP8 block-scaled and bf16.

FP8 operands are ``(q, sf)`` pairs from :mod:`primerl.kernels.fp8`: A quantized per token group
(``quant_per_token_group(x, 128)``: sf ``[M, K/128]``), B per 128x128 block
(``quant_per_block(w)``: sf ``[(G,) ceil(N/128), K/128]``). Accumulation is float32.

Grouped layouts (see :mod:`.offsets`): ``offsets[G]`` cumulative end rows, ``m_indices[M]`` the
group of each row (-1 = padding, 128-row aligned groups), or masked ``[G, max_m, K]``.

Backends (``backend=None`` picks): CPU tensors -> ``"torch"`` (the reference: dequantize, fp32
GEMM). CUDA -> FP8 ops ``"deep_gemm"`` when importable and the output is bf16, else ``"triton"``;
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
from ..fp8.reference import ROUNDINGS
from . import reference
from .offsets import (
    align_counts,
    counts_to_offsets,
    from_masked,
    get_m_alignment,
    group_block_starts,
    m_indices_to_counts,
    max_group_blocks,
    max_padded_rows,
    offsets_to_counts,
    offsets_to_m_indices,
    offsets_to_starts,
    pad_to_contiguous,
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

BLOCK = 128
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8_BACKENDS = ("torch", "triton", "deep_gemm")
_PLAIN_BACKENDS = ("torch", "triton")
# bf16 dense / M-grouped GEMMs default to torch (cuBLAS, torch._grouped_mm) on CUDA: the Triton
# kernels are chosen explicitly until `python -m bench gemm` measures them faster on a GPU.
_CUBLAS_FIRST = ("torch", "triton")


# ------------------------------------------------------------------------------ validation


def _shape(t) -> str:
    return f"{tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_tensor(op: str, name: str, t, dims: int, dtypes: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{op}: {name} must have {dims} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{op}: {name} dtype must be one of {dtypes}, got {t.dtype}")


def _check_same_device(op: str, **tensors) -> torch.device:
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    first = next(iter(devices.values()))
    for name, dev in devices.items():
        if dev != first:
            raise ValueError(f"{op}: all tensors must be on one device; {name} is on {dev}, expected {first}")
    return first


def _check_fp8_pair(op: str, name: str, pair, dims: int, block_rows: bool):
    """Check an (q, sf) operand; returns (q, sf). block_rows: sf has ceil(rows/128) rows (weights)."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"{op}: {name} must be a (q, sf) pair from primerl.kernels.fp8, got {type(pair).__name__}")
    q, sf = pair
    _check_tensor(op, f"{name}[0] (q)", q, dims, FP8_DTYPES)
    _check_tensor(op, f"{name}[1] (sf)", sf, dims, (torch.float32,))
    rows, k = q.shape[-2], q.shape[-1]
    if k % BLOCK != 0:
        raise ValueError(f"{op}: K={k} of {name} must be a multiple of {BLOCK}")
    want_rows = -(-rows // BLOCK) if block_rows else rows
    want = (*q.shape[:-2], want_rows, k // BLOCK)
    if tuple(sf.shape) != want:
        layout = "128x128 block" if block_rows else "1x128 token-group"
        raise ValueError(f"{op}: {name} scales must be {want} ({layout} scales of q {tuple(q.shape)}), got {tuple(sf.shape)}")
    return q.contiguous(), sf.contiguous()


def _check_out_dtype(op: str, out_dtype) -> None:
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")


def _check_index(op: str, name: str, t, length: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: {name} must be a 1-D int32 tensor, got {_shape(t)} {getattr(t, 'dtype', '')}")
    if length is not None and t.numel() != length:
        raise ValueError(f"{op}: {name} must have {length} entries, got {t.numel()}")
    return t.to(torch.int32).contiguous()


def _check_offsets_content(op: str, offsets: torch.Tensor, num_rows: int) -> None:
    """Content checks need the values on the host: done only for CPU tensors (free there)."""
    if offsets.device.type != "cpu" or offsets.numel() == 0:
        return
    if bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[0]) < 0:
        raise ValueError(f"{op}: offsets must be non-decreasing and >= 0, got {offsets.tolist()}")
    if int(offsets[-1]) > num_rows:
        raise ValueError(f"{op}: offsets[-1]={int(offsets[-1])} exceeds the {num_rows} rows of the input")


def _check_m_indices_content(op: str, m_indices: torch.Tensor, num_groups: int, ascending: bool = False) -> None:
    if m_indices.device.type != "cpu":
        return
    if bool(((m_indices < -1) | (m_indices >= num_groups)).any()):
        raise ValueError(f"{op}: m_indices values must be in [-1, {num_groups}), got min {int(m_indices.min())} max {int(m_indices.max())}")
    blocks = m_indices.view(-1, BLOCK)
    hi = blocks.max(dim=1).values
    if bool(((blocks != hi[:, None]) & (blocks != -1)).any()):
        raise ValueError(f"{op}: every {BLOCK}-row block of m_indices must hold one group (or -1 padding); "
                         "build the layout with pad_to_contiguous")
    if ascending:
        owners = torch.cummax(hi, 0).values
        if bool(((hi >= 0) & (hi != owners)).any()):
            raise ValueError(f"{op}: groups in m_indices must appear in ascending order (pad_to_contiguous's layout)")


def _fp8_preference(out_dtype: torch.dtype) -> tuple[str, ...]:
    # DeepGEMM writes bf16 only: with another output dtype the automatic choice skips it
    return ("deep_gemm", "triton", "torch") if out_dtype == torch.bfloat16 else ("triton", "torch")


def _impl(backend: str):
    if backend == "triton":
        from . import triton as impl
    elif backend == "deep_gemm":
        from . import deep_gemm as impl
    else:
        impl = reference
    return impl


# ------------------------------------------------------------------------------ FP8 ops


def fp8_gemm_nt(a, b, *, out_dtype: torch.dtype = torch.bfloat16, backend: str | None = None) -> torch.Tensor:
    """``D[M, N] = A @ B.T`` for a = (q [M, K], sf [M, K/128]), b = (q [N, K], sf [ceil(N/128), K/128])."""
    op = "fp8_gemm_nt"
    aq, asf = _check_fp8_pair(op, "a", a, 2, block_rows=False)
    bq, bsf = _check_fp8_pair(op, "b", b, 2, block_rows=True)
    if aq.shape[1] != bq.shape[1]:
        raise ValueError(f"{op}: K mismatch, a is {tuple(aq.shape)} and b is {tuple(bq.shape)}")
    _check_out_dtype(op, out_dtype)
    dev = _check_same_device(op, aq=aq, asf=asf, bq=bq, bsf=bsf)
    be = resolve_backend(op, backend, dev, supported=_FP8_BACKENDS, preference=_fp8_preference(out_dtype))
    return _impl(be).fp8_gemm_nt((aq, asf), (bq, bsf), out_dtype)


def _check_grouped_fp8(op: str, a, b, a_dims: int):
    aq, asf = _check_fp8_pair(op, "a", a, a_dims, block_rows=False)
    bq, bsf = _check_fp8_pair(op, "b", b, 3, block_rows=True)
    if aq.shape[-1] != bq.shape[-1]:
        raise ValueError(f"{op}: K mismatch, a is {tuple(aq.shape)} and b is {tuple(bq.shape)}")
    return (aq, asf), (bq, bsf)


def m_grouped_fp8_gemm_nt_contiguous(a, b, m_indices: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                                     backend: str | None = None) -> torch.Tensor:
    """Grouped ``D[M, N]``: row i uses ``B[m_indices[i]]``; -1 rows are padding (output zero).

    a = (q [M, K], sf [M, K/128]) with every group starting on a multiple of ``get_m_alignment()``
    (build it with :func:`pad_to_contiguous`), b = (q [G, N, K], sf [G, ceil(N/128), K/128]),
    ``m_indices[M]`` int32. M must be a multiple of 128."""
    op = "m_grouped_fp8_gemm_nt_contiguous"
    a, b = _check_grouped_fp8(op, a, b, 2)
    m = a[0].shape[0]
    if m % BLOCK != 0:
        raise ValueError(f"{op}: M={m} must be a multiple of get_m_alignment()={BLOCK} (pad with pad_to_contiguous)")
    m_indices = _check_index(op, "m_indices", m_indices, m)
    _check_m_indices_content(op, m_indices, b[0].shape[0])
    _check_out_dtype(op, out_dtype)
    dev = _check_same_device(op, aq=a[0], bq=b[0], m_indices=m_indices)
    be = resolve_backend(op, backend, dev, supported=_FP8_BACKENDS, preference=_fp8_preference(out_dtype))
    return _impl(be).m_grouped_fp8_gemm_nt_contiguous(a, b, m_indices, out_dtype)


def m_grouped_fp8_gemm_nt_offsets(a, b, offsets: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                                  backend: str | None = None) -> torch.Tensor:
    """Grouped ``D[M, N]`` with unpadded groups: rows ``offsets[g-1]:offsets[g]`` use ``B[g]``;
    rows past ``offsets[-1]`` are zero. Same operands as the contiguous op, any M."""
    op = "m_grouped_fp8_gemm_nt_offsets"
    a, b = _check_grouped_fp8(op, a, b, 2)
    offsets = _check_index(op, "offsets", offsets, b[0].shape[0])
    _check_offsets_content(op, offsets, a[0].shape[0])
    _check_out_dtype(op, out_dtype)
    dev = _check_same_device(op, aq=a[0], bq=b[0], offsets=offsets)
    be = resolve_backend(op, backend, dev, supported=_PLAIN_BACKENDS, preference=("triton", "torch"))
    return _impl(be).m_grouped_fp8_gemm_nt_offsets(a, b, offsets, out_dtype)


def m_grouped_fp8_gemm_nt_masked(a, b, masked_m: torch.Tensor, expected_m: int, *,
                                 out_dtype: torch.dtype = torch.bfloat16, backend: str | None = None) -> torch.Tensor:
    """Masked grouped ``D[G, max_m, N]``: a = (q [G, max_m, K], sf [G, max_m, K/128]),
    b = (q [G, N, K], sf [G, ceil(N/128), K/128]), ``masked_m[G]`` valid rows per group.

    Rows past ``masked_m[g]`` of A are never read; their output rows are unspecified (the torch
    backend writes zeros, the kernels skip them). ``expected_m`` (a typical ``masked_m``) picks
    the tile shape."""
    op = "m_grouped_fp8_gemm_nt_masked"
    a, b = _check_grouped_fp8(op, a, b, 3)
    if a[0].shape[0] != b[0].shape[0]:
        raise ValueError(f"{op}: a has {a[0].shape[0]} groups but b has {b[0].shape[0]}")
    masked_m = _check_index(op, "masked_m", masked_m, b[0].shape[0])
    if not isinstance(expected_m, int) or expected_m < 0:
        raise ValueError(f"{op}: expected_m must be a non-negative int, got {expected_m!r}")
    if masked_m.device.type == "cpu" and bool((masked_m > a[0].shape[1]).any()):
        raise ValueError(f"{op}: masked_m {masked_m.tolist()} exceeds max_m={a[0].shape[1]}")
    _check_out_dtype(op, out_dtype)
    dev = _check_same_device(op, aq=a[0], bq=b[0], masked_m=masked_m)
    be = resolve_backend(op, backend, dev, supported=_FP8_BACKENDS, preference=_fp8_preference(out_dtype))
    if be == "torch":
        return reference.m_grouped_fp8_gemm_nt_masked(a, b, masked_m, out_dtype)
    return _impl(be).m_grouped_fp8_gemm_nt_masked(a, b, masked_m, expected_m, out_dtype)


def quant_per_group_colwise(x: torch.Tensor, offsets: torch.Tensor, *, dtype: torch.dtype = torch.float8_e4m3fn,
                            ue8m0: bool = False, rounding: str = "reciprocal", backend: str | None = None):
    """Column-wise FP8 quantization in 128-row blocks that never cross a group boundary.

    x ``[T, C]``, ``offsets[G]`` along T -> q ``[T, C]`` fp8, sf ``[max_group_blocks(T, G), C]``
    float32. Group g's blocks start at scale row ``group_block_starts(offsets)[g]``; spare scale
    rows are finite; rows past ``offsets[-1]`` quantize to zero. The operand layout of
    :func:`k_grouped_fp8_gemm_tn_contiguous`. ``rounding`` and the NaN / inf policy are those of
    :mod:`primerl.kernels.fp8` (default ``"reciprocal"``, DeepGEMM's ``per_channel_cast_to_fp8``)."""
    op = "quant_per_group_colwise"
    if rounding not in ROUNDINGS:
        raise ValueError(f"{op}: rounding must be one of {ROUNDINGS}, got {rounding!r}")
    _check_tensor(op, "x", x, 2, (torch.bfloat16, torch.float16, torch.float32))
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{op}: x is empty (shape {tuple(x.shape)})")
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{op}: dtype must be one of {FP8_DTYPES}, got {dtype}")
    offsets = _check_index(op, "offsets", offsets)
    if offsets.numel() == 0:
        raise ValueError(f"{op}: offsets must have at least one group")
    _check_offsets_content(op, offsets, x.shape[0])
    dev = _check_same_device(op, x=x, offsets=offsets)
    be = resolve_backend(op, backend, dev, supported=_PLAIN_BACKENDS, preference=("triton", "torch"))
    return _impl(be).quant_per_group_colwise(x.contiguous(), offsets, dtype, ue8m0, rounding)


def k_grouped_fp8_gemm_tn_contiguous(a, b, offsets: torch.Tensor, *, out_dtype: torch.dtype = torch.float32,
                                     backend: str | None = None) -> torch.Tensor:
    """K-grouped ``D[G, N, K] with D[g] = A_g.T @ B_g`` (the weight gradient of grouped experts:
    A = dY, B = X), groups along the T (reduction) rows given by ``offsets[G]``.

    a = (q [T, N], sf), b = (q [T, K], sf), both from :func:`quant_per_group_colwise` with the same
    offsets. Empty groups give zero."""
    op = "k_grouped_fp8_gemm_tn_contiguous"
    offsets = _check_index(op, "offsets", offsets)
    if offsets.numel() == 0:
        raise ValueError(f"{op}: offsets must have at least one group")
    pairs = []
    for name, pair in (("a", a), ("b", b)):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"{op}: {name} must be a (q, sf) pair from quant_per_group_colwise")
        q, sf = pair
        _check_tensor(op, f"{name}[0] (q)", q, 2, FP8_DTYPES)
        _check_tensor(op, f"{name}[1] (sf)", sf, 2, (torch.float32,))
        want = (max_group_blocks(q.shape[0], offsets.numel()), q.shape[1])
        if tuple(sf.shape) != want:
            raise ValueError(f"{op}: {name} scales must be {want} (quant_per_group_colwise layout), got {tuple(sf.shape)}")
        pairs.append((q.contiguous(), sf.contiguous()))
    if pairs[0][0].shape[0] != pairs[1][0].shape[0]:
        raise ValueError(f"{op}: a and b must have the same rows T, got {pairs[0][0].shape[0]} and {pairs[1][0].shape[0]}")
    _check_offsets_content(op, offsets, pairs[0][0].shape[0])
    _check_out_dtype(op, out_dtype)
    dev = _check_same_device(op, aq=pairs[0][0], bq=pairs[1][0], offsets=offsets)
    be = resolve_backend(op, backend, dev, supported=_PLAIN_BACKENDS, preference=("triton", "torch"))
    return _impl(be).k_grouped_fp8_gemm_tn_contiguous(pairs[0], pairs[1], offsets, out_dtype)


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
    be = resolve_backend(op, backend, dev, supported=_PLAIN_BACKENDS, preference=_CUBLAS_FIRST)
    if be == "triton":
        from . import triton as impl

        return impl.gemm_nt_autograd(a, b, out_dtype)
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
    elif index.device.type == "cpu" and bool(((index < -1) | (index >= b.shape[0])).any()):
        raise ValueError(f"{op}: m_indices values must be in [-1, {b.shape[0]})")
    out_dtype = a.dtype if out_dtype is None else out_dtype
    dev = _check_same_device(op, a=a, b=b, index=index)
    be = resolve_backend(op, backend, dev, supported=_PLAIN_BACKENDS, preference=_CUBLAS_FIRST)
    if be == "triton":
        from . import triton as impl

        if kind == "m_indices":
            if a.shape[0] % BLOCK:
                raise ValueError(f"{op}: the triton backend takes m_indices only in the aligned contiguous layout "
                                 f"(M a multiple of {BLOCK}, see pad_to_contiguous), got M={a.shape[0]}")
            _check_m_indices_content(op, index, b.shape[0], ascending=True)
        return impl.grouped_gemm_nt_autograd(a, b, index, kind, out_dtype)
    if kind == "offsets":
        return reference.grouped_gemm_nt_offsets(a, b, index, out_dtype)
    return reference.grouped_gemm_nt_m_indices(a, b, index, out_dtype)


def k_grouped_gemm_tn(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *,
                      out_dtype: torch.dtype = torch.float32, backend: str | None = None) -> torch.Tensor:
    """bf16 twin of :func:`k_grouped_fp8_gemm_tn_contiguous`: a ``[T, N]``, b ``[T, K]`` ->
    ``D[G, N, K]``, ``D[g] = a_g.T @ b_g`` (float32 accumulation)."""
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
    be = resolve_backend(op, backend, dev, supported=_PLAIN_BACKENDS, preference=("triton", "torch"))
    if be == "triton":
        from . import triton as impl

        return impl.k_grouped_gemm_tn(a.contiguous(), b.contiguous(), offsets, out_dtype)
    return reference.k_grouped_gemm_tn(a, b, offsets, out_dtype)
