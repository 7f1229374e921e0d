"""Triton FP8 GEMMs built for Hopper (and compiled for Blackwell): block-scaled M-grouped NT
(dense, offsets, aligned m_indices, masked) and K-grouped (weight gradients) kernels with TMA
tensor descriptors, a persistent grid and per-128-K-block scale promotion in registers.
:mod:`.triton` picks the mode and tiles and calls the launchers here.

M-grouped: A [M, K] and B [G*N, K] are read through host-side TMA descriptors into a 4-stage
shared-memory pipeline, BM x BN x BK = 128 x 128 x 128 with 8 warps (two consumer warpgroups of
64 rows; 64 x 128 with 4 warps and two programs per SM for decode-sized M). One A scale per row
and one B scale per 128 x 128 block: each K block's partial product is scaled in float32 and added
(``acc += dot(a, b) * (sa * sb)[:, None]``, one FMA per element), the next block's scales loaded
a step ahead. Programs take tiles in bands of 8 M-tiles walked N-tile-major, so the programs
running at once share B panels in L2. Rows another group owns may be read (TMA loads whole
boxes) but are never stored, so NaN there never enters a valid row.

K-grouped: each group's rows are cut into 128-row blocks (one scale row each, see
``quant_per_group_colwise``). The kernel reads the group-blocks layout ``[blocks, C, 128]`` (a
block's rows K-major, zero past its group's end), which ``quant_per_group_colwise(...,
layout="blocks")`` writes directly; row-major operands are re-laid out in one pass first. Every
TMA box then starts at a block boundary and the kernel needs no masks; output tiles 128 x 128,
scales ``sa[block, n] * sb[block, k]`` applied per block (two multiplies per element).

Wide tiles on Hopper (``HALVES=2``): a 128 x 128 FP8 tile moves 32 KB from L2 per 4.2 MFLOP, so
at the H200's ~8 TB/s of L2 bandwidth it cannot pass ~1020 TF/s (the m-grouped kernel measured
937); m-grouped tiles of 128 x 256 (two accumulators sharing each A box) and k-grouped tiles of
256 x 128 (sharing each B box and its column scales) move 48 KB per 8.4 MFLOP (bound ~1360 /
~1170 TF/s, see bench/RESULTS.md). Three 128 x 128 fp32 accumulators (two results and one
partial product) are what 8 warps hold without spilling; a larger tile or an in-flight second
partial (promotion overlapped with the next wgmma) is not: the latter makes ptxas serialize the
wgmma (its C7514 note, which primerl.kernels.aot flags).

Warp specialization (``tl.range(warp_specialize=True)``) compiles on sm_90a with triton 3.6-3.7
only at 64-row tiles and measured 0.6x the software pipeline on the H200 (2026-12-04): off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import offsets as off
from . import triton_common as common  # SM count, architecture (replaced by primerl.kernels.aot), modes
from .layout import BLOCK


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
    HALVES: tl.constexpr, PIN: tl.constexpr,
):
    """FP8 D[rows] = A[rows] @ B[g].T (+ C) with TMA: a_desc over A [M, K], b_desc over B [G*N, K]
    (both K-major), sa [M, K/128] per-row scales, sb [G, N/SB_GRAN, K/128] (SB_GRAN 128: one scale
    per 128x128 block, a scalar per BN <= 128 tile; 1: per row of B).

    Persistent: program p takes tiles p, p + num_progs, ..; tile t -> (M-tile, N-tile) in bands of
    SWIZZLE M-tiles walked N-tile-major, so the programs running at once share B panels in L2.
    Each 128-wide K block's partial product is scaled in float32 registers and added (scale
    promotion); the block's A and B scales are loaded one K step ahead (the TMA pipeline does not
    cover them, and their L2 latency would otherwise sit between the wgmma and the FMAs). Rows
    another group owns are read (TMA loads whole boxes) but never stored.

    HALVES=2 (block scales, BN=128): a tile is BM x 2*BN, two accumulators that share each A box,
    so a K block reads A once for two B boxes (48 KB per 2*BM*BN*BK*2 FLOP instead of 32 KB per
    half as many); the halves are promoted in turn, one [BM, BN] partial product live at a time
    (PIN, compiled mode: see _pin)."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN * HALVES)
    num_k = tl.cdiv(K, BK)
    for tile in range(pid, num_m_tiles * tiles_n, num_progs):
        mt, pn = _tile_in_group(tile, num_m_tiles, tiles_n, SWIZZLE)
        row0, rows, store_ok, row_ok, g, foreign = _m_tile_rows(
            mt, group_ptr, row_start_ptr, row_count_ptr, b_index_ptr, M, num_entries, max_m, MODE, ENTRIES_P2, BM)
        n0 = pn * (BN * HALVES)
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
            if HALVES == 2:
                sb1_ptrs = sb_ptrs + ((n0 + BN) // SB_GRAN - n0 // SB_GRAN) * stride_sbn
                sb1_next = tl.load(sb1_ptrs, mask=steps > 0, other=0.0)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc1 = tl.zeros((BM, BN), dtype=tl.float32)
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
                if HALVES == 2:
                    if PIN:
                        acc = _pin(acc)
                    b1 = b_desc.load([g * N + n0 + BN, kb * BK])
                    scale1 = sa * sb1_next
                    sb1_next = tl.load(sb1_ptrs + (kb + 1), mask=kb + 1 < steps, other=0.0)
                    acc1 += tl.dot(a, b1.T) * scale1[:, None]
        _store_tile(acc, d_ptr, c_ptr, rows, offs_n, store_ok, row_ok, foreign, n_ok, stride_dm, stride_cm, MODE, HAS_C)
        if HALVES == 2:
            _store_tile(acc1, d_ptr, c_ptr, rows, offs_n + BN, store_ok, row_ok, foreign, offs_n + BN < N, stride_dm,
                        stride_cm, MODE, HAS_C)


@triton.jit
def _pin(x):
    """x itself, through an opaque (side-effecting) register move: the FMAs that produce x stay
    before the next wgmma batch. Without it LLVM sinks the first half's promotion FMAs below the
    second half's wgmma, which keeps two partial products live (3 x 64 accumulator registers per
    thread at 128 x 256: ptxas spills)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def _store_tile(acc, d_ptr, c_ptr, rows, offs_n, store_ok, row_ok, foreign, n_ok, stride_dm, stride_cm,
                MODE: tl.constexpr, HAS_C: tl.constexpr):
    """D[rows, offs_n] = acc (+ C) where rows are stored; rows the tile computes nothing for get zero."""
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
def _k_grouped_fp8_kernel(
    a_desc, b_desc, sa_ptr, sb_ptr, d_ptr, c_ptr, offsets_ptr, block_start_ptr, N, K, G, num_progs, stride_sa,
    stride_sb,
    HAS_C: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, SWIZZLE: tl.constexpr,
    PREFETCH_SCALES: tl.constexpr, HALVES: tl.constexpr, PIN: tl.constexpr,
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
    which spill on sm_100a, where the loads stay in step).

    HALVES=2: a tile is 2*BN x BK, two accumulators (n halves) sharing each B box and its BK column
    scales: 48 KB of A+B per block for twice the FLOPs of a BN x BK tile's 32 KB (as in
    _m_grouped_fp8_kernel); scales load in step (no register room for prefetch)."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN * HALVES)
    tiles_k = tl.cdiv(K, BK)
    per_group = tiles_n * tiles_k
    for tile in range(pid, G * per_group, num_progs):
        g = tile // per_group
        pn, pk = _tile_in_group(tile % per_group, tiles_n, tiles_k, SWIZZLE)
        n0 = pn * (BN * HALVES)
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
        acc1 = tl.zeros((BN, BK), dtype=tl.float32)
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
            if HALVES == 2:
                # scaled column-wise then row-wise: no [BN, BK] scale matrix live (26 LDL/STL at
                # 256 x 128 with triton 3.6 otherwise)
                acc += tl.dot(a, b.T) * sb[None, :] * sa[:, None]
            else:
                acc += tl.dot(a, b.T) * (sa[:, None] * sb[None, :])
            if HALVES == 2:
                if PIN:
                    acc = _pin(acc)
                a1 = a_desc.load([(blk0 + j) * N + n0 + BN, 0])
                sa1 = tl.load(sa_ptrs + BN + j * stride_sa, mask=offs_n + BN < N, other=0.0)
                acc1 += tl.dot(a1, b.T) * sb[None, :] * sa1[:, None]
        _store_k_tile(acc, d_ptr, c_ptr, g, offs_n, offs_k, n_ok, k_ok, N, K, HAS_C)
        if HALVES == 2:
            _store_k_tile(acc1, d_ptr, c_ptr, g, offs_n + BN, offs_k, offs_n + BN < N, k_ok, N, K, HAS_C)


@triton.jit
def _store_k_tile(acc, d_ptr, c_ptr, g, offs_n, offs_k, n_ok, k_ok, N, K, HAS_C: tl.constexpr):
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

def fp8_structure(cfg: dict, sb_gran: int, mode: int, has_c: bool, n: int = 0, num_m_tiles: int = 0,
                  interpreter: bool | None = None) -> dict:
    """The TMA FP8 kernel's launch options beyond the tile table: SWIZZLE (M-tiles per L2 band),
    WARP_SPECIALIZE (a TMA producer warpgroup beside the consumers; off: Triton's software
    pipeline over `num_stages` TMA stages), BN caps where 128 columns spill (per-row B scales,
    measured with primerl.kernels.aot), and HALVES: 2 for BM x 256 tiles (two 128-column
    accumulators sharing each A box: 25% fewer L2 bytes per FLOP, the bound of 128 x 128 FP8
    tiles) with block B scales and no C where N is a multiple of 256, unless the wider tiles
    would cost more than ~15% in wave quantization (e.g. M = 128: 28 tiles instead of 56). Hopper
    only: on sm_100a the offsets (table) mode spills at 128 x 256 (2 LDL/STL, primerl.kernels.aot)."""
    interp = common.triton_interpreter_enabled() if interpreter is None else interpreter
    out = dict(cfg, SWIZZLE=8, WARP_SPECIALIZE=False, HALVES=1, PIN=not interp)
    if sb_gran == 1 and not interp:
        # per-row B scales: a thread keeps one B scale per accumulator column; at 128 columns
        # ptxas spills on sm_100a (170 LDL/STL measured with primerl.kernels.aot)
        out["BN"] = min(out["BN"], common.BN_PER_ROW_B)
    wide = sb_gran == BLOCK and not has_c and out["BN"] == BLOCK and n % (2 * BLOCK) == 0
    if wide and interp:
        out["HALVES"] = 2
    elif wide and out["BM"] == BLOCK and common.arch_major() == 9:
        sms = common.num_sms()
        waves = common.cdiv(num_m_tiles * (n // BLOCK), sms)  # in units of a 128 x 128 tile's time
        if 2 * common.cdiv(num_m_tiles * (n // (2 * BLOCK)), sms) <= 1.15 * waves:
            out["HALVES"] = 2
    return out


def launch_m_grouped(a, sa, b, sb, out, mode, group, row_start, row_count, b_index, num_entries, num_m_tiles,
                          c, sb_gran, cfg, max_m=0):
    """TMA path of _launch_m_grouped: a [M, K] and b [G, N, K] fp8 with unit K stride; MASKED mode:
    a holds G blocks of max_m rows, row_count = masked_m."""
    m, k = a.shape
    groups, n = b.shape[:2]
    bm = cfg["BM"]
    if mode == common.MODE_MASKED:
        num_m_tiles = groups * common.cdiv(max_m, bm)
    elif mode != common.MODE_TABLE:
        num_m_tiles = common.cdiv(m, bm)
    elif num_m_tiles == 0:
        num_m_tiles = common.cdiv(m, bm) + num_entries
    cfg = fp8_structure(cfg, sb_gran, mode, c is not None, n, num_m_tiles)
    del cfg["BM"]
    total = num_m_tiles * common.cdiv(n, cfg["BN"] * cfg["HALVES"])
    if total == 0 or n == 0 or m == 0:
        return out
    if a.stride(1) != 1 or b.stride(2) != 1 or b.stride(1) != k or b.stride(0) != n * k:
        raise ValueError(f"fp8 gemm (triton): operands must be K-major (a strides {a.stride()}, "
                         f"b strides {b.stride()})")
    b2 = b.view(groups * n, k)
    # TMA needs 16-byte aligned bases (a view can start anywhere): copy such an operand
    a, b2 = (t if t.data_ptr() % 16 == 0 else t.clone() for t in (a, b2))
    a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], [bm, cfg["BK"]])
    b_desc = TensorDescriptor(b2, [groups * n, k], [k, 1], [cfg["BN"], cfg["BK"]])
    # 64-row tiles (4 warps, 96 KB of stages, < 180 registers): two programs fit an SM, and the
    # second overlaps its loads and scale FMAs with the first's wgmma
    per_sm = 2 if bm == 64 else 1
    num_progs = min(total, per_sm * common.num_sms()) if common.num_sms() > 1 else total
    dummy = group if group is not None else out
    _m_grouped_fp8_kernel[(num_progs,)](
        a_desc, b_desc, sa, sb, out, c if c is not None else out,
        dummy, row_start if row_start is not None else dummy, row_count if row_count is not None else dummy,
        b_index if b_index is not None else dummy,
        m, n, k, num_entries, max_m, num_m_tiles, num_progs, out.stride(0), c.stride(0) if c is not None else 0,
        sa.stride(0), sb.stride(0), sb.stride(1),
        MODE=mode, HAS_C=c is not None, SB_GRAN=sb_gran, ENTRIES_P2=common.next_pow2(max(num_entries, 1)),
        BM=bm, **cfg,
    )
    return out


def k_grouped_tiles(interpreter: bool | None = None, arch_major: int | None = None) -> dict:
    """Tiles of the FP8 k-grouped kernel: 128 x 128 outputs (two consumer warpgroups of 64 rows),
    128-wide blocks of the reduction (one scale row each), 4 TMA stages of A+B (128 KB); scale
    prefetch on Hopper (see _k_grouped_fp8_kernel)."""
    if common.triton_interpreter_enabled() if interpreter is None else interpreter:
        return dict(BN=128, BK=128, BT=BLOCK, SWIZZLE=8, PREFETCH_SCALES=True, HALVES=1, PIN=False, num_warps=4,
                    num_stages=1)
    major = common.arch_major() if arch_major is None else arch_major
    return dict(BN=128, BK=128, BT=BLOCK, SWIZZLE=8, PREFETCH_SCALES=major == 9, HALVES=1, PIN=True, num_warps=8,
                num_stages=4)


def k_grouped_halves(cfg: dict, n: int, k: int, groups: int, has_c: bool = False, interpreter: bool | None = None,
                     arch_major: int | None = None) -> dict:
    """HALVES=2 (2*BN x BK tiles, see _k_grouped_fp8_kernel) on Hopper where N is a multiple of
    2*BN and the wider tiles cost at most ~15% in wave quantization; scale prefetch off there
    (registers). Not on Blackwell, nor with C added in the epilogue: those spill (sm_100a 96, + C on
    sm_90a 4 LDL/STL, primerl.kernels.aot)."""
    interp = common.triton_interpreter_enabled() if interpreter is None else interpreter
    major = common.arch_major() if arch_major is None else arch_major
    if n % (2 * cfg["BN"]) != 0 or (not interp and (major != 9 or has_c)):
        return cfg
    narrow = groups * (n // cfg["BN"]) * common.cdiv(k, cfg["BK"])
    sms = common.num_sms()
    if interp or 2 * common.cdiv(narrow // 2, sms) <= 1.15 * common.cdiv(narrow, sms):
        return dict(cfg, HALVES=2, PREFETCH_SCALES=False)
    return cfg


def _group_blocks(q: torch.Tensor, offsets: torch.Tensor, block_start: torch.Tensor, used: torch.Tensor,
                  num_blocks: int) -> torch.Tensor:
    """fp8 q [T, C] -> [num_blocks, C, 128] K-major group blocks (see _group_blocks_kernel)."""
    t, c = q.shape
    out = torch.empty(num_blocks, c, BLOCK, dtype=q.dtype, device=q.device)
    bc = 128 if common.triton_interpreter_enabled() else 64
    _group_blocks_kernel[(num_blocks, common.cdiv(c, bc))](
        q, out, offsets, block_start, c, offsets.numel(), used, q.stride(0), q.stride(1),
        BT=BLOCK, BC=bc, G_P2=common.next_pow2(offsets.numel()), num_warps=4,
    )
    return out


def k_grouped(a, sa, b, sb, offsets, out_dtype, out=None, c=None):
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
    counts = off.offsets_to_counts(offsets)
    nblocks = (counts + BLOCK - 1) // BLOCK
    block_start = (torch.cumsum(nblocks, 0, dtype=torch.int32) - nblocks).to(torch.int32)
    used = nblocks.sum(dtype=torch.int32).reshape(1)
    ab, bb = (q if q.dim() == 3 else _group_blocks(q, offsets, block_start, used, num_blocks) for q in (a, b))
    cfg = k_grouped_halves(k_grouped_tiles(), n, k, groups, c is not None)
    ab, bb = (t.reshape(-1, BLOCK) if t.data_ptr() % 16 == 0 else t.reshape(-1, BLOCK).clone() for t in (ab, bb))
    a_desc = TensorDescriptor(ab, list(ab.shape), [BLOCK, 1], [cfg["BN"], cfg["BT"]])
    b_desc = TensorDescriptor(bb, list(bb.shape), [BLOCK, 1], [cfg["BK"], cfg["BT"]])
    total = groups * common.cdiv(n, cfg["BN"] * cfg["HALVES"]) * common.cdiv(k, cfg["BK"])
    num_progs = min(total, common.num_sms()) if common.num_sms() > 1 else total
    _k_grouped_fp8_kernel[(num_progs,)](
        a_desc, b_desc, sa, sb, out, c if c is not None else out, offsets, block_start,
        n, k, groups, num_progs, sa.stride(0), sb.stride(0), HAS_C=c is not None, **cfg,
    )
    return out
