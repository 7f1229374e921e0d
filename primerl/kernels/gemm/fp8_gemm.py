"""FP8 block-scaled GEMMs with DeepGEMM's arguments: validate, pick the backend, call.

Operands are ``(q, sf)`` pairs. A: ``q [.., M, K]`` with per-token-group scales ``sf [.., M, K/128]``.
B: ``q [(G,) N, K]`` with, by ``recipe`` (DeepGEMM's (A rows, B rows, K) per scale),
``(1, 128, 128)`` 128x128 block scales ``[(G,) ceil(N/128), K/128]`` (SM90's 1D2D) or
``(1, 1, 128)`` per-row scales ``[(G,) N, K/128]`` (SM100's 1D1D); ``recipe=None`` infers it from
the scale shape. Scales are float32 in any layout (K- or MN-major, e.g. from
:func:`.layout.get_mn_major_tma_aligned_tensor`) or packed UE8M0 int32 ``[.., ceil(K/128/4)]``
(:func:`.layout.get_mn_major_tma_aligned_packed_ue8m0_tensor`).

Outputs: pass ``d`` to write in place (DeepGEMM's convention; bf16 or float32) or get a new
tensor of ``out_dtype``; ``c`` (float32, may alias ``d``) is added: ``D = A @ B.T + C``.
"""

from __future__ import annotations

import torch

from .._backend import BackendUnavailableError, resolve_backend
from .._value_checks import check_values
from ..fp8.reference import ROUNDINGS
from ._checks import (
    _OUT_DTYPES,
    FP8_DTYPES,
    _check_index,
    _check_m_indices_content,
    _check_offsets_content,
    _check_out_dtype,
    _check_same_device,
    _check_tensor,
)
from . import reference
from .dispatch import FP8_BACKENDS, PLAIN_BACKENDS, backend_module
from .layout import BLOCK, RECIPES, unpack_ue8m0
from .offsets import get_mk_alignment_for_contiguous_layout, max_group_blocks, offsets_to_counts, psum_to_m_indices


def _fp8_preference(out_dtype: torch.dtype, c=None) -> tuple[str, ...]:
    # the automatic choice takes DeepGEMM for its main case only: bf16 output, no accumulation
    return ("deep_gemm", "triton", "torch") if out_dtype == torch.bfloat16 and c is None else ("triton", "torch")


def _scales(op: str, name: str, q: torch.Tensor, sf, sf_rows: int, layout: str,
            keep_layout: bool = False) -> torch.Tensor:
    """float32 (any strides) or packed UE8M0 int32 scales -> float32 K-major [.., sf_rows, K/128]
    (float32 scales keep their strides with ``keep_layout``)."""
    groups_k = q.shape[-1] // BLOCK
    lead = tuple(q.shape[:-2])
    if isinstance(sf, torch.Tensor) and sf.dtype == torch.int32:
        want = (*lead, sf_rows, -(-groups_k // 4))
        if tuple(sf.shape) != want:
            raise ValueError(f"{op}: {name} packed UE8M0 scales must be {want} int32 ({layout} scales of q "
                             f"{tuple(q.shape)}, 4 per word), got {tuple(sf.shape)}")
        return unpack_ue8m0(sf, groups_k)
    _check_tensor(op, f"{name}[1] (sf)", sf, q.dim(), (torch.float32, torch.int32))
    want = (*lead, sf_rows, groups_k)
    if tuple(sf.shape) != want:
        raise ValueError(f"{op}: {name} scales must be {want} ({layout} scales of q {tuple(q.shape)}), "
                         f"got {tuple(sf.shape)}")
    return sf if keep_layout else sf.contiguous()


def _check_pair(op: str, name: str, pair, dims: int, rows_per_scale: int, keep_layout: bool = False):
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"{op}: {name} must be a (q, sf) pair from primerl.kernels.fp8, got {type(pair).__name__}")
    q, sf = pair
    _check_tensor(op, f"{name}[0] (q)", q, dims, FP8_DTYPES)
    if q.shape[-1] % BLOCK != 0:
        raise ValueError(f"{op}: K={q.shape[-1]} of {name} must be a multiple of {BLOCK}")
    rows = q.shape[-2]
    layout = "128x128 block" if rows_per_scale == BLOCK else "1x128 token-group"
    return q.contiguous(), _scales(op, name, q, sf, -(-rows // rows_per_scale), layout, keep_layout)


def _b_granularity(op: str, b, recipe) -> int:
    """Rows of B per scale row: 128 for recipe (1, 128, 128), 1 for (1, 1, 128)."""
    if recipe is not None:
        if tuple(recipe) not in RECIPES:
            raise ValueError(f"{op}: recipe must be one of {RECIPES} or None, got {recipe!r}")
        return recipe[1]
    if isinstance(b, (tuple, list)) and len(b) == 2 and all(isinstance(t, torch.Tensor) for t in b) and b[0].dim() >= 2:
        rows = b[0].shape[-2]
        if b[1].dim() >= 2 and b[1].shape[-2] == rows and rows != -(-rows // BLOCK):
            return 1
    return BLOCK


def _check_operands(op: str, a, b, a_dims: int, b_dims: int, recipe, keep_layout: bool = False):
    gran = _b_granularity(op, b, recipe)
    a = _check_pair(op, "a", a, a_dims, 1, keep_layout)
    b = _check_pair(op, "b", b, b_dims, gran, keep_layout)
    if a[0].shape[-1] != b[0].shape[-1]:
        raise ValueError(f"{op}: K mismatch, a is {tuple(a[0].shape)} and b is {tuple(b[0].shape)}")
    return a, b, gran, (1, gran, BLOCK)


def _output(op: str, d, shape: tuple, out_dtype, device, c=None) -> tuple[torch.Tensor | None, torch.dtype]:
    """(``d`` checked or None, the output dtype: d's, else ``out_dtype``, bf16 by default)."""
    if d is None:
        out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
        _check_out_dtype(op, out_dtype)
    else:
        if not isinstance(d, torch.Tensor) or tuple(d.shape) != tuple(shape) or d.dtype not in _OUT_DTYPES:
            raise ValueError(f"{op}: d must be a {shape} tensor of one of {_OUT_DTYPES}, got "
                             f"{getattr(d, 'shape', type(d).__name__)} {getattr(d, 'dtype', '')}")
        if out_dtype is not None and out_dtype != d.dtype:
            raise ValueError(f"{op}: out_dtype={out_dtype} disagrees with d.dtype={d.dtype}; pass one of them")
        if d.stride(-1) != 1 or (d.dim() == 3 and d.stride(0) != d.shape[1] * d.stride(1)):
            raise ValueError(f"{op}: d must have unit column stride and packed groups, got strides {d.stride()}")
        if d.device != device:
            raise ValueError(f"{op}: d is on {d.device}, the operands on {device}")
        out_dtype = d.dtype
    if c is not None:
        if not isinstance(c, torch.Tensor) or tuple(c.shape) != tuple(shape) or c.dtype != torch.float32:
            raise ValueError(f"{op}: c must be a float32 {shape} tensor, got "
                             f"{getattr(c, 'shape', type(c).__name__)} {getattr(c, 'dtype', '')}")
        if out_dtype != torch.float32:
            raise ValueError(f"{op}: accumulating into c needs a float32 output (DeepGEMM's rule), got {out_dtype}")
        if c.device != device or c.stride(-1) != 1:
            raise ValueError(f"{op}: c must be on {device} with unit column stride")
    return d, out_dtype


def _into(d, result: torch.Tensor) -> torch.Tensor:
    """A reference result as the output: itself, or copied into the caller's ``d``."""
    return result if d is None else d.copy_(result)


def _alloc(d, shape: tuple, out_dtype: torch.dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=out_dtype, device=device) if d is None else d


def _cublas_reason(a, b, gran, out_dtype, c, dev: torch.device) -> str | None:
    from . import cublas

    m, k = a[0].shape
    return cublas.reason(m, b[0].shape[0], k, a[0].dtype, b[0].dtype, gran, out_dtype, c is not None, dev)


def _dense_backend(op: str, backend, a, b, gran, out_dtype, c, dev: torch.device) -> str:
    """The dense op's backend: ``"cublas"`` (torch's cuBLAS blockwise FP8) when named or, for
    ``backend=None`` on CUDA, wherever it computes this case correctly; else DeepGEMM, Triton."""
    if backend == "cublas":
        why = _cublas_reason(a, b, gran, out_dtype, c, dev)
        if why is not None:
            raise BackendUnavailableError(f"{op}: backend 'cublas' is unavailable: {why}")
        return "cublas"
    if backend is None and dev.type == "cuda" and _cublas_reason(a, b, gran, out_dtype, c, dev) is None:
        return "cublas"
    return resolve_backend(op, backend, dev, supported=FP8_BACKENDS, preference=_fp8_preference(out_dtype, c))


def fp8_gemm_nt(a, b, d: torch.Tensor | None = None, c: torch.Tensor | None = None, *, recipe=None,
                out_dtype: torch.dtype | None = None, backend: str | None = None) -> torch.Tensor:
    """``D[M, N] = A @ B.T (+ C)`` for a = (q [M, K], sf [M, K/128]), b = (q [N, K], sf); returns d.

    Backends: ``"torch"`` (reference), ``"triton"``, ``"deep_gemm"``, and ``"cublas"``: torch's
    cuBLAS blockwise FP8 (``F.scaled_mm``, see :mod:`.cublas`; SM90, e4m3, recipe (1, 128, 128),
    bf16 output, no ``c``, N and K multiples of 16). ``backend=None`` on CUDA takes ``"cublas"``
    wherever it applies (probed once per device), else DeepGEMM when importable (bf16 output, no
    ``c``), else Triton."""
    op = "fp8_gemm_nt"
    # float32 scales keep their strides until the backend is known: cuBLAS wants A's MN-major
    a, b, gran, recipe = _check_operands(op, a, b, 2, 2, recipe, keep_layout=True)
    dev = _check_same_device(op, aq=a[0], asf=a[1], bq=b[0], bsf=b[1])
    shape = (a[0].shape[0], b[0].shape[0])
    d, out_dtype = _output(op, d, shape, out_dtype, dev, c)
    be = _dense_backend(op, backend, a, b, gran, out_dtype, c, dev)
    if be == "cublas":
        from . import cublas

        return cublas.fp8_gemm_nt(a, b, d)
    a, b = (a[0], a[1].contiguous()), (b[0], b[1].contiguous())
    if be == "torch":
        return _into(d, reference.fp8_gemm_nt(a, b, out_dtype, gran, c))
    d = _alloc(d, shape, out_dtype, dev)
    if be == "deep_gemm":
        return backend_module(be).fp8_gemm_nt(a, b, d, c, recipe)
    return backend_module(be).fp8_gemm_nt(a, b, d, c, gran)


def m_grouped_fp8_gemm_nt_contiguous(a, b, grouped_layout: torch.Tensor, d: torch.Tensor | None = None, *,
                                     use_psum_layout: bool = False, recipe=None, out_dtype: torch.dtype | None = None,
                                     backend: str | None = None) -> torch.Tensor:
    """Grouped ``D[M, N]``: row i uses ``B[group of row i]``; padding rows are written as zero.

    a = (q [M, K], sf [M, K/128]), b = (q [G, N, K], sf [G, .., K/128]). ``grouped_layout`` is
    ``m_indices[M]`` int32 (-1 = padding; any alignment, e.g. from :func:`pad_to_contiguous`) or,
    with ``use_psum_layout=True``, DeepGEMM's ``psum[G]`` (group g owns rows
    ``align(psum[g-1]) .. psum[g]-1`` for the current
    :func:`get_mk_alignment_for_contiguous_layout`; see :func:`counts_to_psum`)."""
    op = "m_grouped_fp8_gemm_nt_contiguous"
    a, b, gran, recipe = _check_operands(op, a, b, 2, 3, recipe)
    m, groups = a[0].shape[0], b[0].shape[0]
    if use_psum_layout:
        psum = _check_index(op, "grouped_layout (psum)", grouped_layout, groups)
        _check_psum_content(op, psum, m)
        m_indices = psum_to_m_indices(psum, m)
    else:
        m_indices = _check_index(op, "grouped_layout (m_indices)", grouped_layout, m)
        _check_m_indices_content(op, m_indices, groups, one_group_per_block=False)
    dev = _check_same_device(op, aq=a[0], bq=b[0], grouped_layout=m_indices)
    shape = (m, b[0].shape[1])
    d, out_dtype = _output(op, d, shape, out_dtype, dev)
    be = resolve_backend(op, backend, dev, supported=FP8_BACKENDS, preference=_fp8_preference(out_dtype))
    if be == "torch":
        return _into(d, reference.m_grouped_fp8_gemm_nt_contiguous(a, b, m_indices, out_dtype, gran))
    d = _alloc(d, shape, out_dtype, dev)
    if be == "deep_gemm":
        layout = psum if use_psum_layout else m_indices
        return backend_module(be).m_grouped_fp8_gemm_nt_contiguous(a, b, layout, d, use_psum_layout, recipe, m_indices)
    return backend_module(be).m_grouped_fp8_gemm_nt_contiguous(a, b, m_indices, d, gran)


def _check_psum_content(op: str, psum: torch.Tensor, num_rows: int) -> None:
    if psum.numel() == 0:
        return
    alignment = get_mk_alignment_for_contiguous_layout()
    starts = torch.cat([psum.new_zeros(1), (psum[:-1] + alignment - 1) // alignment * alignment])
    check_values((psum >= starts).all(), f"{op}: grouped_layout is not a psum layout for alignment {alignment} (each "
                 "entry must be >= the previous one rounded up to the alignment; build it with counts_to_psum)",
                 lambda: f"got psum {psum.tolist()}")
    check_values(psum[-1] <= num_rows, f"{op}: psum[-1] exceeds the {num_rows} rows of a",
                 lambda: f"psum[-1]={int(psum[-1])}")


def m_grouped_fp8_gemm_nt_offsets(a, b, offsets: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                                  backend: str | None = None) -> torch.Tensor:
    """Grouped ``D[M, N]`` with unpadded groups: rows ``offsets[g-1]:offsets[g]`` use ``B[g]``;
    rows past ``offsets[-1]`` are zero. Same operands as the contiguous op (block B scales), any M."""
    op = "m_grouped_fp8_gemm_nt_offsets"
    a, b, _, _ = _check_operands(op, a, b, 2, 3, (1, 128, 128))
    offsets = _check_index(op, "offsets", offsets, b[0].shape[0])
    _check_offsets_content(op, offsets, a[0].shape[0])
    _check_out_dtype(op, out_dtype)
    dev = _check_same_device(op, aq=a[0], bq=b[0], offsets=offsets)
    be = resolve_backend(op, backend, dev, supported=PLAIN_BACKENDS, preference=("triton", "torch"))
    return backend_module(be).m_grouped_fp8_gemm_nt_offsets(a, b, offsets, out_dtype)


def m_grouped_fp8_gemm_nt_masked(a, b, masked_m: torch.Tensor, expected_m: int, d: torch.Tensor | None = None, *,
                                 recipe=None, out_dtype: torch.dtype | None = None,
                                 backend: str | None = None) -> torch.Tensor:
    """Masked grouped ``D[G, max_m, N]``: a = (q [G, max_m, K], sf [G, max_m, K/128]),
    b = (q [G, N, K], sf), ``masked_m[G]`` valid rows per group.

    Rows past ``masked_m[g]`` are neither read (A) nor written (D), on every backend, as in
    DeepGEMM: pass ``d`` to keep what it holds there; a new output holds whatever the allocator
    left. ``expected_m`` (a typical ``masked_m``) picks the tile shape."""
    op = "m_grouped_fp8_gemm_nt_masked"
    a, b, gran, recipe = _check_operands(op, a, b, 3, 3, recipe)
    groups, max_m = a[0].shape[:2]
    if groups != b[0].shape[0]:
        raise ValueError(f"{op}: a has {groups} groups but b has {b[0].shape[0]}")
    masked_m = _check_index(op, "masked_m", masked_m, groups)
    if not isinstance(expected_m, int) or expected_m < 0:
        raise ValueError(f"{op}: expected_m must be a non-negative int, got {expected_m!r}")
    check_values(((masked_m <= max_m) & (masked_m >= 0)).all(), f"{op}: masked_m must lie in [0, max_m={max_m}]",
                 lambda: f"got {masked_m.tolist()}")
    dev = _check_same_device(op, aq=a[0], bq=b[0], masked_m=masked_m)
    shape = (groups, max_m, b[0].shape[1])
    d, out_dtype = _output(op, d, shape, out_dtype, dev)
    be = resolve_backend(op, backend, dev, supported=FP8_BACKENDS, preference=_fp8_preference(out_dtype))
    d = _alloc(d, shape, out_dtype, dev)
    if be == "torch":
        return reference.m_grouped_fp8_gemm_nt_masked(a, b, masked_m, out_dtype, gran, d)
    if be == "deep_gemm":
        return backend_module(be).m_grouped_fp8_gemm_nt_masked(a, b, masked_m, expected_m, d, recipe)
    return backend_module(be).m_grouped_fp8_gemm_nt_masked(a, b, masked_m, expected_m, d, gran)


def _group_offsets(op: str, offsets, ks, num_rows: int, device: torch.device) -> torch.Tensor:
    """Exactly one of ``offsets`` (cumulative ends) / ``ks`` (per-group sizes) -> checked int32 offsets
    (ks land on ``device``)."""
    if (offsets is None) == (ks is None):
        raise ValueError(f"{op}: pass exactly one of offsets (cumulative end rows) and ks (per-group sizes, "
                         f"DeepGEMM's argument), got {'both' if offsets is not None else 'neither'}")
    if ks is not None:
        if isinstance(ks, torch.Tensor):
            ks = _check_index(op, "ks", ks)
        elif isinstance(ks, (list, tuple)) and all(isinstance(k, int) and not isinstance(k, bool) for k in ks):
            ks = torch.tensor(list(ks), dtype=torch.int32)
        else:
            raise ValueError(f"{op}: ks must be a list of ints or a 1-D int tensor, got {ks!r}")
        if ks.numel():
            check_values((ks >= 0).all(), f"{op}: ks must be >= 0", lambda: f"got {ks.tolist()}")
        offsets = torch.cumsum(ks, 0, dtype=torch.int32).to(device)
    else:
        offsets = _check_index(op, "offsets", offsets)
        _reject_sizes_as_offsets(op, offsets, num_rows)
    if offsets.numel() == 0:
        raise ValueError(f"{op}: offsets must have at least one group")
    _check_offsets_content(op, offsets, num_rows)
    return offsets


def _reject_sizes_as_offsets(op: str, offsets: torch.Tensor, num_rows: int) -> None:
    """DeepGEMM's k-grouped ops take per-group sizes, each a multiple of the K alignment, summing to T.
    Such a list read as cumulative offsets would silently drop rows: a non-decreasing list of aligned
    values that sums to T but ends before T is taken for sizes and rejected (a device-side check)."""
    if offsets.numel() > 1:
        last, total = offsets[-1], offsets.sum()
        aligned = (offsets % get_mk_alignment_for_contiguous_layout() == 0).all()
        looks_like_sizes = (last < num_rows) & (total == num_rows) & aligned
        # the row count only in the detail: formatted into the static message, a symbolic size would
        # specialise a compiled graph on it (a recompile per packing)
        check_values(~looks_like_sizes,
                     f"{op}: offsets end before the last row but sum to exactly the row count: they look like "
                     "per-group sizes. offsets are cumulative END rows; pass per-group sizes as ks= (DeepGEMM's "
                     "convention). For cumulative offsets with a tail, pass ks=offsets_to_counts(offsets).tolist()",
                     lambda: f"{num_rows} rows, got offsets {offsets.tolist()}")


def quant_per_group_colwise(x: torch.Tensor, offsets: torch.Tensor | None = None, *, ks=None,
                            dtype: torch.dtype = torch.float8_e4m3fn, ue8m0: bool = False,
                            rounding: str = "reciprocal", compact: bool = False, layout: str = "rows",
                            backend: str | None = None):
    """Column-wise FP8 quantization in 128-row blocks that never cross a group boundary.

    x ``[T, C]`` with groups along T given by ``offsets[G]`` (cumulative ends) or ``ks[G]``
    (per-group sizes) -> q ``[T, C]`` fp8, sf ``[R, C]`` float32 where R is the static bound
    ``max_group_blocks(T, G)`` (no host sync) or, with ``compact=True``, exactly
    ``sum(ceil(ks / 128))`` rows (DeepGEMM's compact per-group scale rows; one host sync on a GPU).
    Group g's blocks start at scale row ``group_block_starts(offsets)[g]``; spare scale rows are
    finite; rows past the last group quantize to zero. The operand layout of
    :func:`k_grouped_fp8_gemm_tn_contiguous`. ``rounding`` and the NaN / inf policy are those of
    :mod:`primerl.kernels.fp8` (default ``"reciprocal"``, DeepGEMM's ``per_channel_cast_to_fp8``).

    ``layout="blocks"`` returns q as group blocks ``[R, C, 128]`` instead: ``q[r, c, i]`` is
    column c of row i of scale block r (zero past its group's end and in spare blocks), the
    K-major layout the Triton k-grouped GEMM reads with TMA (rows are re-laid out there first);
    same values, same sf."""
    op = "quant_per_group_colwise"
    if rounding not in ROUNDINGS:
        raise ValueError(f"{op}: rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if layout not in ("rows", "blocks"):
        raise ValueError(f"{op}: layout must be 'rows' or 'blocks', got {layout!r}")
    _check_tensor(op, "x", x, 2, (torch.bfloat16, torch.float16, torch.float32))
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{op}: x is empty (shape {tuple(x.shape)})")
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{op}: dtype must be one of {FP8_DTYPES}, got {dtype}")
    offsets = _group_offsets(op, offsets, ks, x.shape[0], x.device)
    dev = _check_same_device(op, x=x, offsets=offsets)
    be = resolve_backend(op, backend, dev, supported=PLAIN_BACKENDS, preference=("triton", "torch"))
    q, sf = backend_module(be).quant_per_group_colwise(x.contiguous(), offsets, dtype, ue8m0, rounding, layout)
    if compact:
        rows = _compact_rows(offsets)
        sf = sf[:rows].contiguous()
        if layout == "blocks":
            q = q[:rows]
    return q, sf


def _compact_rows(offsets: torch.Tensor) -> int:
    return int(((offsets_to_counts(offsets) + BLOCK - 1) // BLOCK).sum())


def k_grouped_fp8_gemm_tn_contiguous(a, b, offsets: torch.Tensor | None = None, d: torch.Tensor | None = None,
                                     c: torch.Tensor | None = None, *, ks=None,
                                     out_dtype: torch.dtype | None = None, backend: str | None = None) -> torch.Tensor:
    """K-grouped ``D[G, N, K]`` with ``D[g] = A_g.T @ B_g (+ C[g])`` (the weight gradient of grouped
    experts: A = dY, B = X), groups along the T (reduction) rows given by ``offsets[G]``
    (cumulative end rows) or ``ks[G]`` (per-group sizes, DeepGEMM's argument).

    a = (q [T, N], sf), b = (q [T, K], sf), both from :func:`quant_per_group_colwise` with the same
    groups; sf holds the static ``max_group_blocks(T, G)`` rows or DeepGEMM's compact
    ``sum(ceil(ks / 128))``. Empty groups give zero (or C). Output float32 by default. Both q may
    instead be group blocks ``[R, N, 128]`` / ``[R, K, 128]`` (``layout="blocks"``, R = sf rows):
    the Triton kernel's own layout, read without a re-layout pass.

    ``backend="deep_gemm"`` (only when named: ``None`` never picks it) calls DeepGEMM's op of this
    name with ``ks`` (a host list, read inside the one custom op of the call: one sync when offsets
    / ks live on the GPU) and the compact scale rows. It runs on SM100 only and needs ``ue8m0=True``
    scales, e4m3 operands, every ``ks[g]`` a multiple of 128 and of
    :func:`get_mk_alignment_for_contiguous_layout`, N and K multiples of 16, at most 128 groups and a
    float32 output; anything else is refused before DeepGEMM is called."""
    op = "k_grouped_fp8_gemm_tn_contiguous"
    pairs = []
    for name, pair in (("a", a), ("b", b)):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"{op}: {name} must be a (q, sf) pair from quant_per_group_colwise")
        dims = pair[0].dim() if isinstance(pair[0], torch.Tensor) else 2
        _check_tensor(op, f"{name}[0] (q)", pair[0], 3 if dims == 3 else 2, FP8_DTYPES)
        _check_tensor(op, f"{name}[1] (sf)", pair[1], 2, (torch.float32,))
        # row-major q keeps its strides (the Triton path re-lays it out itself); group blocks must
        # be packed
        pairs.append((pair[0].contiguous() if dims == 3 else pair[0], pair[1].contiguous()))
    (aq, asf), (bq, bsf) = pairs
    blocks = aq.dim() == 3
    if bq.dim() != aq.dim():
        raise ValueError(f"{op}: a and b must share a layout (both rows [T, C] or both group blocks [R, C, 128]), "
                         f"got q shapes {tuple(aq.shape)} and {tuple(bq.shape)}")
    if blocks:
        for name, q, sf in (("a", aq, asf), ("b", bq, bsf)):
            if q.shape[2] != BLOCK or tuple(sf.shape) != tuple(q.shape[:2]):
                raise ValueError(f"{op}: {name} group blocks must be [R, C, {BLOCK}] with scales [R, C], got q "
                                 f"{tuple(q.shape)} and sf {tuple(sf.shape)}")
        if aq.shape[0] != bq.shape[0]:
            raise ValueError(f"{op}: a and b must have the same blocks R, got {aq.shape[0]} and {bq.shape[0]}")
    elif aq.shape[0] != bq.shape[0]:
        raise ValueError(f"{op}: a and b must have the same rows T, got {aq.shape[0]} and {bq.shape[0]}")
    num_rows = aq.shape[0] * BLOCK if blocks else aq.shape[0]  # blocks: a bound on offsets[-1]
    offsets = _group_offsets(op, offsets, ks, num_rows, aq.device)
    bound = max_group_blocks(num_rows, offsets.numel())
    compact = ((offsets_to_counts(offsets) + BLOCK - 1) // BLOCK).sum()  # on the device: no host read
    for name, q, sf in (("a", aq, asf), ("b", bq, bsf)):
        if sf.shape[1] != q.shape[1] or (not blocks and sf.shape[0] > bound):
            raise ValueError(f"{op}: {name} scales must be ({bound}, {q.shape[1]}) (quant_per_group_colwise's static "
                             f"layout) or (sum(ceil(ks / 128)), {q.shape[1]}) (compact rows for these groups), got "
                             f"{tuple(sf.shape)}")
        # sizes only in the detail: a symbolic size in the device assertion's static message would
        # fail to trace with dynamic shapes
        need = (f"{op}: {name} scales must have quant_per_group_colwise's static rows max_group_blocks(T, G) or the "
                "compact sum(ceil(ks / 128)) rows for these groups")
        detail = (lambda name=name, q=q, sf=sf: f"{name} scales must be ({bound}, {q.shape[1]}) (static) or "
                  f"({int(compact)}, {q.shape[1]}) (compact), got {tuple(sf.shape)}: the groups need {int(compact)} "
                  "scale rows")
        if blocks:
            check_values(compact <= sf.shape[0], need, detail)
        elif sf.shape[0] != bound:
            check_values(compact == sf.shape[0], need, detail)
    dev = _check_same_device(op, aq=aq, bq=bq, offsets=offsets)
    out_dtype = torch.float32 if (out_dtype is None and d is None) else out_dtype
    shape = (offsets.numel(), aq.shape[1], bq.shape[1])
    d, out_dtype = _output(op, d, shape, out_dtype, dev, c)
    # DeepGEMM's input contract (SM100, UE8M0, 128-aligned ks) is narrower than what
    # quant_per_group_colwise gives by default, so the automatic choice never takes it
    be = resolve_backend(op, backend, dev, supported=FP8_BACKENDS, preference=("triton", "torch"))
    if blocks and be != "triton":
        pairs = [(reference.group_blocks_to_rows(q, offsets, num_rows), sf) for q, sf in pairs]
    if be == "torch":
        return _into(d, reference.k_grouped_fp8_gemm_tn_contiguous(pairs[0], pairs[1], offsets, out_dtype, c))
    if be == "deep_gemm":  # the group sizes go to the op as a tensor: DeepGEMM's host list is read inside it
        pairs = [(q.contiguous(), sf) for q, sf in pairs]
        return backend_module(be).k_grouped_fp8_gemm_tn_contiguous(pairs[0], pairs[1], offsets_to_counts(offsets),
                                                          _alloc(d, shape, out_dtype, dev), c)
    return backend_module(be).k_grouped_fp8_gemm_tn_contiguous(pairs[0], pairs[1], offsets, out_dtype, d, c)
