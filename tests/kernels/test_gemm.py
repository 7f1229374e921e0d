"""primerl.kernels.gemm: offsets helpers, bf16 twins, FP8 block-scaled GEMMs (all backends).

Metric (DeepGEMM's): calc_diff < 1e-5 of a kernel against dequantize-then-fp32-matmul, and
< 1e-3 of the FP8 result against the unquantized product. Padding rows of every input are
poisoned with NaN and must not leak into the valid outputs.
"""

from __future__ import annotations

import pytest
import torch

from primerl.kernels import backend_status
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
        assert calc_diff(packed[:total].detach(), _grouped_ref(a, b, counts)) < 1e-5

    grad = _randn(*out.shape, seed=3)
    out.backward(grad)
    grad_packed = grad if layout == "offsets" else G.unpad_from_contiguous(grad, offs, total + tail)
    ref_b = torch.stack([
        grad_packed[s - c:s].double().t() @ a[s - c:s].double() for s, c in zip(offs.tolist(), counts)
    ])
    assert not a_in.grad.isnan().any() and not b_in.grad.isnan().any()
    assert bool((a_in.grad[valid] == 0).all())
    if total:
        ref_a = torch.cat([grad_packed[s - c:s].double() @ b[g].double()
                           for g, (s, c) in enumerate(zip(offs.tolist(), counts))])
        got_a = a_in.grad if layout == "offsets" else G.unpad_from_contiguous(a_in.grad, offs, total + tail)
        assert calc_diff(got_a[:total], ref_a) < 1e-5
        assert calc_diff(b_in.grad, ref_b) < 1e-5


@pytest.mark.parametrize("n,k", [(5, 16), (16, 12)])
def test_grouped_gemm_unaligned_dims_backward(n, k):
    """torch._grouped_mm needs 16-byte strides (forward and backward): other dims take the loop."""
    a = _randn(10, k, seed=0).requires_grad_()
    b = _randn(3, n, k, seed=1).requires_grad_()
    offs = _offsets([2, 0, 5])
    out = G.grouped_gemm_nt(a, b, offs, backend="torch")
    out.sum().backward()
    assert calc_diff(out[:7].detach(), _grouped_ref(a.detach(), b.detach(), [2, 0, 5])) < 1e-5
    assert not a.grad.isnan().any() and bool((a.grad[7:] == 0).all()) and bool((b.grad[1] == 0).all())


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
    a_in, b_in = a.detach().requires_grad_(), b.detach().requires_grad_()
    out = G.k_grouped_gemm_tn(a_in, b_in, offs, backend=backend)
    ref = torch.stack([a[s - c:s].double().t() @ b[s - c:s].double() for s, c in zip(offs.tolist(), counts)])
    assert out.shape == (len(counts), n, k) and out.dtype == torch.float32
    assert not out.isnan().any()
    assert calc_diff(out.detach(), ref) < 1e-6

    # the gradients: da = b @ grad[g].T, db = a @ grad[g] over each group's rows; rows past the last group zero
    grad = _randn(*out.shape, seed=3)
    out.backward(grad)
    ref_a = torch.cat([b[s - c:s].double() @ grad[g].double().t()
                       for g, (s, c) in enumerate(zip(offs.tolist(), counts))])
    ref_b = torch.cat([a[s - c:s].double() @ grad[g].double() for g, (s, c) in enumerate(zip(offs.tolist(), counts))])
    for got, want in ((a_in.grad, ref_a), (b_in.grad, ref_b)):
        assert got.shape == (total + 4, want.shape[1]) and not got.isnan().any()
        assert bool((got[total:] == 0).all())
        assert calc_diff(got[:total], want) < 1e-5  # bf16 gradients


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemm_nt_backward_strided_operands(backend):
    """Transposed views in: the weight gradient reads a's rows (the K-grouped kernel takes unit column
    strides only, so the launcher copies such operands first)."""
    a_t, b_t = _randn(32, 6, seed=0), _randn(32, 24, seed=1)
    a, b = a_t.t().requires_grad_(), b_t.t().requires_grad_()
    out = G.gemm_nt(a, b, backend=backend)
    grad = _randn(6, 24, seed=2)
    out.backward(grad)
    assert calc_diff(out.detach(), a.detach().double() @ b.detach().double().t()) < 1e-5
    assert calc_diff(a.grad, grad.double() @ b.detach().double()) < 1e-5
    assert calc_diff(b.grad, grad.double().t() @ a.detach().double()) < 1e-5


# ------------------------------------------------------------------------------ FP8 GEMMs


def _quant_a(x):
    return quant_per_token_group(x, 128)


def _poison_rows(pair, rows_mask):
    """NaN into the q and sf of the given rows (q: 0x7F is NaN in e4m3fn)."""
    q, sf = pair[0].clone(), pair[1].clone()
    q.view(torch.uint8)[rows_mask] = 0x7F
    sf[rows_mask] = NAN
    return q, sf


def _check_fp8(out, a_hat_ref, exact_ref):
    """Kernel vs dequantize+fp32 (adds nothing to the quantization error) and vs unquantized."""
    assert not out.isnan().any()
    assert calc_diff(out, a_hat_ref) < 1e-5
    assert calc_diff(out, exact_ref) < 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,n,k", [(1, 128, 128), (37, 200, 256), (130, 128, 384)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemm_nt(backend, m, n, k, out_dtype):
    x, w = _randn(m, k, seed=m + k), _randn(n, k, seed=n, scale=0.05)
    a, b = _quant_a(x), quant_per_block(w)
    out = G.fp8_gemm_nt(a, b, out_dtype=out_dtype, backend=backend)
    assert out.shape == (m, n) and out.dtype == out_dtype
    deq = R.dequant_token_group(*a) @ R.dequant_block(*b).t()
    _check_fp8(out, deq, x.double() @ w.double().t())


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_gemm_nt_e5m2_activations_fp16_out(backend):
    """Gradients are often quantized to e5m2: mixed e5m2 x e4m3 operands, fp16 output."""
    x, w = _randn(37, 256, seed=3), _randn(128, 256, seed=4, scale=0.05)
    a, b = quant_per_token_group(x, 128, dtype=torch.float8_e5m2), quant_per_block(w)
    out = G.fp8_gemm_nt(a, b, out_dtype=torch.float16, backend=backend)
    assert out.dtype == torch.float16
    deq = R.fp8_gemm_nt(a, b, torch.float32)
    assert calc_diff(out, deq) < 1e-5 and calc_diff(out, x.double() @ w.double().t()) < 5e-3  # 2 mantissa bits


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("counts", [[0, 3, 0], [1, 1, 1], [37, 0, 130, 2]])
def test_m_grouped_fp8_contiguous(backend, counts):
    n, k = 160, 256
    total = sum(counts)
    x = _randn(total, k, seed=total)
    w = _randn(len(counts), n, k, seed=5, scale=0.05)
    offs = _offsets(counts)
    xp, m_idx, _ = G.pad_to_contiguous(x, offs)
    a = _poison_rows(_quant_a(xp), m_idx < 0)
    b = quant_per_block(w)
    out = G.m_grouped_fp8_gemm_nt_contiguous(a, b, m_idx, backend=backend)
    assert out.shape == (xp.shape[0], n) and bool((out[m_idx < 0] == 0).all())
    deq = R.grouped_gemm_nt_m_indices(R.dequant_token_group(*a), R.dequant_block(*b), m_idx, torch.float32)
    exact = G.pad_to_contiguous(_grouped_ref(x, w, counts), offs)[0]
    _check_fp8(out, deq, exact)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("counts", [[0, 3, 0], [37, 0, 130, 2]])
def test_m_grouped_fp8_offsets(backend, counts):
    n, k, tail = 128, 256, 3
    total = sum(counts)
    x = _randn(total + tail, k, seed=total)
    w = _randn(len(counts), n, k, seed=6, scale=0.05)
    rows = torch.arange(total + tail, device=DEV) >= total
    a = _poison_rows(_quant_a(x), rows)
    b = quant_per_block(w)
    out = G.m_grouped_fp8_gemm_nt_offsets(a, b, _offsets(counts), backend=backend)
    assert bool((out[total:] == 0).all())
    deq = R.m_grouped_fp8_gemm_nt_offsets(a, b, _offsets(counts), torch.float32)
    _check_fp8(out[:total], deq[:total], _grouped_ref(x, w, counts))


@pytest.mark.parametrize("backend", BACKENDS)
def test_m_grouped_fp8_masked(backend):
    groups, max_m, n, k = 3, 40, 128, 256
    masked_m = torch.tensor([0, 1, 37], dtype=torch.int32, device=DEV)
    x = _randn(groups, max_m, k, seed=11)
    w = _randn(groups, n, k, seed=12, scale=0.05)
    past = torch.arange(max_m, device=DEV)[None, :] >= masked_m[:, None]
    a = _poison_rows(_quant_a(x), past)
    b = quant_per_block(w)
    out = G.m_grouped_fp8_gemm_nt_masked(a, b, masked_m, expected_m=16, backend=backend)
    assert out.shape == (groups, max_m, n)
    valid = ~past
    deq = R.dequant_token_group(*a).nan_to_num(0) @ R.dequant_block(*b).transpose(1, 2)
    exact = x.double() @ w.double().transpose(1, 2)
    _check_fp8(out[valid], deq[valid], exact[valid])


@pytest.mark.parametrize("layout", ["dense", "m_indices", "offsets", "masked"])
def test_fp8_wide_tiles(monkeypatch, layout):
    """N a multiple of 256: the Triton kernel takes BM x 256 tiles (HALVES=2, two accumulators
    sharing each A box; the second half's B-scale block is the next 128 columns). N = 512 gives two
    such tiles per row band, so the second tile's halves start at scale blocks 2 and 3."""
    from primerl.kernels.gemm import triton_fp8 as F

    real, seen = F.fp8_structure, []
    monkeypatch.setattr(F, "fp8_structure", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    n, k = 512, 384
    w = _randn(3, n, k, seed=21, scale=0.05)
    b = quant_per_block(w)
    if layout == "dense":
        x = _randn(70, k, seed=22)
        a, b0 = _quant_a(x), quant_per_block(w[0])
        out = G.fp8_gemm_nt(a, b0, backend="triton")
        _check_fp8(out, R.fp8_gemm_nt(a, b0, torch.float32), x.double() @ w[0].double().t())
    elif layout == "masked":
        masked_m = torch.tensor([0, 33, 40], dtype=torch.int32, device=DEV)
        x = _randn(3, 40, k, seed=23)
        past = torch.arange(40, device=DEV)[None, :] >= masked_m[:, None]
        a = _poison_rows(_quant_a(x), past)
        out = G.m_grouped_fp8_gemm_nt_masked(a, b, masked_m, expected_m=40, backend="triton")
        deq = R.dequant_token_group(*a).nan_to_num(0) @ R.dequant_block(*b).transpose(1, 2)
        _check_fp8(out[~past], deq[~past], (x.double() @ w.double().transpose(1, 2))[~past])
    else:
        counts = [37, 0, 130]
        offs = _offsets(counts)
        x = _randn(sum(counts), k, seed=24)
        if layout == "m_indices":
            xp, m_idx, _ = G.pad_to_contiguous(x, offs)
            a = _poison_rows(_quant_a(xp), m_idx < 0)
            out = G.m_grouped_fp8_gemm_nt_contiguous(a, b, m_idx, backend="triton")
            assert bool((out[m_idx < 0] == 0).all())
            deq = R.grouped_gemm_nt_m_indices(R.dequant_token_group(*a), R.dequant_block(*b), m_idx, torch.float32)
            _check_fp8(out, deq, G.pad_to_contiguous(_grouped_ref(x, w, counts), offs)[0])
        else:
            a = _quant_a(x)
            out = G.m_grouped_fp8_gemm_nt_offsets(a, b, offs, backend="triton")
            _check_fp8(out, R.m_grouped_fp8_gemm_nt_offsets(a, b, offs, torch.float32), _grouped_ref(x, w, counts))
    assert [cfg["HALVES"] for cfg in seen] == [2], seen


@pytest.mark.parametrize("layout", ["rows", "blocks"])
def test_k_grouped_fp8_wide_tiles(monkeypatch, layout):
    """N a multiple of 256: the k-grouped kernel takes 256 x BK tiles (HALVES=2, two n halves
    sharing each B box and its column scales); N = 512 gives two per group, K = 160 a partial
    k tile; ragged and empty groups."""
    from primerl.kernels.gemm import triton_fp8 as F

    real, seen = F.k_grouped_halves, []
    monkeypatch.setattr(F, "k_grouped_halves", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    counts, n, k = [37, 0, 130, 2], 512, 160
    total = sum(counts)
    dy, x = _randn(total + 2, n, seed=31), _randn(total + 2, k, seed=32)
    offs = _offsets(counts)
    a = G.quant_per_group_colwise(dy, offs, layout=layout, backend="triton")
    b = G.quant_per_group_colwise(x, offs, layout=layout, backend="triton")
    out = G.k_grouped_fp8_gemm_tn_contiguous(a, b, offs, backend="triton")
    rows = [G.quant_per_group_colwise(t, offs, backend="torch") for t in (dy, x)]
    deq = R.k_grouped_fp8_gemm_tn_contiguous(rows[0], rows[1], offs, torch.float32)
    exact = torch.stack([dy[s - c:s].double().t() @ x[s - c:s].double() for s, c in zip(offs.tolist(), counts)])
    _check_fp8(out, deq, exact)
    assert [cfg["HALVES"] for cfg in seen] == [2], seen


def test_fp8_wide_tile_choice(monkeypatch):
    """128 x 256 tiles where N allows them and they keep the SMs about as busy (GPU tile table,
    132 SMs): M = 4096 and the masked 8 x 128-row case take them, M = 128 (56 narrow tiles, 28
    wide) and N = 2112 (no multiple of 256), per-row B scales and C accumulation do not."""
    from primerl.kernels.gemm import triton as T
    from primerl.kernels.gemm import triton_common as C
    from primerl.kernels.gemm import triton_fp8 as F

    def halves(m_tiles, n, sb_gran=128, has_c=False):
        cfg = T.pick_tiles(4096, n, 7168, True, 1, interpreter=False, num_sms=132)
        return F.fp8_structure(cfg, sb_gran, T.MODE_DENSE, has_c, n, m_tiles, interpreter=False)["HALVES"]

    monkeypatch.setattr(C, "num_sms", lambda: 132)
    monkeypatch.setattr(C, "arch_major", lambda: 9)
    assert halves(32, 4096) == 2 and halves(8, 4096) == 2 and halves(256, 7168) == 2
    assert halves(1, 7168) == 1 and halves(32, 2112) == 1
    assert halves(32, 4096, sb_gran=1) == 1 and halves(32, 4096, has_c=True) == 1
    # k-grouped: dW [4, 4096, 7168] (4 x 32 x 56 narrow tiles) takes 256-row tiles, N = 2112 cannot
    kcfg = F.k_grouped_tiles(interpreter=False, arch_major=9)
    assert F.k_grouped_halves(kcfg, 4096, 7168, 4, interpreter=False, arch_major=9)["HALVES"] == 2
    assert F.k_grouped_halves(kcfg, 2112, 7168, 4, interpreter=False, arch_major=9)["HALVES"] == 1
    assert F.k_grouped_halves(kcfg, 4096, 7168, 4, interpreter=False, arch_major=10)["HALVES"] == 1
    monkeypatch.setattr(C, "arch_major", lambda: 10)
    assert halves(32, 4096) == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("counts", [[5], [0, 130, 1, 0], [128, 3]])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_quant_per_group_colwise(backend, counts, ue8m0):
    total, tail, cols = sum(counts), 4, 96
    x = _randn(total + tail, cols, seed=total, scale=3.0)
    x[total:] = NAN
    offs = _offsets(counts)
    q, sf = G.quant_per_group_colwise(x, offs, ue8m0=ue8m0, backend=backend)
    q_ref, sf_ref = R.quant_per_group_colwise(x, offs, torch.float8_e4m3fn, ue8m0)
    assert sf.shape == (G.max_group_blocks(total + tail, len(counts)), cols)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(sf, sf_ref)
    # a block never crosses a group boundary: each group's rows round-trip with its own scales
    x_hat = R.dequant_group_colwise(q, sf, offs)
    assert calc_diff(x_hat[:total], x[:total]) < 1e-3 and bool((x_hat[total:] == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("counts", [[0, 3, 0], [37, 0, 130, 2]])
def test_k_grouped_fp8_gemm_tn(backend, counts):
    total, n, k = sum(counts), 128, 160
    dy, x = _randn(total + 2, n, seed=1), _randn(total + 2, k, seed=2)
    offs = _offsets(counts)
    a = G.quant_per_group_colwise(dy, offs, backend="torch")
    b = G.quant_per_group_colwise(x, offs, backend="torch")
    out = G.k_grouped_fp8_gemm_tn_contiguous(a, b, offs, backend=backend)
    assert out.shape == (len(counts), n, k) and out.dtype == torch.float32
    deq = R.k_grouped_fp8_gemm_tn_contiguous(a, b, offs, torch.float32)
    exact = torch.stack([dy[s - c:s].double().t() @ x[s - c:s].double() for s, c in zip(offs.tolist(), counts)])
    _check_fp8(out, deq, exact)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("counts", [[0, 130, 1, 0], [256, 3]])
def test_quant_per_group_colwise_blocks_layout(backend, counts):
    """layout="blocks": the same values as group blocks [R, C, 128] (zero past a group's end and
    in spare blocks), the same scales; the GEMM gives bitwise the rows layout's result."""
    total, tail, cols = sum(counts), 3, 80
    x = _randn(total + tail, cols, seed=total, scale=2.0)
    offs = _offsets(counts)
    q, sf = G.quant_per_group_colwise(x, offs, backend=backend)
    qb, sfb = G.quant_per_group_colwise(x, offs, layout="blocks", backend=backend)
    assert qb.shape == (sf.shape[0], cols, 128) and torch.equal(sfb, sf)
    assert torch.equal(qb.view(torch.uint8), R.rows_to_group_blocks(q, offs, sf.shape[0]).view(torch.uint8))
    back = R.group_blocks_to_rows(qb, offs, total + tail)
    assert torch.equal(back.view(torch.uint8)[:total], q.view(torch.uint8)[:total]) and bool((back[total:] == 0).all())
    used = sum(-(-c // 128) for c in counts)
    assert bool((qb[used:].float() == 0).all())
    y = _randn(total + tail, 48, seed=1)
    pair_rows = G.quant_per_group_colwise(y, offs, backend=backend)
    pair_blocks = G.quant_per_group_colwise(y, offs, layout="blocks", backend=backend)
    want = G.k_grouped_fp8_gemm_tn_contiguous((q, sf), pair_rows, offs, backend=backend)
    got = G.k_grouped_fp8_gemm_tn_contiguous((qb, sfb), pair_blocks, offs, backend=backend)
    assert torch.equal(got, want)
    qc, sfc = G.quant_per_group_colwise(x, offs, layout="blocks", compact=True, backend=backend)
    assert qc.shape[0] == sfc.shape[0] == used
    with pytest.raises(ValueError, match="share a layout"):
        G.k_grouped_fp8_gemm_tn_contiguous((qb, sfb), pair_rows, offs, backend=backend)
    with pytest.raises(ValueError, match="layout must be"):
        G.quant_per_group_colwise(x, offs, layout="cols", backend=backend)


# ------------------------------------------------------------------------------ validation, adapter


def test_fp8_input_errors():
    x, w = _randn(4, 256, seed=0), _randn(128, 256, seed=1)
    a, b = _quant_a(x), quant_per_block(w)
    with pytest.raises(ValueError, match="scales must be"):
        G.fp8_gemm_nt((a[0], a[1][:, :1].contiguous()), b)
    with pytest.raises(ValueError, match="K mismatch"):
        G.fp8_gemm_nt(a, quant_per_block(_randn(128, 384, seed=2)))
    with pytest.raises(ValueError, match="multiple of 128"):
        G.fp8_gemm_nt(quant_per_token_group(_randn(4, 64, seed=0), 64), b)
    with pytest.raises(TypeError, match=r"\(q, sf\) pair"):
        G.fp8_gemm_nt(x, b)
    with pytest.raises(ValueError, match="out_dtype"):
        G.fp8_gemm_nt(a, b, out_dtype=torch.int8)
    wg = quant_per_block(_randn(2, 128, 256, seed=3))
    with pytest.raises(ValueError, match=r"m_indices\) must have 4 entries"):
        G.m_grouped_fp8_gemm_nt_contiguous(a, wg, torch.zeros(3, dtype=torch.int32, device=DEV))
    if not HAS_CUDA:
        with pytest.raises(ValueError, match=r"m_indices values must be in \[-1, 2\)"):
            G.m_grouped_fp8_gemm_nt_contiguous(a, wg, torch.full((4,), 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        G.grouped_gemm_nt(x.cpu(), _randn(2, 8, 256, seed=5).cpu(), torch.tensor([3, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="layout="):
        G.grouped_gemm_nt(x[:2].cpu(), _randn(2, 8, 256, seed=5).cpu(), torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="backend"):
        G.gemm_nt(x, w, backend="deep_gemm")
    if not HAS_CUDA:  # content checks run on CPU index tensors
        b2 = torch.randn(2, 8, 16)
        desc = torch.cat([torch.ones(128, dtype=torch.int32), torch.zeros(128, dtype=torch.int32)])
        with pytest.raises(ValueError, match="ascending"):
            G.grouped_gemm_nt(torch.randn(256, 16), b2, desc, backend="triton")
        with pytest.raises(ValueError, match="aligned contiguous layout"):
            G.grouped_gemm_nt(torch.randn(100, 16), b2, desc[:100], backend="triton")


@pytest.mark.parametrize("shape", [(5, 2), (128, 3), (3, 7, 1), (2, 130, 4)])
def test_deep_gemm_scale_layout(shape):
    from primerl.kernels.gemm.deep_gemm import is_mn_major_tma_aligned, to_mn_major_tma_aligned, tma_aligned_size

    sf = torch.rand(*shape, generator=_gen(0))
    out = to_mn_major_tma_aligned(sf)
    mn, sk = shape[-2:]
    aligned = tma_aligned_size(mn, 4)
    assert aligned % 4 == 0 and mn <= aligned < mn + 4
    assert torch.equal(out, sf) and is_mn_major_tma_aligned(out) and not (mn % 4 and is_mn_major_tma_aligned(sf))
    assert out.stride()[-2:] == (1, aligned)
    storage = torch.as_strided(out, (*shape[:-2], sk, aligned), (*out.stride()[:-2], aligned, 1))
    assert bool((storage[..., mn:] == 0).all())


# ------------------------------------------------------------------------------ GPU


# GPU shapes cover every launch configuration of the TMA kernels: BM 64 (M <= 64) and 128, BN 64
# (fewer 128-wide tiles than SMs) and 128, more tiles than programs (the persistent loop), M and N
# not multiples of the tile.
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(128, 2112, 7168), (4096, 7168, 2048), (3, 4096, 512), (64, 7168, 2048),
                                   (300, 4160, 1024)])
def test_fp8_gemm_nt_gpu(m, n, k):
    x, w = _randn(m, k, seed=0), _randn(n, k, seed=1, scale=0.02)
    a, b = _quant_a(x), quant_per_block(w)
    deq = R.fp8_gemm_nt(a, b, torch.float32)
    exact = x.double() @ w.double().t()
    for be in ["triton"] + (["deep_gemm"] if backend_status("deep_gemm").available else []):
        out = G.fp8_gemm_nt(a, b, backend=be)
        assert calc_diff(out, deq) < 1e-5 and calc_diff(out, exact) < 1e-3, be


@pytest.mark.gpu
def test_fp8_gemm_nt_row_scaled_b_and_c_gpu():
    """Recipe (1, 1, 128) (a scale per row of B: BN 64 tiles) and D = A @ B.T + C into float32."""
    m, n, k = 1000, 2048, 1024
    x, w = _randn(m, k, seed=2), _randn(n, k, seed=3, scale=0.02)
    a, b = _quant_a(x), quant_per_token_group(w, 128)
    out = G.fp8_gemm_nt(a, b, recipe=(1, 1, 128), backend="triton")
    assert calc_diff(out, R.fp8_gemm_nt(a, b, torch.float32, 1)) < 1e-5
    c = _randn(m, n, seed=4, dtype=torch.float32)
    d = c.clone()
    G.fp8_gemm_nt(a, quant_per_block(w), d, c=d, backend="triton")
    assert calc_diff(d, x.double() @ w.double().t() + c.double()) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("expected_m", [32, 256])
def test_m_grouped_fp8_masked_gpu(expected_m):
    """Masked layout (per-group tiles of BM 64 / 128, tiles past masked_m exit): rows past masked_m
    are not written, NaN rows there are not read into valid rows."""
    groups, max_m, n, k = 4, 256, 4096, 1024
    masked_m = torch.tensor([0, 1, 100, 256], dtype=torch.int32, device=DEV)
    x, w = _randn(groups, max_m, k, seed=5), _randn(groups, n, k, seed=6, scale=0.02)
    past = torch.arange(max_m, device=DEV)[None, :] >= masked_m[:, None]
    a, b = _poison_rows(_quant_a(x), past), quant_per_block(w)
    d = torch.full((groups, max_m, n), 3.0, dtype=torch.bfloat16, device=DEV)
    G.m_grouped_fp8_gemm_nt_masked(a, b, masked_m, expected_m, d, backend="triton")
    assert bool((d[past] == 3.0).all())
    deq = R.dequant_token_group(*a).nan_to_num(0) @ R.dequant_block(*b).transpose(1, 2)
    exact = x.double() @ w.double().transpose(1, 2)
    assert calc_diff(d[~past], deq[~past]) < 1e-5 and calc_diff(d[~past], exact[~past]) < 1e-3


@pytest.mark.gpu
def test_k_grouped_fp8_gpu():
    """Weight gradients: ragged groups (empty, one row, not multiples of 128) through the K-major
    group-block re-layout, static and compact scale rows, and + C."""
    counts, n, k = [300, 0, 1, 1000, 128], 4096, 2048
    offs = _offsets(counts)
    total = sum(counts)
    dy, x = _randn(total + 5, n, seed=7), _randn(total + 5, k, seed=8)
    qa, qb = G.quant_per_group_colwise(dy, offs), G.quant_per_group_colwise(x, offs)
    out = G.k_grouped_fp8_gemm_tn_contiguous(qa, qb, offs, backend="triton")
    exact = torch.stack([dy[s - c:s].double().t() @ x[s - c:s].double() for s, c in zip(offs.tolist(), counts)])
    assert calc_diff(out, R.k_grouped_fp8_gemm_tn_contiguous(qa, qb, offs, torch.float32)) < 1e-5
    assert calc_diff(out, exact) < 1e-3 and bool((out[1] == 0).all())
    blocks = [G.quant_per_group_colwise(t, offs, layout="blocks") for t in (dy, x)]
    assert torch.equal(G.k_grouped_fp8_gemm_tn_contiguous(*blocks, offs, backend="triton"), out)
    ks = counts[:-1] + [counts[-1] + 5]  # the tail rows join the last group
    qa, qb = (G.quant_per_group_colwise(t, ks=ks, compact=True) for t in (dy, x))
    c = _randn(len(ks), n, k, seed=9, dtype=torch.float32)
    d = c.clone()
    G.k_grouped_fp8_gemm_tn_contiguous(qa, qb, d=d, c=d, ks=ks, backend="triton")
    offs = _offsets(ks)
    want = R.k_grouped_fp8_gemm_tn_contiguous(qa, qb, offs, torch.float32, c)
    assert calc_diff(d, want) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("groups,m", [(4, 1000), (8, 37)])
def test_m_grouped_fp8_gpu(groups, m):
    n, k = 4096, 1024
    counts = [m + 13 * g for g in range(groups)]
    offs = _offsets(counts)
    x = _randn(sum(counts), k, seed=0)
    w = _randn(groups, n, k, seed=1, scale=0.02)
    xp, m_idx, _ = G.pad_to_contiguous(x, offs)
    a, b = _quant_a(xp), quant_per_block(w)
    deq = R.m_grouped_fp8_gemm_nt_contiguous(a, b, m_idx, torch.float32)
    assert calc_diff(G.m_grouped_fp8_gemm_nt_contiguous(a, b, m_idx, backend="triton"), deq) < 1e-5
    xa = _quant_a(x)
    assert calc_diff(G.m_grouped_fp8_gemm_nt_offsets(xa, b, offs, backend="triton"),
                     R.m_grouped_fp8_gemm_nt_offsets(xa, b, offs, torch.float32)) < 1e-5
    dy = _randn(sum(counts), n, seed=3)
    qa, qb = G.quant_per_group_colwise(dy, offs), G.quant_per_group_colwise(x, offs)
    assert calc_diff(G.k_grouped_fp8_gemm_tn_contiguous(qa, qb, offs, backend="triton"),
                     R.k_grouped_fp8_gemm_tn_contiguous(qa, qb, offs, torch.float32)) < 1e-5


_AOT_SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from primerl.kernels.gemm import triton as T
from primerl.kernels.gemm import triton_fp8 as F

def check(fn, sig, const, div16, stages, warps, label=None):
    sig = dict(sig)
    for k in const:
        sig[k] = "constexpr"
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    kern = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))
    print(label or fn.__name__, kern.metadata.shared, "wgmma" in kern.asm["ptx"])

cfg = T.pick_tiles(4096, 4096, 7168, True, 1)
ptrs = ["a_ptr", "sa_ptr", "b_ptr", "sb_ptr", "d_ptr", "c_ptr", "group_ptr", "row_start_ptr", "row_count_ptr",
        "b_index_ptr"]
sig = dict(zip(ptrs, ["*fp8e4nv", "*fp32", "*fp8e4nv", "*fp32", "*bf16", "*fp32", "*i32", "*i32", "*i32", "*i32"]))
ints = ["M", "N", "K", "num_entries", "num_m_tiles", "num_progs", "stride_am", "stride_bg", "stride_bn",
        "stride_dm", "stride_cm", "stride_sam", "stride_sbg", "stride_sbn"]
sig.update({n: "i32" for n in ints})
const = dict(stride_ak=1, stride_bk=1, MODE=T.MODE_M_INDICES, SCALED=True, HAS_C=False, SB_GRAN=1, MIXED=True,
             ENTRIES_P2=1, BM=cfg["BM"], BN=64, BK=cfg["BK"], PRECISION="tf32")
check(T._m_grouped_gemm_nt_kernel, sig, const, ptrs + ["N", "K"], cfg["num_stages"], cfg["num_warps"],
      label="m_indices_mode")
desc = "tensordesc<fp8e4nv[128, 128]>"
tsig = dict(a_desc=desc, b_desc=desc, sa_ptr="*fp32", sb_ptr="*fp32", d_ptr="*bf16", c_ptr="*fp32", group_ptr="*i32",
            row_start_ptr="*i32", row_count_ptr="*i32", b_index_ptr="*i32")
tsig.update({n: "i32" for n in ["M", "N", "K", "num_entries", "max_m", "num_m_tiles", "num_progs", "stride_dm",
                                "stride_cm", "stride_sam", "stride_sbg", "stride_sbn"]})
tconst = dict(MODE=T.MODE_TABLE, HAS_C=False, SB_GRAN=128, ENTRIES_P2=16, BM=128, BN=128, BK=128, SWIZZLE=8,
              WARP_SPECIALIZE=False, HALVES=2, PIN=True)
check(F._m_grouped_fp8_kernel, tsig, tconst, ["sa_ptr", "sb_ptr", "d_ptr", "N", "K"], cfg["num_stages"], 8)
check(F._m_grouped_fp8_kernel, tsig, dict(tconst, MODE=T.MODE_DENSE, HAS_C=True, HALVES=1), ["d_ptr", "N", "K"],
      cfg["num_stages"], 8, label="dense_with_c")
ksig = dict(a_desc=desc, b_desc=desc, sa_ptr="*fp32", sb_ptr="*fp32", d_ptr="*fp32", c_ptr="*fp32", offsets_ptr="*i32",
            block_start_ptr="*i32")
ksig.update({n: "i32" for n in ["N", "K", "G", "num_progs", "stride_sa", "stride_sb"]})
check(F._k_grouped_fp8_kernel, ksig, dict(HAS_C=False, BN=128, BK=128, BT=128, SWIZZLE=8, PREFETCH_SCALES=False,
                                          HALVES=2, PIN=True),
      ["sa_ptr", "sb_ptr", "N", "K", "stride_sa", "stride_sb"], 4, 8)
qsig = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", sf_ptr="*fp32", offsets_ptr="*i32", block_start_ptr="*i32", T="i32",
            C="i32", G="i32", R="i32", used_blocks_ptr="*i32")
check(T._quant_group_colwise_kernel, qsig, dict(FMAX=448.0, UE8M0=True, RECIPROCAL=True, BT=128, BC=64, G_P2=8,
                                                BLOCKS=True), [], 1, 4)
'''


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="the gpu tests run the real kernels")
def test_triton_kernels_lower_for_hopper():
    """Compile (not run) the FP8 kernels for sm_90 with Triton's bundled ptxas: the interpreter
    never lowers a kernel, so this is what catches compiled-mode errors without a GPU. Expect
    wgmma (tensor cores on fp8) and a software-pipelined K loop (several stages of shared memory)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = dict((ln.split()[0], ln.split()[1:]) for ln in res.stdout.strip().splitlines())
    shared, wgmma = lines["_m_grouped_fp8_kernel"]
    assert wgmma == "True" and int(shared) >= 3 * (128 + 256) * 128  # >= 3 pipelined TMA stages of A + two B boxes
    # the per-group loop of m_indices tiles (any alignment) and the C epilogue keep the wgmma path
    assert lines["m_indices_mode"][1] == "True" and lines["dense_with_c"][1] == "True"
    assert lines["_k_grouped_fp8_kernel"][1] == "True" and "_quant_group_colwise_kernel" in lines


@pytest.mark.parametrize("scaled,elt", [(True, 1), (False, 2), (False, 4)])
def test_gpu_tile_table(scaled, elt):
    """Every GPU tile config fits Hopper's shared memory, keeps BM dividing the 128-row alignment
    (m_indices tiles stay in one group) and BK = 128 for FP8 (one scale block per K step)."""
    from primerl.kernels.gemm.triton import pick_tiles

    for m in [1, 17, 64, 65, 256, 8192]:
        for n, k in [(16, 128), (2112, 7168), (24576, 1536), (7168, 2048), (4096, 7168)]:
            cfg = pick_tiles(m, n, k, scaled, elt, interpreter=False, num_sms=132)
            assert 128 % cfg["BM"] == 0 and cfg["BN"] <= 128 and cfg["BN"] & (cfg["BN"] - 1) == 0
            assert (cfg["BK"] == 128) if scaled else (cfg["BK"] * elt <= 128)
            assert cfg["num_stages"] * (cfg["BM"] + cfg["BN"]) * cfg["BK"] * elt <= 227 * 1024
            assert cfg["num_stages"] >= 2 and cfg["num_warps"] in (4, 8)
            assert cfg["BM"] == pick_tiles(m, n, k, scaled, elt, interpreter=False, num_groups=8, num_sms=132)["BM"]
    # a short wide dense GEMM would fill 17 of 132 SMs with 128-wide tiles
    assert pick_tiles(128, 2112, 7168, True, 1, interpreter=False, num_sms=132)["BN"] == 64


@pytest.mark.parametrize("shape", [(3, 256, 384), (200, 256), (1, 128)])
def test_reference_dequant_matches_fp8_dequant(shape):
    """The GEMM reference's reshaping dequantizers are bitwise the fp8 package's dequant."""
    from primerl.kernels.fp8 import dequant

    w = torch.randn(*shape, generator=_gen(0))
    assert torch.equal(R.dequant_block(*quant_per_block(w)),
                       dequant(*quant_per_block(w), group_shape=(128, 128), out_dtype=torch.float32))
    assert torch.equal(R.dequant_token_group(*quant_per_token_group(w, 128)),
                       dequant(*quant_per_token_group(w, 128), group_shape=(1, 128), out_dtype=torch.float32))


def test_triton_small_tiles(monkeypatch):
    """GPU tile shapes under the interpreter: BN = 32 tiles start inside a 128-column B-scale
    block and BM = 32 tiles split a 128-row aligned group, so scale gathers and group lookup
    are exercised at sub-block granularity."""
    from primerl.kernels.gemm import triton as T

    real = T.pick_tiles
    monkeypatch.setattr(T, "pick_tiles", lambda *a, **kw: {**real(*a, **kw), "BM": 32, "BN": 32})
    x, w = _randn(70, 256, seed=0), _randn(200, 256, seed=1, scale=0.05)
    a, b = _quant_a(x), quant_per_block(w)
    assert calc_diff(G.fp8_gemm_nt(a, b, backend="triton"), R.fp8_gemm_nt(a, b, torch.float32)) < 1e-5
    counts = [37, 0, 2]
    offs = _offsets(counts)
    wg = quant_per_block(_randn(3, 96, 256, seed=2, scale=0.05))
    xs = _randn(sum(counts), 256, seed=3)
    xp, m_idx, _ = G.pad_to_contiguous(xs, offs)
    ap = _poison_rows(_quant_a(xp), m_idx < 0)
    out = G.m_grouped_fp8_gemm_nt_contiguous(ap, wg, m_idx, backend="triton")
    assert calc_diff(out, R.m_grouped_fp8_gemm_nt_contiguous(ap, wg, m_idx, torch.float32)) < 1e-5
    xa = _quant_a(xs)
    out = G.m_grouped_fp8_gemm_nt_offsets(xa, wg, offs, backend="triton")
    assert calc_diff(out, R.m_grouped_fp8_gemm_nt_offsets(xa, wg, offs, torch.float32)) < 1e-5


def test_triton_fp8_tile_bands(monkeypatch):
    """The FP8 kernels walk tiles in bands of 8 M-tiles (k-grouped: N-tiles), the last band
    partial: with 16-row / 16-column tiles, 11 M-tiles x 3 N-tiles and 13 x 4 output tiles cover
    every output once (outputs are NaN-poisoned, so a skipped tile fails)."""
    from primerl.kernels.gemm import triton as T
    from primerl.kernels.gemm import triton_fp8 as F

    real_tiles, real_k = T.pick_tiles, F.k_grouped_tiles
    monkeypatch.setattr(T, "pick_tiles", lambda *a, **kw: {**real_tiles(*a, **kw), "BM": 16, "BN": 32})
    x, w = _randn(170, 256, seed=0), _randn(96, 256, seed=1, scale=0.05)
    a, b = _quant_a(x), quant_per_block(w)
    assert calc_diff(G.fp8_gemm_nt(a, b, backend="triton"), R.fp8_gemm_nt(a, b, torch.float32)) < 1e-5
    monkeypatch.setattr(F, "k_grouped_tiles", lambda *a, **kw: {**real_k(*a, **kw), "BN": 16, "BK": 16})
    counts = [130, 0, 7]
    offs = _offsets(counts)
    dy, xs = _randn(sum(counts), 200, seed=2), _randn(sum(counts), 64, seed=3)
    qa, qb = G.quant_per_group_colwise(dy, offs), G.quant_per_group_colwise(xs, offs)
    out = G.k_grouped_fp8_gemm_tn_contiguous(qa, qb, offs, backend="triton")
    assert calc_diff(out, R.k_grouped_fp8_gemm_tn_contiguous(qa, qb, offs, torch.float32)) < 1e-5
