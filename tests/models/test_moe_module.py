"""primerl.models.moe.MoE against Hugging Face's MoE blocks, router replay, balancing, dispatcher seam."""

from __future__ import annotations

import pytest
import torch

from primerl.kernels.testing import assert_bitwise_equal, max_rel_err
from primerl.models.moe import MoE

transformers = pytest.importorskip("transformers")


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Weights large enough that routing is far from uniform (a 0.02 init hides errors)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def _qwen3_pair(norm_topk_prob: bool, impl: str, num_experts=8, top_k=2):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=num_experts,
                         num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob)
    cfg._experts_implementation = impl
    hf = Qwen3MoeSparseMoeBlock(cfg)
    _randomise(hf, 0)
    ours = MoE.from_hf_config(cfg)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.w13.copy_(hf.experts.gate_up_proj)
        ours.experts.w2.copy_(hf.experts.down_proj)
    hf_params = {"gate": hf.gate.weight, "w13": hf.experts.gate_up_proj, "w2": hf.experts.down_proj}
    our_params = {"gate": ours.gate.weight, "w13": ours.experts.w13, "w2": ours.experts.w2}
    return hf, ours, hf_params, our_params


def _fwd_bwd(module, params, x, gy, **kw):
    xx = x.clone().requires_grad_()
    y = module(xx, **kw)
    names = list(params)
    grads = torch.autograd.grad(y, [xx] + [params[n] for n in names], gy)
    return y.detach(), dict(zip(["x"] + names, grads))


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_matches_hf_qwen3_moe_block(impl, norm_topk_prob):
    hf, ours, hf_p, our_p = _qwen3_pair(norm_topk_prob, impl)
    torch.manual_seed(1)
    x, gy = torch.randn(3, 7, 32), torch.randn(3, 7, 32)
    y_hf, g_hf = _fwd_bwd(hf, hf_p, x, gy)
    y, g = _fwd_bwd(ours, our_p, x, gy)
    assert max_rel_err(y, y_hf) < 1e-5
    for name in g_hf:
        assert max_rel_err(g[name], g_hf[name]) < 1e-5, name
    assert ours.routing.shape == (21, 2) and ours.routing.dtype == torch.int32


def test_matches_hf_glm4_moe_block():
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    cfg = Glm4MoeConfig(hidden_size=32, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
                        n_group=4, topk_group=2, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5)
    cfg._experts_implementation = "eager"
    hf = Glm4MoeMoE(cfg)
    _randomise(hf, 2)
    ours = MoE.from_hf_config(cfg)
    assert ours.score_func == "sigmoid" and ours.n_groups == 4 and ours.shared_experts is not None
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.expert_bias.copy_(hf.gate.e_score_correction_bias)
        ours.experts.w13.copy_(hf.experts.gate_up_proj)
        ours.experts.w2.copy_(hf.experts.down_proj)
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(ours.shared_experts, n).weight.copy_(getattr(hf.shared_experts, n).weight)
    hf_p = {"gate": hf.gate.weight, "w13": hf.experts.gate_up_proj, "w2": hf.experts.down_proj,
            "shared_down": hf.shared_experts.down_proj.weight}
    our_p = {"gate": ours.gate.weight, "w13": ours.experts.w13, "w2": ours.experts.w2,
             "shared_down": ours.shared_experts.down_proj.weight}
    torch.manual_seed(3)
    x, gy = torch.randn(2, 9, 32), torch.randn(2, 9, 32)
    y_hf, g_hf = _fwd_bwd(hf, hf_p, x, gy)
    y, g = _fwd_bwd(ours, our_p, x, gy)
    assert max_rel_err(y, y_hf) < 1e-5
    for name in g_hf:
        assert max_rel_err(g[name], g_hf[name]) < 1e-5, name


@pytest.mark.parametrize("kind", ["qwen3", "glm"])
def test_replay_live_ids_bitwise(kind):
    torch.manual_seed(4)
    if kind == "qwen3":
        moe = MoE(32, 16, 8, 2, route_norm=True)
    else:
        moe = MoE(32, 16, 8, 3, num_shared_experts=1, score_func="sigmoid", route_norm=True, route_scale=2.0,
                  n_groups=4, topk_groups=2, use_expert_bias=True)
        moe.expert_bias.normal_(std=0.1)
    _randomise(moe, 5)
    params = dict(moe.named_parameters())
    x, gy = torch.randn(2, 6, 32), torch.randn(2, 6, 32)
    y, g = _fwd_bwd(moe, params, x, gy)
    live = moe.routing.clone()
    y_r, g_r = _fwd_bwd(moe, params, x, gy, replay_ids=live.view(2, 6, -1))
    assert_bitwise_equal(y_r, y, "output")
    for name in g:
        assert_bitwise_equal(g_r[name], g[name], name)
    assert_bitwise_equal(moe.routing, live, "routing record")


def test_replay_other_ids_uses_them_and_trains_router():
    torch.manual_seed(6)
    moe = MoE(32, 16, 8, 2, route_norm=True)
    _randomise(moe, 7)
    x = torch.randn(10, 32)
    moe(x)
    replay = ((moe.routing.long() + 3) % 8).to(torch.int32)
    y = moe(x, replay_ids=replay)
    assert torch.equal(moe.routing, replay)
    # the output is the experts' outputs weighted by the softmax renormalised over the replayed set
    logits = x @ moe.gate.weight.detach().T
    w = torch.softmax(logits.gather(1, replay.long()), dim=-1)
    expected = torch.zeros(10, 32)
    for t in range(10):
        for j in range(2):
            e = int(replay[t, j])
            gu = moe.experts.w13[e].detach() @ x[t]
            expected[t] += w[t, j] * (moe.experts.w2[e].detach() @ (torch.nn.functional.silu(gu[:16]) * gu[16:]))
    assert max_rel_err(y.detach(), expected) < 1e-5
    (g,) = torch.autograd.grad((y * torch.randn_like(y)).sum(), moe.gate.weight)
    assert g.abs().sum() > 0


def test_invalid_replay_raises():
    moe = MoE(16, 8, 4, 2)
    with pytest.raises(ValueError, match="replay_ids"):
        moe(torch.randn(5, 16), replay_ids=torch.tensor([[0, 4]] * 5))
    with pytest.raises(ValueError, match="replay_ids"):
        moe(torch.randn(5, 16), replay_ids=torch.tensor([[0, 1]] * 4))
    with pytest.raises(ValueError, match="repeated expert"):
        moe(torch.randn(5, 16), replay_ids=torch.tensor([[2, 2]] * 5))


def test_expert_bias_update_rule_and_selection_only():
    torch.manual_seed(8)
    moe = MoE(16, 8, 4, 1, score_func="sigmoid", use_expert_bias=True, bias_update_rate=0.01)
    _randomise(moe, 9)
    x = torch.randn(40, 16)
    moe.train()
    moe(x)
    counts = torch.bincount(moe.routing.reshape(-1).long(), minlength=4).float()
    assert torch.equal(moe.tokens_per_expert, counts)
    moe.update_expert_bias()
    delta = 0.01 * torch.sign(counts.mean() - counts)
    assert torch.allclose(moe.expert_bias, delta - delta.mean())
    assert torch.equal(moe.tokens_per_expert, torch.zeros(4))
    # a large bias steers selection to its expert, but the weight stays that expert's plain score
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 50.0, 0.0]))
    moe.eval()
    moe(x)
    assert bool((moe.routing == 2).all())
    assert moe.tokens_per_expert.sum() == 0  # counts accumulate in training only


def test_aux_loss_from_live_routing_even_under_replay():
    torch.manual_seed(10)
    moe = MoE(16, 8, 6, 2, load_balance_coeff=0.01)
    _randomise(moe, 11)
    x = torch.randn(30, 16)
    moe(x)
    live, aux = moe.routing.clone(), moe.aux_loss
    probs = torch.softmax(x @ moe.gate.weight.T, dim=-1)
    frac = torch.bincount(live.reshape(-1).long(), minlength=6).float() / live.numel()
    assert torch.allclose(aux, 0.01 * 6 * (frac * probs.mean(0)).sum())
    moe(x, replay_ids=((live.long() + 1) % 6).to(torch.int32))
    assert torch.equal(moe.aux_loss, aux)
    (g,) = torch.autograd.grad(moe.aux_loss, moe.gate.weight)
    assert g.abs().sum() > 0


class LocalDispatcher:
    """A one-rank stand-in for primerl.parallel.expert.AllToAllDispatcher: sorts the token copies
    by expert, and on combine weights and sums them."""

    def __init__(self, num_experts):
        self.num_experts = num_experts

    def dispatch(self, x, topk_ids, topk_weights):
        flat = topk_ids.reshape(-1).long()
        order = torch.sort(flat, stable=True).indices
        x_recv = x[order // topk_ids.shape[1]]
        counts = torch.bincount(flat, minlength=self.num_experts)
        return x_recv, counts, (order, topk_weights, x.shape[0])

    def combine(self, y_recv, handle):
        order, w, t = handle
        y_slots = torch.empty_like(y_recv)
        y_slots[order] = y_recv
        return (y_slots.view(t, w.shape[1], -1) * w.unsqueeze(-1).to(y_recv.dtype)).sum(1)


def test_dispatcher_seam_matches_local_path():
    torch.manual_seed(12)
    moe = MoE(32, 16, 8, 3, num_shared_experts=1, route_norm=True)
    _randomise(moe, 13)
    params = dict(moe.named_parameters())
    x, gy = torch.randn(11, 32), torch.randn(11, 32)
    y, g = _fwd_bwd(moe, params, x, gy)
    moe.set_dispatcher(LocalDispatcher(8))
    y_d, g_d = _fwd_bwd(moe, params, x, gy)
    assert max_rel_err(y_d, y) < 1e-5
    for name in g:
        assert max_rel_err(g_d[name], g[name]) < 1e-5, name


def test_edge_shapes():
    torch.manual_seed(14)
    for t, e, k in [(1, 4, 1), (1, 4, 4), (5, 1, 1), (6, 5, 5)]:
        moe = MoE(16, 8, e, k, route_norm=True)
        _randomise(moe, t)
        x = torch.randn(t, 16, requires_grad=True)
        y = moe(x)
        y.sum().backward()
        assert y.shape == (t, 16) and torch.isfinite(x.grad).all()
        assert moe.routing.shape == (t, k)


def test_enable_fp8_runs_the_fp8_experts():
    from primerl.kernels.testing import sqnr_db

    torch.manual_seed(15)
    moe = MoE(128, 128, 4, 2, route_norm=True, dtype=torch.bfloat16)
    _randomise(moe, 16)
    x = torch.randn(24, 128, dtype=torch.bfloat16)
    y_bf16 = moe(x)
    with pytest.raises(ValueError, match="multiples of 128"):
        MoE(96, 128, 4, 2).experts.enable_fp8("blockwise")
    moe.experts.enable_fp8("blockwise")
    xx = x.clone().requires_grad_()
    y = moe(xx)
    y.float().sum().backward()
    assert 20.0 < sqnr_db(y_bf16.detach().float(), y.detach().float()) < 60.0  # quantized, but close
    assert moe.experts.w13.grad is not None and torch.isfinite(xx.grad).all()
    moe.experts.enable_fp8(None)
    assert torch.equal(moe(x), y_bf16)


def test_convert_to_fp8_switches_experts_and_keeps_router():
    from primerl.kernels.fp8_training import convert_to_fp8

    moe = MoE(128, 128, 4, 2, num_shared_experts=1)
    convert_to_fp8(moe, "blockwise_fp8_wgrad")
    assert moe.experts.fp8_recipe == "blockwise_fp8_wgrad"
    assert type(moe.gate).__name__ == "Router"  # the router stays in high precision
    y = moe(torch.randn(6, 128, dtype=torch.float32))
    assert y.shape == (6, 128) and torch.isfinite(y).all()
