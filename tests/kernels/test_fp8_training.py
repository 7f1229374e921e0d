"""primerl.kernels.fp8_training: FP8 linear / grouped linear with autograd, convert_to_fp8.

Metric: SQNR (dB) of the FP8 forward output and of both gradients against the same computation
in bf16 inputs with float64 math, >= 25 dB for both recipes and both backends.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from primerl.kernels import gemm as G
from primerl.kernels.fp8_training import Fp8Linear, convert_to_fp8, fp8_grouped_linear, fp8_linear
from primerl.kernels.testing import sqnr_db

from fp8_testing import check_grouped_linear_against_float64, leaf as _leaf, randn as _randn  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "triton"]
RECIPES = ["blockwise", "blockwise_fp8_wgrad"]
MIN_SQNR_DB = 25.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_matches_bf16(backend, recipe):
    batch, seq, k, n = 3, 13, 256, 128  # 39 rows: not a multiple of any block
    x, w, bias = _randn(batch, seq, k, seed=0), _randn(n, k, seed=1, scale=0.05), _randn(n, seed=2)
    grad = _randn(batch, seq, n, seed=3)
    xf, wf, bf = _leaf(x), _leaf(w), _leaf(bias)
    y = fp8_linear(xf, wf, bf, recipe=recipe, backend=backend)
    y.backward(grad)
    xr, wr, br = _leaf(x.double()), _leaf(w.double()), _leaf(bias.double())
    yr = xr @ wr.t() + br
    yr.backward(grad.double())
    assert y.dtype == torch.bfloat16 and y.shape == (batch, seq, n)
    assert wf.grad.dtype == w.dtype and xf.grad.shape == x.shape
    for name, got, ref in [("y", y, yr), ("dx", xf.grad, xr.grad), ("dw", wf.grad, wr.grad), ("db", bf.grad, br.grad)]:
        assert sqnr_db(ref.detach(), got.detach()) >= MIN_SQNR_DB, name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_grouped_linear_matches_bf16(backend, recipe):
    check_grouped_linear_against_float64([37, 0, 130, 1], 3, MIN_SQNR_DB, recipe=recipe, backend=backend)


def test_recipes_differ_only_in_wgrad():
    x, w = _randn(40, 128, seed=0), _randn(128, 128, seed=1, scale=0.05)
    grad = _randn(40, 128, seed=2)
    out = {}
    for recipe in RECIPES:
        xf, wf = _leaf(x), _leaf(w)
        fp8_linear(xf, wf, recipe=recipe, backend="torch").backward(grad)
        out[recipe] = (xf.grad, wf.grad)
    assert torch.equal(out["blockwise"][0], out["blockwise_fp8_wgrad"][0])
    assert not torch.equal(out["blockwise"][1], out["blockwise_fp8_wgrad"][1])
    exact = grad.double().t() @ x.double()
    assert sqnr_db(exact, out["blockwise"][1]) > sqnr_db(exact, out["blockwise_fp8_wgrad"][1])


def test_frozen_weight_skips_wgrad():
    x, w = _leaf(_randn(40, 128, seed=0)), _randn(128, 128, seed=1, scale=0.05)
    fp8_linear(x, w, backend="torch").sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape and w.grad is None
    xg, wg = _randn(40, 128, seed=2), _leaf(_randn(2, 128, 128, seed=3, scale=0.05))
    fp8_grouped_linear(xg, wg, torch.tensor([10, 40], dtype=torch.int32, device=DEV), backend="torch").sum().backward()
    assert wg.grad is not None and wg.grad.shape == wg.shape and not wg.grad.isnan().any()


def test_input_errors():
    x, w = _randn(4, 256, seed=0), _randn(100, 256, seed=1)
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_linear(x, w)
    with pytest.raises(ValueError, match="recipe"):
        fp8_linear(x, _randn(128, 256, seed=1), recipe="tensorwise")
    with pytest.raises(ValueError, match="offsets"):
        fp8_grouped_linear(x, _randn(2, 128, 256, seed=1), torch.tensor([4], dtype=torch.int32, device=DEV))


def test_custom_ops_pass_opcheck():
    x, w = _randn(40, 128, seed=0), _randn(128, 128, seed=1, scale=0.05)
    offsets = torch.tensor([10, 40], dtype=torch.int32, device=DEV)
    torch.library.opcheck(torch.ops.primerl.fp8_linear_fwd.default, (x, _leaf(w), "blockwise", "torch"))
    torch.library.opcheck(torch.ops.primerl.fp8_grouped_linear_fwd.default,
                          (x, _leaf(_randn(2, 128, 128, seed=2)), offsets, "blockwise_fp8_wgrad", "torch"))


@pytest.mark.no_poison
def test_torch_compile_traces_fp8_ops():
    torch._dynamo.reset()
    lin = nn.Linear(128, 128, bias=True).to(DEV)
    convert_to_fp8(lin)
    w_g = nn.Parameter(_randn(2, 128, 128, seed=3, dtype=torch.float32))
    offsets = torch.tensor([5, 20], dtype=torch.int32, device=DEV)

    def step(x):
        return fp8_grouped_linear(lin(x), w_g, offsets, recipe="blockwise_fp8_wgrad").square().mean()

    x = _randn(20, 128, seed=4, dtype=torch.float32)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss = compiled(x)
    loss.backward()
    grads = (lin.weight.grad.clone(), w_g.grad.clone())
    lin.weight.grad = w_g.grad = None
    eager = step(x)
    eager.backward()
    assert torch.equal(loss, eager)
    assert torch.equal(grads[0], lin.weight.grad) and torch.equal(grads[1], w_g.grad)


class _ToyExperts(nn.Module):
    """Stands in for the project's grouped experts: implements the enable_fp8 protocol."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 128, 128) * 0.05)
        self.inner = nn.Linear(128, 128)  # owned: must not be converted by convert_to_fp8
        self.recipe = None

    def enable_fp8(self, recipe):
        self.recipe = recipe

    def forward(self, x, offsets):
        if self.recipe is None:
            return G.grouped_gemm_nt(x, self.w.to(x.dtype), offsets)
        return fp8_grouped_linear(x, self.w, offsets, recipe=self.recipe)


def test_convert_to_fp8():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128), nn.GELU(), nn.Linear(128, 256), nn.Linear(256, 10))
    model.experts = _ToyExperts()
    with pytest.raises(ValueError, match=r"3 is nn.Linear\(in_features=256, out_features=10\)"):
        convert_to_fp8(model, incompatible="raise")
    assert type(model[0]) is nn.Linear and model.experts.recipe is None  # nothing changed on error
    skipped = convert_to_fp8(copy.deepcopy(model))  # the default: kept in high precision, reported
    assert type(skipped[3]) is nn.Linear and isinstance(skipped[0], Fp8Linear)
    assert sorted(skipped.fp8_conversion.converted) == ["0", "2", "experts"]
    assert list(skipped.fp8_conversion.kept) == ["3"] and "multiples of 128" in skipped.fp8_conversion.kept["3"]
    ref = [p.detach().clone() for p in model.parameters()]
    params = list(model.parameters())
    x = torch.randn(24, 256)
    y_ref = model[:3](x)
    convert_to_fp8(model, "blockwise_fp8_wgrad", filter_fn=lambda fqn, mod: fqn != "3")
    assert model.fp8_conversion.kept == {"3": "excluded by filter_fn"}
    assert isinstance(model[0], Fp8Linear) and isinstance(model[2], Fp8Linear) and type(model[3]) is nn.Linear
    assert model[0].recipe == "blockwise_fp8_wgrad" and model.experts.recipe == "blockwise_fp8_wgrad"
    assert type(model.experts.inner) is nn.Linear
    assert all(a is b for a, b in zip(params, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(ref, model.parameters()))
    y = model[:3](x)
    assert sqnr_db(y_ref.detach(), y.detach()) >= MIN_SQNR_DB
    y.sum().backward()  # a stride-0 gradient
    assert model[0].weight.grad is not None and not model[0].weight.grad.isnan().any()
