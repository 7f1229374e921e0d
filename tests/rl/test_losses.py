import math

import pytest
import torch

from primerl.rl.losses import CORRECTIONS, LOSS_METHODS, policy_loss
from primerl.rl.metrics import effective_sample_size, kl_estimate, kl_k1, kl_k2, kl_k3

CU = torch.tensor([0, 3, 3, 7, 12], dtype=torch.int32)  # includes an empty sequence
T = 12


def _batch(seed, spread=0.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    ilp = -torch.rand(T, generator=g, dtype=dtype) * 3 - 0.05
    lp = (ilp + spread * torch.randn(T, generator=g, dtype=dtype)).clamp(max=-1e-3)
    seq_adv = torch.randn(4, generator=g, dtype=dtype)
    adv = seq_adv[torch.repeat_interleave(torch.arange(4), CU.diff().long())]
    mask = torch.rand(T, generator=g) < 0.8
    mask[4] = True
    return lp.requires_grad_(), ilp, adv, mask


def _reinforce_grad(lp, adv, mask, aggregation):
    x = lp.detach().clone().requires_grad_()
    per = torch.where(mask, -adv * x, torch.zeros_like(x))
    if aggregation == "token_mean":
        loss = per.sum() / mask.sum()
    else:
        seq_ids = torch.repeat_interleave(torch.arange(4), CU.diff().long())
        n = torch.zeros(4, dtype=x.dtype).index_add(0, seq_ids, mask.to(x.dtype))
        s = torch.zeros(4, dtype=x.dtype).index_add(0, seq_ids, per) / n.clamp_min(1)
        loss = s.sum() / (n > 0).sum()
    (g,) = torch.autograd.grad(loss, x)
    return g


@pytest.mark.parametrize("method", LOSS_METHODS)
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("corrections", [(), ("icepop", "mis", "geo_rs", "veto")])
def test_on_policy_gradient_equals_reinforce(method, aggregation, corrections):
    lp, ilp, adv, mask = _batch(seed=1)
    ilp = lp.detach().clone()  # on policy: the sampler's log-probs equal the trainer's
    loss, metrics = policy_loss(lp, ilp, adv, mask, method=method, aggregation=aggregation, cu_seqlens=CU,
                                corrections=corrections)
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, _reinforce_grad(lp, adv, mask, aggregation), rtol=1e-10, atol=1e-12)
    assert metrics["mismatch_kl"] == 0 and metrics["ess"] == 1 and metrics["correction_drop_frac"] == 0


def test_on_policy_with_old_logprobs_and_tis_equals_reinforce():
    lp, ilp, adv, mask = _batch(seed=2)
    same = lp.detach().clone()
    loss, _ = policy_loss(lp, same, adv, mask, method="ppo_clip", old_logprobs=same, corrections=("tis",))
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, _reinforce_grad(lp, adv, mask, "token_mean"))


def _single(method, ratio, adv, **kw):
    lp = torch.tensor([math.log(0.3 * ratio)], dtype=torch.float64, requires_grad=True)
    ilp = torch.tensor([math.log(0.3)], dtype=torch.float64)
    loss, metrics = policy_loss(lp, ilp, torch.tensor([adv], dtype=torch.float64), torch.tensor([True]),
                                method=method, **kw)
    (g,) = torch.autograd.grad(loss, lp)
    return float(loss.detach()), float(g), metrics


@pytest.mark.parametrize(
    "ratio,adv,kw,loss,grad,low,high",
    [
        (1.5, 1.0, {}, -1.28, 0.0, 0, 1),          # clipped at 1 + 0.28: no gradient
        (1.1, 1.0, {}, -1.1, -1.1, 0, 0),          # inside: d(-rA)/dlp = -rA
        (0.5, -1.0, {}, 0.8, 0.0, 1, 0),           # clipped at 1 - 0.2
        (0.5, 1.0, {}, -0.5, -0.5, 0, 0),          # the min picks the unclipped term
        (1.5, -1.0, {}, 1.5, 1.5, 0, 0),           # pessimistic side keeps the gradient
        (5.0, -1.0, {"dual_clip_c": 3.0}, 3.0, 0.0, 0, 0),  # dual clip bounds the loss at c|A|
        (2.0, -1.0, {"dual_clip_c": 3.0}, 2.0, 2.0, 0, 0),
        (1.5, 1.0, {"eps_high": 0.6}, -1.5, -1.5, 0, 0),
    ],
)
def test_ppo_clip_known_values(ratio, adv, kw, loss, grad, low, high):
    val, g, m = _single("ppo_clip", ratio, adv, **kw)
    assert val == pytest.approx(loss, rel=1e-12) and g == pytest.approx(grad, abs=1e-12)
    assert float(m["clip_frac_low"]) == low and float(m["clip_frac_high"]) == high
    if "dual_clip_c" in kw:
        assert float(m["dual_clip_frac"]) == (1.0 if g == 0 else 0.0)


def test_dppo_tv_matches_formula_and_masks_by_advantage_sign():
    p_train = torch.tensor([0.5, 0.1, 0.2, 0.3, 0.6, 0.35], dtype=torch.float64)
    p_inf = torch.tensor([0.1, 0.5, 0.2, 0.25, 0.3, 0.1], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.0, 0.5, -2.0, 1.0], dtype=torch.float64)
    mask = torch.tensor([True, True, True, False, True, True])
    lp = p_train.log().requires_grad_()
    loss, m = policy_loss(lp, p_inf.log(), adv, mask, method="dppo_tv", kl_coef=0.003)
    # token 0: +0.4 with A > 0 -> masked high; token 1: -0.4 with A < 0 -> masked low;
    # token 4: +0.3 with A < 0 -> kept (moving against a negative advantage is allowed); token 5: +0.25 > 0.2
    keep = torch.tensor([0, 0, 1, 0, 1, 0], dtype=torch.float64)
    x = lp.detach().clone().requires_grad_()
    log_r = x - p_inf.log()
    expect = ((-keep * adv * log_r.exp() + 0.003 * log_r**2) * mask).sum() / mask.sum()
    (g_expect,) = torch.autograd.grad(expect, x)
    (g,) = torch.autograd.grad(loss, lp)
    assert float(loss.detach()) == pytest.approx(float(expect.detach()), rel=1e-12)
    torch.testing.assert_close(g, g_expect)
    assert float(m["clip_frac_low"]) == pytest.approx(1 / 5) and float(m["clip_frac_high"]) == pytest.approx(2 / 5)


def test_dppo_defaults_are_prime_rl():
    # delta 0.2 is the default: a move of +0.19 is kept, +0.21 masked
    for p, kept in ((0.49, True), (0.51, False)):
        lp = torch.tensor([math.log(p)], dtype=torch.float64, requires_grad=True)
        loss, _ = policy_loss(lp, torch.tensor([math.log(0.3)], dtype=torch.float64),
                              torch.ones(1, dtype=torch.float64), torch.tensor([True]), method="dppo_tv")
        (g,) = torch.autograd.grad(loss, lp)
        kl_grad = 2e-3 * math.log(p / 0.3)
        assert float(g) == pytest.approx((-p / 0.3 if kept else 0.0) + kl_grad, rel=1e-9)


def test_gspo_sequence_ratio_clip_and_token_variant():
    lp, ilp, adv, mask = _batch(seed=3, spread=0.05)
    loss, m = policy_loss(lp, ilp, adv, mask, method="gspo", cu_seqlens=CU, eps_low=0.01, eps_high=0.02)
    # closed form per sequence: s_i = exp(mean log-ratio over its loss tokens)
    x = lp.detach().clone().requires_grad_()
    terms = []
    for i in range(4):
        sl = slice(int(CU[i]), int(CU[i + 1]))
        mk = mask[sl]
        if mk.sum() == 0:
            continue
        s = torch.exp((x[sl] - ilp[sl])[mk].mean())
        a = adv[sl][mk][0]
        terms.append(-torch.minimum(s * a, s.clamp(0.99, 1.02) * a))
    expect = torch.stack(terms).mean()
    assert float(loss.detach()) == pytest.approx(float(expect.detach()), rel=1e-12)
    (g,) = torch.autograd.grad(loss, lp, retain_graph=True)
    (ge,) = torch.autograd.grad(expect, x)
    torch.testing.assert_close(g, ge)
    # GSPO-token with a per-sequence advantage: same value and gradient (GSPO paper, section 4.3)
    loss_t, _ = policy_loss(lp, ilp, adv, mask, method="gspo_token", cu_seqlens=CU, eps_low=0.01,
                            eps_high=0.02, aggregation="seq_mean_token_mean")
    (gt,) = torch.autograd.grad(loss_t, lp)
    assert float(loss_t.detach()) == pytest.approx(float(loss.detach()), rel=1e-12)
    torch.testing.assert_close(gt, g)


def test_cispo_weight_is_clipped_constant():
    lp, ilp, adv, mask = _batch(seed=4, spread=0.3)
    loss, m = policy_loss(lp, ilp, adv, mask, method="cispo")
    r = torch.exp(lp.detach() - ilp)
    (g,) = torch.autograd.grad(loss, lp)
    expect = torch.where(mask, -r.clamp(0.0, 1.28) * adv, torch.zeros_like(r)) / mask.sum()
    torch.testing.assert_close(g, expect)
    assert float(m["clip_frac_high"]) == pytest.approx(float(((r > 1.28) & mask).sum() / mask.sum()))


def test_gradcheck_smooth_methods():
    lp, ilp, adv, mask = _batch(seed=5, spread=0.05)
    for method, kw in (("reinforce", {}), ("dppo_tv", {}), ("gspo", {"eps_low": 0.5, "eps_high": 0.5}),
                       ("ppo_clip", {"eps_low": 0.9, "eps_high": 0.9})):
        assert torch.autograd.gradcheck(
            lambda x: policy_loss(x, ilp, adv, mask, method=method, cu_seqlens=CU, **kw)[0], (lp,))


def test_tis_weights_by_truncated_old_over_inference():
    lp, ilp, adv, mask = _batch(seed=6)
    g = torch.Generator().manual_seed(0)
    old = lp.detach() + torch.randn(T, generator=g, dtype=lp.dtype)
    loss, _ = policy_loss(lp, ilp, adv, mask, method="reinforce", old_logprobs=old, corrections=("tis",), tis_cap=1.5)
    (gr,) = torch.autograd.grad(loss, lp)
    rho = torch.exp(old - ilp).clamp(max=1.5)
    r = torch.exp(lp.detach() - old)
    torch.testing.assert_close(gr, torch.where(mask, -rho * r * adv, torch.zeros_like(r)) / mask.sum())


@pytest.mark.parametrize("bypass", [True, False])
def test_icepop_and_token_mis_drop_tokens_outside_bounds(bypass):
    lp = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5], dtype=torch.float64)).requires_grad_()
    ilp = torch.log(torch.tensor([0.05, 0.2, 0.5, 0.9], dtype=torch.float64))  # rho = 10, 2.5, 1, 0.56
    adv = torch.ones(4, dtype=torch.float64)
    mask = torch.ones(4, dtype=torch.bool)
    old = None if bypass else lp.detach().clone()
    for corr, kw, kept in (("icepop", {}, [0, 1, 1, 1]), ("mis", {}, [0, 0, 1, 1]),
                           ("icepop", {"icepop_alpha": 0.6}, [0, 1, 1, 0])):
        loss, m = policy_loss(lp, ilp, adv, mask, method="reinforce", corrections=(corr,), old_logprobs=old, **kw)
        (g,) = torch.autograd.grad(loss, lp)
        kept_t = torch.tensor(kept, dtype=torch.float64)
        w = torch.ones(4, dtype=torch.float64) if bypass else torch.exp(lp.detach() - ilp)
        r = torch.exp(lp.detach() - (ilp if bypass else lp.detach()))
        torch.testing.assert_close(g, -kept_t * w * r / 4)
        assert float(m[f"{corr}_drop_frac"]) == pytest.approx(1 - sum(kept) / 4)


def test_sequence_level_corrections_drop_whole_sequences():
    cu = torch.tensor([0, 3, 6, 9], dtype=torch.int32)
    ilp = torch.full((9,), math.log(0.5), dtype=torch.float64)
    lp = ilp.clone()
    lp[1] = math.log(0.5 * 1e-5)  # seq 0: one catastrophic token (rho 1e-5)
    lp[4] = math.log(0.5 * 1.01)  # seq 1: geometric mean 1.01^(1/3) = 1.0033 > 1.001
    lp = lp.requires_grad_()
    adv = torch.ones(9, dtype=torch.float64)
    mask = torch.ones(9, dtype=torch.bool)
    cases = {("veto",): [1, 0, 0], ("geo_rs",): [1, 1, 0], ("mis",): [1, 0, 0]}
    for corr, dropped in cases.items():
        kw = {"mis_level": "sequence", "mis_low": 0.5, "mis_high": 2.0} if corr == ("mis",) else {}
        loss, m = policy_loss(lp, ilp, adv, mask, method="reinforce", corrections=corr, cu_seqlens=cu, **kw)
        (g,) = torch.autograd.grad(loss, lp)
        for i, d in enumerate(dropped):
            assert (g[3 * i:3 * i + 3] == 0).all() == bool(d), (corr, i)
        assert float(m["correction_drop_frac"]) == pytest.approx(sum(dropped) / 3)


def test_aggregations_closed_form():
    adv = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=torch.float64)
    mask = torch.tensor([True, True, False, True, True, True])
    lp = torch.full((6,), -1.0, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 3, 6])
    run = lambda agg, **kw: float(policy_loss(lp.detach(), lp.detach(), adv, mask, method="reinforce", aggregation=agg,
                                              cu_seqlens=cu, **kw)[0])
    assert run("token_mean") == pytest.approx(-(1 + 2 + 4 + 5 + 6) / 5)
    assert run("seq_mean_token_mean") == pytest.approx(-((1 + 2) / 2 + (4 + 5 + 6) / 3) / 2)
    assert run("token_sum_norm", norm_constant=100) == pytest.approx(-18 / 100)
    assert run("global_token_sum", global_num_tokens=36) == pytest.approx(-18 / 36)


def test_masked_positions_with_wild_values_do_not_leak():
    lp, ilp, adv, mask = _batch(seed=7)
    lp2 = lp.detach().clone()
    lp2[~mask] = 500.0  # placeholders that would overflow exp()
    ilp2 = ilp.clone()
    ilp2[~mask] = -1e4
    lp2.requires_grad_()
    for method in LOSS_METHODS:
        loss, m = policy_loss(lp2, ilp2, adv, mask, method=method, cu_seqlens=CU)
        (g,) = torch.autograd.grad(loss, lp2)
        assert torch.isfinite(loss) and torch.isfinite(g).all() and (g[~mask] == 0).all()
        assert all(torch.isfinite(v) for v in m.values())


def test_metrics_values():
    lp = torch.log(torch.tensor([0.2, 0.4, 0.1], dtype=torch.float64)).requires_grad_()
    ilp = torch.log(torch.tensor([0.1, 0.4, 0.2], dtype=torch.float64))  # log-ratios ln2, 0, -ln2
    ent = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    _, m = policy_loss(lp, ilp, torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.bool),
                       method="reinforce", entropy=ent)
    k3 = ((1 - math.log(2)) + 0 + (math.log(2) - 0.5)) / 3
    assert float(m["mismatch_kl"]) == pytest.approx(k3)
    assert float(m["ratio_mean"]) == pytest.approx(3.5 / 3) and float(m["ratio_max"]) == pytest.approx(2.0)
    assert float(m["ess"]) == pytest.approx(3.5**2 / (3 * 5.25))
    assert float(m["entropy"]) == pytest.approx(2.0) and float(m["num_tokens"]) == 3


def test_kl_estimators():
    ln2 = torch.tensor([math.log(2), -math.log(2)], dtype=torch.float64)
    torch.testing.assert_close(kl_k3(ln2), torch.tensor([1 - math.log(2), math.log(2) - 0.5], dtype=torch.float64))
    torch.testing.assert_close(kl_k1(ln2), -ln2)
    torch.testing.assert_close(kl_k2(ln2), ln2**2 / 2)
    assert kl_estimate(torch.zeros(1), "k3") == 0
    # exact expectation over a discrete q: sum_x q(x) k(log p/q) = KL(q || p) for k1 and k3
    q = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    p = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    kl = (q * (q / p).log()).sum()
    for kind in ("k1", "k3"):
        assert float((q * kl_estimate(p.log() - q.log(), kind)).sum()) == pytest.approx(float(kl))
    assert (kl_k3(torch.linspace(-5, 5, 101)) >= 0).all()
    assert float(effective_sample_size(torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.ones(4, dtype=torch.bool))) == 0.25


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(method="ppo"), "unknown method 'ppo'"),
        (dict(corrections=("tis", "foo")), "unknown correction 'foo'"),
        (dict(aggregation="mean"), "unknown aggregation 'mean'"),
        (dict(epsilon=0.2), "unknown hyperparameter 'epsilon'"),
        (dict(method="reinforce", eps_low=0.2), "'eps_low' is not used by method='reinforce'"),
        (dict(tis_cap=3.0), "'tis_cap' is not used"),
        (dict(corrections=("tis",)), "'tis' needs old_logprobs"),
        (dict(method="gspo"), "need cu_seqlens"),
        (dict(corrections=("veto",)), "need cu_seqlens"),
        (dict(aggregation="token_sum_norm"), "needs norm_constant"),
        (dict(aggregation="global_token_sum"), "needs global_num_tokens"),
        (dict(cu_seqlens=torch.tensor([0, 2, 3])), "end at T=4"),
        (dict(corrections=("mis",), mis_level="batch"), "mis_level"),
        (dict(dual_clip_c=0.5), "dual_clip_c must be > 1"),
        (dict(old_logprobs=torch.zeros(3)), "old_logprobs must be a 1-D tensor"),
        (dict(entropy=torch.zeros(4, 2)), "entropy must be a 1-D tensor"),
    ],
)
def test_bad_arguments_raise(kw, match):
    x = torch.zeros(4)
    with pytest.raises(ValueError, match=match):
        policy_loss(x, x, x, torch.ones(4, dtype=torch.bool), **kw)


def test_every_correction_name_is_exercised():
    # tis/mis/icepop/geo_rs/veto here; sequence_mask in test_loss_terms.py and test_prime_rl_parity.py
    assert set(CORRECTIONS) == {"tis", "mis", "icepop", "geo_rs", "veto", "sequence_mask"}
    assert set(LOSS_METHODS) == {"ppo_clip", "dppo_tv", "ipo", "gspo", "gspo_token", "cispo", "reinforce"}
