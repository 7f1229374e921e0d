"""primerl.rl.distill_advantages: hand-computed cases, options, bad input, and the brute-force
reverse KL (full-distribution gradient and the sampled estimator)."""

import pytest
import torch

from primerl.rl import distill_advantages


def test_hand_computed_per_token():
    ls = torch.tensor([0.0, -1.0, -2.0, -0.5])
    lt = torch.tensor([-9.0, -0.5, -3.0, -0.5])
    mask = torch.tensor([False, True, True, True])
    out = distill_advantages(ls, lt, mask)
    assert out.advantages.tolist() == [0.0, 0.5, -1.0, 0.0]
    # reverse KL estimate: mean over loss tokens of ls - lt = (-0.5 + 1.0 + 0.0) / 3
    assert float(out.reverse_kl) == pytest.approx(0.5 / 3)


def test_clip_coef_and_reward_composition():
    ls = torch.tensor([-1.0, -4.0, -0.1])
    lt = torch.tensor([-3.0, -0.5, -0.1])
    mask = torch.tensor([True, True, False])
    out = distill_advantages(ls, lt, mask, clip=1.0, coef=0.5, reward_advantages=torch.tensor([0.2, 0.2, 0.2]))
    # A = [-2, 3.5, 0] -> clipped [-1, 1, 0] -> * 0.5 -> + 0.2
    assert out.advantages.tolist() == pytest.approx([-0.3, 0.7, 0.2])
    assert float(out.reverse_kl) == pytest.approx((2.0 - 3.5) / 2)  # before the clip
    pure = distill_advantages(ls, lt, mask, coef=2.0)
    assert pure.advantages.tolist() == pytest.approx([-4.0, 7.0, 0.0])
    scalar = distill_advantages(ls, lt, mask, reward_advantages=1.0)
    assert scalar.advantages.tolist() == pytest.approx([-1.0, 4.5, 1.0])


def test_token_and_sequence_normalisation():
    ls = torch.zeros(6)
    lt = torch.tensor([1.0, 3.0, 0.0, 2.0, 4.0, 6.0])
    mask = torch.tensor([True, True, False, True, True, True])
    tok = distill_advantages(ls, lt, mask, normalize="token", eps=0.0).advantages
    a = torch.tensor([1.0, 3.0, 2.0, 4.0, 6.0])
    std = float(a.std(correction=0))
    assert tok.tolist() == pytest.approx([1 / std, 3 / std, 0.0, 2 / std, 4 / std, 6 / std])
    cu = torch.tensor([0, 3, 6])
    seq = distill_advantages(ls, lt, mask, normalize="sequence", cu_seqlens=cu, eps=0.0).advantages
    s1 = float(torch.tensor([1.0, 3.0]).std(correction=0))  # sequence 1's loss tokens only
    s2 = float(torch.tensor([2.0, 4.0, 6.0]).std(correction=0))
    assert seq.tolist() == pytest.approx([1 / s1, 3 / s1, 0.0, 2 / s2, 4 / s2, 6 / s2])
    assert (tok > 0).sum() == 5  # scale only: signs are kept


@pytest.mark.parametrize("kwargs,match", [
    (dict(normalize="batch"), "normalize"),
    (dict(clip=0.0), "clip"),
    (dict(normalize="sequence"), "cu_seqlens"),
    (dict(normalize="sequence", cu_seqlens=torch.tensor([0, 2])), "cu_seqlens"),
])
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        distill_advantages(torch.zeros(3), torch.zeros(3), torch.ones(3, dtype=torch.bool), **kwargs)


def test_bad_tensors():
    m = torch.ones(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="teacher_logprobs"):
        distill_advantages(torch.zeros(3), torch.zeros(4), m)
    with pytest.raises(ValueError, match="loss_mask"):
        distill_advantages(torch.zeros(3), torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError, match="non-finite"):
        distill_advantages(torch.zeros(3), torch.tensor([0.0, float("-inf"), 0.0]), m)
    # a non-finite value outside the loss mask is ignored (a prompt token the teacher never scored)
    out = distill_advantages(torch.zeros(3), torch.tensor([float("nan"), -1.0, 0.0]), torch.tensor([False, True, True]))
    assert out.advantages.tolist() == [0.0, -1.0, 0.0]


def _two_distributions(V=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g, requires_grad=True), torch.randn(V, generator=g)


def test_policy_gradient_is_minus_reverse_kl_gradient_exactly():
    """Summed over the whole vocabulary weighted by pi_S: E_S[A(y) grad log pi_S(y)] = -grad KL(S||T)."""
    s_logits, t_logits = _two_distributions()
    log_s = torch.log_softmax(s_logits, -1)
    log_t = torch.log_softmax(t_logits, -1)
    kl = (log_s.exp() * (log_s - log_t)).sum()
    (grad_kl,) = torch.autograd.grad(kl, s_logits, retain_graph=True)
    V = log_s.numel()
    adv = distill_advantages(log_s.detach(), log_t, torch.ones(V, dtype=torch.bool)).advantages
    surrogate = (log_s.exp().detach() * adv * log_s).sum()  # expectation of A * log pi_S over y ~ pi_S
    (grad_pg,) = torch.autograd.grad(surrogate, s_logits)
    torch.testing.assert_close(grad_pg, -grad_kl, rtol=1e-5, atol=1e-6)


def test_sampled_estimator_matches_full_reverse_kl():
    """Tokens sampled from pi_S: the mean of -A (reverse_kl) and the sampled policy gradient agree with
    the full-distribution reverse KL and its gradient within their sampling error."""
    s_logits, t_logits = _two_distributions(seed=3)
    log_s = torch.log_softmax(s_logits, -1)
    log_t = torch.log_softmax(t_logits, -1)
    kl = (log_s.exp() * (log_s - log_t)).sum()
    (grad_kl,) = torch.autograd.grad(kl, s_logits, retain_graph=True)
    N = 200_000
    y = torch.multinomial(log_s.exp().detach(), N, replacement=True, generator=torch.Generator().manual_seed(1))
    out = distill_advantages(log_s.detach()[y], log_t[y], torch.ones(N, dtype=torch.bool))
    per_token = (log_s - log_t).detach()[y]
    se = float(per_token.std()) / N ** 0.5
    assert abs(float(out.reverse_kl) - float(kl.detach())) < 4 * se
    (grad_pg,) = torch.autograd.grad((out.advantages * log_s[y]).mean(), s_logits)
    err = (grad_pg + grad_kl).abs().max()
    assert err < 0.02, f"sampled policy gradient vs -grad KL: max abs error {float(err):.4f}"


# --- the teacher's top-k term (distill.topk) -------------------------------------------------------

def _head(T=9, D=6, V=13, k=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g, dtype=dtype, requires_grad=True)
    W = torch.randn(V, D, generator=g, dtype=dtype, requires_grad=True)
    y = torch.randint(0, V, (T,), generator=g)
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(T)])
    temp = torch.rand(T, generator=g, dtype=torch.float32) + 0.5
    return h, W, y, ids, temp


@pytest.mark.parametrize("chunk", [2, 64])
def test_student_topk_logprobs_is_the_full_log_softmax_with_its_gradients(chunk):
    """Against log_softmax over the whole vocabulary: values (max abs error < 1e-5) and the gradients
    of hidden and weight (fused log-probs of the sampled tokens carry the log-partition)."""
    from primerl.kernels.logprobs import fused_logprobs
    from primerl.rl import student_topk_logprobs

    h, W, y, ids, temp = _head()
    lp, _ = fused_logprobs(h.float(), W.float(), y, temperature=temp)
    got = student_topk_logprobs(h.float(), W.float(), y, lp, ids, temperature=temp, chunk_size=chunk)
    want = torch.log_softmax((h @ W.T) / temp.double().unsqueeze(1), -1).gather(1, ids)
    assert (got.double() - want).abs().max() < 1e-5
    probe = torch.randn(got.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    g_got = torch.autograd.grad((got.double() * probe).sum(), (h, W))
    g_want = torch.autograd.grad((want * probe).sum(), (h, W))
    for a, b, name in zip(g_got, g_want, ("hidden", "weight")):
        err = float((a - b).abs().max() / b.abs().max())
        assert err < 1e-5, f"{name} gradient: max error {err:.2e} relative to its largest entry"


def test_topk_distill_kl_against_brute_force_and_its_minimum():
    """The renormalised forward KL over the teacher's top-k: equal to the brute-force sum, 0 outside
    the mask, >= 0, and 0 where the student is the teacher's renormalised top-k."""
    from primerl.rl import topk_distill_kl

    g = torch.Generator().manual_seed(2)
    T, V, k = 6, 10, 3
    t_logits, s_logits = torch.randn(T, V, generator=g), torch.randn(T, V, generator=g)
    lt, ls = torch.log_softmax(t_logits, -1), torch.log_softmax(s_logits, -1)
    ids = lt.topk(k, dim=1).indices
    mask = torch.tensor([True, True, False, True, True, True])
    kl = topk_distill_kl(ls.gather(1, ids), lt.gather(1, ids), mask)
    for t in range(T):
        if not mask[t]:
            assert kl[t] == 0
            continue
        p = lt[t, ids[t]].exp()
        q = p / p.sum()
        want = sum(float(q[j] * (q[j].log() - ls[t, ids[t, j]])) for j in range(k))
        assert float(kl[t]) == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert float(kl[t]) >= 0
    q_all = torch.full((T, V), -30.0)
    q_all.scatter_(1, ids, lt.gather(1, ids))
    match = torch.log_softmax(q_all, -1)  # the student that is the teacher's renormalised top-k
    assert topk_distill_kl(match.gather(1, ids), lt.gather(1, ids), mask).abs().max() < 1e-5


def test_topk_bad_shapes():
    from primerl.rl import student_topk_logprobs, topk_distill_kl

    h, W, y, ids, _ = _head()
    with pytest.raises(ValueError, match="topk_ids must be"):
        student_topk_logprobs(h, W, y, torch.zeros(9), ids[:3])
    with pytest.raises(ValueError, match="both be"):
        topk_distill_kl(torch.zeros(9, 4), torch.zeros(9, 3), torch.ones(9, dtype=torch.bool))
    with pytest.raises(ValueError, match="loss_mask"):
        topk_distill_kl(torch.zeros(9, 4), torch.zeros(9, 4), torch.ones(9))
