"""Triton FP8 quantization kernels, bitwise equal to :mod:`primerl.kernels.fp8.reference`.

Bit-exactness rests on four choices shared with the reference: the scale, the quotient and the
reciprocal use IEEE round-to-nearest division (``tl.math.div_rn``; a plain ``/`` on fp32 lowers
to the approximate ``div.full.f32`` on NVIDIA GPUs), ``rounding="reciprocal"`` multiplies by that
reciprocal (``mul.rn``), the ue8m0 rounding works on the exponent bits, and values are clamped to
the fp8 range (NaN kept) before the (round-to-nearest-even) cast. The absolute maximum is taken
on the bits of ``|x|`` as integers (:func:`_abs_bits`): for non-negative floats the integer order
is the float order with NaN above inf, so a NaN propagates as in ``torch.amax`` (``tl.max`` on
floats would drop it).

Layouts: a per-token-group quantization of x ``[..., K]`` is a row quantization of the
contiguous ``[numel / group_size, group_size]`` view, so one row kernel serves per-token-group and
rowwise. Blocks get their own kernel; tensorwise is two passes (partial maxima, then cast).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import triton_interpreter_enabled
from .reference import AMAX_FLOOR, fp8_max

# Elements one program holds at once: a register budget on the GPU; under the interpreter every
# program costs Python overhead, so fewer, larger programs are much faster there.
_GPU_TILE = 8192  # a 7168-wide row fits one tile; 64 groups of 128 per program
_GPU_BLOCK_TILE = 16384  # a whole 128 x 128 weight block stays in registers (one read)
_INTERPRETER_TILE = 1 << 16
_MAX_PARTIALS = 1024


def _tile_elems(block: bool = False) -> int:
    if triton_interpreter_enabled():
        return _INTERPRETER_TILE
    return _GPU_BLOCK_TILE if block else _GPU_TILE


AMAX_FLOOR_C = tl.constexpr(AMAX_FLOOR)


@triton.jit
def _div_rn(a, b):
    # tl.math.div_rn does not broadcast its operands (a plain `/` would).
    a, b = tl.broadcast(a, b)
    return tl.math.div_rn(a, b)


@triton.jit
def _abs_bits(x):
    """|x| (float32) as int32 bits: max over these is a NaN-propagating absolute maximum."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _scale_from_amax(amax, FMAX: tl.constexpr, UE8M0: tl.constexpr):
    """amax: float32, or int32 bits from _abs_bits."""
    amax = amax.to(tl.float32, bitcast=True)
    amax = tl.where(amax < AMAX_FLOOR_C, AMAX_FLOOR_C, amax)  # keeps NaN (tl.maximum would not)
    sf = _div_rn(amax, tl.full([], FMAX, tl.float32))
    if UE8M0:
        # 2 ** ceil(log2(sf)): bump the exponent when any mantissa bit is set, drop the mantissa;
        # the exponent is clamped to [1, 254] (inf / NaN -> 2**127), as DeepGEMM's ceil_to_ue8m0.
        bits = sf.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        exponent = tl.minimum(tl.maximum(exponent, 1), 254)
        sf = (exponent << 23).to(tl.float32, bitcast=True)
    return sf


@triton.jit
def _cast_scaled(x, sf, FMAX: tl.constexpr, OUT_DTYPE: tl.constexpr, RECIPROCAL: tl.constexpr):
    if RECIPROCAL:
        y = x * tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf)
    else:
        y = _div_rn(x, sf)
    y = tl.where(y == y, tl.minimum(tl.maximum(y, -FMAX), FMAX), y)
    return y.to(OUT_DTYPE)


@triton.jit
def _quant_rows_kernel(
    x_ptr, q_ptr, sf_ptr, n_rows, row_len,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    FMAX: tl.constexpr, UE8M0: tl.constexpr, RECIPROCAL: tl.constexpr,
):
    """x, q: [n_rows, row_len] contiguous; sf: [n_rows]. One program: BLOCK_R rows."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    base = rows.to(tl.int64)[:, None] * row_len
    cols = tl.arange(0, BLOCK_C)[None, :]
    out_dtype = q_ptr.dtype.element_ty
    if NUM_CHUNKS == 1:
        mask = row_ok[:, None] & (cols < row_len)
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        sf = _scale_from_amax(tl.max(_abs_bits(x), axis=1), FMAX, UE8M0)
        tl.store(q_ptr + base + cols, _cast_scaled(x, sf[:, None], FMAX, out_dtype, RECIPROCAL), mask=mask)
    else:
        amax = tl.zeros([BLOCK_R], dtype=tl.int32)
        for c in range(NUM_CHUNKS):
            cc = cols + c * BLOCK_C
            mask = row_ok[:, None] & (cc < row_len)
            x = tl.load(x_ptr + base + cc, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(_abs_bits(x), axis=1))
        sf = _scale_from_amax(amax, FMAX, UE8M0)
        for c in range(NUM_CHUNKS):
            cc = cols + c * BLOCK_C
            mask = row_ok[:, None] & (cc < row_len)
            x = tl.load(x_ptr + base + cc, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_ptr + base + cc, _cast_scaled(x, sf[:, None], FMAX, out_dtype, RECIPROCAL), mask=mask)
    tl.store(sf_ptr + rows, sf, mask=row_ok)


@triton.jit
def _quant_blocks_kernel(
    w_ptr, q_ptr, sf_ptr, N, K, bn, bk, n_blocks_n, n_blocks_k,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS_N: tl.constexpr, CHUNKS_K: tl.constexpr,
    FMAX: tl.constexpr, UE8M0: tl.constexpr, RECIPROCAL: tl.constexpr,
):
    """w, q: [G, N, K] contiguous; sf: [G, n_blocks_n, n_blocks_k]. One program: one bn x bk block,
    visited in BLOCK_N x BLOCK_K chunks (a single chunk when the block fits)."""
    # one flat grid axis (axes 1 and 2 are limited to 65535 programs on CUDA)
    pid = tl.program_id(0)
    pid_k = pid % n_blocks_k
    pid_n = (pid // n_blocks_k) % n_blocks_n
    g = pid // (n_blocks_k * n_blocks_n)
    n0 = pid_n * bn
    k0 = pid_k * bk
    n_end = tl.minimum(n0 + bn, N)
    k_end = tl.minimum(k0 + bk, K)
    base = g.to(tl.int64) * N * K
    r = tl.arange(0, BLOCK_N)[:, None]
    c = tl.arange(0, BLOCK_K)[None, :]
    out_dtype = q_ptr.dtype.element_ty
    if CHUNKS_N * CHUNKS_K == 1:
        rows = n0 + r
        cols = k0 + c
        mask = (rows < n_end) & (cols < k_end)
        offs = base + rows.to(tl.int64) * K + cols
        x = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        sf = _scale_from_amax(tl.max(tl.max(_abs_bits(x), axis=1), axis=0), FMAX, UE8M0)
        tl.store(q_ptr + offs, _cast_scaled(x, sf, FMAX, out_dtype, RECIPROCAL), mask=mask)
    else:
        amax = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.int32)
        for i in range(CHUNKS_N):
            rows = n0 + i * BLOCK_N + r
            for j in range(CHUNKS_K):
                cols = k0 + j * BLOCK_K + c
                mask = (rows < n_end) & (cols < k_end)
                offs = base + rows.to(tl.int64) * K + cols
                amax = tl.maximum(amax, _abs_bits(tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)))
        sf = _scale_from_amax(tl.max(tl.max(amax, axis=1), axis=0), FMAX, UE8M0)
        for i in range(CHUNKS_N):
            rows = n0 + i * BLOCK_N + r
            for j in range(CHUNKS_K):
                cols = k0 + j * BLOCK_K + c
                mask = (rows < n_end) & (cols < k_end)
                offs = base + rows.to(tl.int64) * K + cols
                x = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(q_ptr + offs, _cast_scaled(x, sf, FMAX, out_dtype, RECIPROCAL), mask=mask)
    tl.store(sf_ptr + pid, sf)


@triton.jit
def _amax_partials_kernel(x_ptr, partial_ptr, numel, BLOCK: tl.constexpr):
    """partial[p] = bits of max |x| over the BLOCK-sized tiles p, p + P, p + 2P, ... (P programs);
    partial is int32 (see _abs_bits)."""
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    n_tiles = tl.cdiv(numel, BLOCK)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.int32)
    block_i64 = tl.full([], BLOCK, tl.int64)  # 64-bit offsets; `t` is a plain int under the interpreter
    for t in range(pid, n_tiles, n_progs):
        o = t * block_i64 + offs
        amax = tl.maximum(amax, _abs_bits(tl.load(x_ptr + o, mask=o < numel, other=0.0).to(tl.float32)))
    tl.store(partial_ptr + pid, tl.max(amax, axis=0))


@triton.jit
def _cast_tensorwise_kernel(
    x_ptr, q_ptr, partial_ptr, sf_ptr, numel, n_partials,
    BLOCK: tl.constexpr, PARTIALS_BLOCK: tl.constexpr, FMAX: tl.constexpr, RECIPROCAL: tl.constexpr,
):
    """Every program reduces the (few, cached) partial maxima itself: no third launch for sf."""
    pid = tl.program_id(0)
    p = tl.arange(0, PARTIALS_BLOCK)
    amax = tl.max(tl.load(partial_ptr + p, mask=p < n_partials, other=0), axis=0)
    sf = _scale_from_amax(amax, FMAX, False)
    o = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = o < numel
    x = tl.load(x_ptr + o, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + o, _cast_scaled(x, sf, FMAX, q_ptr.dtype.element_ty, RECIPROCAL), mask=mask)
    if pid == 0:
        tl.store(sf_ptr, sf)


def _num_warps(elems: int) -> int:
    return 8 if elems >= 8192 else 4


def _quant_rows(x: torch.Tensor, q: torch.Tensor, sf: torch.Tensor, row_len: int, dtype: torch.dtype,
                ue8m0: bool, rounding: str) -> None:
    n_rows = x.numel() // row_len
    tile = _tile_elems()
    block_c = min(triton.next_power_of_2(row_len), tile)
    num_chunks = triton.cdiv(row_len, block_c)
    block_r = max(1, min(tile // block_c, triton.next_power_of_2(n_rows)))
    grid = (triton.cdiv(n_rows, block_r),)
    _quant_rows_kernel[grid](
        x, q, sf, n_rows, row_len,
        BLOCK_R=block_r, BLOCK_C=block_c, NUM_CHUNKS=num_chunks,
        FMAX=fp8_max(dtype), UE8M0=ue8m0, RECIPROCAL=rounding == "reciprocal",
        num_warps=_num_warps(block_r * block_c),
    )


def quant_per_token_group(x: torch.Tensor, group_size: int, dtype: torch.dtype, ue8m0: bool,
                          rounding: str = "reciprocal"):
    """x [..., K] contiguous -> q [..., K] fp8, sf [..., K // group_size] float32."""
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    sf = torch.empty(*x.shape[:-1], x.shape[-1] // group_size, dtype=torch.float32, device=x.device)
    _quant_rows(x, q, sf, group_size, dtype, ue8m0, rounding)
    return q, sf


def quant_rowwise(x: torch.Tensor, dtype: torch.dtype, rounding: str = "divide"):
    """x [..., K] contiguous -> q [..., K] fp8, sf [..., 1] float32."""
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    sf = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
    _quant_rows(x, q, sf, x.shape[-1], dtype, False, rounding)
    return q, sf


def quant_per_block(w: torch.Tensor, block_size: tuple[int, int], dtype: torch.dtype, ue8m0: bool,
                    rounding: str = "reciprocal"):
    """w [(G,) N, K] contiguous -> q like w, sf [(G,) ceil(N/bn), ceil(K/bk)] float32."""
    bn, bk = block_size
    n, k = w.shape[-2:]
    g = w.numel() // (n * k)
    nb, kb = triton.cdiv(n, bn), triton.cdiv(k, bk)
    q = torch.empty(w.shape, dtype=dtype, device=w.device)
    sf = torch.empty(*w.shape[:-2], nb, kb, dtype=torch.float32, device=w.device)
    tile = _tile_elems(block=True)
    block_k = min(triton.next_power_of_2(bk), tile)
    block_n = max(1, min(triton.next_power_of_2(bn), tile // block_k))
    grid = (g * nb * kb,)
    _quant_blocks_kernel[grid](
        w, q, sf, n, k, bn, bk, nb, kb,
        BLOCK_N=block_n, BLOCK_K=block_k,
        CHUNKS_N=triton.cdiv(bn, block_n), CHUNKS_K=triton.cdiv(bk, block_k),
        FMAX=fp8_max(dtype), UE8M0=ue8m0, RECIPROCAL=rounding == "reciprocal",
        num_warps=_num_warps(block_n * block_k),
    )
    return q, sf


def quant_tensorwise(x: torch.Tensor, dtype: torch.dtype, rounding: str = "divide"):
    """x (any shape, contiguous) -> q like x, sf [] float32."""
    numel = x.numel()
    block = min(_tile_elems(), triton.next_power_of_2(numel))
    n_tiles = triton.cdiv(numel, block)
    n_partials = min(n_tiles, _MAX_PARTIALS)
    partials = torch.empty(n_partials, dtype=torch.int32, device=x.device)
    _amax_partials_kernel[(n_partials,)](x, partials, numel, BLOCK=block, num_warps=_num_warps(block))
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    sf = torch.empty((), dtype=torch.float32, device=x.device)
    _cast_tensorwise_kernel[(n_tiles,)](
        x, q, partials, sf, numel, n_partials,
        BLOCK=block, PARTIALS_BLOCK=triton.next_power_of_2(n_partials), FMAX=fp8_max(dtype),
        RECIPROCAL=rounding == "reciprocal", num_warps=_num_warps(block),
    )
    return q, sf
