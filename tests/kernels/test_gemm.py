"""primerl.kernels.gemm: offsets helpers, bf16 twins, FP8 block-scaled GEMMs (all backends).

Metric (DeepGEMM's): calc_diff < 1e-5 of a kernel against dequantize-then-fp32-matmul, and
< 1e-3 of the FP8 result against the unquantized product. Padding rows of every input are
poisoned with NaN and must not leak into the valid outputs.
"""

from __future__ import annotations

import pytest
import torch

from primerl.kernels import gemm as G
from primerl.kernels.fp8 import quant_per_block, quant_per_token_group
from primerl.kernels.gemm import reference as R
from primerl.kernels.testing import calc_diff

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
BACKENDS = ["torch", "triton"]
NAN = float("nan")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype).to(DEV)


def _offsets(counts) -> torch.Tensor:
    return G.counts_to_offsets(torch.tensor(counts, dtype=torch.int32)).to(DEV)


# Group-size patterns: empty groups, one-row groups, ragged sizes, a block-crossing group.
GROUPED_COUNTS = [[5], [0, 3, 0], [1, 1, 1], [37, 0, 130, 2], [200, 56]]


# ------------------------------------------------------------------------------ offsets helpers


@pytest.mark.parametrize("counts", GROUPED_COUNTS)
def test_offsets_round_trips(counts):
    counts_t = torch.tensor(counts, dtype=torch.int32)
    offs = G.counts_to_offsets(counts_t)
    assert torch.equal(G.offsets_to_counts(offs), counts_t)
    total = sum(counts)
    m_idx = G.offsets_to_m_indices(offs, total + 3)
    expected = torch.tensor(sum(([g] * c for g, c in enumerate(counts)), []) + [-1] * 3, dtype=torch.int32)
    assert torch.equal(m_idx, expected)
    assert torch.equal(G.m_indices_to_counts(m_idx, len(counts)), counts_t)

    x = torch.randn(total + 3, 4, generator=_gen(1))
    x[total:] = NAN
    xp, m_pad, padded_offs = G.pad_to_contiguous(x, offs)
    align = G.get_m_alignment()
    assert xp.shape[0] == sum(-(-c // align) * align for c in counts)
    assert torch.equal(padded_offs, G.counts_to_offsets(G.align_counts(counts_t)))
    assert not xp.isnan().any()
    assert torch.equal(G.m_indices_to_counts(m_pad, len(counts)), counts_t)
    assert torch.equal(G.unpad_from_contiguous(xp, offs, total + 3)[:total], x[:total])
    # static size for sync-free callers: the bound holds and extra rows are padding
    bound = G.max_padded_rows(total + 3, len(counts))
    xb, mb, _ = G.pad_to_contiguous(x, offs, total_rows=bound)
    assert xb.shape[0] == bound and torch.equal(xb[: xp.shape[0]], xp) and bool((mb[xp.shape[0]:] == -1).all())

    max_m = max(counts + [1])
    xm, masked_m = G.to_masked(x, offs, max_m)
    assert torch.equal(masked_m, counts_t) and not xm.isnan().any()
    assert torch.equal(G.from_masked(xm, offs, total + 3)[:total], x[:total])


def test_group_block_starts():
    offs = _offsets([130, 0, 1, 256]).cpu()
    assert G.group_block_starts(offs).tolist() == [0, 2, 2, 3]
    assert G.max_group_blocks(387, 4) >= 2 + 0 + 1 + 2


# ------------------------------------------------------------------------------ bf16 twins


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,n,k", [(1, 16, 16), (37, 48, 96), (130, 128, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemm_nt(backend, m, n, k, dtype):
    a, b = _randn(m, k, seed=m, dtype=dtype), _randn(n, k, seed=n + 1, dtype=dtype)
    out = G.gemm_nt(a, b, backend=backend)
    ref = a.double() @ b.double().t()
    assert out.dtype == dtype and out.shape == (m, n)
    assert calc_diff(out, ref) < (1e-5 if dtype == torch.bfloat16 else 1e-10)


def _grouped_ref(a, b, counts):
    rows, start = [], 0
    for g, c in enumerate(counts):
        rows.append(a[start:start + c].double() @ b[g].double().t())
        start += c
    return torch.cat(rows) if rows else a.new_zeros(0, b.shape[1]).double()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("counts", GROUPED_COUNTS)
@pytest.mark.parametrize("layout", ["offsets", "m_indices"])
def test_grouped_gemm_nt_forward_backward(backend, counts, layout):
    n, k, tail = 64, 128, 5
    total = sum(counts)
    a = _randn(total + tail, k, seed=sum(counts))
    a[total:] = NAN
    b = _randn(len(counts), n, k, seed=7, scale=0.1)
    offs = _offsets(counts)
    if layout == "offsets":
        index, a_in = offs, a
    else:  # the aligned contiguous layout the kernels use
        a_in, index, _ = G.pad_to_contiguous(a, offs)
        a_in[index < 0] = NAN
    a_in = a_in.detach().requires_grad_()
    b_in = b.detach().requires_grad_()
    out = G.grouped_gemm_nt(a_in, b_in, index, layout=layout, backend=backend)
    valid = (index < 0) if layout == "m_indices" else (torch.arange(a_in.shape[0], device=DEV) >= total)
    assert out.shape == (a_in.shape[0], n)
    assert not out.isnan().any() and bool((out[valid] == 0).all())
    packed = out if layout == "offsets" else G.unpad_from_contiguous(out, offs, total + tail)
    if total:
        assert calc_diff(packed[:total], _grouped_ref(a, b, counts)) < 1e-5

    grad = _randn(*out.shape, seed=3)
    out.backward(grad)
    grad_packed = grad if layout == "offsets" else G.unpad_from_contiguous(grad, offs, total + tail)
    ref_b = torch.stack([
        grad_packed[s - c:s].double().t() @ a[s - c:s].double() for s, c in zip(offs.tolist(), counts)
    ])
    assert not a_in.grad.isnan().any() and not b_in.grad.isnan().any()
    assert bool((a_in.grad[valid] == 0).all())
    if total:
        ref_a = torch.cat([grad_packed[s - c:s].double() @ b[g].double() for g, (s, c) in enumerate(zip(offs.tolist(), counts))])
        got_a = a_in.grad if layout == "offsets" else G.unpad_from_contiguous(a_in.grad, offs, total + tail)
        assert calc_diff(got_a[:total], ref_a) < 1e-5
        assert calc_diff(b_in.grad, ref_b) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_gemm_gradcheck_fp64(backend):
    """Finite differences of the bf16 path's math in float64 (float32 for the Triton kernels)."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    counts = [3, 0, 2]
    a = torch.randn(6, 16, dtype=dtype, generator=_gen(0)).to(DEV).requires_grad_()
    b = torch.randn(3, 16, 16, dtype=dtype, generator=_gen(1)).to(DEV).requires_grad_()
    offs = _offsets(counts)
    fn = lambda a_, b_: G.grouped_gemm_nt(a_, b_, offs, backend=backend)  # noqa: E731
    eps, atol = (1e-6, 1e-7) if dtype == torch.float64 else (1e-2, 5e-2)
    # fast_mode (a random projection of the Jacobian): each probe is a kernel launch under the interpreter
    assert torch.autograd.gradcheck(fn, (a, b), eps=eps, atol=atol, rtol=1e-2 if dtype == torch.float32 else 1e-3,
                                    fast_mode=backend == "triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemm_nt_gradcheck(backend):
    dtype = torch.float64 if backend == "torch" else torch.float32
    a = torch.randn(5, 16, dtype=dtype, generator=_gen(0)).to(DEV).requires_grad_()
    b = torch.randn(16, 16, dtype=dtype, generator=_gen(1)).to(DEV).requires_grad_()
    eps, atol = (1e-6, 1e-7) if dtype == torch.float64 else (1e-2, 5e-2)
    assert torch.autograd.gradcheck(lambda x, y: G.gemm_nt(x, y, backend=backend), (a, b), eps=eps, atol=atol,
                                    rtol=1e-2 if dtype == torch.float32 else 1e-3, fast_mode=backend == "triton")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("counts", [[0, 3, 0], [37, 0, 130, 2]])
def test_k_grouped_gemm_tn(backend, counts):
    total, n, k = sum(counts), 32, 48
    a = _randn(total + 4, n, seed=1)
    b = _randn(total + 4, k, seed=2)
    a[total:] = NAN
    b[total:] = NAN
    offs = _offsets(counts)
    out = G.k_grouped_gemm_tn(a, b, offs, backend=backend)
    ref = torch.stack([a[s - c:s].double().t() @ b[s - c:s].double() for s, c in zip(offs.tolist(), counts)])
    assert out.shape == (len(counts), n, k) and out.dtype == torch.float32
    assert not out.isnan().any()
    assert calc_diff(out, ref) < 1e-6
