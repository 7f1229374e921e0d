"""Triton kernels of the MoE ops: align (counts, padded layout), row scatter / weighted combine,
SwiGLU forward / backward and SwiGLU + per-token-group FP8 quantization.

Each launcher matches its :mod:`.reference` twin bit for bit: the layout is integer math and a
stable rank (one-hot prefix sums, no atomics), sums run in float32 in the reference's order,
kernels launch with ``enable_fp_fusion=False`` (no FMA contraction) and divide with ``div_rn``.
On a GPU ``exp`` is libdevice's ``expf`` (what torch's CUDA exp calls); the interpreter has no
libdevice and uses ``tl.exp``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import triton_interpreter_enabled
from ..fp8.reference import ROUNDINGS, fp8_max
from ..fp8.triton import _abs_bits, _cast_scaled, _scale_from_amax
from .reference import max_padded_rows

from triton.language.extra import libdevice

# The interpreter has no libdevice; on a GPU, libdevice's expf is what torch's CUDA exp calls.
_LIBDEVICE_EXP = tl.constexpr(not triton_interpreter_enabled())

_NO_FMA = {"enable_fp_fusion": False}


def _slots(num_experts: int) -> int:
    """Slots per program of the layout kernels: the rank kernel holds a [slots, experts] one-hot and
    its prefix sum, so 16384 elements at most (measured AOT: 256 x 256 spills on sm_90a/sm_100a at
    any warp count, 64 x 256 and 128 x 128 use under 150 registers)."""
    return max(16, min(256, 16384 // _pow2(num_experts)))


def _pow2(n: int) -> int:
    """A block size covering n: a power of two, at least 16 (tiny tiles are masked, not special-cased)."""
    return max(16, triton.next_power_of_2(max(int(n), 1)))


# ------------------------------------------------------------------------------------------ layout
@triton.jit
def _block_counts_kernel(ids_ptr, block_counts_ptr, n, E, EP: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    slots = pid * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + slots, mask=slots < n, other=-1)
    experts = tl.arange(0, EP)
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
    tl.store(block_counts_ptr + pid * E + experts, tl.sum(onehot, axis=0), mask=experts < E)


@triton.jit
def _block_bases_kernel(
    block_counts_ptr, block_base_ptr, counts_ptr, ends_ptr, num_blocks, E, align,
    EP: tl.constexpr, CHUNK: tl.constexpr,
):
    experts = tl.arange(0, EP)
    emask = experts < E
    counts = tl.zeros([EP], dtype=tl.int32)
    for c in range(0, num_blocks, CHUNK):
        rows = c + tl.arange(0, CHUNK)
        m = (rows[:, None] < num_blocks) & emask[None, :]
        counts += tl.sum(tl.load(block_counts_ptr + rows[:, None] * E + experts[None, :], mask=m, other=0), axis=0)
    padded = (counts + align - 1) // align * align
    ends = tl.cumsum(padded, axis=0)
    tl.store(counts_ptr + experts, counts, mask=emask)
    tl.store(ends_ptr + experts, ends, mask=emask)
    running = ends - padded
    for c in range(0, num_blocks, CHUNK):
        rows = c + tl.arange(0, CHUNK)
        m = (rows[:, None] < num_blocks) & emask[None, :]
        bc = tl.load(block_counts_ptr + rows[:, None] * E + experts[None, :], mask=m, other=0)
        base = tl.cumsum(bc, axis=0) - bc + running[None, :]
        tl.store(block_base_ptr + rows[:, None] * E + experts[None, :], base, mask=m)
        running += tl.sum(bc, axis=0)


@triton.jit
def _place_kernel(ids_ptr, block_base_ptr, row_of_slot_ptr, sorted_slots_ptr, n, E,
                  EP: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    slots = pid * BLOCK + tl.arange(0, BLOCK)
    smask = slots < n
    ids = tl.load(ids_ptr + slots, mask=smask, other=-1)
    experts = tl.arange(0, EP)
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
    rank = tl.sum((tl.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
    base = tl.load(block_base_ptr + pid * E + ids, mask=smask, other=0)
    rows = base + rank
    tl.store(row_of_slot_ptr + slots, rows, mask=smask)
    tl.store(sorted_slots_ptr + rows, slots, mask=smask)


@triton.jit
def _block_expert_kernel(ends_ptr, block_expert_ptr, num_blocks, E, align, EP: tl.constexpr, BLOCK: tl.constexpr):
    blocks = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    experts = tl.arange(0, EP)
    ends = tl.load(ends_ptr + experts, mask=experts < E, other=0)
    total = tl.max(ends, axis=0)
    start = blocks * align
    # searchsorted(ends, start, right=True): experts whose group ends at or before this block
    owner = tl.sum(((ends[None, :] <= start[:, None]) & (experts[None, :] < E)).to(tl.int32), axis=1)
    owner = tl.where(start < total, owner, -1)
    tl.store(block_expert_ptr + blocks, owner, mask=blocks < num_blocks)


def _layout(topk_ids: torch.Tensor, num_experts: int, align: int):
    flat = topk_ids.reshape(-1).to(torch.int32).contiguous()
    n, dev, e = flat.numel(), flat.device, num_experts
    ep = _pow2(e)
    slots = _slots(e)
    nblk = triton.cdiv(n, slots) if n else 0
    block_counts = torch.empty((max(nblk, 1), e), dtype=torch.int32, device=dev)
    block_base = torch.empty_like(block_counts)
    counts = torch.empty(e, dtype=torch.int32, device=dev)
    ends = torch.empty(e, dtype=torch.int32, device=dev)
    if nblk:
        _block_counts_kernel[(nblk,)](flat, block_counts, n, e, EP=ep, BLOCK=slots)
    _block_bases_kernel[(1,)](block_counts, block_base, counts, ends, nblk, e, align, EP=ep, CHUNK=16)
    return flat, block_base, counts, ends, nblk


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    return _layout(topk_ids, num_experts, 1)[2]


def align(topk_ids: torch.Tensor, num_experts: int, block: int):
    flat, block_base, _, ends, nblk = _layout(topk_ids, num_experts, block)
    n, dev = flat.numel(), flat.device
    p = max_padded_rows(n, num_experts, block)
    row_of_slot = torch.empty(n, dtype=torch.int32, device=dev)
    sorted_slots = torch.full((p,), n, dtype=torch.int32, device=dev)
    if nblk:
        _place_kernel[(nblk,)](flat, block_base, row_of_slot, sorted_slots, n, num_experts,
                               EP=_pow2(num_experts), BLOCK=_slots(num_experts))
    nb = triton.cdiv(p, block)
    block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
    if nb:
        bb = 128
        _block_expert_kernel[(triton.cdiv(nb, bb),)](ends, block_expert, nb, num_experts, block,
                                                     EP=_pow2(num_experts), BLOCK=bb)
    return row_of_slot, sorted_slots, block_expert, ends[-1:].clone(), ends


# ------------------------------------------------------------------------------------ row movement
@triton.jit
def _scatter_rows_kernel(
    src_ptr, row_map_ptr, scale_ptr, out_ptr, n, K, D,
    HAS_SCALE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    slots = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    smask = slots < n
    m = smask[:, None] & (cols[None, :] < D)
    tokens = (slots // K).to(tl.int64)
    rows = tl.load(row_map_ptr + slots, mask=smask, other=0).to(tl.int64)
    vals = tl.load(src_ptr + tokens[:, None] * D + cols[None, :], mask=m, other=0.0)
    if HAS_SCALE:
        s = tl.load(scale_ptr + slots, mask=smask, other=0.0)
        vals = (vals.to(tl.float32) * s[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], vals, mask=m)


def scatter_rows(src: torch.Tensor, row_map: torch.Tensor, scale: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    t, k = row_map.shape
    d = src.shape[1]
    out = torch.zeros(num_rows, d, dtype=src.dtype, device=src.device)
    n = t * k
    if n == 0 or d == 0:
        return out
    block_d = min(_pow2(d), 512)
    block_s = max(1, min(64, 4096 // block_d))
    scale_arg = scale.contiguous() if scale is not None else src
    grid = (triton.cdiv(n, block_s), triton.cdiv(d, block_d))
    _scatter_rows_kernel[grid](
        src.contiguous(), row_map.contiguous(), scale_arg, out, n, k, d,
        HAS_SCALE=scale is not None, BLOCK_S=block_s, BLOCK_D=block_d, **_NO_FMA,
    )
    return out


@triton.jit
def _combine_rows_kernel(
    y_ptr, row_map_ptr, w_ptr, out_ptr, T, K, D,
    HAS_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tmask = tokens < T
    m = tmask[:, None] & (cols[None, :] < D)
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in range(K):
        rows = tl.load(row_map_ptr + tokens * K + j, mask=tmask, other=0).to(tl.int64)
        term = tl.load(y_ptr + rows[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + tokens * K + j, mask=tmask, other=0.0)
            term = term * w[:, None]
        acc = acc + term
    tl.store(out_ptr + tokens[:, None].to(tl.int64) * D + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=m)


def combine_rows(y_perm: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    t, k = row_map.shape
    d = y_perm.shape[1]
    out = torch.empty(t, d, dtype=y_perm.dtype, device=y_perm.device)
    if t == 0 or d == 0:
        return out
    if k == 0:
        return out.zero_()
    block_d = min(_pow2(d), 512)
    block_t = max(1, min(64, 4096 // block_d))
    w_arg = weights.contiguous() if weights is not None else y_perm
    grid = (triton.cdiv(t, block_t), triton.cdiv(d, block_d))
    _combine_rows_kernel[grid](
        y_perm.contiguous(), row_map.contiguous(), w_arg, out, t, k, d,
        HAS_W=weights is not None, BLOCK_T=block_t, BLOCK_D=block_d, **_NO_FMA,
    )
    return out


# ------------------------------------------------------------------------------------------ SwiGLU
@triton.jit
def _sigmoid(g):
    if _LIBDEVICE_EXP:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    return tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), 1.0 + e)


@triton.jit
def _swiglu_kernel(gu_ptr, h_ptr, M, INTER, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    m = (r[:, None] < M) & (c[None, :] < INTER)
    base = r[:, None].to(tl.int64) * (2 * INTER) + c[None, :]
    g = tl.load(gu_ptr + base, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + base + INTER, mask=m, other=0.0).to(tl.float32)
    h = g * _sigmoid(g) * u
    tl.store(h_ptr + r[:, None].to(tl.int64) * INTER + c[None, :], h.to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd_kernel(gu_ptr, dh_ptr, dgu_ptr, M, INTER, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    m = (r[:, None] < M) & (c[None, :] < INTER)
    base = r[:, None].to(tl.int64) * (2 * INTER) + c[None, :]
    g = tl.load(gu_ptr + base, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + base + INTER, mask=m, other=0.0).to(tl.float32)
    d = tl.load(dh_ptr + r[:, None].to(tl.int64) * INTER + c[None, :], mask=m, other=0.0).to(tl.float32)
    sig = _sigmoid(g)
    silu = g * sig
    dg = d * u * sig * (1.0 + g * (1.0 - sig))
    du = d * silu
    tl.store(dgu_ptr + base, dg.to(dgu_ptr.dtype.element_ty), mask=m)
    tl.store(dgu_ptr + base + INTER, du.to(dgu_ptr.dtype.element_ty), mask=m)


def _swiglu_blocks(m: int, i: int) -> tuple[int, int]:
    block_i = min(_pow2(i), 256)
    return max(1, min(64, 4096 // block_i)), block_i


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    m, i = gu.shape[0], gu.shape[1] // 2
    h = torch.empty(m, i, dtype=gu.dtype, device=gu.device)
    if m and i:
        bm, bi = _swiglu_blocks(m, i)
        _swiglu_kernel[(triton.cdiv(m, bm), triton.cdiv(i, bi))](
            gu.contiguous(), h, m, i, BLOCK_M=bm, BLOCK_I=bi, **_NO_FMA
        )
    return h


def swiglu_backward(gu: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    m, i = gu.shape[0], gu.shape[1] // 2
    dgu = torch.empty_like(gu)
    if m and i:
        bm, bi = _swiglu_blocks(m, i)
        _swiglu_bwd_kernel[(triton.cdiv(m, bm), triton.cdiv(i, bi))](
            gu.contiguous(), dh.contiguous(), dgu, m, i, BLOCK_M=bm, BLOCK_I=bi, **_NO_FMA
        )
    return dgu


@triton.jit
def _swiglu_quant_kernel(
    gu_ptr, q_ptr, sf_ptr, M, INTER,
    GROUP: tl.constexpr, FMAX: tl.constexpr, UE8M0: tl.constexpr, RECIPROCAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    grp = tl.program_id(1)
    c = grp * GROUP + tl.arange(0, GROUP)
    m = (r[:, None] < M) & (c[None, :] < INTER)
    base = r[:, None].to(tl.int64) * (2 * INTER) + c[None, :]
    g = tl.load(gu_ptr + base, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + base + INTER, mask=m, other=0.0).to(tl.float32)
    h = g * _sigmoid(g) * u
    # the fp8 quantizer's helpers: NaN-propagating amax, clamped UE8M0, the chosen rounding
    sf = _scale_from_amax(tl.max(_abs_bits(h), axis=1), FMAX, UE8M0)
    q = _cast_scaled(h, sf[:, None], FMAX, q_ptr.dtype.element_ty, RECIPROCAL)
    tl.store(q_ptr + r[:, None].to(tl.int64) * INTER + c[None, :], q, mask=m)
    tl.store(sf_ptr + r.to(tl.int64) * (INTER // GROUP) + grp, sf, mask=r < M)


def swiglu_quant(gu: torch.Tensor, group_size: int, dtype: torch.dtype, ue8m0: bool,
                 rounding: str = "reciprocal"):
    if rounding not in ROUNDINGS:
        raise ValueError(f"swiglu_quant: rounding must be one of {ROUNDINGS}, got {rounding!r}")
    m, i = gu.shape[0], gu.shape[1] // 2
    q = torch.empty(m, i, dtype=dtype, device=gu.device)
    sf = torch.empty(m, i // group_size, dtype=torch.float32, device=gu.device)
    if m and i:
        bm = max(1, min(64, 4096 // group_size))
        _swiglu_quant_kernel[(triton.cdiv(m, bm), i // group_size)](
            gu.contiguous(), q, sf, m, i,
            GROUP=group_size, FMAX=fp8_max(dtype), UE8M0=ue8m0, RECIPROCAL=rounding == "reciprocal",
            BLOCK_M=bm, **_NO_FMA,
        )
    return q, sf
