"""What the Triton attention kernels share (:mod:`.triton`'s square kernels, :mod:`.mla_triton`'s
two-part kernels, :mod:`primerl.kernels.sparse_attention.triton`): the mask rule of
:mod:`.reference` as ``@triton.jit`` functions (same sequence, ``k_pos >= 0``, causal
``k_pos <= q_pos``; block-skip tests), sequence bounds and position loads, and the host-side
inputs of a recomputing backward. Softmax runs in base 2 with the scale folded in (``LOG2E``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_POS_BIG = tl.constexpr(2**30)  # "no valid key" sentinel for the block-skip test


def _dot_precision(dtype: torch.dtype):
    # float32 inputs: IEEE products (the default TF32 would miss the 2x-of-torch error bound)
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _load_positions(Pos, base, offs, n_valid, HAS_POS: tl.constexpr, shift):
    """Positions of tokens ``offs`` of one sequence; -1 (masked) beyond ``n_valid``."""
    valid = offs < n_valid
    if HAS_POS:
        return tl.load(Pos + base + offs, mask=valid, other=-1)
    return tl.where(valid, offs + shift, -1)


@triton.jit
def _seq_bounds(CuQ, CuK, b):
    """(q_start, len_q, k_start, len_k) of sequence b."""
    q_start = tl.load(CuQ + b)
    len_q = tl.load(CuQ + b + 1) - q_start
    k_start = tl.load(CuK + b)
    len_k = tl.load(CuK + b + 1) - k_start
    return q_start, len_q, k_start, len_k


@triton.jit
def _key_loop_bounds(m0, len_q, len_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                     HAS_POS: tl.constexpr):
    """(n_full, n_end) for the query block at m0: key blocks before n_full every query of the block
    sees in full (no mask to apply), none at or after n_end (default positions only)."""
    n_end = len_k
    n_full = 0
    if not HAS_POS:
        if CAUSAL:
            n_end = tl.minimum(len_k, m0 + BLOCK_M + len_k - len_q)
            n_full = tl.maximum(tl.minimum(len_k, m0 + len_k - len_q + 1), 0) // BLOCK_N * BLOCK_N
        else:
            n_full = len_k // BLOCK_N * BLOCK_N
    return n_full, n_end


@triton.jit
def _first_query_block(n0, len_q, len_k, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, HAS_POS: tl.constexpr):
    """The first query block that can see the key block at n0 (default positions; else 0)."""
    m_begin = 0
    if CAUSAL and not HAS_POS:
        m_begin = tl.maximum(0, n0 - (len_k - len_q)) // BLOCK_M * BLOCK_M
    return m_begin


@triton.jit
def _key_block_summary(k_pos):
    """(earliest real key position, whether the block has a real key) of a key block."""
    return tl.min(tl.where(k_pos >= 0, k_pos, _POS_BIG), axis=0), tl.max(k_pos, axis=0) >= 0


@triton.jit
def _query_block_sees(k_pos_min, q_pos, CAUSAL: tl.constexpr):
    """Whether a query block (positions ``q_pos``) sees any key of a block whose earliest real key is at
    ``k_pos_min``."""
    run = True
    if CAUSAL:
        run = k_pos_min <= tl.max(q_pos, axis=0)
    return run


@triton.jit
def _block_runs(k_pos, q_pos_max, CAUSAL: tl.constexpr):
    """Whether any query of a block (latest position ``q_pos_max``) sees a key of this key block."""
    if CAUSAL:
        return tl.min(tl.where(k_pos >= 0, k_pos, _POS_BIG), axis=0) <= q_pos_max
    return tl.max(k_pos, axis=0) >= 0


@triton.jit
def _visible(k_pos, q_pos, CAUSAL: tl.constexpr):
    """[BM, BN] mask: the key is real, and (causal) not after the query."""
    visible = (k_pos >= 0)[None, :]
    if CAUSAL:
        visible = visible & (k_pos[None, :] <= q_pos[:, None])
    return visible


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def backward_inputs(dout, q, k, v, out, lse, dlse):
    """(q, k, v, dout) with a contiguous last dim, lse contiguous, and delta ``[Hq, T]`` float32 =
    rowsum(dO * O) - dlse (the lse gradient enters dS exactly like -delta does)."""
    q, k, v, dout = (_last_dim_contiguous(t) for t in (q, k, v, dout))
    delta = (dout.float() * out.float()).sum(-1).transpose(0, 1).contiguous()
    if dlse is not None:
        delta = delta - dlse.float()
    return q, k, v, dout, lse.contiguous(), delta


def _pos_args(spec):
    if spec.q_positions is None:
        return spec.cu_seqlens_q, spec.cu_seqlens_q, False  # dummies, never read
    return spec.q_positions, spec.k_positions, True
