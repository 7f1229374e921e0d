"""Triton GEMMs: the mode and tile choice for every op, the pointer-load M-grouped NT kernel
(16/32-bit; FP8 m_indices layouts whose tiles mix groups) and K-grouped TN kernel (16/32-bit weight
gradients), the colwise group quantizer. The FP8 TMA kernels (dense, offsets, aligned m_indices,
masked, k-grouped) live in :mod:`.triton_fp8`; the autograd of the 16/32-bit GEMMs in
:mod:`._triton_autograd`; every entry point here as a custom op in :mod:`.triton_ops`. All
persistent.

Scheduling. The M-grouped kernels walk a flat list of (M-tile, N-tile) pairs with a stride of
the number of programs (one program per SM on a GPU). How an M-tile maps to rows depends on the
mode:

* DENSE: tile ``mt`` covers rows ``mt*BM ..``, group 0.
* TABLE: a small device-side table of row ranges ``(start, count, b_index)`` with cumulative tile
  ends; tile ``mt`` belongs to the entry whose tile range holds it (a vector compare against
  all entries). Offsets layouts add a tail entry with ``b_index = -1`` that writes zeros for rows
  past ``offsets[-1]``. The table is built with torch ops on the device: no host sync.
* MASKED (FP8): group ``mt // ceil(max_m / BM)``; a tile past ``masked_m`` computes and stores
  nothing (no table: nothing to build on the host).
* M_INDICES: DeepGEMM's aligned layout; a tile's group is the max of its rows' ``m_indices``
  (every 128-row block holds one group), rows whose index differs are padding and give zero.

Pointer-kernel FP8 (mixed m_indices tiles): BK = 128, ``acc += dot(a, b) * sa[:, None] *
sb[None, :]``, rows that are not read masked at the load.

Tile shapes come from :func:`pick_tiles`, a table keyed on (rows per group, N, K), not autotuning.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8 import reference as fp8_ref
from ..fp8.reference import fp8_max
from ..fp8.triton import _abs_bits, _cast_scaled, _scale_from_amax
from . import offsets as off
from . import triton_common as common  # SM count and architecture: read through the module (AOT replaces them)
from . import triton_fp8 as _fp8
from .layout import BLOCK
from .triton_common import (BN_PER_ROW_B, MODE_DENSE, MODE_M_INDICES, MODE_MASKED, MODE_TABLE, cdiv, next_pow2,
                            pow2_clamp, triton_interpreter_enabled)


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
            a = tl.load(a_ptr + rows64[None, :] * stride_a + offs_n[:, None], mask=r_ok[None, :] & n_ok[:, None],
                        other=0.0)
            b = tl.load(b_ptr + rows64[:, None] * stride_b + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                        other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        out_offs = g.to(tl.int64) * N * K + offs_n[:, None] * K + offs_k[None, :]
        tl.store(d_ptr + out_offs, acc.to(d_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])

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
        return dict(BM=pow2_clamp(rows_per_group, 16, 128), BN=pow2_clamp(n, 16, 128),
                    BK=BLOCK if scaled else pow2_clamp(k, 16, 128), num_warps=4, num_stages=1)
    if rows_per_group <= 64:
        bm, warps = 64, 4
    else:
        bm, warps = 128, 8
    bn = 128 if n > 64 else pow2_clamp(n, 16, 128)
    sms = common.num_sms() if num_sms is None else num_sms
    if bn == 128 and num_groups * cdiv(rows_per_group, bm) * cdiv(n, 128) < sms:
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
        return _fp8.launch_m_grouped(a, sa, b, sb, out, mode, group, row_start, row_count, b_index, num_entries,
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
        num_m_tiles = cdiv(m, bm)
    elif num_m_tiles == 0:
        num_m_tiles = cdiv(m, bm) + num_entries
    total = num_m_tiles * cdiv(n, cfg["BN"])
    if total == 0 or n == 0:
        return out
    num_progs = max(1, min(total, common.num_sms() * (2 if bm == 64 else 1))) if common.num_sms() > 1 else total
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
        ENTRIES_P2=next_pow2(max(num_entries, 1)), BM=bm, PRECISION=_precision(a.dtype), **cfg,
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
        bn, bk = pow2_clamp(n, 16, 128), pow2_clamp(k, 16, 128)
        bt, warps, stages = pow2_clamp(t // max(groups, 1), 16, 128), 4, 1
    else:
        bn, bk, bt, warps, stages = 128, 128, 64, 8, 3
    total = groups * cdiv(n, bn) * cdiv(k, bk)
    num_progs = min(total, common.num_sms()) if common.num_sms() > 1 else total
    _k_grouped_gemm_tn_kernel[(num_progs,)](
        a, b, out, offsets, m_indices if m_indices is not None else offsets, n, k, groups, num_progs,
        a.stride(0), b.stride(0), ROW_MASK=m_indices is not None, BN=bn, BK=bk, BT=bt,
        PRECISION=_precision(a.dtype), num_warps=warps, num_stages=stages,
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
    _fp8.launch_m_grouped(aq.view(groups * max_m, k), asf.view(groups * max_m, -1), bq, bsf,
                          out.view(groups * max_m, n), MODE_MASKED, None, None, masked_m, None, 1, 0, None, sb_gran,
                          cfg, max_m=max_m)
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
    _quant_group_colwise_kernel[(bound + 1, cdiv(c, bc))](
        x, q, sf, offsets, block_start, t, c, groups, bound, used,
        FMAX=fp8_max(dtype), UE8M0=ue8m0, RECIPROCAL=rounding == "reciprocal", BT=BLOCK, BC=bc,
        G_P2=next_pow2(groups), BLOCKS=blocks, num_warps=4,
    )
    return q, sf


def k_grouped_fp8_gemm_tn_contiguous(a, b, offsets, out_dtype, d=None, c=None):
    return _fp8.k_grouped(a[0], a[1], b[0], b[1], offsets, out_dtype, out=d, c=c)


# ------------------------------------------------------------------------------ 16/32-bit entry points
# (differentiated in :mod:`._triton_autograd`)


def gemm_nt(a, b, out_dtype):
    """a [M, K], b [N, K] (any strides) -> [M, N] out_dtype."""
    out = torch.empty(a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)
    return _launch_m_grouped(a, None, b.unsqueeze(0), None, out, MODE_DENSE, None, rows_per_group=a.shape[0])


def grouped_gemm_nt_offsets(a, b, offsets, out_dtype):
    """a [M, K], b [G, N, K] (any strides), offsets [G] -> [M, N] (rows past offsets[-1] zero)."""
    return _grouped_offsets(a, None, b, None, offsets, out_dtype)


def grouped_gemm_nt_m_indices(a, b, m_indices, out_dtype):
    """a [M, K], b [G, N, K] (any strides), m_indices [M] (aligned contiguous layout) -> [M, N]."""
    return _grouped_m_indices(a, None, b, None, m_indices, out_dtype)


def k_grouped_gemm_tn(a, b, offsets, out_dtype, m_indices=None):
    """a [T, N], b [T, K] (any strides: the kernel reads rows with unit column stride, so others are
    copied) -> [G, N, K]; with m_indices [T], rows whose index is -1 are skipped."""
    return _k_grouped(a.contiguous(), b.contiguous(), offsets, out_dtype, m_indices)
