"""primerl.kernels.lora: lora_linear and grouped_lora, every backend, forward and every gradient.

Metric (flash-attention's rule): against a float64 evaluation of the same formula on the same
inputs, a backend's max abs error may be at most twice that of plain PyTorch at the input dtype,
plus 1e-6 of the reference's largest magnitude (so float32 cases at ~1e-7 relative do not trip on
a rounding). FP8 bases: DeepGEMM's calc_diff < 1e-5 against the torch backend (same quantized
operands) and < 1e-3 against the unquantized product. Inputs are drawn fresh per case; torch.empty
outputs are NaN-poisoned (tests/conftest.py); rows outside every group hold NaN and must not leak.
The Triton backend runs under TRITON_INTERPRET=1 on CPU (the conftest sets it) at small shapes.
"""

from __future__ import annotations

import pytest
import torch

from primerl.kernels import backend_status
from primerl.kernels import gemm as G
from primerl.kernels.fp8 import quant_per_block
from primerl.kernels.lora import grouped_lora, lora_linear
from primerl.kernels.lora import reference as R
from primerl.kernels.testing import calc_diff

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not backend_status("triton").available, reason="triton unavailable"))]
NAN = float("nan")


def _randn(*shape, seed, dtype=torch.float32, scale=1.0, grad=True):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    return t.to(dtype).to(DEV).requires_grad_(grad)


def _fwd_bwd(fn, inputs, grad_out_seed: int):
    """fn(*inputs) and the gradients of <y, g> for a fixed random g w.r.t. the inputs that require
    grad (in order)."""
    y = fn(*inputs)
    g = _randn(*y.shape, seed=grad_out_seed, dtype=y.dtype, grad=False)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(y, leaves, g) if leaves else ()
    return [y.detach(), *grads]


def _as(inputs, dtype):
    return [t.detach().to(dtype).requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor)
            and t.dtype.is_floating_point else t for t in inputs]


def _assert_close(name, got, ref64, torch_at_dtype):
    """got: a backend's tensors; ref64: float64 evaluation; torch_at_dtype: PyTorch at the dtype."""
    assert len(got) == len(ref64) == len(torch_at_dtype), name
    for i, (g, r, t) in enumerate(zip(got, ref64, torch_at_dtype)):
        assert g.shape == r.shape and g.dtype == t.dtype, f"{name}[{i}]: {g.shape}/{g.dtype} vs {r.shape}/{t.dtype}"
        assert torch.isfinite(g).all(), f"{name}[{i}]: non-finite values (an unwritten output?)"
        err = (g.double() - r).abs().max().item() if g.numel() else 0.0
        err_torch = (t.double() - r).abs().max().item() if t.numel() else 0.0
        floor = 1e-6 * (r.abs().max().item() if r.numel() else 0.0)
        assert err <= 2 * err_torch + floor, f"{name}[{i}]: max abs error {err:.3e} > 2 x torch's {err_torch:.3e} + " \
                                             f"{floor:.1e}"


def _check_against_float64(name, fn_backend, fn_torch, inputs, seed):
    """fn_backend at the inputs' dtype vs fn_torch in float64 and at the dtype (same inputs)."""
    got = _fwd_bwd(fn_backend, inputs, seed)
    ref = _fwd_bwd(fn_torch, _as(inputs, torch.float64), seed)
    at_dtype = _fwd_bwd(fn_torch, inputs, seed)
    _assert_close(name, got, ref, at_dtype)


# ------------------------------------------------------------------------------ lora_linear


def _plain_lora_linear(x, w, a, b, scale, bias=None):
    """The formula itself (x [..., d]): x @ W.T + scale * (x @ A.T) @ B.T (+ bias)."""
    y = x @ w.t() + scale * ((x @ a.t()) @ b.t())
    return y if bias is None else y + bias


# (lead shape of x, d, n, r): one row, primes, rank 1, a rank over one tile, leading dims
LINEAR_SHAPES = [((1,), 16, 8, 1), ((7,), 33, 17, 5), ((2, 9), 64, 48, 8), ((37,), 32, 40, 20)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead,d,n,r", LINEAR_SHAPES)
def test_lora_linear_matches_float64(backend, dtype, lead, d, n, r):
    seed = hash((lead, d, n, r)) % 1000
    x = _randn(*lead, d, seed=seed, dtype=dtype)
    w = _randn(n, d, seed=seed + 1, dtype=dtype, grad=False)  # frozen base: no weight gradient
    a = _randn(r, d, seed=seed + 2, dtype=dtype, scale=d ** -0.5)
    b = _randn(n, r, seed=seed + 3, dtype=dtype)
    _check_against_float64(
        f"lora_linear[{backend}, {dtype}]", lambda *t: lora_linear(*t, 0.75, backend=backend),
        lambda *t: _plain_lora_linear(*t, 0.75), [x, w, a, b], seed + 4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear_trainable_base_and_bias_get_gradients(backend, dtype):
    x, w = _randn(11, 24, seed=1, dtype=dtype), _randn(20, 24, seed=2, dtype=dtype)
    a, b, bias = _randn(4, 24, seed=3, dtype=dtype), _randn(20, 4, seed=4, dtype=dtype), _randn(20, seed=5, dtype=dtype)
    _check_against_float64(
        f"lora_linear(weight, bias)[{backend}]",
        lambda x, w, a, b, bias: lora_linear(x, w, a, b, 2.0, bias=bias, backend=backend),
        lambda x, w, a, b, bias: _plain_lora_linear(x, w, a, b, 2.0, bias), [x, w, a, b, bias], 6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_linear_only_adapter_gradients(backend):
    """x frozen too (a first layer): the adapters still get their gradients, nothing else is asked."""
    x, w = _randn(6, 16, seed=7, grad=False), _randn(12, 16, seed=8, grad=False)
    a, b = _randn(2, 16, seed=9), _randn(12, 2, seed=10)
    _check_against_float64(f"lora_linear(adapters only)[{backend}]", lambda *t: lora_linear(*t, 0.5, backend=backend),
                           lambda *t: _plain_lora_linear(*t, 0.5), [x, w, a, b], 11)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_linear_no_rows(backend):
    x = _randn(0, 16, seed=1)
    a, b = _randn(4, 16, seed=2), _randn(8, 4, seed=3)
    y = lora_linear(x, _randn(8, 16, seed=4, grad=False), a, b, 1.0, backend=backend)
    assert y.shape == (0, 8)
    da, db = torch.autograd.grad(y.sum(), (a, b))
    assert torch.equal(da, torch.zeros_like(a)) and torch.equal(db, torch.zeros_like(b))


# ------------------------------------------------------------------------------ FP8 bases


def _fp8_inputs(seed, m=9, d=256, n=128, r=8):
    x = _randn(m, d, seed=seed, dtype=torch.bfloat16)
    w = _randn(n, d, seed=seed + 1, scale=0.1, grad=False)
    a = _randn(r, d, seed=seed + 2, dtype=torch.bfloat16, scale=d ** -0.5)
    b = _randn(n, r, seed=seed + 3, dtype=torch.bfloat16)
    return x, w, a, b


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_linear_fp8_weight(backend):
    """A frozen block-FP8 base (quant_per_block's (wq, wsf)): the backend agrees with the torch
    backend (same quantized operands) and with the unquantized product; dx goes through the FP8
    dgrad, dA / dB are exact LoRA gradients."""
    x, w, a, b = _fp8_inputs(3)
    wq = quant_per_block(w)
    got = _fwd_bwd(lambda x, a, b: lora_linear(x, wq, a, b, 2.0, backend=backend), [x, a, b], 4)
    want = _fwd_bwd(lambda x, a, b: lora_linear(x, wq, a, b, 2.0, backend="torch"), [x, a, b], 4)
    exact = _fwd_bwd(lambda x, a, b: _plain_lora_linear(x.double(), w.double(), a.double(), b.double(), 2.0),
                     [x, a, b], 4)
    for i, (g, t, e) in enumerate(zip(got, want, exact)):
        assert g.dtype == torch.bfloat16 and torch.isfinite(g).all()
        assert calc_diff(g, t) < 1e-5, f"[{i}] vs torch backend: {calc_diff(g, t):.2e}"
        assert calc_diff(g, e) < 1e-3, f"[{i}] vs unquantized: {calc_diff(g, e):.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
def test_lora_linear_fp8_recipe(backend, recipe):
    """A 16/32-bit base run by fp8_training.fp8_linear (an Fp8Linear's base): its weight, if
    trainable, gets fp8_linear's gradient."""
    x, w, a, b = _fp8_inputs(5)
    w = w.to(torch.bfloat16).requires_grad_()
    got = _fwd_bwd(lambda *t: lora_linear(*t, 0.5, fp8_recipe=recipe, backend=backend), [x, w, a, b], 6)
    exact = _fwd_bwd(lambda *t: _plain_lora_linear(*(u.double() for u in t), 0.5), [x, w, a, b], 6)
    assert len(got) == 5
    for i, (g, e) in enumerate(zip(got, exact)):
        assert torch.isfinite(g).all() and calc_diff(g, e) < 1e-3, f"[{i}] vs unquantized: {calc_diff(g, e):.2e}"


# ------------------------------------------------------------------------------ grouped_lora

# rows per expert: one expert, empty experts, one-row experts, ragged, a group crossing tiles
GROUP_COUNTS = [[5], [0, 3, 0], [1, 1, 1], [37, 0, 61, 2], [130, 6]]


def _offsets(counts):
    return G.counts_to_offsets(torch.tensor(counts, dtype=torch.int32)).to(DEV)


def _grouped_inputs(counts, seed, dtype, d=32, n=24, r=4, tail=0):
    m = sum(counts) + tail
    x = _randn(m, d, seed=seed, dtype=dtype)
    if tail:
        with torch.no_grad():
            x[sum(counts):] = NAN  # rows in no group: never read
    a = _randn(len(counts), r, d, seed=seed + 1, dtype=dtype, scale=d ** -0.5)
    b = _randn(len(counts), n, r, seed=seed + 2, dtype=dtype)
    return x, a, b


def _loop_of_lora_linear(x, a, b, scale, offsets):
    """The per-expert loop of lora_linear (zero base): the spec grouped_lora must equal."""
    out, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        zero_w = torch.zeros(b.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
        out.append(lora_linear(x[start:end], zero_w, a[e], b[e], scale, backend="torch"))
        start = end
    tail = x.shape[0] - start
    return torch.cat(out + [x.new_zeros(tail, b.shape[1])]) if tail else torch.cat(out)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", GROUP_COUNTS)
def test_grouped_lora_offsets_matches_a_loop_of_lora_linear(backend, dtype, counts):
    seed = 10 * len(counts) + sum(counts)
    x, a, b = _grouped_inputs(counts, seed, dtype)
    offs = _offsets(counts)
    _check_against_float64(
        f"grouped_lora(offsets)[{backend}, {dtype}, {counts}]",
        lambda x, a, b: grouped_lora(x, a, b, 1.5, offsets=offs, backend=backend),
        lambda x, a, b: _loop_of_lora_linear(x, a, b, 1.5, offs), [x, a, b], seed + 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_lora_tail_rows_are_zero_and_never_read(backend):
    counts, tail = [4, 0, 9], 5
    x, a, b = _grouped_inputs(counts, 21, torch.float32, tail=tail)
    offs = _offsets(counts)
    y = grouped_lora(x, a, b, 0.5, offsets=offs, backend=backend)
    m = sum(counts)
    assert torch.equal(y[m:], torch.zeros_like(y[m:]))
    dx, da, db = torch.autograd.grad(y, (x, a, b), torch.randn_like(y))
    assert torch.equal(dx[m:], torch.zeros_like(dx[m:])), "gradient of rows in no group"
    assert all(torch.isfinite(t).all() for t in (y, dx[:m], da, db))
    want = _loop_of_lora_linear(x[:m].detach(), a.detach(), b.detach(), 0.5, offs)
    assert (y[:m] - want).abs().max() <= 1e-5 * want.abs().max()


def _m_indices_layout(counts, alignment=128):
    """The aligned contiguous layout: every expert's rows start on a multiple of ``alignment``,
    padding rows -1."""
    mi = []
    for e, c in enumerate(counts):
        padded = -(-c // alignment) * alignment
        mi += [e] * c + [-1] * (padded - c)
    return torch.tensor(mi, dtype=torch.int32).to(DEV)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[60, 0, 30], [128, 1]])
def test_grouped_lora_m_indices_matches_offsets(backend, dtype, counts):
    """m_indices with -1 padding rows (NaN inputs there) equals the packed offsets result scattered
    into the padded layout; gradients likewise."""
    mi = _m_indices_layout(counts)
    x, a, b = _grouped_inputs([mi.numel()], 31, dtype)
    a, b = (_randn(len(counts), *t.shape[1:], seed=32 + i, dtype=dtype) for i, t in enumerate((a, b)))
    with torch.no_grad():
        x[mi < 0] = NAN
    got = _fwd_bwd(lambda x, a, b: grouped_lora(x, a, b, 0.5, m_indices=mi, backend=backend), [x, a, b], 33)
    valid = mi >= 0
    assert torch.equal(got[0][~valid], torch.zeros_like(got[0][~valid]))
    assert torch.equal(got[1][~valid], torch.zeros_like(got[1][~valid]))
    offs = _offsets(counts)
    packed = x.detach()[valid].requires_grad_()

    def packed_then_scattered(xp, a, b):
        return xp.new_zeros(x.shape[0], b.shape[1]).index_put((valid.nonzero()[:, 0],),
                                                             _loop_of_lora_linear(xp, a, b, 0.5, offs))

    ref = _fwd_bwd(packed_then_scattered, _as([packed, a, b], torch.float64), 33)
    at_dtype = _fwd_bwd(packed_then_scattered, [packed, a, b], 33)
    got[1] = got[1][valid]
    _assert_close(f"grouped_lora(m_indices)[{backend}, {dtype}]", got, ref, at_dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_lora_is_the_lora_of_routed_experts(backend):
    """Grouped base GEMM + grouped_lora == the per-expert loop of lora_linear with each expert's
    own base weight (how apply_lora adds adapters to fused experts)."""
    counts = [7, 0, 12, 3]
    x, a, b = _grouped_inputs(counts, 41, torch.float32)
    w = _randn(len(counts), b.shape[1], x.shape[1], seed=44, grad=False)
    offs = _offsets(counts)

    def grouped(x, a, b):
        return G.grouped_gemm_nt(x, w, offs, layout="offsets") + grouped_lora(x, a, b, 2.0, offsets=offs,
                                                                              backend=backend)

    def loop(x, a, b):
        bounds = [0] + offs.tolist()
        return torch.cat([lora_linear(x[s:e], w[i], a[i], b[i], 2.0, backend=backend)
                          for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))])

    got, want = _fwd_bwd(grouped, [x, a, b], 45), _fwd_bwd(loop, [x, a, b], 45)
    for i, (g, t) in enumerate(zip(got, want)):
        assert (g - t).abs().max() <= 1e-5 * t.abs().max(), f"[{i}]"


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_lora_no_rows_and_no_routed_rows(backend):
    a, b = _randn(3, 4, 16, seed=1), _randn(3, 8, 4, seed=2)
    for x, offs in ((_randn(0, 16, seed=3), _offsets([0, 0, 0])), (_randn(5, 16, seed=4), _offsets([0, 0, 0]))):
        y = grouped_lora(x, a, b, 1.0, offsets=offs, backend=backend)
        assert torch.equal(y, torch.zeros(x.shape[0], 8, device=DEV))
        dx, da, db = torch.autograd.grad(y, (x, a, b), torch.ones_like(y))
        assert all(torch.equal(t, torch.zeros_like(t)) for t in (dx, da, db))


def test_grouped_lora_loop_reference_is_the_loop():
    """reference.grouped_lora_loop (the bench baseline) equals the loop of lora_linear."""
    counts = [3, 0, 5]
    x, a, b = _grouped_inputs(counts, 51, torch.float32)
    offs = _offsets(counts)
    assert torch.allclose(R.grouped_lora_loop(x, a, b, 0.5, offs), _loop_of_lora_linear(x, a, b, 0.5, offs))


# ------------------------------------------------------------------------------ bad input


def _good_linear():
    return dict(x=torch.randn(3, 16), weight=torch.randn(8, 16), lora_a=torch.randn(4, 16), lora_b=torch.randn(8, 4),
                scale=0.5)


@pytest.mark.parametrize("change,error,match", [
    (dict(x=torch.randn(3, 15)), ValueError, r"lora_linear: weight must be \[n, d\] with d = 15"),
    (dict(lora_a=torch.randn(4, 15)), ValueError, r"lora_a \[r, d\] must have d = 16"),
    (dict(lora_b=torch.randn(8, 5)), ValueError, r"lora_b \[n, r\] must have r = 4"),
    (dict(lora_b=torch.randn(9, 4)), ValueError, r"lora_b must be \[n, r\] with n = 8"),
    (dict(lora_a=torch.randn(0, 16), lora_b=torch.randn(8, 0)), ValueError, r"rank r >= 1"),
    (dict(lora_a=torch.randn(4, 16, 1)), ValueError, r"lora_a must have 2 dims"),
    (dict(lora_a=torch.randn(4, 16).double()), ValueError, r"lora_a dtype must be one of"),
    (dict(weight=torch.randn(8, 16).bfloat16()), ValueError, r"weight dtype must be one of"),
    (dict(x=torch.randn(3, 16).to(torch.int32)), ValueError, r"x dtype must be one of"),
    (dict(scale=torch.tensor(0.5)), TypeError, r"scale must be a Python float"),
    (dict(bias=torch.randn(9)), ValueError, r"bias must be \[n\] = \(8,\)"),
    (dict(fp8_recipe="tensorwise"), ValueError, r"fp8_recipe must be None or one of"),
    (dict(backend="cuda"), ValueError, r"backend 'cuda' is not implemented"),
])
def test_lora_linear_bad_input(change, error, match):
    args = {**_good_linear(), **change}
    with pytest.raises(error, match=match):
        lora_linear(args.pop("x"), args.pop("weight"), args.pop("lora_a"), args.pop("lora_b"), args.pop("scale"),
                    **args)


def test_lora_linear_bad_fp8_weight():
    x, a, b = torch.randn(3, 256), torch.randn(4, 256), torch.randn(128, 4)
    wq, wsf = quant_per_block(torch.randn(128, 256))
    with pytest.raises(ValueError, match=r"weight\[1\] \(wsf\) must be the 128x128 block scales \(1, 2\)"):
        lora_linear(x, (wq, wsf.t()), a, b, 1.0)
    with pytest.raises(ValueError, match=r"weight\[0\] \(wq\) dtype must be one of"):
        lora_linear(x, (wq.float(), wsf), a, b, 1.0)
    with pytest.raises(ValueError, match="multiples of 128"):
        lora_linear(torch.randn(3, 64), quant_per_block(torch.randn(128, 64)), torch.randn(4, 64), b, 1.0)
    with pytest.raises(ValueError, match="already FP8"):
        lora_linear(x, (wq, wsf), a, b, 1.0, fp8_recipe="blockwise")
    with pytest.raises(TypeError, match="an FP8 weight is a pair"):
        lora_linear(x, (wq, wsf, wsf), a, b, 1.0)


def _good_grouped():
    return dict(x=torch.randn(6, 16), lora_a=torch.randn(3, 4, 16), lora_b=torch.randn(3, 8, 4), scale=0.5,
                offsets=torch.tensor([2, 2, 6], dtype=torch.int32))


@pytest.mark.parametrize("change,error,match", [
    (dict(lora_a=torch.randn(3, 4, 15)), ValueError, r"lora_a \[E, r, d\] must have d = 16"),
    (dict(lora_b=torch.randn(3, 8, 5)), ValueError, r"lora_b \[E, n, r\] must have r = 4"),
    (dict(lora_b=torch.randn(2, 8, 4)), ValueError, r"the same experts E"),
    (dict(lora_a=torch.randn(4, 16)), ValueError, r"lora_a must have 3 dims"),
    (dict(x=torch.randn(2, 3, 16)), ValueError, r"x must have 2 dims"),
    (dict(lora_b=torch.randn(3, 8, 4).bfloat16()), ValueError, r"lora_b dtype must be one of"),
    (dict(offsets=torch.tensor([2, 6], dtype=torch.int32)), ValueError, r"offsets must have 3 entries"),
    (dict(offsets=torch.tensor([2, 1, 6], dtype=torch.int32)), ValueError, r"offsets must be non-decreasing"),
    (dict(offsets=torch.tensor([2, 2, 7], dtype=torch.int32)), ValueError, r"at most the rows of the input"),
    (dict(offsets=torch.tensor([2.0, 2.0, 6.0])), ValueError, r"offsets must be a 1-D int32 tensor"),
    (dict(m_indices=torch.zeros(6, dtype=torch.int32)), ValueError, r"exactly one of offsets= .* or m_indices="),
    (dict(offsets=None), ValueError, r"exactly one of offsets="),
    (dict(offsets=None, m_indices=torch.tensor([0, 0, 3, 1, 1, -1], dtype=torch.int32)), ValueError,
     r"m_indices values must be in \[-1, 3\)"),
    (dict(offsets=None, m_indices=torch.zeros(5, dtype=torch.int32)), ValueError, r"m_indices must have 6 entries"),
    (dict(scale=True), TypeError, r"scale must be a Python float"),
])
def test_grouped_lora_bad_input(change, error, match):
    args = {**_good_grouped(), **change}
    with pytest.raises(error, match=match):
        grouped_lora(args.pop("x"), args.pop("lora_a"), args.pop("lora_b"), args.pop("scale"), **args)


@pytest.mark.skipif(not backend_status("triton").available, reason="triton unavailable")
def test_grouped_lora_triton_wants_the_aligned_m_indices_layout():
    a, b = torch.randn(2, 4, 16, device=DEV), torch.randn(2, 8, 4, device=DEV)
    with pytest.raises(ValueError, match=r"aligned contiguous layout \(M a multiple of 128"):
        grouped_lora(torch.randn(6, 16, device=DEV), a, b, 1.0, m_indices=torch.zeros(6, dtype=torch.int32,
                                                                                       device=DEV), backend="triton")
    mixed = torch.cat([torch.zeros(100), torch.ones(28)]).to(torch.int32).to(DEV)  # two experts in one block
    with pytest.raises(ValueError, match=r"every 128-row block of m_indices must hold one group"):
        grouped_lora(torch.randn(128, 16, device=DEV), a, b, 1.0, m_indices=mixed, backend="triton")
    # on torch any order is fine
    grouped_lora(torch.randn(128, 16, device=DEV), a, b, 1.0, m_indices=mixed.flip(0), backend="torch")


# ------------------------------------------------------------------------------ GPU


# The launch configurations a GPU picks (BM 64, shrink BK 64, expand BN 128, the rank in one tile
# up to 64 and in two at 128), rows not multiples of a tile, ragged experts with an empty one.
@pytest.mark.gpu
@pytest.mark.parametrize("m,d,n,r", [(4096, 2048, 1024, 16), (1000, 1024, 2112, 64), (77, 512, 384, 128)])
def test_lora_linear_triton_gpu(m, d, n, r):
    x = _randn(m, d, seed=1, dtype=torch.bfloat16)
    w = _randn(n, d, seed=2, dtype=torch.bfloat16, scale=d ** -0.5, grad=False)
    a = _randn(r, d, seed=3, dtype=torch.bfloat16, scale=d ** -0.5)
    b = _randn(n, r, seed=4, dtype=torch.bfloat16, scale=0.1)
    _check_against_float64(f"lora_linear[triton gpu {m}x{d}x{n} r{r}]",
                           lambda *t: lora_linear(*t, 2.0, backend="triton"), lambda *t: _plain_lora_linear(*t, 2.0),
                           [x, w, a, b], 5)


@pytest.mark.gpu
@pytest.mark.parametrize("counts,r", [([1000, 0, 3000, 17, 96], 16), ([640, 2, 0, 1900], 64)])
def test_grouped_lora_triton_gpu(counts, r):
    x, a, b = _grouped_inputs(counts, 6, torch.bfloat16, d=2048, n=768, r=r, tail=40)
    offs = _offsets(counts)
    m = sum(counts)
    _check_against_float64(f"grouped_lora[triton gpu {counts} r{r}]",
                           lambda x, a, b: grouped_lora(x, a, b, 0.5, offsets=offs, backend="triton")[:m],
                           lambda x, a, b: _loop_of_lora_linear(x[:m], a, b, 0.5, offs), [x, a, b], 7)
    mi = _m_indices_layout(counts)
    xp = _randn(mi.numel(), 2048, seed=8, dtype=torch.bfloat16, grad=False)
    with torch.no_grad():
        y = grouped_lora(xp, a, b, 0.5, m_indices=mi, backend="triton")
        want = grouped_lora(xp, a, b, 0.5, m_indices=mi, backend="torch")
    assert calc_diff(y, want) < 1e-5 and torch.equal(y[mi < 0], torch.zeros_like(y[mi < 0]))
