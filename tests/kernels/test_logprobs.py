"""fused_logprobs (chunked torch and Triton per-chunk kernels) against the full-logits reference.

Metric: max_rel_err = max|a - e| / max|e|; threshold 1e-5 in float32 for values and for the
gradients w.r.t. hidden and weight (the chunked path only reorders float32 sums).
"""

import pytest
import torch

from primerl.kernels.logprobs import fused_logprobs, logprobs_reference
from primerl.kernels.testing import max_rel_err

BACKENDS = ["torch", "triton"]
# (T, V, D, chunk_size, vocab_chunk_size): single chunk, ragged multi-chunk, primes, length 1
CASES = [
    (1, 7, 5, 4, 4),
    (13, 97, 24, 5, 16),
    (37, 101, 16, 8, 32),
    (16, 64, 8, 16, 64),
    (3, 1, 4, 2, 1),
]


def _inputs(T, V, D, seed, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * scale / D**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    return hidden, weight, targets, g


def _grads(logp, ent, hidden, weight, g):
    g_lp = torch.randn(logp.shape, generator=g)
    loss = (logp * g_lp).sum()
    if ent is not None:
        loss = loss + (ent * torch.randn(ent.shape, generator=g)).sum()
    return torch.autograd.grad(loss, (hidden, weight))


# The interpreter is slow: Triton runs the per-token temperature (the general case) only.
VALUE_CASES = [("torch", c, t) for c in CASES for t in ("one", "scalar", "per_token")]
VALUE_CASES += [("triton", c, "per_token") for c in CASES]


@pytest.mark.parametrize("backend,case,temperature", VALUE_CASES)
def test_values_and_grads_match_reference(backend, case, temperature):
    T, V, D, tc, vc = case
    seed = hash((T, V, D, temperature)) % 2**31
    hidden, weight, targets, g = _inputs(T, V, D, seed, scale=3.0)
    temp = {"one": 1.0, "scalar": 0.7, "per_token": torch.rand(T, generator=g) + 0.3}[temperature]
    logp, ent = fused_logprobs(hidden, weight, targets, temperature=temp, chunk_size=tc,
                               vocab_chunk_size=vc, backend=backend)
    ref_lp, ref_ent = logprobs_reference(hidden, weight, targets, temp)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == (T,)
    assert max_rel_err(logp.detach(), ref_lp.detach()) < 1e-5
    assert max_rel_err(ent.detach(), ref_ent.detach()) < 1e-5
    g_state = g.get_state()
    gh, gw = _grads(logp, ent, hidden, weight, g)
    g.set_state(g_state)
    rh, rw = _grads(ref_lp, ref_ent, hidden, weight, g)
    assert max_rel_err(gh, rh) < 1e-5
    assert max_rel_err(gw, rw) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_entropy_gradient_of_logprobs_only(backend):
    hidden, weight, targets, g = _inputs(11, 53, 12, seed=3)
    logp, ent = fused_logprobs(hidden, weight, targets, return_entropy=False, chunk_size=4,
                               vocab_chunk_size=16, backend=backend)
    assert ent is None
    ref_lp, _ = logprobs_reference(hidden, weight, targets, return_entropy=False)
    assert max_rel_err(logp.detach(), ref_lp.detach()) < 1e-5
    gh, gw = _grads(logp, None, hidden, weight, torch.Generator().manual_seed(1))
    rh, rw = _grads(ref_lp, None, hidden, weight, torch.Generator().manual_seed(1))
    assert max_rel_err(gh, rh) < 1e-5 and max_rel_err(gw, rw) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_peaked_logits_stay_finite_and_accurate(backend):
    # Logit scale ~ 60: probabilities saturate to one-hot, the entropy is tiny; exercises the
    # rescaling of the running sums and the cancellation-free entropy.
    hidden, weight, targets, g = _inputs(9, 40, 8, seed=5, scale=150.0)
    logp, ent = fused_logprobs(hidden, weight, targets, chunk_size=4, vocab_chunk_size=8, backend=backend)
    ref_lp, ref_ent = logprobs_reference(hidden, weight, targets)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    assert max_rel_err(logp.detach(), ref_lp.detach()) < 1e-5
    assert (ent.detach() - ref_ent.detach()).abs().max() < 1e-4
    gh, gw = _grads(logp, ent, hidden, weight, torch.Generator().manual_seed(2))
    assert torch.isfinite(gh).all() and torch.isfinite(gw).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_one_input_requires_grad(backend):
    hidden, weight, targets, _ = _inputs(6, 30, 8, seed=7)
    hidden.requires_grad_(False)
    logp, ent = fused_logprobs(hidden, weight, targets, chunk_size=4, vocab_chunk_size=8, backend=backend)
    (gw,) = torch.autograd.grad(logp.sum() + ent.sum(), (weight,))
    ref_lp, ref_ent = logprobs_reference(hidden, weight, targets)
    (rw,) = torch.autograd.grad(ref_lp.sum() + ref_ent.sum(), (weight,))
    assert max_rel_err(gw, rw) < 1e-5


def test_triton_kernels_with_many_small_tiles(monkeypatch):
    # 2x4 tiles: several programs per chunk and several online-softmax steps inside one program
    import primerl.kernels.logprobs.triton as tk

    monkeypatch.setattr(tk, "_FORCE_BLOCKS", (2, 4))
    hidden, weight, targets, g = _inputs(7, 29, 8, seed=13, scale=4.0)
    temp = torch.rand(7, generator=g) + 0.5
    logp, ent = fused_logprobs(hidden, weight, targets, temperature=temp, chunk_size=5, vocab_chunk_size=13,
                               backend="triton")
    ref_lp, ref_ent = logprobs_reference(hidden, weight, targets, temp)
    assert max_rel_err(logp.detach(), ref_lp.detach()) < 1e-5
    assert max_rel_err(ent.detach(), ref_ent.detach()) < 1e-5
    gh, gw = _grads(logp, ent, hidden, weight, torch.Generator().manual_seed(6))
    rh, rw = _grads(ref_lp, ref_ent, hidden, weight, torch.Generator().manual_seed(6))
    assert max_rel_err(gh, rh) < 1e-5 and max_rel_err(gw, rw) < 1e-5


def test_bf16_inputs_match_reference_and_keep_dtype():
    hidden, weight, targets, g = _inputs(10, 70, 16, seed=11, dtype=torch.bfloat16)
    logp, ent = fused_logprobs(hidden, weight, targets, chunk_size=4, vocab_chunk_size=32)
    ref_lp, ref_ent = logprobs_reference(hidden, weight, targets)
    # both upcast the same bf16 values to float32, so the values agree to float32 accuracy
    assert max_rel_err(logp.detach(), ref_lp.detach()) < 1e-5
    assert max_rel_err(ent.detach(), ref_ent.detach()) < 1e-5
    gh, gw = _grads(logp, ent, hidden, weight, torch.Generator().manual_seed(4))
    rh, rw = _grads(ref_lp, ref_ent, hidden, weight, torch.Generator().manual_seed(4))
    assert gh.dtype == gw.dtype == torch.bfloat16
    assert max_rel_err(gh, rh) < 1e-2 and max_rel_err(gw, rw) < 1e-2  # one bf16 rounding each


def test_empty_batch():
    hidden = torch.zeros(0, 8, requires_grad=True)
    weight = torch.randn(5, 8, requires_grad=True)
    logp, ent = fused_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long))
    assert logp.shape == ent.shape == (0,)
    logp.sum().backward()
    assert weight.grad.abs().sum() == 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(targets=torch.tensor([0, 9])), r"targets must lie in \[0, 9\)"),
        (dict(targets=torch.tensor([0.0, 1.0])), "targets must be an integer"),
        (dict(targets=torch.tensor([0, 1, 2])), "targets must be an integer tensor of shape"),
        (dict(temperature=0.0), "temperature must be > 0"),
        (dict(temperature=torch.ones(3)), r"temperature must be a scalar or shape \(2,\)"),
        (dict(temperature=torch.tensor([1.0, -1.0])), "every temperature must be > 0"),
        (dict(weight=torch.randn(9, 3)), r"weight must be \[V, 4\]"),
        (dict(chunk_size=0), "chunk sizes must be >= 1"),
        (dict(backend="cuda"), "not implemented"),
    ],
)
def test_bad_input_raises(kwargs, match):
    args = dict(hidden=torch.randn(2, 4), weight=torch.randn(9, 4), targets=torch.tensor([0, 8]))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        fused_logprobs(args.pop("hidden"), args.pop("weight"), args.pop("targets"), **args)
