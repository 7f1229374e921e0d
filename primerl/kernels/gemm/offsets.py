"""Grouped-row layouts and the conversions between them, in one place.

Legend: G groups, M rows (tokens), ``counts[G]`` rows per group.

* ``offsets[G]`` int32: cumulative END row of each group (``torch._grouped_mm``'s ``offs``):
  group g owns rows ``offsets[g-1] .. offsets[g]-1`` (``offsets[-1]`` = 0). Rows at or past
  ``offsets[G-1]`` belong to no group.
* ``m_indices[M]`` int32: the group of each row, -1 for a padding row (DeepGEMM's contiguous
  layout, where every group starts on a multiple of ``get_mk_alignment_for_contiguous_layout()``).
* ``psum[G]`` int32 (DeepGEMM's ``use_psum_layout``): group g owns rows ``start_g .. psum[g]-1``
  with ``start_0 = 0`` and ``start_g = align(psum[g-1], alignment)``; rows in between are padding.
* masked layout: ``x[G, max_m, ...]`` with ``masked_m[G]`` valid rows per group (DeepGEMM's
  low-latency decode layout).

Everything here runs on the tensors' device without a host sync, except where a function says it
needs a Python int (an output size) and none was passed.
"""

from __future__ import annotations

import torch

from .._constant_result import assume_constant_result

M_ALIGNMENT = 128  # DeepGEMM's legacy alignment (SM90)
_alignment = [M_ALIGNMENT]


def get_mk_alignment_for_contiguous_layout() -> int:
    """Row (M, or K for K-grouped) alignment of each group in the contiguous layouts: the default
    of every layout helper here. 128 unless changed with the setter."""
    return _alignment[0]


def set_mk_alignment_for_contiguous_layout(alignment: int) -> None:
    """Set the alignment the layout helpers use (DeepGEMM: set it to at least the theoretical value
    of the device, see :func:`get_theoretical_mk_alignment_for_contiguous_layout`). primerl's own
    kernels accept any positive alignment; the deep_gemm backend needs DeepGEMM's to match."""
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0:
        raise ValueError(f"set_mk_alignment_for_contiguous_layout: alignment must be a positive int, got {alignment!r}")
    _alignment[0] = alignment


def get_theoretical_mk_alignment_for_contiguous_layout(expected_m: int | None = None, *,
                                                       arch_major: int | None = None) -> int:
    """DeepGEMM's smallest usable group alignment: 128 on SM90 (and when no GPU is present); on
    SM100 the smallest of 224, 192, .., 32 that still covers ``expected_m`` rows (224 when
    ``expected_m`` is None). ``arch_major`` defaults to the current CUDA device's."""
    if expected_m is not None and (not isinstance(expected_m, int) or expected_m < 0):
        raise ValueError(f"get_theoretical_mk_alignment_for_contiguous_layout: expected_m must be a "
                         f"non-negative int or None, got {expected_m!r}")
    if arch_major is None:
        arch_major = current_arch_major()
    if arch_major != 10:
        return M_ALIGNMENT
    block_m, step = 224, 32
    while expected_m is not None and block_m > 32 and block_m - step >= expected_m:
        block_m -= step
    return block_m


@assume_constant_result
def device_capability(device) -> tuple[int, int]:
    """The CUDA compute capability of ``device``: the one place primerl asks (tests mock it). A
    compile-time constant: torch.compile calls it at trace time rather than tracing the query."""
    return torch.cuda.get_device_capability(device)


def current_arch_major() -> int | None:
    if not torch.cuda.is_available():
        return None
    return device_capability(torch.cuda.current_device())[0]


def get_m_alignment() -> int:
    """Alias of :func:`get_mk_alignment_for_contiguous_layout` (primerl's earlier name)."""
    return get_mk_alignment_for_contiguous_layout()


def _alignment_or_default(alignment: int | None) -> int:
    if alignment is None:
        return get_mk_alignment_for_contiguous_layout()
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"alignment must be a positive int, got {alignment!r}")
    return alignment


def _as_int32(name: str, t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D integer tensor, got {_describe(t)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    return t.to(torch.int32)


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"tensor of shape {tuple(t.shape)} and dtype {t.dtype}"
    return type(t).__name__


def counts_to_offsets(counts: torch.Tensor) -> torch.Tensor:
    """``counts[G]`` -> cumulative end ``offsets[G]`` (int32)."""
    counts = _as_int32("counts", counts)
    return torch.cumsum(counts, 0, dtype=torch.int32)


def offsets_to_counts(offsets: torch.Tensor) -> torch.Tensor:
    """Cumulative end ``offsets[G]`` -> ``counts[G]`` (int32)."""
    offsets = _as_int32("offsets", offsets)
    return torch.diff(offsets, prepend=offsets.new_zeros(1))


def offsets_to_starts(offsets: torch.Tensor) -> torch.Tensor:
    """Cumulative end ``offsets[G]`` -> first row of each group ``starts[G]`` (int32)."""
    offsets = _as_int32("offsets", offsets)
    return torch.cat([offsets.new_zeros(1), offsets[:-1]])


def align_counts(counts: torch.Tensor, alignment: int | None = None) -> torch.Tensor:
    """Round every count up to a multiple of ``alignment`` (empty groups stay empty)."""
    alignment = _alignment_or_default(alignment)
    counts = _as_int32("counts", counts)
    return (counts + alignment - 1) // alignment * alignment


def max_padded_rows(num_rows: int, num_groups: int, alignment: int | None = None) -> int:
    """A static upper bound on the padded total, for shape-stable (sync-free, graph-capturable) code."""
    alignment = _alignment_or_default(alignment)
    return -(-num_rows // alignment) * alignment + num_groups * alignment


def offsets_to_m_indices(offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``offsets[G]`` -> ``m_indices[num_rows]``: each row's group, -1 past ``offsets[-1]``."""
    offsets = _as_int32("offsets", offsets)
    rows = torch.arange(num_rows, device=offsets.device, dtype=torch.int32)
    group = torch.searchsorted(offsets, rows, right=True).to(torch.int32)
    return torch.where(group < offsets.numel(), group, -1).to(torch.int32)


def m_indices_to_counts(m_indices: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``m_indices[M]`` -> ``counts[G]`` of valid (non -1) rows per group (int32)."""
    m_indices = _as_int32("m_indices", m_indices)
    valid = m_indices >= 0
    idx = torch.where(valid, m_indices, num_groups).long()
    return torch.bincount(idx, minlength=num_groups + 1)[:num_groups].to(torch.int32)


def _dest_rows(offsets: torch.Tensor, num_rows: int, alignment: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows ``0..num_rows-1`` of the packed layout: their row in the aligned layout (-1 for
    rows past ``offsets[-1]``), and the aligned layout's end offsets."""
    counts = offsets_to_counts(offsets)
    padded_offsets = torch.cumsum(align_counts(counts, alignment), 0, dtype=torch.int32)
    padded_starts = padded_offsets - align_counts(counts, alignment)
    group = offsets_to_m_indices(offsets, num_rows)
    rows = torch.arange(num_rows, device=offsets.device, dtype=torch.int32)
    safe = group.clamp_min(0).long()
    starts = offsets - counts
    dest = padded_starts[safe] + rows - starts[safe]
    return torch.where(group >= 0, dest, -1), padded_offsets


def pad_to_contiguous(
    x: torch.Tensor,
    offsets: torch.Tensor,
    alignment: int | None = None,
    *,
    total_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed rows ``x[M, ...]`` grouped by ``offsets`` -> the aligned contiguous layout.

    Returns ``(x_padded[P, ...], m_indices[P], padded_offsets[G])`` with padding rows zero and
    ``m_indices`` -1 there. ``P = total_rows`` when given (must be >= the padded total, e.g.
    :func:`max_padded_rows`; no host sync) else the exact padded total (one host sync).
    Differentiable in ``x``. ``alignment`` defaults to :func:`get_mk_alignment_for_contiguous_layout`.
    """
    alignment = _alignment_or_default(alignment)
    offsets = _as_int32("offsets", offsets)
    if x.dim() < 1:
        raise ValueError(f"pad_to_contiguous: x must have a row dim, got shape {tuple(x.shape)}")
    dest, padded_offsets = _dest_rows(offsets, x.shape[0], alignment)
    if total_rows is None:
        total_rows = int(padded_offsets[-1]) if padded_offsets.numel() else 0
    valid = dest >= 0
    scatter_to = torch.where(valid, dest, total_rows).long()  # invalid rows go to a dropped extra row
    out = x.new_zeros((total_rows + 1, *x.shape[1:]))
    src = torch.where(valid.view(-1, *([1] * (x.dim() - 1))), x, torch.zeros((), dtype=x.dtype, device=x.device))
    out = out.index_copy(0, scatter_to, src)[:total_rows]
    m_indices = offsets_to_m_indices(padded_offsets, total_rows)
    # rows in a group's aligned tail are padding: mark them -1
    src_rows = torch.zeros(total_rows + 1, dtype=torch.bool, device=x.device)
    src_rows[scatter_to] = True
    m_indices = torch.where(src_rows[:total_rows], m_indices, -1)
    return out, m_indices, padded_offsets


def unpad_from_contiguous(
    y_padded: torch.Tensor, offsets: torch.Tensor, num_rows: int, alignment: int | None = None
) -> torch.Tensor:
    """Inverse of :func:`pad_to_contiguous`: ``y_padded[P, ...]`` -> packed ``y[num_rows, ...]``
    (rows past ``offsets[-1]`` come back zero). Differentiable."""
    alignment = _alignment_or_default(alignment)
    offsets = _as_int32("offsets", offsets)
    dest, _ = _dest_rows(offsets, num_rows, alignment)
    valid = dest >= 0
    out = y_padded.index_select(0, dest.clamp_min(0).long())
    return torch.where(valid.view(-1, *([1] * (y_padded.dim() - 1))), out,
                       torch.zeros((), dtype=out.dtype, device=out.device))


def counts_to_psum(counts: torch.Tensor, alignment: int | None = None) -> torch.Tensor:
    """``counts[G]`` -> DeepGEMM's psum layout ``psum[G]``: ``psum[g] = align(psum[g-1]) + counts[g]``
    (the end row of each group when every group starts on a multiple of ``alignment``)."""
    counts = _as_int32("counts", counts)
    aligned = align_counts(counts, alignment)
    return torch.cumsum(aligned, 0, dtype=torch.int32) - aligned + counts


def psum_to_m_indices(psum: torch.Tensor, num_rows: int, alignment: int | None = None) -> torch.Tensor:
    """psum layout ``psum[G]`` -> ``m_indices[num_rows]`` (-1 for the gaps and rows past the end)."""
    alignment = _alignment_or_default(alignment)
    psum = _as_int32("psum", psum)
    starts = torch.cat([psum.new_zeros(1), (psum[:-1] + alignment - 1) // alignment * alignment])
    rows = torch.arange(num_rows, device=psum.device, dtype=torch.int32)
    group = torch.searchsorted(psum, rows, right=True).to(torch.int32)
    safe = group.clamp_max(max(psum.numel() - 1, 0)).long()
    valid = (group < psum.numel()) & (rows >= starts[safe])
    return torch.where(valid, group, -1).to(torch.int32)


def to_masked(x: torch.Tensor, offsets: torch.Tensor, max_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ``x[M, ...]`` -> masked layout ``(x_masked[G, max_m, ...], masked_m[G])``.

    Every group must hold at most ``max_m`` rows (rows beyond are dropped: check ``masked_m``
    against ``offsets_to_counts(offsets)`` if unsure). Unused rows are zero. Differentiable.
    """
    offsets = _as_int32("offsets", offsets)
    num_groups = offsets.numel()
    counts = offsets_to_counts(offsets)
    group = offsets_to_m_indices(offsets, x.shape[0])
    rows = torch.arange(x.shape[0], device=x.device, dtype=torch.int32)
    safe = group.clamp_min(0).long()
    local = rows - (offsets - counts)[safe]
    valid = (group >= 0) & (local < max_m)
    dest = torch.where(valid, safe * max_m + local, num_groups * max_m).long()
    src = torch.where(valid.view(-1, *([1] * (x.dim() - 1))), x, torch.zeros((), dtype=x.dtype, device=x.device))
    out = x.new_zeros((num_groups * max_m + 1, *x.shape[1:])).index_copy(0, dest, src)
    return out[:-1].view(num_groups, max_m, *x.shape[1:]), counts.clamp_max(max_m)


def from_masked(y_masked: torch.Tensor, offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Inverse of :func:`to_masked`: ``y[G, max_m, ...]`` -> packed ``y[num_rows, ...]``."""
    offsets = _as_int32("offsets", offsets)
    max_m = y_masked.shape[1]
    counts = offsets_to_counts(offsets)
    group = offsets_to_m_indices(offsets, num_rows)
    rows = torch.arange(num_rows, device=y_masked.device, dtype=torch.int32)
    safe = group.clamp_min(0).long()
    local = rows - (offsets - counts)[safe]
    valid = (group >= 0) & (local < max_m)
    flat = y_masked.reshape(-1, *y_masked.shape[2:])
    out = flat.index_select(0, torch.where(valid, safe * max_m + local, 0).long())
    return torch.where(valid.view(-1, *([1] * (flat.dim() - 1))), out,
                       torch.zeros((), dtype=out.dtype, device=out.device))


def group_block_starts(offsets: torch.Tensor, block: int = 128) -> torch.Tensor:
    """First scale-block row of each group when every group is cut into ``block``-row blocks that
    never cross a group boundary (the layout of :func:`quant_per_group_colwise`'s scales)."""
    counts = offsets_to_counts(offsets)
    nblocks = (counts + block - 1) // block
    return torch.cumsum(nblocks, 0, dtype=torch.int32) - nblocks


def max_group_blocks(num_rows: int, num_groups: int, block: int = 128) -> int:
    """Static bound on the number of group-local ``block``-row blocks (sum of ceil(count/block))."""
    return -(-num_rows // block) + num_groups
