"""Triton GEMMs. FP8 (block-scaled): a TMA M-grouped NT kernel (dense, offsets, aligned m_indices,
masked) and a TMA K-grouped kernel (weight gradients). 16/32-bit, and FP8 m_indices layouts whose
tiles mix groups: a pointer-load M-grouped NT kernel and a K-grouped TN kernel. All persistent.

Scheduling. The M-grouped kernels walk a flat list of (M-tile, N-tile) pairs with a stride of
the number of programs (one program per SM on a GPU); the FP8 kernel orders them in bands of 8
M-tiles walked N-tile-major (programs running at once share B panels in L2). How an M-tile maps
to rows depends on the mode:

* DENSE: tile ``mt`` covers rows ``mt*BM ..``, group 0.
* TABLE: a small device-side table of row ranges ``(start, count, b_index)`` with cumulative tile
  ends; tile ``mt`` belongs to the entry whose tile range holds it (a vector compare against
  all entries). Offsets layouts add a tail entry with ``b_index = -1`` that writes zeros for rows
  past ``offsets[-1]``. The table is built with torch ops on the device: no host sync.
* MASKED (FP8): group ``mt // ceil(max_m / BM)``; a tile past ``masked_m`` computes and stores
  nothing (no table: nothing to build on the host).
* M_INDICES: DeepGEMM's aligned layout; a tile's group is the max of its rows' ``m_indices``
  (every 128-row block holds one group), rows whose index differs are padding and give zero.

FP8 (Hopper structure): A [M, K] and B [G*N, K] are read through TMA tensor descriptors into a
4-stage shared-memory pipeline, BM x BN x BK = 128 x 128 x 128 with 8 warps (two consumer
warpgroups of 64 rows; 64 x 128 with 4 warps for decode-sized M). One A scale per row and one B
scale per 128 x 128 block: each K block's partial product is scaled in float32 registers and
added (scale promotion, ``acc += dot(a, b) * (sa * sb)[:, None]``, one FMA per element), with
the next block's scales loaded a step ahead. Rows another group owns may be read (TMA loads
whole boxes) but are never stored, so NaN there never enters a valid row.

K-grouped FP8: each group's rows are cut into 128-row blocks (one scale row each, see
:func:`quant_per_group_colwise`). The kernel reads the group-blocks layout ``[blocks, C, 128]``
(a block's rows K-major, zero past its group's end), which ``quant_per_group_colwise(...,
layout="blocks")`` writes directly; row-major operands are re-laid out in one pass first. Every
TMA box then starts at a block boundary and the kernel needs no masks; output tiles 128 x 128,
scales ``sa[block, n] * sb[block, k]`` applied per block.

Warp specialization (``tl.range(warp_specialize=True)``) compiles on sm_90a with triton 3.6-3.7
only at 64-row tiles and measured 0.6x the software pipeline on the H200: off by default.
Tile shapes come from :func:`pick_tiles`, a table keyed on (rows per group, N, K), not autotuning.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .._backend import triton_interpreter_enabled as _interpreter_env
from ..fp8 import reference as fp8_ref
from ..fp8.reference import fp8_max
from ..fp8.triton import _abs_bits, _cast_scaled, _scale_from_amax
from . import offsets as off

BLOCK = 128


@functools.lru_cache(maxsize=None)
def triton_interpreter_enabled() -> bool:
    """TRITON_INTERPRET=1, read once: it must be set before the first @triton.jit runs, so it does not
    change later (reading the environment costs ~1-10 us, several times per launch)."""
    return _interpreter_env()

MODE_DENSE, MODE_TABLE, MODE_M_INDICES, MODE_MASKED = 0, 1, 2, 3  # MASKED: FP8 (TMA) kernel only
BN_PER_ROW_B = 64


@triton.jit
def _k_loop(a_ptr, sa_ptr, b_ptr, sb_ptr, rows, row_ok, offs_n, n_mask, g, K, stride_am, stride_ak, stride_bg,
            stride_bn, stride_bk, stride_sam, stride_sbg, stride_sbn,
            SCALED: tl.constexpr, SB_GRAN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            PRECISION: tl.constexpr):
    """acc[BM, BN] = sum over K of A[rows] @ B[g, offs_n].T (rows not row_ok read as zero); a group
    g < 0 runs zero K steps (padding / tail tiles store zeros)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    num_k = tl.where(g >= 0, tl.cdiv(K, BK), 0)
    g64 = tl.maximum(g, 0).to(tl.int64)
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + g64 * stride_bg + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    sa_ptrs = sa_ptr + rows.to(tl.int64) * stride_sam
    sb_ptrs = sb_ptr + g64 * stride_sbg + (offs_n // SB_GRAN) * stride_sbn
    for kb in range(0, num_k):
        k_ok = kb * BK + offs_k < K
        a = tl.load(a_ptrs + kb * BK * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs + kb * BK * stride_bk, mask=n_mask[None, :] & k_ok[:, None], other=0.0)
        if SCALED:
            sa = tl.load(sa_ptrs + kb, mask=row_ok, other=0.0)
            sb = tl.load(sb_ptrs + kb, mask=n_mask, other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _m_grouped_gemm_nt_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, d_ptr, c_ptr,
    group_ptr, row_start_ptr, row_count_ptr, b_index_ptr,
    M, N, K, num_entries, num_m_tiles, num_progs,
    stride_am, stride_ak, stride_bg, stride_bn, stride_bk, stride_dm, stride_cm,
    stride_sam, stride_sbg, stride_sbn,
    MODE: tl.constexpr, SCALED: tl.constexpr, HAS_C: tl.constexpr, SB_GRAN: tl.constexpr, MIXED: tl.constexpr,
    ENTRIES_P2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    """D[rows] = A[rows] @ B[g].T (+ C[rows] with HAS_C); SB_GRAN: B-scale rows cover 128 (block
    scales) or 1 (per-row scales, recipe (1, 1, 128)) rows of B. MIXED (m_indices only): a tile
    may hold several groups (group alignment not a multiple of BM)."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    for tile in range(pid, num_m_tiles * n_tiles, num_progs):
        mt = tile // n_tiles
        offs_n = (tile % n_tiles) * BN + tl.arange(0, BN)
        n_mask = offs_n < N
        if MODE == 2 and MIXED:
            # m_indices with alignments that are no multiple of BM (e.g. 32..224 on SM100): one K
            # loop per group present in the tile, each storing its own rows; -1 rows get zero.
            # (Stored inside the loop: a second [BM, BN] accumulator would spill registers. The
            # loop still spills on sm_100a, so it is compiled only for such layouts.)
            rows = mt * BM + tl.arange(0, BM)
            in_bounds = rows < M
            row_group = tl.load(group_ptr + rows, mask=in_bounds, other=-1)
            g_hi = tl.max(row_group, axis=0)
            g_lo = tl.min(tl.where(row_group >= 0, row_group, 2**30), axis=0)
            d_ptrs = d_ptr + rows.to(tl.int64)[:, None] * stride_dm + offs_n[None, :]
            pad = in_bounds & (row_group < 0)
            tl.store(d_ptrs, tl.zeros((BM, BN), dtype=d_ptr.dtype.element_ty), mask=pad[:, None] & n_mask[None, :])
            for gg in range(g_lo, g_hi + 1):
                row_ok = row_group == gg
                present = tl.max(row_ok.to(tl.int32), axis=0) > 0
                acc = _k_loop(a_ptr, sa_ptr, b_ptr, sb_ptr, rows, row_ok, offs_n, n_mask,
                              tl.where(present, gg, -1), K, stride_am, stride_ak, stride_bg, stride_bn, stride_bk,
                              stride_sam, stride_sbg, stride_sbn, SCALED, SB_GRAN, BM, BN, BK, PRECISION)
                tl.store(d_ptrs, acc.to(d_ptr.dtype.element_ty), mask=row_ok[:, None] & n_mask[None, :])
        else:
            if MODE == 0:
                rows = mt * BM + tl.arange(0, BM)
                row_ok = rows < M
                store_ok = row_ok
                g = mt * 0
            elif MODE == 2:
                # one group per tile: the tile's group is the max of its rows' m_indices
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
                local = (mt - prev) * BM + tl.arange(0, BM)
                rows = start + local
                store_ok = (local < count) & (e < num_entries)
                row_ok = store_ok & (g >= 0)
            acc = _k_loop(a_ptr, sa_ptr, b_ptr, sb_ptr, rows, row_ok, offs_n, n_mask, g, K, stride_am, stride_ak,
                          stride_bg, stride_bn, stride_bk, stride_sam, stride_sbg, stride_sbn,
                          SCALED, SB_GRAN, BM, BN, BK, PRECISION)
            out = tl.where(row_ok[:, None], acc, 0.0)
            if MODE == 2:
                # a row of another group here means the layout's alignment is not the one the launch
                # assumed: NaN, never a silent zero
                out = tl.where(foreign[:, None], float("nan"), out)
            st_mask = store_ok[:, None] & n_mask[None, :]
            if HAS_C:
                out += tl.load(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], mask=st_mask,
                               other=0.0)
            d_ptrs = d_ptr + rows.to(tl.int64)[:, None] * stride_dm + offs_n[None, :]
            tl.store(d_ptrs, out.to(d_ptr.dtype.element_ty), mask=st_mask)



@triton.jit
def _m_tile_rows(mt, group_ptr, row_start_ptr, row_count_ptr, b_index_ptr, M, num_entries, max_m,
                 MODE: tl.constexpr, ENTRIES_P2: tl.constexpr, BM: tl.constexpr):
    """M-tile mt -> (first row, rows [BM], rows to store, rows to compute, group or -1 when the
    tile computes nothing, foreign rows). DENSE / M_INDICES tiles cover rows mt*BM..; TABLE tiles
    look their entry up (see the module doc); MASKED tiles are group mt // ceil(max_m / BM)'s,
    rows past row_count[g] (masked_m) neither computed nor stored."""
    if MODE == 1:
        ent = tl.arange(0, ENTRIES_P2)
        tile_ends = tl.load(group_ptr + ent, mask=ent < num_entries, other=2**30)
        e = tl.sum((tile_ends <= mt).to(tl.int32), axis=0)
        e_safe = tl.minimum(e, num_entries - 1)
        prev = tl.load(group_ptr + e_safe - 1, mask=e_safe > 0, other=0)
        count = tl.load(row_count_ptr + e_safe)
        g = tl.where(e < num_entries, tl.load(b_index_ptr + e_safe), -1)
        row0 = tl.load(row_start_ptr + e_safe) + (mt - prev) * BM
        local = (mt - prev) * BM + tl.arange(0, BM)
        store_ok = (local < count) & (e < num_entries)
        row_ok = store_ok & (g >= 0)
        foreign = store_ok & False
    elif MODE == 3:
        tiles_per_group = tl.cdiv(max_m, BM)
        g = mt // tiles_per_group
        first = (mt % tiles_per_group) * BM
        count = tl.minimum(tl.load(row_count_ptr + g), max_m)
        row0 = g * max_m + first
        store_ok = first + tl.arange(0, BM) < count
        row_ok = store_ok
        g = tl.where(first < count, g, -1)
        foreign = store_ok & False
    else:
        row0 = mt * BM
        rows_in = row0 + tl.arange(0, BM) < M
        store_ok = rows_in
        if MODE == 2:
            # one group per tile: the tile's group is the max of its rows' m_indices
            row_group = tl.load(group_ptr + row0 + tl.arange(0, BM), mask=rows_in, other=-1)
            g = tl.max(row_group, axis=0)
            row_ok = (row_group == g) & (g >= 0)
            foreign = (row_group >= 0) & (row_group != g)
        else:
            g = mt * 0
            row_ok = rows_in
            foreign = rows_in & False
    return row0, row0 + tl.arange(0, BM), store_ok, row_ok, g, foreign


@triton.jit
def _m_grouped_fp8_kernel(
    a_desc, b_desc, sa_ptr, sb_ptr, d_ptr, c_ptr, group_ptr, row_start_ptr, row_count_ptr, b_index_ptr,
    M, N, K, num_entries, max_m, num_m_tiles, num_progs, stride_dm, stride_cm, stride_sam, stride_sbg, stride_sbn,
    MODE: tl.constexpr, HAS_C: tl.constexpr, SB_GRAN: tl.constexpr, ENTRIES_P2: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWIZZLE: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """FP8 D[rows] = A[rows] @ B[g].T (+ C) with TMA: a_desc over A [M, K], b_desc over B [G*N, K]
    (both K-major), sa [M, K/128] per-row scales, sb [G, N/SB_GRAN, K/128] (SB_GRAN 128: one scale
    per 128x128 block, a scalar per BN <= 128 tile; 1: per row of B).

    Persistent: program p takes tiles p, p + num_progs, ..; tile t -> (M-tile, N-tile) in bands of
    SWIZZLE M-tiles walked N-tile-major, so the programs running at once share B panels in L2.
    Each 128-wide K block's partial product is scaled in float32 registers and added (scale
    promotion); the block's A and B scales are loaded one K step ahead (the TMA pipeline does not
    cover them, and their L2 latency would otherwise sit between the wgmma and the FMAs). Rows
    another group owns are read (TMA loads whole boxes) but never stored."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    num_k = tl.cdiv(K, BK)
    for tile in range(pid, num_m_tiles * tiles_n, num_progs):
        mt, pn = _tile_in_group(tile, num_m_tiles, tiles_n, SWIZZLE)
        row0, rows, store_ok, row_ok, g, foreign = _m_tile_rows(
            mt, group_ptr, row_start_ptr, row_count_ptr, b_index_ptr, M, num_entries, max_m, MODE, ENTRIES_P2, BM)
        n0 = pn * BN
        offs_n = n0 + tl.arange(0, BN)
        n_ok = offs_n < N
        g64 = tl.maximum(g, 0).to(tl.int64)
        sa_ptrs = sa_ptr + rows.to(tl.int64) * stride_sam
        if SB_GRAN == 1:
            sb_ptrs = sb_ptr + g64 * stride_sbg + offs_n * stride_sbn
        else:
            sb_ptrs = sb_ptr + g64 * stride_sbg + (n0 // SB_GRAN) * stride_sbn
        steps = tl.where(g >= 0, num_k, 0)
        sa_next = tl.load(sa_ptrs, mask=row_ok & (steps > 0), other=0.0)
        if SB_GRAN != 1:
            sb_next = tl.load(sb_ptrs, mask=steps > 0, other=0.0)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in tl.range(0, steps, warp_specialize=WARP_SPECIALIZE):
            a = a_desc.load([row0, kb * BK])
            b = b_desc.load([g * N + n0, kb * BK])
            sa = sa_next
            sa_next = tl.load(sa_ptrs + (kb + 1), mask=row_ok & (kb + 1 < steps), other=0.0)
            if SB_GRAN == 1:
                sb = tl.load(sb_ptrs + kb, mask=n_ok, other=0.0)
                acc += tl.dot(a, b.T) * (sa[:, None] * sb[None, :])
            else:
                scale = sa * sb_next
                sb_next = tl.load(sb_ptrs + (kb + 1), mask=kb + 1 < steps, other=0.0)
                acc += tl.dot(a, b.T) * scale[:, None]
        out = tl.where(row_ok[:, None], acc, 0.0)
        if MODE == 2:
            # a row of another group here means the layout's alignment is not the one the launch
            # assumed: NaN, never a silent zero
            out = tl.where(foreign[:, None], float("nan"), out)
        st_mask = store_ok[:, None] & n_ok[None, :]
        if HAS_C:
            out += tl.load(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], mask=st_mask, other=0.0)
        tl.store(d_ptr + rows.to(tl.int64)[:, None] * stride_dm + offs_n[None, :], out.to(d_ptr.dtype.element_ty),
                 mask=st_mask)


@triton.jit
def _k_grouped_gemm_tn_kernel(
    a_ptr, b_ptr, d_ptr, offsets_ptr, m_indices_ptr, N, K, G, num_progs, stride_a, stride_b,
    ROW_MASK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, PRECISION: tl.constexpr,
):
    """16/32-bit weight gradients: d[g, n, k] = sum over rows t of group g of a[t, n] * b[t, k]
    (row-major operands; Hopper's 16-bit wgmma takes them MN-major from shared memory)."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in range(pid, G * n_tiles * k_tiles, num_progs):
        g = tile // (n_tiles * k_tiles)
        rest = tile % (n_tiles * k_tiles)
        offs_n = (rest // k_tiles) * BN + tl.arange(0, BN)
        offs_k = (rest % k_tiles) * BK + tl.arange(0, BK)
        n_ok = offs_n < N
        k_ok = offs_k < K
        end = tl.load(offsets_ptr + g)
        start = tl.load(offsets_ptr + g - 1, mask=g > 0, other=0)
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for t in range(start, end, BT):
            rows = t + tl.arange(0, BT)
            r_ok = rows < end
            if ROW_MASK:
                r_ok = r_ok & (tl.load(m_indices_ptr + rows, mask=r_ok, other=-1) >= 0)
            rows64 = rows.to(tl.int64)
            a = tl.load(a_ptr + rows64[None, :] * stride_a + offs_n[:, None], mask=r_ok[None, :] & n_ok[:, None], other=0.0)
            b = tl.load(b_ptr + rows64[:, None] * stride_b + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        out_offs = g.to(tl.int64) * N * K + offs_n[:, None] * K + offs_k[None, :]
        tl.store(d_ptr + out_offs, acc.to(d_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])

@triton.jit
def _tile_in_group(r, tiles_n, tiles_k, SWIZZLE: tl.constexpr):
    """Tile r of a (tiles_n x tiles_k) grid -> (pn, pk), in bands of SWIZZLE N-tiles walked
    K-tile-major, so the programs running at once share A and B panels in L2."""
    width = SWIZZLE * tiles_k
    band = r // width
    first = band * SWIZZLE
    rows = tl.minimum(tiles_n - first, SWIZZLE)
    return first + (r % width) % rows, (r % width) // rows


@triton.jit
def _k_grouped_fp8_kernel(
    a_desc, b_desc, sa_ptr, sb_ptr, d_ptr, c_ptr, offsets_ptr, block_start_ptr, N, K, G, num_progs, stride_sa, stride_sb,
    HAS_C: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, SWIZZLE: tl.constexpr,
    PREFETCH_SCALES: tl.constexpr,
):
    """d[g] = A_g.T @ B_g (+ c[g]) from K-major FP8 group blocks: a_desc over A [R*N, BT], b_desc
    over B [R*K, BT], rows r*N + n holding column n of scale block r (row i of the block at
    column i, zero past its group's end; see _group_blocks_kernel); sa [R, N], sb [R, K] one scale
    per (block, column); group g owns blocks block_start[g] .. + ceil(rows_g / BT). A box past N
    (K) reads the next block's rows into accumulator rows (columns) that are not stored.

    Persistent: each program walks output tiles (g, n-tile, k-tile) with a stride of the number of
    programs; a tile loops over its group's blocks through TMA, scales each block's partial
    product in float32 registers (scale promotion) and adds it. A thread needs one B scale per
    accumulator column (32 at 128x128 / 8 warps): PREFETCH_SCALES loads block j+1's scales while
    block j computes (their L2 latency is otherwise paid after every wait; it costs ~30 registers,
    which spill on sm_100a, where the loads stay in step)."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    tiles_k = tl.cdiv(K, BK)
    per_group = tiles_n * tiles_k
    for tile in range(pid, G * per_group, num_progs):
        g = tile // per_group
        pn, pk = _tile_in_group(tile % per_group, tiles_n, tiles_k, SWIZZLE)
        n0 = pn * BN
        k0 = pk * BK
        offs_n = n0 + tl.arange(0, BN)
        offs_k = k0 + tl.arange(0, BK)
        n_ok = offs_n < N
        k_ok = offs_k < K
        end = tl.load(offsets_ptr + g)
        start = tl.load(offsets_ptr + g - 1, mask=g > 0, other=0)
        blk0 = tl.load(block_start_ptr + g)
        steps = tl.cdiv(end - start, BT)
        sa_ptrs = sa_ptr + blk0.to(tl.int64) * stride_sa + offs_n
        sb_ptrs = sb_ptr + blk0.to(tl.int64) * stride_sb + offs_k
        if PREFETCH_SCALES:
            sa_next = tl.load(sa_ptrs, mask=n_ok & (steps > 0), other=0.0)
            sb_next = tl.load(sb_ptrs, mask=k_ok & (steps > 0), other=0.0)
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for j in range(0, steps):
            a = a_desc.load([(blk0 + j) * N + n0, 0])
            b = b_desc.load([(blk0 + j) * K + k0, 0])
            if PREFETCH_SCALES:
                sa = sa_next
                sb = sb_next
                sa_next = tl.load(sa_ptrs + (j + 1) * stride_sa, mask=n_ok & (j + 1 < steps), other=0.0)
                sb_next = tl.load(sb_ptrs + (j + 1) * stride_sb, mask=k_ok & (j + 1 < steps), other=0.0)
            else:
                sa = tl.load(sa_ptrs + j * stride_sa, mask=n_ok, other=0.0)
                sb = tl.load(sb_ptrs + j * stride_sb, mask=k_ok, other=0.0)
            acc += tl.dot(a, b.T) * (sa[:, None] * sb[None, :])
        out_offs = g.to(tl.int64) * N * K + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
        st_mask = n_ok[:, None] & k_ok[None, :]
        if HAS_C:
            acc += tl.load(c_ptr + out_offs, mask=st_mask, other=0.0)
        tl.store(d_ptr + out_offs, acc.to(d_ptr.dtype.element_ty), mask=st_mask)


@triton.jit
def _group_blocks_kernel(q_ptr, out_ptr, offsets_ptr, block_start_ptr, C, G, used_blocks_ptr, stride_qt, stride_qc,
                         BT: tl.constexpr, BC: tl.constexpr, G_P2: tl.constexpr):
    """q [T, C] (any strides) -> out [R, C, BT]: out[b, c, i] = q[row i of group block b, c] (zero
    past the group's end). Program (block b, column tile); blocks past the used count exit."""
    blk = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    c_ok = cols < C
    if blk < tl.load(used_blocks_ptr):
        ent = tl.arange(0, G_P2)
        starts = tl.load(block_start_ptr + ent, mask=ent < G, other=2**30)
        g = tl.sum((starts <= blk).to(tl.int32), axis=0) - 1
        end = tl.load(offsets_ptr + g)
        row0 = tl.load(offsets_ptr + g - 1, mask=g > 0, other=0) + (blk - tl.load(block_start_ptr + g)) * BT
        local = tl.arange(0, BT)
        ok = (row0 + local < end)[:, None] & c_ok[None, :]
        x = tl.load(q_ptr + (row0 + local).to(tl.int64)[:, None] * stride_qt + cols.to(tl.int64)[None, :] * stride_qc,
                    mask=ok, other=0.0)
        dst = out_ptr + blk.to(tl.int64) * C * BT + cols.to(tl.int64)[None, :] * BT + local[:, None]
        tl.store(dst, x, mask=c_ok[None, :])

@triton.jit
def _quant_group_colwise_kernel(
    x_ptr, q_ptr, sf_ptr, offsets_ptr, block_start_ptr, T, C, G, R, used_blocks_ptr,
    FMAX: tl.constexpr, UE8M0: tl.constexpr, RECIPROCAL: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    G_P2: tl.constexpr, BLOCKS: tl.constexpr,
):
    """Program (scale block b, column tile). Blocks below the used count quantize BT rows of one
    group (found by comparing b against every group's block range); the next programs zero the
    rows past offsets[-1]; the rest exit (their scale rows were pre-filled). BLOCKS: q is the
    group-blocks layout [R, C, BT] (block b's rows K-major, zero past the group's end; the
    programs past the used count zero the spare blocks) instead of [T, C]."""
    blk = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    c_ok = cols < C
    used = tl.load(used_blocks_ptr)
    if blk < used:
        ent = tl.arange(0, G_P2)
        starts = tl.load(block_start_ptr + ent, mask=ent < G, other=2**30)
        g = tl.sum((starts <= blk).to(tl.int32), axis=0) - 1
        # an empty group shares its start with the next one: take the last group starting here
        end = tl.load(offsets_ptr + g)
        row0 = tl.load(offsets_ptr + g - 1, mask=g > 0, other=0) + (blk - tl.load(block_start_ptr + g)) * BT
        rows = row0 + tl.arange(0, BT)
        ok = (rows < end)[:, None] & c_ok[None, :]
        ptrs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        x = tl.load(x_ptr + ptrs, mask=ok, other=0.0).to(tl.float32)
        sf = _scale_from_amax(tl.max(_abs_bits(x), axis=0), FMAX, UE8M0)
        tl.store(sf_ptr + blk.to(tl.int64) * C + cols, sf, mask=c_ok)
        q = _cast_scaled(x, sf[None, :], FMAX, q_ptr.dtype.element_ty, RECIPROCAL)
        if BLOCKS:
            slots = blk.to(tl.int64) * C * BT + cols.to(tl.int64)[None, :] * BT + tl.arange(0, BT)[:, None]
            tl.store(q_ptr + slots, q, mask=c_ok[None, :])
        else:
            tl.store(q_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], q, mask=ok)
    else:
        zero = tl.zeros((BT, BC), dtype=tl.float32).to(q_ptr.dtype.element_ty)
        if BLOCKS:
            slots = blk.to(tl.int64) * C * BT + cols.to(tl.int64)[None, :] * BT + tl.arange(0, BT)[:, None]
            tl.store(q_ptr + slots, zero, mask=c_ok[None, :] & (blk < R))
        else:
            rows = tl.load(offsets_ptr + G - 1) + (blk - used) * BT + tl.arange(0, BT)
            ok = (rows < T)[:, None] & c_ok[None, :]
            tl.store(q_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], zero, mask=ok)


# ------------------------------------------------------------------------------ tile heuristics


@functools.lru_cache(maxsize=None)
def _num_sms() -> int:
    if torch.cuda.is_available() and not triton_interpreter_enabled():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 1


@functools.lru_cache(maxsize=None)
def _arch_major() -> int:
    """The current CUDA device's compute capability major (9 Hopper, 10 Blackwell); 9 without one."""
    if torch.cuda.is_available() and not triton_interpreter_enabled():
        return torch.cuda.get_device_capability(torch.cuda.current_device())[0]
    return 9


# host-side integer helpers: triton.cdiv / next_power_of_2 are ConstexprFunctions, ~10 us a call
# from Python, several per launch
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def _pow2_clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, _next_pow2(max(int(x), 1))))


def pick_tiles(rows_per_group: int, n: int, k: int, scaled: bool, element_size: int = 2,
               interpreter: bool | None = None, num_groups: int = 1, num_sms: int | None = None) -> dict:
    """Tile table (BM, BN, BK, warps, stages) keyed on the rows each group holds, N and K.

    Interpreter: the largest blocks the shape allows (each program costs Python overhead).
    GPU (Hopper): BM 64 for decode-sized groups, else 128; BN 128 (one FP8 B-scale block), or 64
    when 128-wide tiles would leave SMs idle (e.g. M=128, N=2112: 17 tiles for 132 SMs); BK 128
    for FP8 (one scale block per K step) and 64 for 16-bit; stages sized so A+B stages fit in
    ~200 KB of shared memory. BM depends on ``rows_per_group`` only (callers size tables with it).
    """
    if triton_interpreter_enabled() if interpreter is None else interpreter:
        return dict(BM=_pow2_clamp(rows_per_group, 16, 128), BN=_pow2_clamp(n, 16, 128),
                    BK=BLOCK if scaled else _pow2_clamp(k, 16, 128), num_warps=4, num_stages=1)
    if rows_per_group <= 64:
        bm, warps = 64, 4
    else:
        bm, warps = 128, 8
    bn = 128 if n > 64 else _pow2_clamp(n, 16, 128)
    sms = _num_sms() if num_sms is None else num_sms
    if bn == 128 and num_groups * _cdiv(rows_per_group, bm) * _cdiv(n, 128) < sms:
        bn = 64
    bk = BLOCK if scaled else (64 if element_size == 2 else 32)
    stage_bytes = (bm + bn) * bk * element_size
    # FP8 (TMA kernel): 4 stages (128 KB at 128x128x128); 3 measured 10% slower on the H200
    stages = max(2, min(4 if scaled else 5, (200 * 1024) // stage_bytes))
    return dict(BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


# ------------------------------------------------------------------------------ launchers


def _launch_m_grouped(a, sa, b, sb, out, mode, group, row_start=None, row_count=None, b_index=None,
                      num_entries=1, num_m_tiles=0, rows_per_group=1, c=None, sb_gran=BLOCK, mixed=False):
    """a [M, K] (any strides), b [G, N, K] (any strides), out [M, N] (unit column stride), c like
    out (added, DENSE mode); sb_gran: rows of B per B-scale row (128 or 1)."""
    m, k = a.shape
    n = b.shape[1]
    scaled = sa is not None
    cfg = pick_tiles(rows_per_group, n, k, scaled, a.element_size(), num_groups=b.shape[0])
    if mode == MODE_M_INDICES:
        cfg["BM"] = min(cfg["BM"], BLOCK)
        mixed = _tiles_mix_groups(group, cfg["BM"])
    if scaled and not mixed:
        return _launch_m_grouped_fp8(a, sa, b, sb, out, mode, group, row_start, row_count, b_index, num_entries,
                                     num_m_tiles, c, sb_gran, cfg)
    if scaled and sb_gran == 1 and not triton_interpreter_enabled():
        # per-row B scales: each thread keeps a distinct scale per accumulator column (block scales:
        # one per 128 columns); at 128x128 tiles ptxas spills (sm_90a, 50 LDL/STL measured with
        # primerl.kernels.aot, with 5 or 3 stages alike): halve the tile's columns
        cfg["BN"] = min(cfg["BN"], BN_PER_ROW_B)
    if scaled and mode == MODE_TABLE and not triton_interpreter_enabled():
        # table mode (offsets / masked layouts) reads each tile's group bounds from a table; at BN=128
        # ptxas spills (sm_90a 6, sm_100a 44-62 LDL/STL measured with primerl.kernels.aot), BN=64
        # compiles spill-free on both
        cfg["BN"] = min(cfg["BN"], BN_PER_ROW_B)
    if scaled and c is not None and not triton_interpreter_enabled():
        # the C tile loaded in the epilogue spills at 128x128 on sm_100a (15 LDL/STL measured)
        cfg["BN"] = min(cfg["BN"], BN_PER_ROW_B)
    bm = cfg.pop("BM")
    if mode != MODE_TABLE:
        num_m_tiles = _cdiv(m, bm)
    elif num_m_tiles == 0:
        num_m_tiles = _cdiv(m, bm) + num_entries
    total = num_m_tiles * _cdiv(n, cfg["BN"])
    if total == 0 or n == 0:
        return out
    num_progs = max(1, min(total, _num_sms() * (2 if bm == 64 else 1))) if _num_sms() > 1 else total
    dummy = group if group is not None else out
    _m_grouped_gemm_nt_kernel[(num_progs,)](
        a, sa if scaled else a, b, sb if scaled else b, out, c if c is not None else out,
        dummy, row_start if row_start is not None else dummy, row_count if row_count is not None else dummy,
        b_index if b_index is not None else dummy,
        m, n, k, num_entries, num_m_tiles, num_progs,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        c.stride(0) if c is not None else 0,
        sa.stride(0) if scaled else 0, sb.stride(0) if scaled else 0, sb.stride(1) if scaled else 0,
        MODE=mode, SCALED=scaled, HAS_C=c is not None, SB_GRAN=sb_gran, MIXED=mixed,
        ENTRIES_P2=_next_pow2(max(num_entries, 1)), BM=bm, PRECISION=_precision(a.dtype), **cfg,
    )
    return out


def fp8_structure(cfg: dict, sb_gran: int, mode: int, has_c: bool, interpreter: bool | None = None) -> dict:
    """The TMA FP8 kernel's launch options beyond the tile table: SWIZZLE (M-tiles per L2 band),
    WARP_SPECIALIZE (a TMA producer warpgroup beside the consumers; off: Triton's software
    pipeline over `num_stages` TMA stages), and BN caps where 128 columns spill (per-row B
    scales, measured with primerl.kernels.aot)."""
    out = dict(cfg, SWIZZLE=8, WARP_SPECIALIZE=False)
    if sb_gran == 1 and not (triton_interpreter_enabled() if interpreter is None else interpreter):
        # per-row B scales: a thread keeps one B scale per accumulator column; at 128 columns
        # ptxas spills on sm_100a (170 LDL/STL measured with primerl.kernels.aot)
        out["BN"] = min(out["BN"], BN_PER_ROW_B)
    return out


def _launch_m_grouped_fp8(a, sa, b, sb, out, mode, group, row_start, row_count, b_index, num_entries, num_m_tiles,
                          c, sb_gran, cfg, max_m=0):
    """TMA path of _launch_m_grouped: a [M, K] and b [G, N, K] fp8 with unit K stride; MASKED mode:
    a holds G blocks of max_m rows, row_count = masked_m."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = a.shape
    groups, n = b.shape[:2]
    cfg = fp8_structure(cfg, sb_gran, mode, c is not None)
    bm = cfg.pop("BM")
    if mode == MODE_MASKED:
        num_m_tiles = groups * _cdiv(max_m, bm)
    elif mode != MODE_TABLE:
        num_m_tiles = _cdiv(m, bm)
    elif num_m_tiles == 0:
        num_m_tiles = _cdiv(m, bm) + num_entries
    total = num_m_tiles * _cdiv(n, cfg["BN"])
    if total == 0 or n == 0 or m == 0:
        return out
    if a.stride(1) != 1 or b.stride(2) != 1 or b.stride(1) != k or b.stride(0) != n * k:
        raise ValueError(f"fp8 gemm (triton): operands must be K-major (a strides {a.stride()}, b strides {b.stride()})")
    b2 = b.view(groups * n, k)
    # TMA needs 16-byte aligned bases (a view can start anywhere): copy such an operand
    a, b2 = (t if t.data_ptr() % 16 == 0 else t.clone() for t in (a, b2))
    a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], [bm, cfg["BK"]])
    b_desc = TensorDescriptor(b2, [groups * n, k], [k, 1], [cfg["BN"], cfg["BK"]])
    # 64-row tiles (4 warps, 96 KB of stages, < 180 registers): two programs fit an SM, and the
    # second overlaps its loads and scale FMAs with the first's wgmma
    per_sm = 2 if bm == 64 else 1
    num_progs = min(total, per_sm * _num_sms()) if _num_sms() > 1 else total
    dummy = group if group is not None else out
    _m_grouped_fp8_kernel[(num_progs,)](
        a_desc, b_desc, sa, sb, out, c if c is not None else out,
        dummy, row_start if row_start is not None else dummy, row_count if row_count is not None else dummy,
        b_index if b_index is not None else dummy,
        m, n, k, num_entries, max_m, num_m_tiles, num_progs, out.stride(0), c.stride(0) if c is not None else 0,
        sa.stride(0), sb.stride(0), sb.stride(1),
        MODE=mode, HAS_C=c is not None, SB_GRAN=sb_gran, ENTRIES_P2=_next_pow2(max(num_entries, 1)),
        BM=bm, **cfg,
    )
    return out


def _tiles_mix_groups(m_indices: torch.Tensor, bm: int) -> bool:
    """Whether a BM-row tile of this m_indices layout can hold two groups: read on CPU (free);
    on a GPU taken from the configured alignment (no sync): groups start on multiples of
    get_mk_alignment_for_contiguous_layout(), and a tile that still meets two groups writes NaN."""
    if m_indices.device.type == "cpu":
        m = m_indices.numel()
        blocks = torch.nn.functional.pad(m_indices, (0, -m % bm), value=-1).view(-1, bm)
        hi = blocks.max(dim=1, keepdim=True).values
        return bool(((blocks >= 0) & (blocks != hi)).any())
    return off.get_mk_alignment_for_contiguous_layout() % bm != 0


def _offsets_table(offsets: torch.Tensor, num_rows: int, bm: int):
    """Entries = groups + one zero-writing tail entry for rows past offsets[-1]."""
    ends = torch.cat([offsets, offsets.new_full((1,), num_rows)])
    starts = torch.cat([offsets.new_zeros(1), ends[:-1]])
    counts = ends - starts
    b_index = torch.arange(offsets.numel() + 1, device=offsets.device, dtype=torch.int32)
    b_index[-1] = -1
    tile_ends = torch.cumsum((counts + bm - 1) // bm, 0, dtype=torch.int32)
    return tile_ends, starts.contiguous(), counts.contiguous(), b_index


def _grouped_offsets(a, sa, b, sb, offsets, out_dtype):
    m, n, groups = a.shape[0], b.shape[1], b.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    rows_per_group = max(1, m // max(groups, 1))
    bm = pick_tiles(rows_per_group, n, a.shape[1], sa is not None, a.element_size())["BM"]
    tile_ends, starts, counts, b_index = _offsets_table(offsets, m, bm)
    return _launch_m_grouped(a, sa, b, sb, out, MODE_TABLE, tile_ends, starts, counts, b_index,
                             num_entries=groups + 1, rows_per_group=rows_per_group)


def _grouped_m_indices(a, sa, b, sb, m_indices, out_dtype):
    m, n = a.shape[0], b.shape[1]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    return _launch_m_grouped(a, sa, b, sb, out, MODE_M_INDICES, m_indices,
                             rows_per_group=max(1, m // max(b.shape[0], 1)))


def _k_grouped(a, b, offsets, out_dtype, m_indices=None):
    """bf16 / float32 weight gradients: a [T, N], b [T, K] row-major -> [G, N, K]."""
    t, n = a.shape
    k = b.shape[1]
    groups = offsets.numel()
    out = torch.empty(groups, n, k, dtype=out_dtype, device=a.device)
    if triton_interpreter_enabled():
        bn, bk = _pow2_clamp(n, 16, 128), _pow2_clamp(k, 16, 128)
        bt, warps, stages = _pow2_clamp(t // max(groups, 1), 16, 128), 4, 1
    else:
        bn, bk, bt, warps, stages = 128, 128, 64, 8, 3
    total = groups * _cdiv(n, bn) * _cdiv(k, bk)
    num_progs = min(total, _num_sms()) if _num_sms() > 1 else total
    _k_grouped_gemm_tn_kernel[(num_progs,)](
        a, b, out, offsets, m_indices if m_indices is not None else offsets, n, k, groups, num_progs,
        a.stride(0), b.stride(0), ROW_MASK=m_indices is not None, BN=bn, BK=bk, BT=bt,
        PRECISION=_precision(a.dtype), num_warps=warps, num_stages=stages,
    )
    return out


def k_grouped_tiles(interpreter: bool | None = None, arch_major: int | None = None) -> dict:
    """Tiles of the FP8 k-grouped kernel: 128 x 128 outputs (two consumer warpgroups of 64 rows),
    128-wide blocks of the reduction (one scale row each), 4 TMA stages of A+B (128 KB); scale
    prefetch on Hopper (see _k_grouped_fp8_kernel)."""
    if triton_interpreter_enabled() if interpreter is None else interpreter:
        return dict(BN=128, BK=128, BT=BLOCK, SWIZZLE=8, PREFETCH_SCALES=True, num_warps=4, num_stages=1)
    major = _arch_major() if arch_major is None else arch_major
    return dict(BN=128, BK=128, BT=BLOCK, SWIZZLE=8, PREFETCH_SCALES=major == 9, num_warps=8, num_stages=4)


def _group_blocks(q: torch.Tensor, offsets: torch.Tensor, block_start: torch.Tensor, used: torch.Tensor,
                  num_blocks: int) -> torch.Tensor:
    """fp8 q [T, C] -> [num_blocks, C, 128] K-major group blocks (see _group_blocks_kernel)."""
    t, c = q.shape
    out = torch.empty(num_blocks, c, BLOCK, dtype=q.dtype, device=q.device)
    bc = 128 if triton_interpreter_enabled() else 64
    _group_blocks_kernel[(num_blocks, _cdiv(c, bc))](
        q, out, offsets, block_start, c, offsets.numel(), used, q.stride(0), q.stride(1),
        BT=BLOCK, BC=bc, G_P2=_next_pow2(offsets.numel()), num_warps=4,
    )
    return out


def _scale_rows_desc(sf: torch.Tensor, width: int):
    """Descriptor over float32 scale rows sf [R, C] read [1, width] at a time; rows padded to a
    multiple of 4 columns (TMA's 16-byte stride rule) by a copy when C is not."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, cols = sf.shape
    if sf.stride(1) != 1 or sf.stride(0) % 4 or sf.storage_offset() % 4:
        padded = sf.new_zeros(rows, -(-cols // 4) * 4)
        padded[:, :cols] = sf
        sf = padded[:, :cols]
    return TensorDescriptor(sf, [rows, cols], [sf.stride(0), 1], [1, width])


def _k_grouped_fp8(a, sa, b, sb, offsets, out_dtype, out=None, c=None):
    """a [T, N], b [T, K] fp8 (any strides) or their group blocks [R, N, 128], [R, K, 128], with
    colwise group scales sa [R, N], sb [R, K] -> out [G, N, K]."""
    n, k = sa.shape[1], sb.shape[1]
    t = a.shape[0] * BLOCK if a.dim() == 3 else a.shape[0]
    groups = offsets.numel()
    if out is None:
        out = torch.empty(groups, n, k, dtype=out_dtype, device=a.device)
    num_blocks = min(off.max_group_blocks(t, groups), sa.shape[0], sb.shape[0])
    if num_blocks == 0 or n == 0 or k == 0:  # no rows in any group (compact scales) or an empty output
        return out.copy_(c) if c is not None else out.zero_()
    from triton.tools.tensor_descriptor import TensorDescriptor

    counts = off.offsets_to_counts(offsets)
    nblocks = (counts + BLOCK - 1) // BLOCK
    block_start = (torch.cumsum(nblocks, 0, dtype=torch.int32) - nblocks).to(torch.int32)
    used = nblocks.sum(dtype=torch.int32).reshape(1)
    ab, bb = (q if q.dim() == 3 else _group_blocks(q, offsets, block_start, used, num_blocks) for q in (a, b))
    cfg = k_grouped_tiles()
    ab, bb = (t.reshape(-1, BLOCK) if t.data_ptr() % 16 == 0 else t.reshape(-1, BLOCK).clone() for t in (ab, bb))
    a_desc = TensorDescriptor(ab, list(ab.shape), [BLOCK, 1], [cfg["BN"], cfg["BT"]])
    b_desc = TensorDescriptor(bb, list(bb.shape), [BLOCK, 1], [cfg["BK"], cfg["BT"]])
    total = groups * _cdiv(n, cfg["BN"]) * _cdiv(k, cfg["BK"])
    num_progs = min(total, _num_sms()) if _num_sms() > 1 else total
    _k_grouped_fp8_kernel[(num_progs,)](
        a_desc, b_desc, sa, sb, out, c if c is not None else out, offsets, block_start,
        n, k, groups, num_progs, sa.stride(0), sb.stride(0), HAS_C=c is not None, **cfg,
    )
    return out


# ------------------------------------------------------------------------------ FP8 entry points


def fp8_gemm_nt(a, b, d, c=None, sb_gran=BLOCK):
    """d [M, N] written in place (unit column stride), c [M, N] float32 added when given."""
    (aq, asf), (bq, bsf) = a, b
    return _launch_m_grouped(aq, asf, bq.unsqueeze(0), bsf.unsqueeze(0), d, MODE_DENSE, None,
                             rows_per_group=aq.shape[0], c=c, sb_gran=sb_gran)


def m_grouped_fp8_gemm_nt_contiguous(a, b, m_indices, d, sb_gran=BLOCK):
    (aq, asf), (bq, bsf) = a, b
    return _launch_m_grouped(aq, asf, bq, bsf, d, MODE_M_INDICES, m_indices,
                             rows_per_group=max(1, aq.shape[0] // max(bq.shape[0], 1)), sb_gran=sb_gran)


def m_grouped_fp8_gemm_nt_offsets(a, b, offsets, out_dtype):
    return _grouped_offsets(a[0], a[1], b[0], b[1], offsets, out_dtype)


def m_grouped_fp8_gemm_nt_masked(a, b, masked_m, expected_m, out, sb_gran=BLOCK):
    """out [G, max_m, N] contiguous: rows past masked_m[g] are neither read nor written. Tiles are
    laid out per group (ceil(max_m / BM) each, BM from expected_m); a tile past masked_m[g] exits
    at once, so the launch needs no host-side table."""
    (aq, asf), (bq, bsf) = a, b
    groups, max_m, k = aq.shape
    n = bq.shape[1]
    cfg = pick_tiles(max(expected_m, 1), n, k, True, 1, num_groups=groups)
    _launch_m_grouped_fp8(aq.view(groups * max_m, k), asf.view(groups * max_m, -1), bq, bsf, out.view(groups * max_m, n),
                          MODE_MASKED, None, None, masked_m, None, 1, 0, None, sb_gran, cfg, max_m=max_m)
    return out


def quant_per_group_colwise(x, offsets, dtype, ue8m0, rounding="reciprocal", layout="rows"):
    """layout "rows": q [T, C]; "blocks": q [R, C, 128] (see _k_grouped_fp8_kernel)."""
    t, c = x.shape
    groups = offsets.numel()
    blocks = layout == "blocks"
    # spare scale rows get the scale of an all-zero block, as in the reference
    zero_block_sf = fp8_ref.scale_from_amax(torch.zeros(1, device=x.device), dtype, ue8m0)
    bound = off.max_group_blocks(t, groups)
    sf = zero_block_sf.expand(bound, c).contiguous()
    q = torch.empty((bound, c, BLOCK) if blocks else (t, c), dtype=dtype, device=x.device)
    counts = off.offsets_to_counts(offsets)
    nblocks = (counts + BLOCK - 1) // BLOCK
    block_start = torch.cumsum(nblocks, 0, dtype=torch.int32) - nblocks
    used = nblocks.sum(dtype=torch.int32).reshape(1)
    bc = 128 if triton_interpreter_enabled() else 64
    # used blocks + ceil(tail / 128) tail chunks <= bound + 1 (see max_group_blocks)
    _quant_group_colwise_kernel[(bound + 1, _cdiv(c, bc))](
        x, q, sf, offsets, block_start, t, c, groups, bound, used,
        FMAX=fp8_max(dtype), UE8M0=ue8m0, RECIPROCAL=rounding == "reciprocal", BT=BLOCK, BC=bc,
        G_P2=_next_pow2(groups), BLOCKS=blocks, num_warps=4,
    )
    return q, sf


def k_grouped_fp8_gemm_tn_contiguous(a, b, offsets, out_dtype, d=None, c=None):
    return _k_grouped_fp8(a[0], a[1], b[0], b[1], offsets, out_dtype, out=d, c=c)


def k_grouped_gemm_tn(a, b, offsets, out_dtype):
    return _k_grouped(a, b, offsets, out_dtype)


# ------------------------------------------------------------------------------ bf16 autograd


def _m_indices_segments(m_indices: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Aligned contiguous layout (groups in ascending order) -> padded segment end offsets[G].
    An all-padding block is owned by the group before it (its rows are masked anyway)."""
    block_group = m_indices.view(-1, BLOCK).amax(dim=1)
    owner = torch.cummax(block_group, 0).values.clamp_min(0).long()
    blocks = torch.bincount(owner, minlength=num_groups)[:num_groups]
    return (torch.cumsum(blocks, 0) * BLOCK).to(torch.int32)


class _GroupedGemmNT(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, index, kind, out_dtype):
        ctx.save_for_backward(a, b, index)
        ctx.kind = kind
        if kind == "offsets":
            return _grouped_offsets(a, None, b, None, index, out_dtype)
        if kind == "m_indices":
            return _grouped_m_indices(a, None, b, None, index, out_dtype)
        return _launch_m_grouped(a, None, b.unsqueeze(0), None,
                                 torch.empty(a.shape[0], b.shape[0], dtype=out_dtype, device=a.device),
                                 MODE_DENSE, None, rows_per_group=a.shape[0])

    @staticmethod
    def backward(ctx, grad):
        a, b, index = ctx.saved_tensors
        grad = grad.contiguous().to(a.dtype)
        grad_a = grad_b = None
        if ctx.kind == "dense":
            if ctx.needs_input_grad[0]:
                grad_a = _launch_m_grouped(grad, None, b.t().unsqueeze(0), None, torch.empty_like(a),
                                           MODE_DENSE, None, rows_per_group=a.shape[0])
            if ctx.needs_input_grad[1]:
                ones = torch.full((1,), a.shape[0], dtype=torch.int32, device=a.device)
                grad_b = _k_grouped(grad, a, ones, torch.float32)[0].to(b.dtype)
            return grad_a, grad_b, None, None, None
        b_t = b.transpose(1, 2)
        if ctx.needs_input_grad[0]:
            if ctx.kind == "offsets":
                grad_a = _grouped_offsets(grad, None, b_t, None, index, a.dtype)
            else:
                grad_a = _grouped_m_indices(grad, None, b_t, None, index, a.dtype)
        if ctx.needs_input_grad[1]:
            if ctx.kind == "offsets":
                grad_b = _k_grouped(grad, a, index, torch.float32)
            else:
                segments = _m_indices_segments(index, b.shape[0])
                grad_b = _k_grouped(grad, a, segments, torch.float32, m_indices=index)
            grad_b = grad_b.to(b.dtype)
        return grad_a, grad_b, None, None, None


def gemm_nt_autograd(a, b, out_dtype):
    return _GroupedGemmNT.apply(a, b, torch.empty(0, dtype=torch.int32, device=a.device), "dense", out_dtype)


def grouped_gemm_nt_autograd(a, b, index, kind, out_dtype):
    return _GroupedGemmNT.apply(a, b, index, kind, out_dtype)
