"""Deliberately bad kernels for tests/kernels/test_aot.py: each must be flagged by the AOT
checker (primerl.kernels.aot.problems). Loaded by path into the compile subprocess (no
TRITON_INTERPRET there), so the @triton.jit functions here are real JIT functions.

* a small FP8 dot (16 x 16 x 32 tile, one warp): too small for wgmma / tcgen05, so it compiles to
  a pre-Hopper mma.sync or none: "tensor-core path lost";
* the same dot at a good tile (128 x 128 x 64, 8 warps) capped at 64 registers per thread
  (``maxnreg=64``; it needs about 100): ptxas must spill;
* a bf16 dot with 256 x 256 x 128 tiles and 4 stages: about 512 KB of shared memory;
* an FP8 loop whose dot result is carried to the next iteration and read there while the next
  dot is in flight (a tiny synchronous dot first, so Triton leaves the big one asynchronous):
  the loop-carried copy reads the accumulator of an in-flight wgmma, and ptxas serializes every
  wgmma (its C7514 note): "wgmma serialized".
"""

import torch
import triton
import triton.language as tl

from primerl.kernels.aot import Case


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STEPS: tl.constexpr):
    """c[BM, BN] = sum over STEPS of a[BM, BK] @ b[BK, BN] (row-major tiles, float32 out)."""
    m = tl.arange(0, BM)
    n = tl.arange(0, BN)
    k = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for s in range(STEPS):
        a = tl.load(a_ptr + s * BM * BK + m[:, None] * BK + k[None, :])
        b = tl.load(b_ptr + s * BK * BN + k[:, None] * BN + n[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + m[:, None] * BN + n[None, :], acc)


@triton.jit
def _late_use_kernel(a_desc, b_desc, c_ptr, steps, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """c = sum over steps of A[:, s] @ B[:, s].T (TMA boxes), each product added one iteration
    after its dot."""
    m = tl.arange(0, BM)
    n = tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    part = tl.zeros((BM, BN), dtype=tl.float32)
    for s in range(0, steps):
        a = a_desc.load([0, s * BK])
        b = b_desc.load([0, s * BK])
        zero = tl.sum(tl.dot(tl.zeros((BM, 32), dtype=tl.float8e4nv), tl.zeros((32, 16), dtype=tl.float8e4nv)), axis=1)
        new = tl.dot(a, b.T)
        acc += part * (1.0 + zero)[:, None]
        part = new
    tl.store(c_ptr + m[:, None] * BN + n[None, :], acc + part)


def _late_use(bm, bn, bk, steps=8):
    from triton.tools.tensor_descriptor import TensorDescriptor

    a = torch.empty(bm, steps * bk, dtype=E4M3, device="cuda")
    b = torch.empty(bn, steps * bk, dtype=E4M3, device="cuda")
    descs = [TensorDescriptor(t, list(t.shape), [t.shape[1], 1], [rows, bk]) for t, rows in ((a, bm), (b, bn))]
    _late_use_kernel[(1,)](*descs, torch.empty(bm * bn, dtype=torch.float32, device="cuda"), steps, BM=bm, BN=bn,
                           BK=bk, num_warps=8, num_stages=3)


@triton.jit
def _wide_row_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(y_ptr + offs, tl.cumsum(x, 0) * tl.max(x, 0))


def _wide_row(n, num_warps):
    x = torch.empty(n, dtype=torch.float32, device="cuda")
    _wide_row_kernel[(1,)](x, torch.empty_like(x), N=n, num_warps=num_warps)


def _dot(dtype, bm, bn, bk, steps=8, **options):
    a = torch.empty(steps * bm * bk, dtype=dtype, device="cuda")
    b = torch.empty(steps * bk * bn, dtype=dtype, device="cuda")
    c = torch.empty(bm * bn, dtype=torch.float32, device="cuda")
    _dot_kernel[(1,)](a, b, c, BM=bm, BN=bn, BK=bk, STEPS=steps, **options)


E4M3 = torch.float8_e4m3fn
CASES = [
    Case("bad: fp8 dot 16x16x32 one warp", lambda: _dot(E4M3, 16, 16, 32, num_warps=1), "fp8", ci=True),
    Case("bad: prefix sum of 8192 floats in one warp", lambda: _wide_row(8192, 1), None, ci=True),
    Case("bad: bf16 dot 256x256x128 4 stages", lambda: _dot(torch.bfloat16, 256, 256, 128, num_warps=8, num_stages=4),
         "bf16", ci=True),
    Case("good: fp8 dot 128x128x64 8 warps", lambda: _dot(E4M3, 128, 128, 64, num_warps=8), "fp8", ci=True),
    Case("bad: fp8 dot result used one iteration late", lambda: _late_use(128, 128, 128), "fp8", ci=True),
]
