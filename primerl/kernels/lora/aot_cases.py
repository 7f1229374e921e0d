"""AOT cases (:mod:`primerl.kernels.aot`) of the LoRA kernels at the shapes of LoRA on a large MoE
(hidden 7168, expert width 2048, rank 16 and 64): the dense shrink / expand of ``lora_linear``
(forward, and the backward's strided operands: shrink by B.T, expand by A.T into the dgrad), and
the grouped pair of ``grouped_lora`` over 8 experts x 4096 rows (offsets table and the aligned
m_indices layout). Triton specialises on unit strides and 16-divisible ones, so the transposed
operands of the backward compile separately: they are cases of their own. The test suite's subset
(``ci``) keeps one case per kernel and row mode (4 of 10: the suite compiles them for two targets)."""

from __future__ import annotations

import functools

import torch

from ..aot_case import Case

BF16, I32 = torch.bfloat16, torch.int32
M, D, N, E = 4096, 7168, 2048, 8


def _cuda(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="cuda")


def _shrink_dense(r, transposed):
    from . import triton as lt

    if transposed:  # backward: dxa [M, r] = dy [M, N] @ B [N, r], B read as B.T [1, r, N]
        lt.shrink(_cuda(M, N), _cuda(N, r).t().unsqueeze(0), None, "dense", 0.5, BF16)
    else:
        lt.shrink(_cuda(M, D), _cuda(1, r, D), None, "dense", 1.0, BF16)


def _expand_dense(r, transposed):
    from . import triton as lt

    if transposed:  # backward: dx [M, D] += dxa [M, r] @ A [r, D], A read as A.T [1, D, r]
        c = _cuda(M, D)
        lt.expand(_cuda(M, r), _cuda(r, D).t().unsqueeze(0), None, "dense", 1.0, c=c, out=c)
    else:
        c = _cuda(M, N)
        lt.expand(_cuda(M, r), _cuda(1, N, r), None, "dense", 0.5, c=c, out=c)


def _grouped(kernel, kind, r):
    from . import triton as lt

    index = _cuda(E, dtype=I32) if kind == "offsets" else _cuda(E * M, dtype=I32)
    if kernel == "shrink":
        lt.shrink(_cuda(E * M, D), _cuda(E, r, D), index, kind, 1.0, BF16)
    else:
        lt.expand(_cuda(E * M, r), _cuda(E, N, r), index, kind, 0.5)


P = functools.partial
CASES = [
    Case(f"lora shrink dense M={M} d={D} r=16", P(_shrink_dense, 16, False), "bf16", ci=True),
    Case(f"lora shrink dense M={M} d={D} r=64", P(_shrink_dense, 64, False), "bf16"),
    Case(f"lora shrink dense by B.T (backward) M={M} n={N} r=16", P(_shrink_dense, 16, True), "bf16"),
    Case(f"lora expand dense + c M={M} n={N} r=16", P(_expand_dense, 16, False), "bf16", ci=True),
    Case(f"lora expand dense + c M={M} n={N} r=64", P(_expand_dense, 64, False), "bf16"),
    Case(f"lora expand dense by A.T into dgrad (backward) M={M} d={D} r=16", P(_expand_dense, 16, True), "bf16"),
    Case(f"lora shrink grouped offsets E={E} M={E * M} d={D} r=16", P(_grouped, "shrink", "offsets", 16), "bf16",
         ci=True),
    Case(f"lora expand grouped offsets E={E} M={E * M} n={N} r=16", P(_grouped, "expand", "offsets", 16), "bf16"),
    Case(f"lora shrink grouped m_indices E={E} M={E * M} d={D} r=16", P(_grouped, "shrink", "m_indices", 16), "bf16"),
    Case(f"lora expand grouped m_indices E={E} M={E * M} n={N} r=16", P(_grouped, "expand", "m_indices", 16), "bf16",
         ci=True),
]
