"""Triton kernels for the per-chunk work of the chunked log-probabilities (see chunked.py).

The logits block ``z[Tc, Vc]`` (float32, raw h.W) comes from a matmul; one kernel updates the
online log-sum-exp state of each token row, the other turns the block into dL/dlogits in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import triton_interpreter_enabled
from .chunked import M_INIT

_M_INIT = tl.constexpr(M_INIT)


@triton.jit
def _lse_chunk_kernel(z_ptr, stride_z, inv_temp_ptr, targets_ptr, m_ptr, s_ptr, w_ptr, zt_ptr,
                      n_rows, n_cols, v0,
                      WITH_ENTROPY: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < n_rows
    it = tl.load(inv_temp_ptr + rows, mask=rmask, other=1.0)
    tgt = tl.load(targets_ptr + rows, mask=rmask, other=-1) - v0
    m = tl.load(m_ptr + rows, mask=rmask, other=_M_INIT)
    s = tl.load(s_ptr + rows, mask=rmask, other=0.0)
    w = tl.load(w_ptr + rows, mask=rmask, other=0.0)
    zt = tl.load(zt_ptr + rows, mask=rmask, other=0.0)
    for c0 in range(0, n_cols, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        mask = rmask[:, None] & (cols[None, :] < n_cols)
        z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0) * it[:, None]
        z = tl.where(mask, z, _M_INIT)
        hit = mask & (cols[None, :] == tgt[:, None])
        zt += tl.sum(tl.where(hit, z, 0.0), axis=1)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        a = tl.exp(m - m_new)
        d = z - m_new[:, None]
        e = tl.where(mask, tl.exp(d), 0.0)
        if WITH_ENTROPY:
            w = a * (w + (m - m_new) * s) + tl.sum(tl.where(mask, e * d, 0.0), axis=1)
        s = a * s + tl.sum(e, axis=1)
        m = m_new
    tl.store(m_ptr + rows, m, mask=rmask)
    tl.store(s_ptr + rows, s, mask=rmask)
    tl.store(w_ptr + rows, w, mask=rmask)
    tl.store(zt_ptr + rows, zt, mask=rmask)


@triton.jit
def _dlogits_chunk_kernel(z_ptr, stride_z, inv_temp_ptr, targets_ptr, lse_ptr, ez_ptr, g_lp_ptr, g_ent_ptr,
                          n_rows, n_cols, v0,
                          WITH_ENTROPY: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols[None, :] < n_cols)
    it = tl.load(inv_temp_ptr + rows, mask=rmask, other=1.0)
    tgt = tl.load(targets_ptr + rows, mask=rmask, other=-1) - v0
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
    g = tl.load(g_lp_ptr + rows, mask=rmask, other=0.0)
    ptrs = z_ptr + rows[:, None] * stride_z + cols[None, :]
    z = tl.load(ptrs, mask=mask, other=0.0) * it[:, None]
    p = tl.exp(z - lse[:, None])
    dz = tl.where(cols[None, :] == tgt[:, None], g[:, None], 0.0) - g[:, None] * p
    if WITH_ENTROPY:
        ez = tl.load(ez_ptr + rows, mask=rmask, other=0.0)
        h = tl.load(g_ent_ptr + rows, mask=rmask, other=0.0)
        dz -= h[:, None] * p * (z - ez[:, None])
    tl.store(ptrs, dz * it[:, None], mask=mask)


_FORCE_BLOCKS: tuple[int, int] | None = None


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

    @staticmethod
    def forward_chunk(z, work, inv_temp, targets, v0, m, s, w, zt, with_entropy):
        tc, vc = z.shape
        bt, bv = _blocks(tc, vc, 4, 1024)
        _lse_chunk_kernel[(triton.cdiv(tc, bt),)](
            z, z.stride(0), inv_temp, targets, m, s, w, zt, tc, vc, v0,
            WITH_ENTROPY=with_entropy, BLOCK_T=bt, BLOCK_V=bv)

    @staticmethod
    def backward_chunk(z, work, inv_temp, targets, v0, lse, ez, g_lp, g_ent):
        tc, vc = z.shape
        bt, bv = _blocks(tc, vc, 16, 256)
        with_entropy = g_ent is not None
        _dlogits_chunk_kernel[(triton.cdiv(tc, bt), triton.cdiv(vc, bv))](
            z, z.stride(0), inv_temp, targets, lse, ez, g_lp, g_ent if with_entropy else g_lp, tc, vc, v0,
            WITH_ENTROPY=with_entropy, BLOCK_T=bt, BLOCK_V=bv)
