"""Closed-form checks (float64, hand-computed values) of ipo, the reference-KL and SFT terms, loss
weights, the zero-advantage drop, the two-sided sequence mask and custom methods."""

import math

import pytest
import torch

from primerl.rl.losses import DEFAULT_HPARAMS, check_loss_spec, policy_loss

F64 = torch.float64
LN2 = math.log(2)


def _t(*xs, **kw):
    return torch.tensor(xs, dtype=F64, **kw)


def _logp(*ps):
    return torch.log(_t(*ps)).requires_grad_()


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


def test_ipo_masks_moves_in_either_direction_and_keeps_kl():
    b = torch.log(_t(0.3, 0.3, 0.3, 0.3))
    adv = _t(1.0, -1.0, 1.0, -2.0)
    mask = torch.ones(4, dtype=torch.bool)
    # probability moves +0.05, +0.15, -0.15, 0: threshold 0.1 drops the middle two whatever A's sign
    lp = _logp(0.35, 0.45, 0.15, 0.3)
    loss, m = policy_loss(lp, b, adv, mask, method="ipo", kl_coef=0.0)
    assert loss.item() == pytest.approx((-(0.35 / 0.3) + 2.0) / 4, abs=1e-15)  # 5/24
    g = _grad(loss, lp)
    torch.testing.assert_close(g, _t(-(0.35 / 0.3) / 4, 0, 0, 0.5))
    assert float(m["clip_frac_high"]) == 0.25 and float(m["clip_frac_low"]) == 0.25
    c = 0.01
    loss_kl, _ = policy_loss(lp, b, adv, mask, method="ipo", kl_coef=c)
    lr = (lp - b).detach()
    assert float((loss_kl - loss).detach()) == pytest.approx(c * float((lr**2).sum()) / 4, rel=1e-12)
    torch.testing.assert_close(_grad(loss_kl, lp) - g, 2 * c * lr / 4)  # KL on the dropped tokens too
    assert DEFAULT_HPARAMS["ipo"] == {"ipo_threshold": 0.1, "kl_coef": 1e-3}


def test_reference_kl_term_closed_form():
    b = torch.log(_t(0.3, 0.3, 0.3))
    ref = torch.log(_t(0.6, 0.6, 0.15))
    lp = _logp(0.3, 0.05, 0.3)  # token 1 fell by 0.25 > delta 0.2: one-sided trust region drops it
    mask = torch.ones(3, dtype=torch.bool)
    coef, drift = 0.5, 0.01
    # no policy-gradient tokens (all advantages 0 and dropped): the loss is the reference term alone
    loss, m = policy_loss(lp, b, torch.zeros(3, dtype=F64), mask, method="reinforce", drop_zero_advantage=True,
                          ref_logprobs=ref, ref_kl_coef=coef, ref_kl_drift=drift)
    per = [-LN2, drift * math.log(6) ** 2, LN2]
    assert loss.item() == pytest.approx(coef * sum(per) / 3, rel=1e-13)
    torch.testing.assert_close(_grad(loss, lp), coef * _t(-LN2, 2 * drift * math.log(1 / 6), LN2) / 3)
    assert float(m["ref_kl_drop_frac"]) == pytest.approx(1 / 3) and float(m["pg_tokens"]) == 0
    k3 = lambda x: math.expm1(x) - x  # noqa: E731
    assert float(m["ref_kl"]) == pytest.approx((k3(LN2) + k3(math.log(12)) + k3(-LN2)) / 3)
    # a rise is never dropped (one-sided), and ref_weights select / weight the tokens
    lp_up = _logp(0.3, 0.9, 0.3)
    loss, _ = policy_loss(lp_up, b, torch.zeros(3, dtype=F64), mask, method="reinforce", drop_zero_advantage=True,
                          ref_logprobs=ref, ref_weights=_t(2.0, 1.0, 0.0), ref_kl_drift=0.0)
    expect = (2 * -LN2 + 1 * -math.log(0.6 / 0.9) * 3.0) / 3  # weights 2, 1 (sum 3); ratio 0.9/0.3 = 3
    assert loss.item() == pytest.approx(expect, rel=1e-13)
    assert DEFAULT_HPARAMS["ref_kl"] == {"ref_kl_coef": 1.0, "ref_kl_delta": 0.2, "ref_kl_drift": 1e-3}


def test_sft_term_on_its_own_tokens_and_denominator():
    lp = _logp(0.5, 0.25, 0.125, 0.5)
    mask = torch.tensor([False, True, True, True])
    adv = _t(0.0, 1.0, 3.0, 0.0)
    sft_w = _t(1.0, 0.0, 2.0, 0.0)  # token 0 is not a loss token: the SFT term may train it anyway
    loss, m = policy_loss(lp, lp.detach(), adv, mask, method="reinforce", sft_weights=sft_w, sft_coef=0.1)
    pg = -(1.0 + 3.0 + 0.0) / 3  # on policy: r = 1; pg term over its 3 tokens
    sft = (1 * LN2 + 2 * 3 * LN2) / 3  # sum w (-lp) / sum w
    assert loss.item() == pytest.approx(pg + 0.1 * sft, rel=1e-13)
    torch.testing.assert_close(_grad(loss, lp), _t(-0.1 / 3, -1 / 3, -3 / 3 - 0.1 * 2 / 3, 0.0))
    assert float(m["sft_nll"]) == pytest.approx(sft)


def test_loss_weights_scale_tokens_and_the_denominator():
    lp = _logp(0.5, 0.5, 0.5, 0.5)
    adv = _t(1.0, 2.0, 3.0, 4.0)
    mask = torch.tensor([True, True, True, False])
    w = _t(1.0, 0.0, 3.0, 5.0)  # weight 0 removes token 1; token 3 is outside the mask
    loss, m = policy_loss(lp, lp.detach(), adv, mask, method="reinforce", loss_weights=w)
    assert loss.item() == pytest.approx(-(1 * 1 + 3 * 3) / 4)
    torch.testing.assert_close(_grad(loss, lp), _t(-1 / 4, 0, -9 / 4, 0))
    assert float(m["pg_tokens"]) == 4
    cu = torch.tensor([0, 2, 4])
    loss, _ = policy_loss(lp, lp.detach(), adv, mask, method="reinforce", loss_weights=w, cu_seqlens=cu,
                          aggregation="seq_mean_token_mean")
    assert loss.item() == pytest.approx(-(1.0 + 9 / 3) / 2)  # seq 0: 1/1, seq 1: 3*3/3
    loss, _ = policy_loss(lp, lp.detach(), adv, mask, method="reinforce", loss_weights=w, cu_seqlens=cu,
                          aggregation="seq_mean_token_mean", global_num_seqs=4)
    assert loss.item() == pytest.approx(-(1.0 + 3.0) / 4)


@pytest.mark.parametrize("method", ["reinforce", "dppo_tv"])
def test_zero_advantage_tokens_leave_the_loss_and_its_denominator(method):
    ilp = torch.log(_t(0.5, 0.5, 0.5, 0.5))
    lp = _logp(0.6, 0.5, 0.5, 0.5)  # the zero-advantage token 0 is off policy: its KL goes with it
    adv = _t(0.0, 0.0, 2.0, 4.0)
    mask = torch.ones(4, dtype=torch.bool)
    kept, m = policy_loss(lp, ilp, adv, mask, method=method)
    dropped, m2 = policy_loss(lp, ilp, adv, mask, method=method, drop_zero_advantage=True)
    kl = 1e-3 * math.log(1.2) ** 2 if method == "dppo_tv" else 0.0
    assert kept.item() == pytest.approx((-6 + kl) / 4, rel=1e-12)
    assert dropped.item() == pytest.approx(-6 / 2, rel=1e-12)
    torch.testing.assert_close(_grad(dropped, lp), _t(0, 0, -1, -2))
    assert float(m["zero_adv_frac"]) == float(m2["zero_adv_frac"]) == 0.5
    assert float(m2["pg_tokens"]) == 2 and float(m2["num_tokens"]) == 4


def test_sequence_mask_drops_a_sequence_on_either_bound():
    cu = torch.tensor([0, 2, 4, 6])
    ilp = torch.log(torch.full((6,), 0.001, dtype=F64))
    lp = ilp.clone()
    lp[1] = math.log(0.2)  # seq 0: rho 200 > 100
    lp[2] = math.log(0.001 * 0.005)  # seq 1: rho 0.005
    lp = lp.requires_grad_()
    adv, mask = torch.ones(6, dtype=F64), torch.ones(6, dtype=torch.bool)
    run = lambda **kw: policy_loss(lp, ilp, adv, mask, method="reinforce", corrections=("sequence_mask",),  # noqa: E731
                                   cu_seqlens=cu, **kw)
    loss, m = run()  # defaults 0 / 100: only the high bound bites
    g = _grad(loss, lp)
    assert (g[:2] == 0).all() and (g[2:] != 0).all() and float(m["sequence_mask_drop_frac"]) == pytest.approx(1 / 3)
    loss, m = run(sequence_mask_low=0.01)
    g = _grad(loss, lp)
    assert (g[:4] == 0).all() and (g[4:] == -1 / 6).all()
    assert loss.item() == pytest.approx(-2 / 6) and float(m["sequence_mask_drop_frac"]) == pytest.approx(2 / 3)


def _custom_module(tmp_path, monkeypatch, body):
    (tmp_path / "my_losses.py").write_text("import torch\n\n" + body)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_custom_method_by_import_path(tmp_path, monkeypatch):
    _custom_module(tmp_path, monkeypatch, (
        "def clipped(inputs, eps=0.1):\n"
        "    r = torch.exp(inputs.logprobs - inputs.behaviour_logprobs)\n"
        "    a = inputs.advantages\n"
        "    per = -torch.minimum(r * a, r.clamp(1 - eps, 1 + eps) * a)\n"
        "    return per, {'mean_ratio': r[inputs.loss_mask].mean()}\n"
        "def wrong_shape(inputs):\n"
        "    return inputs.logprobs.sum()\n"))
    g = torch.Generator().manual_seed(0)
    ilp = -torch.rand(10, generator=g, dtype=F64) * 2 - 0.1
    lp = (ilp + 0.3 * torch.randn(10, generator=g, dtype=F64)).requires_grad_()
    adv = torch.randn(10, generator=g, dtype=F64)
    mask = torch.rand(10, generator=g) < 0.8
    cu = torch.tensor([0, 4, 10])
    for corr, hp in (((), {}), (("icepop", "sequence_mask"), {"icepop_alpha": 0.8})):
        mine, m = policy_loss(lp, ilp, adv, mask, method="my_losses:clipped", eps=0.25, corrections=corr, cu_seqlens=cu,
                              **hp)
        ref, _ = policy_loss(lp, ilp, adv, mask, method="ppo_clip", eps_low=0.25, eps_high=0.25, corrections=corr,
                             cu_seqlens=cu, **hp)
        torch.testing.assert_close(mine, ref, rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(_grad(mine, lp), _grad(ref, lp), rtol=1e-14, atol=1e-15)
        assert float(m["custom/mean_ratio"]) == pytest.approx(float(torch.exp(lp.detach() - ilp)[mask].mean()))
    with pytest.raises(ValueError, match=r"custom method my_losses:wrong_shape must return the per-token loss"):
        policy_loss(lp, ilp, adv, mask, method="my_losses:wrong_shape")
    for spec, match in (("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
                        ("my_losses:nope", "has no function 'nope'"), ("my_losses:", "package.module:function")):
        with pytest.raises(ValueError, match=match):
            policy_loss(lp, ilp, adv, mask, method=spec)


@pytest.mark.parametrize("kw,match", [
    (dict(loss_mask=torch.full((4,), 2.0)), "loss_mask must hold only 0 and 1"),
    (dict(loss_mask=torch.ones(4, dtype=torch.complex64)), "loss_mask must be bool"),
    (dict(advantages=torch.zeros(4, device="meta")), "advantages is on meta"),
    (dict(loss_weights=torch.tensor([1.0, -1.0, 0.0, 0.0])), "loss_weights must be finite and >= 0"),
    (dict(sft_weights=torch.tensor([1.0, float("nan"), 0.0, 0.0])), "sft_weights must be finite"),
    (dict(ref_weights=torch.ones(4)), "ref_weights weight the reference-KL term, which needs ref_logprobs"),
    (dict(ref_kl_coef=1.0), "'ref_kl_coef' is not used"),
    (dict(sft_coef=1.0), "'sft_coef' is not used"),
    (dict(ref_logprobs=torch.zeros(4), ref_kl_coef=-1.0), "ref_kl_coef must be a finite number >= 0"),
    (dict(ref_logprobs=torch.zeros(4), global_term_tokens={"sft": 3}), r"global_term_tokens\['sft'\]"),
    (dict(global_num_seqs=3), "global_num_seqs"),
    (dict(method="ipo", ipo_threshold=float("inf")), "ipo_threshold must be a finite number"),
    (dict(corrections=("sequence_mask",)), "need cu_seqlens"),
    (dict(corrections=("sequence_mask",), sequence_mask_high=-1.0, cu_seqlens=torch.tensor([0, 4])),
     "sequence_mask_low/sequence_mask_high must be >= 0"),
])
def test_bad_arguments_of_the_new_options_raise(kw, match):
    x = torch.zeros(4)
    args = dict(logprobs=x, inference_logprobs=x, advantages=x, loss_mask=torch.ones(4, dtype=torch.bool))
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    with pytest.raises(ValueError, match=match):
        policy_loss(args["logprobs"], args["inference_logprobs"], args["advantages"], args["loss_mask"], **kw)


def test_check_loss_spec_for_config_validators():
    name, custom, fn_kw, corr, agg, hp = check_loss_spec("dppo_tv", ["sequence_mask"], None, {"kl_coef": 0.0})
    assert (name, custom, fn_kw, corr, agg) == ("dppo_tv", None, {}, ("sequence_mask",), "token_mean")
    assert hp == {"delta_low": 0.2, "delta_high": 0.2, "kl_coef": 0.0, "sequence_mask_low": 0.0,
                  "sequence_mask_high": 100.0}
    assert check_loss_spec("ipo", terms=("ref_kl",))[5]["ref_kl_delta"] == 0.2
    for args, match in ((("foo",), "unknown method 'foo'"), (("ipo", ["bar"]), "unknown correction 'bar'"),
                        (("ipo", [], "mean"), "unknown aggregation"), (("ipo", [], None, {"eps_low": 0.1}), "eps_low"),
                        (("ipo", [], None, None, ("kl",)), "unknown term")):
        with pytest.raises(ValueError, match=match):
            check_loss_spec(*args)
