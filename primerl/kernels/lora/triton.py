"""Triton LoRA kernels: the two low-rank products of S-LoRA / Punica (``shrink`` to the rank,
``expand`` back to the output width, the latter adding into an existing output), dense or grouped
by expert over the grouped GEMMs' row layouts.

Legend: M rows, K reduction (d for the forward shrink), N output columns, R rank, G groups.

* ``shrink``: ``out[M, R] = scale * x[M, K] @ a[g][R, K].T`` for the rows of group g.
* ``expand``: ``out[M, N] = c[M, N] + scale * xa[M, R] @ b[g][N, R].T`` (``c`` optional; ``out`` may
  be ``c`` itself: each element is read before the same program writes it).

Both read their operands through strides, so transposed views serve the backward (``dxa = dy @ B``
is a shrink by ``B.T``, ``dx += dxa @ A`` an expand by ``A.T``) without copies. The base GEMM stays
on cuBLAS (``torch.mm``) or the FP8 GEMMs: a Triton base GEMM would lose more to cuBLAS than
fusing the add saves (the expand adds into the base output instead: one read of it, no separate
add kernel).

Row layouts (``mode``): dense (every row, group 0); ``offsets`` (the table of
:func:`primerl.kernels.gemm.triton._offsets_table`: one entry per group plus a zero-writing tail
entry for rows past ``offsets[-1]``, tiles never cross a group); ``m_indices`` (DeepGEMM's aligned
contiguous layout: each 128-row block one group, -1 rows zero). Rows outside every group are
written as zero (expand: ``c`` unchanged) and never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gemm.layout import BLOCK
from ..gemm.triton import _offsets_table
from ..gemm import triton_common as common
from ..gemm.triton_common import MODE_DENSE, MODE_M_INDICES, MODE_TABLE, cdiv, next_pow2, pow2_clamp

MODES = {"dense": MODE_DENSE, "offsets": MODE_TABLE, "m_indices": MODE_M_INDICES}


@triton.jit
def _tile_rows(mt, M, group_ptr, row_start_ptr, row_count_ptr, b_index_ptr, num_entries,
               MODE: tl.constexpr, ENTRIES_P2: tl.constexpr, BM: tl.constexpr):
    """Rows of M-tile ``mt``: (rows [BM], row_ok: rows of group g to compute, store_ok: rows this
    tile writes, g: the tile's group (-1: none), foreign: rows of another group (m_indices with a
    layout the launch did not assume))."""
    if MODE == 0:
        rows = mt * BM + tl.arange(0, BM)
        store_ok = rows < M
        row_ok = store_ok
        g = mt * 0
        foreign = rows < 0
    elif MODE == 2:
        rows = mt * BM + tl.arange(0, BM)
        store_ok = rows < M
        row_group = tl.load(group_ptr + rows, mask=store_ok, other=-1)
        g = tl.max(row_group, axis=0)
        row_ok = (row_group == g) & (g >= 0)
        foreign = (row_group >= 0) & (row_group != g)
    else:
        ent = tl.arange(0, ENTRIES_P2)
        tile_ends = tl.load(group_ptr + ent, mask=ent < num_entries, other=2**30)
        e = tl.sum((tile_ends <= mt).to(tl.int32), axis=0)
        e_safe = tl.minimum(e, num_entries - 1)
        prev = tl.load(group_ptr + e_safe - 1, mask=e_safe > 0, other=0)
        start = tl.load(row_start_ptr + e_safe)
        count = tl.load(row_count_ptr + e_safe)
        g = tl.load(b_index_ptr + e_safe)
        g = tl.where(e < num_entries, g, -1)
        local = (mt - prev) * BM + tl.arange(0, BM)
        rows = start + local
        store_ok = (local < count) & (e < num_entries)
        row_ok = store_ok & (g >= 0)
        foreign = rows < 0
    return rows, row_ok, store_ok, g, foreign


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr, group_ptr, row_start_ptr, row_count_ptr, b_index_ptr,
    M, K, R, num_entries, scale,
    stride_xm, stride_xk, stride_ag, stride_ar, stride_ak, stride_om,
    MODE: tl.constexpr, ENTRIES_P2: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (M-tile, R-tile): out[rows, r] = scale * sum_k x[rows, k] * a[g, r, k]."""
    mt = tl.program_id(0)
    offs_r = tl.program_id(1) * BR + tl.arange(0, BR)
    r_ok = offs_r < R
    rows, row_ok, store_ok, g, foreign = _tile_rows(mt, M, group_ptr, row_start_ptr, row_count_ptr, b_index_ptr,
                                                    num_entries, MODE, ENTRIES_P2, BM)
    rows64 = rows.to(tl.int64)
    g64 = tl.maximum(g, 0).to(tl.int64)
    acc = tl.zeros((BM, BR), dtype=tl.float32)
    num_k = tl.where(g >= 0, tl.cdiv(K, BK), 0)
    for kb in range(0, num_k):
        offs_k = kb * BK + tl.arange(0, BK)
        k_ok = offs_k < K
        xt = tl.load(x_ptr + rows64[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_ptr + g64 * stride_ag + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                     mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(xt, at, acc, input_precision=PRECISION)
    out = tl.where(row_ok[:, None], acc * scale, 0.0)
    if MODE == 2:
        out = tl.where(foreign[:, None], float("nan"), out)
    tl.store(out_ptr + rows64[:, None] * stride_om + offs_r[None, :], out.to(out_ptr.dtype.element_ty),
             mask=store_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(
    xa_ptr, b_ptr, c_ptr, out_ptr, group_ptr, row_start_ptr, row_count_ptr, b_index_ptr,
    M, N, R, num_entries, scale,
    stride_xam, stride_xar, stride_bg, stride_bn, stride_br, stride_cm, stride_om,
    MODE: tl.constexpr, HAS_C: tl.constexpr, ENTRIES_P2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BR: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (M-tile, N-tile): out[rows, n] = c[rows, n] + scale * sum_r xa[rows, r] * b[g, n, r]."""
    mt = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    rows, row_ok, store_ok, g, foreign = _tile_rows(mt, M, group_ptr, row_start_ptr, row_count_ptr, b_index_ptr,
                                                    num_entries, MODE, ENTRIES_P2, BM)
    rows64 = rows.to(tl.int64)
    g64 = tl.maximum(g, 0).to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    num_r = tl.where(g >= 0, tl.cdiv(R, BR), 0)
    for rb in range(0, num_r):
        offs_r = rb * BR + tl.arange(0, BR)
        r_ok = offs_r < R
        xat = tl.load(xa_ptr + rows64[:, None] * stride_xam + offs_r[None, :] * stride_xar,
                      mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        bt = tl.load(b_ptr + g64 * stride_bg + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                     mask=n_ok[None, :] & r_ok[:, None], other=0.0)
        acc = tl.dot(xat, bt, acc, input_precision=PRECISION)
    out = tl.where(row_ok[:, None], acc * scale, 0.0)
    if MODE == 2:
        out = tl.where(foreign[:, None], float("nan"), out)
    st_mask = store_ok[:, None] & n_ok[None, :]
    if HAS_C:
        out += tl.load(c_ptr + rows64[:, None] * stride_cm + offs_n[None, :], mask=st_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows64[:, None] * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty), mask=st_mask)


# ------------------------------------------------------------------------------ launchers


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def pick_tiles(rows_per_group: int, width: int, reduction: int, kernel: str) -> dict:
    """Tiles (BM, BR/BN, BK, warps, stages). Interpreter: the largest blocks the shape allows (each
    program costs Python overhead). GPU: BM 64 (LoRA products are thin: more M-tiles keep the SMs
    busy), the rank in one tile up to 64; shrink BK 64 over d; expand BN 128."""
    if common.triton_interpreter_enabled():
        bm = pow2_clamp(rows_per_group, 16, 128)
        if kernel == "shrink":
            return dict(BM=bm, BR=pow2_clamp(width, 16, 128), BK=pow2_clamp(reduction, 16, 128), num_warps=4,
                        num_stages=1)
        return dict(BM=bm, BN=pow2_clamp(width, 16, 128), BR=pow2_clamp(reduction, 16, 128), num_warps=4,
                    num_stages=1)
    if kernel == "shrink":
        return dict(BM=64, BR=pow2_clamp(width, 16, 64), BK=64, num_warps=4, num_stages=4)
    return dict(BM=64, BN=128, BR=pow2_clamp(reduction, 16, 64), num_warps=4, num_stages=3)


def _layout(index, kind: str, m: int, groups: int, bm: int):
    """(mode, group_ptr, row_start, row_count, b_index, num_entries, num_m_tiles) for the launch."""
    mode = MODES[kind]
    if kind == "offsets":
        tile_ends, starts, counts, b_index = _offsets_table(index, m, bm)
        # each group may end in a partial tile: at most one extra tile per table entry
        return mode, tile_ends, starts, counts, b_index, groups + 1, cdiv(m, bm) + groups + 1
    return mode, index, None, None, None, 1, cdiv(m, bm)


def _rows_per_group(m: int, kind: str, groups: int) -> int:
    return max(1, m // max(groups, 1)) if kind != "dense" else max(m, 1)


def shrink(x: torch.Tensor, a: torch.Tensor, index: torch.Tensor | None, kind: str, scale: float,
           out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] (any strides), a [G, R, K] (any strides; G = 1 for ``kind="dense"``), index offsets
    [G] / m_indices [M] / None -> out [M, R] = scale * x @ a[g].T per row's group (zero outside)."""
    m, k = x.shape
    groups, r = a.shape[0], a.shape[1]
    out = torch.empty(m, r, dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    cfg = pick_tiles(_rows_per_group(m, kind, groups), r, k, "shrink")
    bm = cfg.pop("BM")
    if kind == "m_indices":
        bm = min(bm, BLOCK)
    mode, group, starts, counts, b_index, entries, m_tiles = _layout(index, kind, m, groups, bm)
    dummy = group if group is not None else out
    _shrink_kernel[(m_tiles, cdiv(r, cfg["BR"]))](
        x, a, out, dummy, starts if starts is not None else dummy, counts if counts is not None else dummy,
        b_index if b_index is not None else dummy, m, k, r, entries, float(scale),
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), out.stride(0),
        MODE=mode, ENTRIES_P2=next_pow2(entries), BM=bm, PRECISION=_precision(x.dtype), **cfg,
    )
    return out


def expand(xa: torch.Tensor, b: torch.Tensor, index: torch.Tensor | None, kind: str, scale: float,
           c: torch.Tensor | None = None, out: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """xa [M, R] (any strides), b [G, N, R] (any strides), c [M, N] (unit column stride) or None ->
    out [M, N] = c + scale * xa @ b[g].T (``out`` may be ``c``: in place). Rows outside every
    group: c (zero without c)."""
    m, r = xa.shape
    groups, n = b.shape[0], b.shape[1]
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype or xa.dtype, device=xa.device)
    if m == 0 or n == 0:
        return out
    cfg = pick_tiles(_rows_per_group(m, kind, groups), n, r, "expand")
    bm = cfg.pop("BM")
    if kind == "m_indices":
        bm = min(bm, BLOCK)
    mode, group, starts, counts, b_index, entries, m_tiles = _layout(index, kind, m, groups, bm)
    dummy = group if group is not None else out
    _expand_kernel[(m_tiles, cdiv(n, cfg["BN"]))](
        xa, b, c if c is not None else out, out, dummy, starts if starts is not None else dummy,
        counts if counts is not None else dummy, b_index if b_index is not None else dummy,
        m, n, r, entries, float(scale),
        xa.stride(0), xa.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0) if c is not None else 0,
        out.stride(0),
        MODE=mode, HAS_C=c is not None, ENTRIES_P2=next_pow2(entries), BM=bm, PRECISION=_precision(xa.dtype), **cfg,
    )
    return out
