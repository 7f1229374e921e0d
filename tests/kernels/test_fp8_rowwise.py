"""The "rowwise" FP8 training recipe (primerl.kernels.fp8_rowwise via fp8_training / moe).

CPU: the dequantizing emulation against float64 references (SQNR, the metric of
test_fp8_training.py: >= 25 dB for the output and every gradient), the 16-aligned group padding
bitwise, the emulated 2D x 2D grouped GEMM bitwise against a per-group loop.
GPU: torch._scaled_mm / torch._scaled_grouped_mm against the same emulation on the device
(calc_diff < 1e-5: both are float32 accumulations of the same FP8 products, rounded to bf16).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from primerl.kernels import fp8_rowwise as RW
from primerl.kernels import gemm as G
from primerl.kernels.fp8_training import Fp8Linear, convert_to_fp8, fp8_linear
from primerl.kernels.testing import assert_bitwise_equal, calc_diff, sqnr_db

from fp8_testing import check_grouped_linear_against_float64, leaf as _leaf, randn as _randn  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MIN_SQNR_DB = 25.0


def test_rowwise_linear_matches_float64():
    batch, seq, k, n = 3, 13, 256, 128  # 39 tokens: the wgrad pads them to 48
    x, w, bias = _randn(batch, seq, k, seed=0), _randn(n, k, seed=1, scale=0.05), _randn(n, seed=2)
    grad = _randn(batch, seq, n, seed=3)
    xf, wf, bf = _leaf(x), _leaf(w), _leaf(bias)
    y = fp8_linear(xf, wf, bf, recipe="rowwise")
    y.backward(grad)
    xr, wr, br = _leaf(x.double()), _leaf(w.double()), _leaf(bias.double())
    (xr @ wr.t() + br).backward(grad.double())
    assert y.dtype == torch.bfloat16 and wf.grad.dtype == w.dtype
    yr = xr.detach() @ wr.detach().t() + br.detach()
    for name, got, ref in [("y", y, yr), ("dx", xf.grad, xr.grad), ("dw", wf.grad, wr.grad), ("db", bf.grad, br.grad)]:
        assert sqnr_db(ref.detach(), got.detach()) >= MIN_SQNR_DB, name


@pytest.mark.parametrize("counts,tail", [([37, 0, 130, 1], 3), ([16, 16], 0), ([5], 0)])
def test_rowwise_grouped_linear_matches_float64(counts, tail):
    check_grouped_linear_against_float64(counts, tail, MIN_SQNR_DB, recipe="rowwise")


@pytest.mark.parametrize("counts,tail", [([37, 0, 130, 1], 3), ([16, 32], 0), ([0, 0], 5), ([1], 0)])
def test_pad_groups_bitwise(counts, tail):
    total = sum(counts)
    x = torch.arange((total + tail) * 3, dtype=torch.float32).view(-1, 3) + 1
    offsets = G.counts_to_offsets(torch.tensor(counts, dtype=torch.int32))
    xp, offs_pad = RW.pad_groups(x, offsets, 16)
    assert xp.shape == (-(-(total + tail + 15 * len(counts)) // 16) * 16, 3) and offs_pad.dtype == torch.int32
    want_ends, start, pad_start = [], 0, 0
    want = torch.zeros_like(xp)
    for c in counts:
        want[pad_start:pad_start + c] = x[start:start + c]
        start += c
        pad_start += -(-c // 16) * 16
        want_ends.append(pad_start)
    assert offs_pad.tolist() == want_ends and all(e % 16 == 0 for e in want_ends)
    assert_bitwise_equal(xp, want, "padded rows")
    xt, offs_t = RW.pad_groups_t(x, offsets, 16)
    assert torch.equal(offs_t, offs_pad) and xt.is_contiguous()
    assert_bitwise_equal(xt, want.t().contiguous(), "padded transposed")
    if tail == 0:
        assert_bitwise_equal(RW.pad_groups_t(x, offsets, 16, tail=False)[0], xt, "no-tail promise")


def test_q_transposed_is_bitwise_the_transposed_quantization():
    w = _randn(3, 48, 32, seed=4, device="cpu") * 5
    got = RW._q_transposed(w)
    want = RW._q(w.transpose(-2, -1))
    assert_bitwise_equal(got[0], want[0], "q")
    assert_bitwise_equal(got[1], want[1].view(3, 32), "scale")


def test_emulated_k_grouped_matches_per_group_loop():
    from primerl.kernels.fp8 import quant_rowwise

    g = torch.Generator().manual_seed(0)
    offsets = torch.tensor([16, 16, 48, 64], dtype=torch.int32)
    a, b = torch.randn(8, 64, generator=g), torch.randn(24, 64, generator=g)
    aq, as_ = quant_rowwise(a)
    bq, bs = quant_rowwise(b)
    sa = torch.rand(4 * 8, generator=g) + 0.5  # distinct per-group scales: the emulation's indexing
    sb = torch.rand(4 * 24, generator=g) + 0.5
    out = RW.scaled_k_grouped_mm(aq, sa, bq, sb, offsets)
    start = 0
    for grp, end in enumerate(offsets.tolist()):
        a_g = aq[:, start:end].float() * sa[grp * 8:(grp + 1) * 8, None]
        b_g = bq[:, start:end].float() * sb[grp * 24:(grp + 1) * 24, None]
        assert_bitwise_equal(out[grp], (a_g @ b_g.t()).to(torch.bfloat16), f"group {grp}")
        start = end


def test_convert_to_fp8_rowwise():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128), nn.GELU(), nn.Linear(128, 256))
    x = torch.randn(24, 256)
    y_ref = model(x)
    convert_to_fp8(model, "rowwise")
    assert isinstance(model[0], Fp8Linear) and model[0].recipe == "rowwise"
    y = model(x)
    assert sqnr_db(y_ref.detach(), y.detach()) >= MIN_SQNR_DB
    y.sum().backward()  # a stride-0 gradient
    assert not model[0].weight.grad.isnan().any() and model[0].weight.grad.dtype == torch.float32


# ------------------------------------------------------------------------------ GPU


def _emulated(fn, *args):
    """Run ``fn`` with the dequantizing emulation on the same device and operands."""
    with RW.emulated():
        return fn(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("counts", [[37, 0, 130, 1], [512, 512, 256, 768]])
def test_rowwise_kernels_match_emulation_gpu(counts):
    k, n = 512, 1024
    offsets = G.counts_to_offsets(torch.tensor(counts, dtype=torch.int32)).cuda()
    total = sum(counts)
    x, w = _randn(total, k, seed=0), _randn(len(counts), n, k, seed=1, scale=0.05)
    dy = _randn(total, n, seed=2)
    for name, fn, args in [("forward", RW.grouped_forward, (x, w, offsets)),
                           ("dgrad", RW.grouped_dgrad, (dy, w, offsets)),
                           ("wgrad", RW.grouped_wgrad, (dy, x, offsets))]:
        got, want = fn(*args), _emulated(fn, *args)
        assert calc_diff(got, want) < 1e-5, name
    wd = _randn(n, k, seed=3, scale=0.05)
    xq, xs = RW._q(x)
    wq, ws = RW._q(wd)
    assert calc_diff(RW.scaled_mm(xq, xs, wq, ws), _emulated(RW.scaled_mm, xq, xs, wq, ws)) < 1e-5


@pytest.mark.gpu
def test_rowwise_training_matches_float64_gpu():
    x, w = _randn(300, 1024, seed=0), _randn(2048, 1024, seed=1, scale=0.05)
    grad = _randn(300, 2048, seed=2)
    xf, wf = _leaf(x), _leaf(w)
    fp8_linear(xf, wf, recipe="rowwise").backward(grad)
    xr, wr = _leaf(x.double()), _leaf(w.double())
    (xr @ wr.t()).backward(grad.double())
    assert sqnr_db(xr.grad, xf.grad) >= MIN_SQNR_DB and sqnr_db(wr.grad, wf.grad) >= MIN_SQNR_DB
