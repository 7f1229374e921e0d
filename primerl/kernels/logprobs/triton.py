"""Triton kernels for the per-chunk work of the chunked log-probabilities (see chunked.py).

The logits block ``z[Tc, Vc]`` (float32) comes from a matmul; each kernel makes one pass over it:
the forward kernel reads it once and updates the online log-sum-exp state (max, sum, target logit,
entropy term) of each token row; the backward kernel reads it once and writes dL/dz in the GEMM
operand dtype (bf16/fp16, or float32 in place). Both optionally scale z by a per-row 1/temperature
first (bf16/fp16 operands, where the rows of hidden are not pre-scaled).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._backend import triton_interpreter_enabled
from .chunked import M_INIT

_M_INIT = tl.constexpr(M_INIT)


@triton.jit
def _lse_chunk_kernel(z_ptr, stride_z, targets_ptr, inv_temp_ptr, m_ptr, r_ptr, w_ptr, zt_ptr,
                      n_rows, n_cols, v0,
                      WITH_ENTROPY: tl.constexpr, HAS_TEMP: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    # state per row (see chunked.py): m running max, r = sum exp(z - m) - 1, w = sum exp(z - m)(z - m)
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < n_rows
    tgt = tl.load(targets_ptr + rows, mask=rmask, other=-1) - v0
    m = tl.load(m_ptr + rows, mask=rmask, other=_M_INIT)
    r = tl.load(r_ptr + rows, mask=rmask, other=0.0)
    w = tl.load(w_ptr + rows, mask=rmask, other=0.0)
    zt = tl.load(zt_ptr + rows, mask=rmask, other=0.0)
    if HAS_TEMP:
        it = tl.load(inv_temp_ptr + rows, mask=rmask, other=1.0)
    z_row = z_ptr + rows.to(tl.int64)[:, None] * stride_z
    for c0 in range(0, n_cols, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        mask = rmask[:, None] & (cols[None, :] < n_cols)
        z = tl.load(z_row + cols[None, :], mask=mask, other=0.0)
        if HAS_TEMP:
            z = z * it[:, None]
        z = tl.where(mask, z, _M_INIT)
        hit = mask & (cols[None, :] == tgt[:, None])
        zt += tl.sum(tl.where(hit, z, 0.0), axis=1)
        tile_max = tl.max(z, axis=1)
        new_max = tile_max > m
        m_new = tl.where(new_max, tile_max, m)
        a = tl.exp(m - m_new)
        d = z - m_new[:, None]
        below = mask & (d < 0.0)
        e = tl.where(below, tl.exp(d), 0.0)
        ties = tl.sum(tl.where(mask & (d == 0.0), 1.0, 0.0), axis=1)
        rest = tl.sum(e, axis=1) + (ties - tl.where(new_max, 1.0, 0.0))  # integer part first: exact
        if WITH_ENTROPY:
            w = a * (w + (m - m_new) * (1.0 + r)) + tl.sum(e * d, axis=1)
        r = tl.where(new_max, rest + a * (1.0 + r), r + rest)
        m = m_new
    tl.store(m_ptr + rows, m, mask=rmask)
    tl.store(r_ptr + rows, r, mask=rmask)
    tl.store(w_ptr + rows, w, mask=rmask)
    tl.store(zt_ptr + rows, zt, mask=rmask)


@triton.jit
def _dlogits_chunk_kernel(z_ptr, stride_z, dz_ptr, stride_dz, targets_ptr, inv_temp_ptr, m_ptr, ls_ptr, c_ptr,
                          g_lp_ptr, g_ent_ptr, tgt_grad_ptr,
                          n_rows, n_cols, v0,
                          WITH_ENTROPY: tl.constexpr, HAS_TEMP: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    # dz = -p (g + h ((z - m) + c)), p = exp((z - m) - ls); the target element gets tgt_grad;
    # then times 1/temperature (z = raw * it) and rounded once to dz's dtype
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols[None, :] < n_cols)
    tgt = tl.load(targets_ptr + rows, mask=rmask, other=-1) - v0
    m = tl.load(m_ptr + rows, mask=rmask, other=0.0)
    ls = tl.load(ls_ptr + rows, mask=rmask, other=0.0)
    g = tl.load(g_lp_ptr + rows, mask=rmask, other=0.0)
    tg = tl.load(tgt_grad_ptr + rows, mask=rmask, other=0.0)
    rows64 = rows.to(tl.int64)[:, None]
    z = tl.load(z_ptr + rows64 * stride_z + cols[None, :], mask=mask, other=0.0)
    if HAS_TEMP:
        it = tl.load(inv_temp_ptr + rows, mask=rmask, other=1.0)
        z = z * it[:, None]
    d = z - m[:, None]
    p = tl.exp(d - ls[:, None])
    if WITH_ENTROPY:
        c = tl.load(c_ptr + rows, mask=rmask, other=0.0)
        h = tl.load(g_ent_ptr + rows, mask=rmask, other=0.0)
        dz = -p * (g[:, None] + h[:, None] * (d + c[:, None]))
    else:
        dz = -p * g[:, None]
    dz = tl.where(cols[None, :] == tgt[:, None], tg[:, None], dz)
    if HAS_TEMP:
        dz = dz * it[:, None]
    tl.store(dz_ptr + rows64 * stride_dz + cols[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask)


_FORCE_BLOCKS: tuple[int, int] | None = None

# GPU tiles: (rows, columns, warps). The forward walks a row block across the whole chunk (one
# program per BLOCK_T rows); the backward is one tile per program.
LSE_TILE = (4, 1024, 4)
DLOGITS_TILE = (16, 256, 4)


def _blocks(n_rows: int, n_cols: int, gpu_rows: int, gpu_cols: int) -> tuple[int, int]:
    # On a GPU the tile stays small enough to live in registers (about 32 fp32 values per thread
    # at 4 warps); the interpreter prefers few, large programs, so tiny shapes get one tile.
    if _FORCE_BLOCKS is not None:  # tests: several tiles and loop iterations at tiny shapes
        return _FORCE_BLOCKS
    if triton_interpreter_enabled():
        gpu_rows, gpu_cols = 64, 1024
    return (min(gpu_rows, triton.next_power_of_2(max(n_rows, 1))),
            min(gpu_cols, triton.next_power_of_2(max(n_cols, 1))))


class TritonChunkOps:
    """Drop-in for chunked.TorchChunkOps; the logits block is contiguous float32."""

    needs_work = False

    @staticmethod
    def forward_chunk(z, work, targets, v0, m, r, w, zt, with_entropy, inv_temp=None):
        tc, vc = z.shape
        bt, bv = _blocks(tc, vc, LSE_TILE[0], LSE_TILE[1])
        _lse_chunk_kernel[(triton.cdiv(tc, bt),)](
            z, z.stride(0), targets, m if inv_temp is None else inv_temp, m, r, w, zt, tc, vc, v0,
            WITH_ENTROPY=with_entropy, HAS_TEMP=inv_temp is not None, BLOCK_T=bt, BLOCK_V=bv,
            num_warps=LSE_TILE[2])

    @staticmethod
    def backward_chunk(z, work, dz_out, targets, v0, m, ls, c, g_lp, g_ent, tgt_grad, inv_temp=None):
        tc, vc = z.shape
        bt, bv = _blocks(tc, vc, DLOGITS_TILE[0], DLOGITS_TILE[1])
        with_entropy = g_ent is not None
        _dlogits_chunk_kernel[(triton.cdiv(tc, bt), triton.cdiv(vc, bv))](
            z, z.stride(0), dz_out, dz_out.stride(0), targets, m if inv_temp is None else inv_temp, m, ls, c, g_lp,
            g_ent if with_entropy else g_lp, tgt_grad, tc, vc, v0,
            WITH_ENTROPY=with_entropy, HAS_TEMP=inv_temp is not None, BLOCK_T=bt, BLOCK_V=bv,
            num_warps=DLOGITS_TILE[2])
