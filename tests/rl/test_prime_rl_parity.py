"""primerl's losses and advantages against prime-rl's formulas, transcribed here in float64.

prime-rl computes each loss per sequence and sums: rl / N_rl + ce / N_ce + ref_kl / N_ref_kl, where
each N is the global count of that component's tokens (for rl: the sum of its weights). The
functions below are independent transcriptions of that math (one sequence at a time, as prime-rl
does); primerl runs on the same sequences packed into one batch. Losses and gradients must agree
to float64 rounding.
"""

import math

import pytest
import torch

from primerl.rl.advantages import max_rl, rloo
from primerl.rl.losses import policy_loss

F64 = torch.float64
TOL = dict(rtol=1e-13, atol=1e-15)


# ---------------------------------------------------------------- prime-rl's math, per sequence
def _ratio(lp, ilp):
    log_r = lp - ilp
    return log_r, torch.exp(log_r)


def prl_dppo_kl(lp, ilp, adv, mask, w, d_low=0.2, d_high=0.2, adv_tau=1.0, kl_tau=1e-3):
    log_r, r = _ratio(lp, ilp)
    diff = torch.exp(lp) - torch.exp(ilp)
    invalid = torch.where(adv > 0, diff > d_high, diff < -d_low)
    keep = mask & ~invalid
    per = -(keep * adv_tau * adv * r) + kl_tau * mask.to(F64) * log_r**2  # (a float x bool tensor is float32)
    return (per if w is None else per * w).sum()


def prl_ipo(lp, ilp, adv, mask, w, threshold=0.1, adv_tau=1.0, kl_tau=1e-3):
    log_r, r = _ratio(lp, ilp)
    keep = mask & ~((torch.exp(lp) - torch.exp(ilp)).abs() > threshold)
    per = -(keep * adv_tau * adv * r) + kl_tau * mask.to(F64) * log_r**2  # (a float x bool tensor is float32)
    return (per if w is None else per * w).sum()


def prl_icepop(lp, ilp, adv, mask, w, low=0.2, high=5.0):
    _, r = _ratio(lp, ilp)
    keep = mask & (r >= low) & (r <= high)
    per = -(keep * adv * r)
    return (per if w is None else per * w).sum()


def prl_seq_minmax(lp, ilp, adv, mask, w, low, high):
    _, r = _ratio(lp, ilp)
    drop = bool(r.masked_fill(~mask, math.inf).min() < low) or bool(r.masked_fill(~mask, -math.inf).max() > high)
    keep = mask & ~torch.tensor(drop)
    return (-(keep * adv * r)).sum()


def prl_ref_kl(lp, ilp, ref, mask, w):
    log_r, r = _ratio(lp, ilp)
    keep = mask & ~(torch.exp(lp) - torch.exp(ilp) < -0.2)
    per = -(keep * (ref - lp).detach() * r) + 1e-3 * mask.to(F64) * log_r**2
    return (per if w is None else per * w).sum()


def prl_ce(lp, mask, w):
    nll = -lp if w is None else -lp * w
    return nll[mask].sum()


def prl_compute_loss(seqs, rl_fn, rl_scale, ce_scale=1, ref_scale=1):
    """seqs: dicts of per-sequence tensors lp, ilp, adv, mask, ref, rl_w, ce_w, ref_w (None = absent)."""
    rl = ce = ref = 0.0
    for s in seqs:
        rl_mask = s["mask"] if s["rl_w"] is None else s["mask"] & (s["rl_w"] != 0)
        rl = rl + rl_fn(s["lp"], s["ilp"], s["adv"], rl_mask, s["rl_w"])
        if s["ce_w"] is not None:
            ce = ce + prl_ce(s["lp"], s["ce_w"] != 0, s["ce_w"])
        if s["ref_w"] is not None:
            ref = ref + prl_ref_kl(s["lp"], s["ilp"], s["ref"], s["ref_w"] != 0, s["ref_w"])
    return rl / rl_scale + ce / ce_scale + ref / ref_scale


# ---------------------------------------------------------------- shared data
def _sequences(seed, lengths=(6, 1, 9, 5, 7), zero_adv=(3,), weights=False, terms=False):
    """Random sequences whose probabilities move far enough (|p - p_b| up to ~0.5) to cross every
    trust region; prompt tokens (mask False) lead each sequence."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i, n in enumerate(lengths):
        p_inf = 0.05 + 0.9 * torch.rand(n, generator=g, dtype=F64)
        p = (p_inf + 0.3 * torch.randn(n, generator=g, dtype=F64)).clamp(0.01, 0.99)
        n_prompt = min(2, n - 1)
        mask = torch.arange(n) >= n_prompt
        a = (-1) ** (i // 2) * (0.5 + float(torch.rand(1, generator=g, dtype=F64)))  # both signs in every batch
        adv = torch.full((n,), 0.0 if i in zero_adv else a, dtype=F64)
        s = {"lp": p.log(), "ilp": p_inf.log(), "adv": adv, "mask": mask,
             "ref": (0.05 + 0.9 * torch.rand(n, generator=g, dtype=F64)).log(),
             "rl_w": None, "ce_w": None, "ref_w": None}
        if weights:
            s["rl_w"] = torch.where(torch.rand(n, generator=g) < 0.2, 0.0, 0.5 + torch.rand(n, generator=g, dtype=F64))
        if terms:
            s["ce_w"] = torch.where(torch.rand(n, generator=g) < 0.5, 0.0, 1.0).to(F64)
            s["ce_w"][0] = 0.0  # a sequence's first token has no log-prob
            s["ref_w"] = (mask & (torch.rand(n, generator=g) < 0.7)).to(F64)
        seqs.append(s)
    return seqs


def _packed(seqs):
    cat = lambda k: torch.cat([s[k] for s in seqs]) if seqs[0][k] is not None else None  # noqa: E731
    cu = torch.tensor([0] + [len(s["lp"]) for s in seqs], dtype=torch.int32).cumsum(0).to(torch.int32)
    return {k: cat(k) for k in seqs[0]}, cu


def _leaf(x):
    return x.detach().clone().requires_grad_()


def _both(seqs, prl_fn, rl_scale, primerl_kw, ce_scale=1, ref_scale=1):
    """(prime-rl loss, grads per sequence concatenated), (primerl loss, grad)."""
    seqs = [dict(s, lp=_leaf(s["lp"])) for s in seqs]
    ref_loss = prl_compute_loss(seqs, prl_fn, rl_scale, ce_scale, ref_scale)
    ref_grad = torch.cat(torch.autograd.grad(ref_loss, [s["lp"] for s in seqs]))
    p, cu = _packed(seqs)
    lp = _leaf(p["lp"])
    kw = dict(primerl_kw)
    if p["rl_w"] is not None:
        kw["loss_weights"] = p["rl_w"]
    if p["ce_w"] is not None:
        kw["sft_weights"] = p["ce_w"]
    if p["ref_w"] is not None:
        kw.update(ref_logprobs=p["ref"], ref_weights=p["ref_w"])
    loss, _ = policy_loss(lp, p["ilp"], p["adv"], p["mask"], cu_seqlens=cu, **kw)
    (grad,) = torch.autograd.grad(loss, lp)
    return (ref_loss, ref_grad), (loss, grad)


def _rl_scale(seqs):
    return sum(float(s["mask"].sum()) if s["rl_w"] is None else float((s["rl_w"] * s["mask"]).sum()) for s in seqs)


def _assert_same(a, b):
    torch.testing.assert_close(b[0], a[0], **TOL)
    torch.testing.assert_close(b[1], a[1], **TOL)


# ---------------------------------------------------------------- losses
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("weights", [False, True])
def test_default_dppo_tv_kl_equals_prime_rl(seed, weights):
    seqs = _sequences(seed, weights=weights)
    scale = _rl_scale(seqs)
    ref, ours = _both(seqs, prl_dppo_kl, scale, dict(method="dppo_tv", aggregation="global_token_sum",
                                                     global_num_tokens=scale))
    _assert_same(ref, ours)
    # token_mean is the same thing when the batch is the whole step: sum w l / sum w
    _, ours_mean = _both(seqs, prl_dppo_kl, scale, dict(method="dppo_tv"))
    _assert_same(ref, ours_mean)


def test_the_parity_data_crosses_every_trust_region():
    hits = torch.zeros(4, dtype=torch.bool)
    for seed in range(3):
        p, _ = _packed(_sequences(seed))
        diff, m, a = p["lp"].exp() - p["ilp"].exp(), p["mask"], p["adv"]
        hits |= torch.stack([((diff > 0.2) & m & (a > 0)).any(), ((diff < -0.2) & m & (a < 0)).any(),
                             ((diff > 0.1) & m).any(), ((diff < -0.1) & m).any()])
    assert hits.all()  # both DPPO masks and both sides of the IPO mask


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("weights", [False, True])
def test_ipo_equals_prime_rl(seed, weights):
    seqs = _sequences(seed, weights=weights)
    ref, ours = _both(seqs, prl_ipo, _rl_scale(seqs), dict(method="ipo"))
    _assert_same(ref, ours)


@pytest.mark.parametrize("seed", [0, 4])
def test_icepop_equals_reinforce_with_the_icepop_correction(seed):
    seqs = _sequences(seed, weights=True)
    ref, ours = _both(seqs, prl_icepop, _rl_scale(seqs),
                      dict(method="reinforce", corrections=("icepop",), icepop_alpha=0.2, icepop_beta=5.0))
    _assert_same(ref, ours)


def test_sequence_min_max_mask_equals_prime_rl():
    seqs = _sequences(5)
    dropped = 0
    for s in seqs:  # which sequences the bounds drop, by prime-rl's rule
        r = (s["lp"] - s["ilp"]).exp()[s["mask"]]
        dropped += bool((r < 0.5).any() or (r > 2.0).any())
    assert 0 < dropped < len(seqs)
    fn = lambda *a: prl_seq_minmax(*a, low=0.5, high=2.0)  # noqa: E731
    ref, ours = _both(seqs, fn, _rl_scale(seqs), dict(method="reinforce", corrections=("sequence_mask",),
                                                      sequence_mask_low=0.5, sequence_mask_high=2.0))
    _assert_same(ref, ours)


@pytest.mark.parametrize("seed", [0, 6])
@pytest.mark.parametrize("prl_fn,method", [(prl_dppo_kl, "dppo_tv"), (prl_ipo, "ipo")])
def test_three_components_each_normalised_on_its_own_tokens(seed, prl_fn, method):
    seqs = _sequences(seed, weights=True, terms=True)
    n_ce = sum(int((s["ce_w"] != 0).sum()) for s in seqs)
    n_ref = sum(int((s["ref_w"] != 0).sum()) for s in seqs)
    scale = _rl_scale(seqs)
    ref, ours = _both(seqs, prl_fn, scale,
                      dict(method=method, aggregation="global_token_sum", global_num_tokens=scale,
                           global_term_tokens={"sft": n_ce, "ref_kl": n_ref}),
                      ce_scale=n_ce, ref_scale=n_ref)
    _assert_same(ref, ours)


def test_zero_advantage_drop_equals_prime_rl_filtering_those_samples():
    """prime-rl's orchestrator drops samples with no signal; drop_zero_advantage gives the same loss
    and gradient while keeping them in the batch."""
    seqs = _sequences(7, zero_adv=(0, 3))
    kept = [s for s in seqs if bool((s["adv"] != 0).any())]
    scale = _rl_scale(kept)
    kept_ref = prl_compute_loss([dict(s, lp=_leaf(s["lp"])) for s in kept], prl_dppo_kl, scale)
    p, cu = _packed(seqs)
    lp = _leaf(p["lp"])
    loss, m = policy_loss(lp, p["ilp"], p["adv"], p["mask"], method="dppo_tv", cu_seqlens=cu, drop_zero_advantage=True)
    torch.testing.assert_close(loss, kept_ref.detach(), **TOL)
    kept_leaves = [_leaf(s["lp"]) for s in kept]
    ref_loss = prl_compute_loss([dict(s, lp=x) for s, x in zip(kept, kept_leaves)], prl_dppo_kl, scale)
    ref_grads = iter(torch.autograd.grad(ref_loss, kept_leaves))
    (grad,) = torch.autograd.grad(loss, lp)
    expect = torch.cat([next(ref_grads) if bool((s["adv"] != 0).any()) else torch.zeros_like(s["lp"]) for s in seqs])
    torch.testing.assert_close(grad, expect, **TOL)
    n_zero = sum(int(s["mask"].sum()) for s in seqs if not bool((s["adv"] != 0).any()))
    assert float(m["zero_adv_frac"]) == pytest.approx(n_zero / int(p["mask"].sum()))


# ---------------------------------------------------------------- advantages
def prl_max_rl(group):
    mean = group.mean()
    return torch.zeros_like(group) if mean <= 0 else (group - mean) / mean


def prl_loo_global_std(groups, all_rewards):
    G = groups.shape[1]
    return (groups - groups.mean(dim=1, keepdim=True)) * G / (G - 1) / all_rewards.std()


def test_max_rl_equals_prime_rl():
    r = torch.tensor([1, 0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0, 0.5, 0.25, 1, 0], dtype=torch.float32)
    out = max_rl(r, 4)
    expect = torch.cat([prl_max_rl(g) for g in r.double().view(-1, 4)])
    torch.testing.assert_close(out.advantages.double(), expect, rtol=1e-6, atol=1e-7)


def test_leave_one_out_with_batch_std_equals_prime_rl():
    r = torch.tensor([1, 0, 0, 0, 1, 1, 0, 1, 0.5, 0.25, 1, 0], dtype=torch.float32)
    out = rloo(r, 4, std_normalize="batch", eps=0.0)
    expect = prl_loo_global_std(r.double().view(-1, 4), r.double()).flatten()
    torch.testing.assert_close(out.advantages.double(), expect, rtol=1e-6, atol=1e-7)
