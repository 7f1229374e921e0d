"""The CPU path of the grouped GEMM reference (one torch.mm per group into a preallocated output,
forward and backward): bitwise what torch._grouped_mm and its autograd compute, rows past the last
offset never read and their gradient zero."""

from __future__ import annotations

import pytest
import torch

from primerl.kernels import gemm as G
from primerl.kernels.gemm import grouped_eager as E
from primerl.kernels.testing import assert_bitwise_equal


# ragged, empty, single and similar-sized groups; padding rows past the last offset (NaN, never read)
@pytest.mark.parametrize("counts,pad", [([3, 0, 17, 1, 0, 40], 0), ([0, 0, 5], 3), ([1], 0), ([0, 0], 4),
                                        ([64, 63, 65], 2), ([9, 8, 8, 10], 1)])
@pytest.mark.parametrize("sum_grad", [False, True])
def test_per_group_path_is_bitwise_grouped_mm(counts, pad, sum_grad):
    g = torch.Generator().manual_seed(sum(counts) + pad)
    m, n, k = sum(counts) + pad, 24, 32  # 16-byte strides: torch._grouped_mm runs forward and backward
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    a = torch.randn(m, k, generator=g)
    a[sum(counts):] = float("nan")  # padding rows are never read
    b = torch.randn(len(counts), n, k, generator=g)
    dout = torch.randn(m, n, generator=g)

    leaves = [a.clone().requires_grad_(), b.clone().requires_grad_()]
    out = G.grouped_gemm_nt(*leaves, offs, layout="offsets", backend="torch")
    (out.sum() if sum_grad else (out * dout).sum()).backward()  # .sum(): a stride-0 gradient

    end = sum(counts)
    ra, rb = a[:end].clone().requires_grad_(), b.clone().requires_grad_()
    ref = torch._grouped_mm(ra, rb.transpose(-2, -1), offs=offs)
    ref.backward(torch.ones_like(ref) if sum_grad else dout[:end])
    assert_bitwise_equal(out[:end].detach(), ref.detach(), "out")
    assert_bitwise_equal(leaves[0].grad[:end], ra.grad, "da")
    assert_bitwise_equal(leaves[1].grad, rb.grad, "db")
    assert (out[end:] == 0).all() and (leaves[0].grad[end:] == 0).all()


def test_per_group_path_is_the_cpu_float32_reference(monkeypatch):
    calls = []
    real = E._GroupedMMPerGroup.apply
    monkeypatch.setattr(E._GroupedMMPerGroup, "apply", lambda *a: calls.append(1) or real(*a))
    offs = torch.tensor([2, 5], dtype=torch.int32)
    G.grouped_gemm_nt(torch.randn(5, 16), torch.randn(2, 8, 16), offs)
    G.grouped_gemm_nt(torch.randn(5, 16, dtype=torch.bfloat16), torch.randn(2, 8, 16, dtype=torch.bfloat16), offs)
    assert calls == [1]  # bf16 keeps torch._grouped_mm (its rounding differs from torch.mm's)
