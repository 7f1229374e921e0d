"""Optional integration: primerl's grouped GEMMs swapped into torchtitan's grouped experts.

torchtitan's Qwen3-MoE debug model (dim 256, expert hidden 768, 64 experts top-8; cut to 2
layers) in float32 on CPU: forward parity before/after the swap (whole model, no grad: flex
attention has no CPU backward) and gradients of one MoE block."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys

import pytest
import torch

from primerl.kernels.testing import max_rel_err, sqnr_db
from primerl.models.integrations.torchtitan import (
    is_primerl_grouped_experts,
    restore_torchtitan_grouped_experts,
    swap_torchtitan_grouped_experts,
)

N_LAYERS = 2
EXPERT_NAMES = [f"layers.{i}.moe.routed_experts.inner_experts" for i in range(N_LAYERS)]


@pytest.fixture(scope="module")
def qwen3_moe():
    pytest.importorskip("torchtitan")
    from torchtitan.models.qwen3 import qwen3_configs

    config = qwen3_configs["debugmodel_moe"](attn_backend="flex")
    config = dataclasses.replace(config, layers=config.layers[:N_LAYERS])
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    model.eval()
    # the debug init (std 0.02) makes near-uniform routing; larger gate weights give real top-k choices
    for layer in model.layers.values():
        layer.moe.router.gate.weight.data.normal_(0, 0.5)
    return model, config


def _inputs(vocab_size: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (2, 32), generator=g)
    positions = torch.arange(32).repeat(2, 1)
    return tokens, positions


def _logits(model, tokens, positions):
    with torch.no_grad():
        return model(tokens, positions, model.get_attention_masks(positions))


def test_importing_primerl_does_not_import_torchtitan():
    code = ("import sys, primerl, primerl.models, primerl.models.integrations.torchtitan; "
            "assert 'torchtitan' not in sys.modules, 'torchtitan was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_missing_torchtitan_error_names_pip_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchtitan.models.common.moe", None)
    with pytest.raises(ImportError, match=r"pip install --no-deps torchtitan==0\.3\.0"):
        swap_torchtitan_grouped_experts(torch.nn.Linear(2, 2))


def test_swap_selects_validates_and_restores(qwen3_moe):
    from torchtitan.models.common.moe import GroupedExperts

    model = copy.deepcopy(qwen3_moe[0])
    keys = list(model.state_dict())
    with pytest.raises(ValueError, match="recipe must be one of"):
        swap_torchtitan_grouped_experts(model, recipe="fp8")
    only_first = swap_torchtitan_grouped_experts(model, "bf16", filter_fn=lambda fqn, m: fqn.startswith("layers.0."))
    assert only_first == EXPERT_NAMES[:1]
    assert swap_torchtitan_grouped_experts(model, "blockwise") == EXPERT_NAMES
    experts = model.get_submodule(EXPERT_NAMES[0])
    assert is_primerl_grouped_experts(experts) and isinstance(experts, GroupedExperts)
    assert experts.primerl_recipe == "blockwise" and "primerl_recipe='blockwise'" in repr(experts)
    assert list(model.state_dict()) == keys
    assert restore_torchtitan_grouped_experts(model) == EXPERT_NAMES
    assert type(experts) is GroupedExperts and not hasattr(experts, "primerl_backend")


def test_fp8_swap_rejects_dims_not_multiple_of_128():
    pytest.importorskip("torchtitan")
    from torchtitan.models.common.moe import GroupedExperts

    experts = GroupedExperts.Config(dim=128, hidden_dim=96, num_experts=2).build()
    with pytest.raises(ValueError, match=r"w1_EFD has shape \(2, 96, 128\)"):
        swap_torchtitan_grouped_experts(torch.nn.ModuleDict({"e": experts}), "blockwise")
    assert not is_primerl_grouped_experts(experts)  # nothing changed
    assert swap_torchtitan_grouped_experts(experts, "bf16") == [""]


def test_bf16_swap_forward_parity(qwen3_moe, monkeypatch):
    base, config = qwen3_moe
    tokens, positions = _inputs(config.vocab_size)
    expected = _logits(base, tokens, positions)

    import primerl.kernels.gemm as gemm

    calls = []
    real = gemm.grouped_gemm_nt
    monkeypatch.setattr(gemm, "grouped_gemm_nt", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    model = copy.deepcopy(base)
    swap_torchtitan_grouped_experts(model, recipe="bf16")
    got = _logits(model, tokens, positions)
    assert len(calls) == 3 * N_LAYERS  # w1, w3, w2 of every layer went through primerl
    assert torch.isfinite(got).all()
    assert max_rel_err(got, expected) < 1e-5


@pytest.mark.parametrize("recipe", ["blockwise", "blockwise_fp8_wgrad"])
def test_fp8_swap_forward_sqnr(qwen3_moe, recipe):
    base, config = qwen3_moe
    tokens, positions = _inputs(config.vocab_size)
    expected = _logits(base, tokens, positions)
    model = copy.deepcopy(base)
    swap_torchtitan_grouped_experts(model, recipe=recipe)
    got = _logits(model, tokens, positions)
    assert torch.isfinite(got).all()
    assert not torch.equal(got, expected)  # the FP8 path really ran
    assert sqnr_db(expected, got) >= 20.0


@pytest.mark.parametrize("recipe, min_sqnr", [("bf16", None), ("blockwise", 20.0), ("blockwise_fp8_wgrad", 20.0)])
def test_swapped_moe_block_gradients(qwen3_moe, recipe, min_sqnr):
    base_moe = qwen3_moe[0].layers["0"].moe

    def run(moe):
        g = torch.Generator().manual_seed(2)
        x = torch.randn(2, 16, 256, generator=g).requires_grad_(True)
        weight = torch.randn(2, 16, 256, generator=g)
        out = moe(x)
        (out * weight).sum().backward()
        grads = {"x": x.grad, **{n: p.grad for n, p in moe.named_parameters() if p.requires_grad}}
        return out.detach(), grads

    ref_out, ref_grads = run(copy.deepcopy(base_moe).train())
    moe = copy.deepcopy(base_moe).train()
    swap_torchtitan_grouped_experts(moe, recipe=recipe)
    out, grads = run(moe)
    assert set(grads) == set(ref_grads) and {"x", "routed_experts.inner_experts.w1_EFD"} <= set(grads)
    for name, ref in ref_grads.items():
        got = grads[name]
        assert got is not None and torch.isfinite(got).all() and got.abs().sum() > 0, name
        if min_sqnr is None:
            assert max_rel_err(got, ref) < 1e-5, name
        else:
            assert sqnr_db(ref, got) >= min_sqnr, (name, sqnr_db(ref, got))
    if min_sqnr is None:
        assert max_rel_err(out, ref_out) < 1e-5
    else:
        assert sqnr_db(ref_out, out) >= min_sqnr



@pytest.mark.parametrize("recipe", ["bf16", "blockwise"])
def test_experts_on_triton_backend(recipe):
    """The swapped seam on the Triton kernels (interpreter here), forward and backward, with an
    empty expert; against the same recipe on the torch reference."""
    pytest.importorskip("torchtitan")
    from torchtitan.models.common.moe import GroupedExperts

    torch.manual_seed(3)
    experts = GroupedExperts.Config(dim=128, hidden_dim=128, num_experts=3).build()
    for p in experts.parameters():
        p.data.normal_(0, 0.05)
    counts = torch.tensor([17, 0, 23])
    x = torch.randn(40, 128)

    def run(backend):
        module = copy.deepcopy(experts)
        swap_torchtitan_grouped_experts(module, recipe, backend=backend)
        xi = x.clone().requires_grad_(True)
        out = module(xi, counts)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(4)))
        return [out, xi.grad] + [p.grad for p in module.parameters()]

    for got, ref in zip(run("triton"), run("torch")):
        assert torch.isfinite(got).all()
        assert sqnr_db(ref, got) >= 40.0
