import pytest
import torch

from primerl.rl.advantages import drgrpo, grpo, linear_length_penalty, max_rl, rloo


def _rewards(groups, size, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, (groups * size,), generator=g).float() + torch.rand(groups * size, generator=g)


@pytest.mark.parametrize("size", [2, 3, 8])
def test_grpo_matches_per_group_formula(size):
    r = _rewards(5, size, seed=size)
    out = grpo(r, size)
    for g in range(5):
        x = r[g * size:(g + 1) * size].double()
        expect = (x - x.mean()) / (x.std(unbiased=True) + 1e-6)
        torch.testing.assert_close(out.advantages[g * size:(g + 1) * size].double(), expect, rtol=1e-6, atol=1e-6)
    biased = grpo(r, size, unbiased_std=False, eps=0.0)
    x = r[:size].double()
    torch.testing.assert_close(biased.advantages[:size].double(), (x - x.mean()) / x.std(unbiased=False),
                               rtol=1e-6, atol=1e-6)
    assert out.advantages.dtype == torch.float32


def test_drgrpo_is_mean_centred_and_equals_grpo_without_std():
    r = _rewards(4, 6, seed=1)
    d = drgrpo(r, 6).advantages
    torch.testing.assert_close(d.view(4, 6).sum(1), torch.zeros(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(d, grpo(r, 6, std_normalize=False).advantages)


def test_rloo_leave_one_out_closed_form():
    r = torch.tensor([1.0, 0.0, 0.0, 3.0, 2.0, 2.0, 5.0, 1.0])
    a = rloo(r, 4).advantages
    # group 0: baselines (0+0+3)/3=1, (1+0+3)/3=4/3, 4/3, (1+0+0)/3=1/3
    torch.testing.assert_close(a[:4], torch.tensor([0.0, -4 / 3, -4 / 3, 8 / 3]))
    x = r[4:]
    torch.testing.assert_close(a[4:], 4 / 3 * (x - x.mean()))


def test_rloo_std_normalisation_closed_form():
    r = torch.tensor([1.0, 0.0, 0.0, 3.0, 2.0, 2.0, 2.0, 2.0])
    plain = rloo(r, 4).advantages
    # group 0: mean 1, unbiased std sqrt((0+1+1+4)/3) = sqrt(2); group 1 is uniform (0, flagged)
    g = rloo(r, 4, std_normalize="group", eps=0.0)
    torch.testing.assert_close(g.advantages[:4], plain[:4] / 2**0.5)
    assert (g.advantages[4:] == 0).all() and g.uniform_groups.tolist() == [False, True]
    b = rloo(r, 4, std_normalize="batch", eps=0.0)  # std of all 8 rewards: mean 1.5, sum sq dev 8 -> sqrt(8/7)
    torch.testing.assert_close(b.advantages, plain / (8 / 7) ** 0.5)
    with pytest.raises(ValueError, match="std_normalize must be None, 'group' or 'batch'"):
        rloo(r, 4, std_normalize="global")


def test_max_rl_closed_form():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, 1.0, 0.0, 0.0])
    out = max_rl(r, 4)
    # mean 1/4: (r - 1/4) * 4 = [3, -1, -1, -1]; mean 3/4: (r - 3/4) * 4/3; all 0: uniform; mean 0 <= 0: no signal
    torch.testing.assert_close(out.advantages[:4], torch.tensor([3.0, -1.0, -1.0, -1.0]))
    torch.testing.assert_close(out.advantages[4:8], torch.tensor([1 / 3, 1 / 3, 1 / 3, -1.0]))
    assert (out.advantages[8:] == 0).all()
    assert out.uniform_groups.tolist() == [False, False, True, True]


@pytest.mark.parametrize("fn", [grpo, drgrpo, rloo, max_rl])
def test_uniform_groups_get_zero_and_are_reported(fn):
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 0.7, 0.7, 0.7])
    out = fn(r, 3)
    assert out.uniform_groups.tolist() == [True, False, True]
    assert (out.advantages[:3] == 0).all() and (out.advantages[6:] == 0).all()
    assert (out.advantages[3:6] != 0).all()
    assert out.sample_mask.tolist() == [False] * 3 + [True] * 3 + [False] * 3
    adv, uniform = out  # unpacks like a tuple
    assert adv is out.advantages


def test_length_penalty_is_linear_and_applied_before_normalisation():
    r = torch.tensor([1.0, 1.0, 0.0, 0.0])
    lengths = torch.tensor([10, 20, 10, 40])
    pen = linear_length_penalty(r, lengths, coef=0.5, max_length=40)
    torch.testing.assert_close(pen, torch.tensor([1 - 0.125, 1 - 0.25, -0.125, -0.5]))
    out = drgrpo(r, 2, lengths=lengths, length_coef=0.5, max_length=40)
    torch.testing.assert_close(out.advantages, torch.tensor([0.0625, -0.0625, 0.1875, -0.1875]))
    assert not out.uniform_groups.any()  # the penalty broke the tie in group 0


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: grpo(torch.ones(5), 2), "multiple of group_size"),
        (lambda: grpo(torch.ones(4, 1), 2), "1-D"),
        (lambda: rloo(torch.ones(4), 1), "group_size must be >= 2"),
        (lambda: grpo(torch.ones(4), 1), "unbiased std needs group_size >= 2"),
        (lambda: drgrpo(torch.tensor([1.0, float("nan")]), 2), "NaN"),
        (lambda: drgrpo(torch.ones(2), 2, length_coef=0.1), "needs lengths"),
        (lambda: linear_length_penalty(torch.ones(2), torch.ones(3), 0.1), "lengths must have shape"),
    ],
)
def test_bad_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("fn", [grpo, drgrpo, rloo, max_rl])
def test_huge_finite_rewards_give_finite_advantages(fn):
    """Rewards near float32's limit (1e38): float32 group sums / squares would overflow to inf and
    the advantages to NaN; computed in float64 they match the closed form on the rewards scaled down."""
    torch.manual_seed(3)
    small = torch.rand(16) * 2 - 0.5
    big = small * 1e38
    got = fn(big, 4).advantages
    want = fn(small.double(), 4).advantages.double()
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    scale = 1.0 if fn in (grpo, max_rl) else 1e38  # grpo / max_rl are scale-free, the others scale with r
    # (grpo: eps = 1e-6 next to a std of ~0.5 in the small run)
    assert torch.allclose(got.double() / scale, want, rtol=1e-5, atol=1e-6), (got, want)


def test_advantages_that_do_not_fit_float32_are_refused():
    with pytest.raises(ValueError, match="rloo: advantages do not fit float32"):
        rloo(torch.tensor([3e38, -3e38]), 2)  # A = +-6e38
