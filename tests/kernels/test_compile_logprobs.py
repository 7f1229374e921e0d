"""fused_logprobs under torch.compile (fullgraph; aot_eager and inductor; forward and backward),
FakeTensorMode and meta tensors; opcheck of its custom ops; no host reads; and the options
ignore_index / bias / 3-D input against the float64 full-logits reference.

Compiled vs eager: bitwise (the chunk loop is one custom op per direction; what surrounds it —
masking by ignore_index, the bias column, reshapes — is exact). Options vs the reference: metric
max_rel_err (max|a - e| / max|e|) below 1e-5 for log-probs, entropies and every gradient, as in
test_logprobs.py.
"""

import torch
import pytest
from torch._subclasses.fake_tensor import FakeTensorMode

import primerl.kernels as K
from primerl.kernels.logprobs import fused_logprobs
from primerl.kernels.logprobs.op import fused_logprobs_bwd, fused_logprobs_fwd
from primerl.kernels.testing import assert_bitwise_equal, count_host_reads, max_rel_err

T, D, V = 11, 8, 37
CHUNKS = dict(chunk_size=4, vocab_chunk_size=16)  # several token and vocabulary chunks


def _inputs(seed, dtype=torch.float32, B=None):
    g = torch.Generator().manual_seed(seed)
    lead = (T,) if B is None else (B, T)
    hidden = torch.randn(*lead, D, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) / D**0.5).to(dtype).requires_grad_()
    bias = torch.randn(V, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, V, lead, generator=g)
    ignored = torch.rand(lead, generator=g) < 0.3
    targets_ig = torch.where(ignored, torch.full_like(targets, -100), targets)
    temp = torch.rand(lead, generator=g) + 0.5
    return hidden, weight, bias, targets, targets_ig, temp, g


def _variants(hidden, weight, bias, targets, targets_ig, temp, h3, t3):
    """Every option in one graph: plain, per-token temperature, bias + ignore_index, 3-D, no entropy."""
    out = []
    out += fused_logprobs(hidden, weight, targets, **CHUNKS)
    out += fused_logprobs(hidden, weight, targets, temperature=temp, **CHUNKS)
    out += fused_logprobs(hidden, weight, targets_ig, bias=bias, temperature=0.7, **CHUNKS)
    out += fused_logprobs(h3, weight, t3, **CHUNKS)
    out.append(fused_logprobs(hidden, weight, targets, return_entropy=False, **CHUNKS)[0])
    return tuple(out)


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_compiled_forward_and_backward_bitwise_equal_eager(compile_backend):
    hidden, weight, bias, targets, targets_ig, temp, g = _inputs(1)
    h3 = torch.randn(2, 5, D, generator=g).requires_grad_()
    t3 = torch.randint(0, V, (2, 5), generator=g)
    args = (hidden, weight, bias, targets, targets_ig, temp, h3, t3)
    leaves = (hidden, weight, bias, h3)
    torch._dynamo.reset()
    with K.debug_checks(False):
        eager = _variants(*args)
        compiled = torch.compile(_variants, backend=compile_backend, fullgraph=True)(*args)
    upstream = [torch.randn(o.shape, generator=g) for o in eager]
    want = torch.autograd.grad(eager, leaves, upstream)
    got = torch.autograd.grad(compiled, leaves, upstream)
    for i, (a, e) in enumerate(zip(compiled, eager)):
        assert_bitwise_equal(a, e, f"output {i}")
    for name, a, e in zip(("hidden", "weight", "bias", "hidden 3-D"), got, want):
        assert_bitwise_equal(a, e, f"grad {name}")


def test_dynamic_shapes_one_graph_over_lengths():
    """A new token count does not recompile (dynamic=True: one frame for four lengths)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(V, D, generator=g)

    def f(h, t):
        lp, ent = fused_logprobs(h, weight, t, **CHUNKS)
        return lp + ent

    cf = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    with K.debug_checks(False):
        for n in (5, 9, 13, 17):
            h, t = torch.randn(n, D, generator=g), torch.randint(0, V, (n,), generator=g)
            assert_bitwise_equal(cf(h, t), f(h, t), f"T={n}")
    assert counter.frame_count == 1


@pytest.mark.parametrize("mode", ["fake", "meta"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_and_meta_shapes_and_dtypes(mode, dtype):
    def run(hidden, weight, bias, targets):
        lp, ent = fused_logprobs(hidden, weight, targets, bias=bias, temperature=torch.full(targets.shape, 0.9,
                                                                                            device=hidden.device),
                                 **CHUNKS)
        gh, gw, gb = torch.autograd.grad((lp + ent).sum(), (hidden, weight, bias))
        return lp, ent, gh, gw, gb

    def make(device):
        return (torch.randn(3, T, D, dtype=dtype, device=device, requires_grad=True),
                torch.randn(V, D, dtype=dtype, device=device, requires_grad=True),
                torch.randn(V, dtype=dtype, device=device, requires_grad=True),
                torch.randint(0, V, (3, T), device=device))

    if mode == "fake":
        with FakeTensorMode(), count_host_reads() as reads:
            lp, ent, gh, gw, gb = run(*make("cpu"))
        assert reads.total == 0
    else:
        lp, ent, gh, gw, gb = run(*make("meta"))
    assert lp.shape == ent.shape == (3, T) and lp.dtype == ent.dtype == torch.float32
    assert gh.shape == (3, T, D) and gw.shape == (V, D) and gb.shape == (V,)
    assert gh.dtype == gw.dtype == gb.dtype == dtype


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck_custom_ops(backend):
    g = torch.Generator().manual_seed(3)
    t, d, v = 5, 4, 9
    hidden = torch.randn(t, d, generator=g, requires_grad=True)
    weight = torch.randn(v, d, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (t,), generator=g)
    inv_temp = torch.rand(t, generator=g) + 0.5
    fwd_args = (hidden, weight, targets, inv_temp, False, 2, 4, True, backend)
    torch.library.opcheck(fused_logprobs_fwd, fwd_args)
    with torch.no_grad():  # the backward op has no autograd of its own (no double backward)
        lp, ent, m, ls, c = fused_logprobs_fwd(*fwd_args)
    g_lp, g_ent = torch.randn(t, generator=g), torch.randn(t, generator=g)
    for need in ((True, True), (True, False), (False, True)):
        bwd_args = (hidden.detach(), weight.detach(), targets, inv_temp, lp, ent, m, ls, c, g_lp,
                    g_ent, False, 2, 4, *need, backend)
        torch.library.opcheck(fused_logprobs_bwd, bwd_args)
    torch.library.opcheck(fused_logprobs_bwd, bwd_args[:10] + (None,) + bwd_args[11:])  # entropy unused


def test_no_host_reads_forward_and_backward():
    hidden, weight, bias, targets, targets_ig, temp, _ = _inputs(4)
    with K.debug_checks(False), count_host_reads() as reads:
        lp, ent = fused_logprobs(hidden, weight, targets_ig, bias=bias, temperature=temp, **CHUNKS)
        (lp.sum() + ent.sum()).backward()
    assert reads.total == 0, reads.where


def _reference(hidden, weight, bias, targets, temperature, ignore_index=-100):
    """float64 full logits (+ bias), log-softmax; 0 at ignored targets. -> (logprobs, entropy) [...]"""
    logits = hidden.double() @ weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    t = temperature.double().unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
    logp_all = torch.log_softmax(logits / t, dim=-1)
    valid = targets != ignore_index
    lp = logp_all.gather(-1, torch.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(valid, lp, zero), torch.where(valid, ent, zero)


def _check(got, want, leaves, g):
    upstream = [torch.randn(w.shape, generator=g, dtype=torch.float64) for w in want]
    for a, e in zip(got, want):
        assert a.dtype == torch.float32 and a.shape == e.shape
        assert max_rel_err(a.detach(), e.detach()) < 1e-5
    ga = torch.autograd.grad(got, leaves, [u.float() for u in upstream])
    ge = torch.autograd.grad(want, leaves, upstream)
    for a, e in zip(ga, ge):
        assert max_rel_err(a, e) < 1e-5
    return ga


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ignore_index_bias_and_3d_match_reference(backend):
    hidden, weight, bias, targets, targets_ig, temp, g = _inputs(5, B=2)
    assert (targets_ig == -100).any() and (targets_ig != -100).any()
    got = fused_logprobs(hidden, weight, targets_ig, bias=bias, temperature=temp, backend=backend, **CHUNKS)
    want = _reference(hidden, weight, bias, targets_ig, temp)
    gh, _, _ = _check(got, want, (hidden, weight, bias), g)
    ignored = targets_ig == -100
    assert (got[0][ignored] == 0).all() and (got[1][ignored] == 0).all()
    assert (gh[ignored] == 0).all()  # no gradient through an ignored target


def test_3d_equals_flattened_2d_bitwise():
    hidden, weight, _, targets, targets_ig, temp, _ = _inputs(6, B=3)
    lp3, ent3 = fused_logprobs(hidden, weight, targets_ig, temperature=temp, **CHUNKS)
    lp2, ent2 = fused_logprobs(hidden.reshape(-1, D), weight, targets_ig.reshape(-1), temperature=temp.reshape(-1),
                               **CHUNKS)
    assert_bitwise_equal(lp3, lp2.view(3, T), "logprobs")
    assert_bitwise_equal(ent3, ent2.view(3, T), "entropy")


def test_ignore_index_none_and_custom():
    hidden, weight, _, targets, _, _, g = _inputs(7)
    # a custom in-vocabulary ignore_index ignores those targets
    t = targets.clone()
    t[:3] = 5
    got = fused_logprobs(hidden, weight, t, ignore_index=5, **CHUNKS)
    want = _reference(hidden, weight, None, t, 1.0, ignore_index=5)
    _check(got, want, (hidden, weight), g)
    # ignore_index=None: -100 is out of the vocabulary (debug mode names the range)
    t[0] = -100
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 37\): got range \[-100"):
        fused_logprobs(hidden, weight, t, ignore_index=None)
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 37\) \(or ignore_index=-100\)"):
        fused_logprobs(hidden, weight, torch.full((T,), V))
    with pytest.raises(ValueError, match="ignore_index must be an int or None"):
        fused_logprobs(hidden, weight, targets, ignore_index=1.5)


def test_bad_bias_and_shapes_raise():
    hidden, weight, bias, targets, *_ = _inputs(8)
    with pytest.raises(ValueError, match=r"bias must be a \[37\] tensor of weight's dtype"):
        fused_logprobs(hidden, weight, targets, bias=bias[:-1])
    with pytest.raises(ValueError, match=r"bias must be a \[37\] tensor of weight's dtype"):
        fused_logprobs(hidden, weight, targets, bias=bias.double())
    with pytest.raises(ValueError, match=r"targets must be an integer tensor of shape \(2, 11\)"):
        fused_logprobs(hidden.detach().expand(2, T, D), weight, targets)
    with pytest.raises(ValueError, match=r"temperature must be a scalar or shape \(11,\)"):
        fused_logprobs(hidden, weight, targets, temperature=torch.ones(3))


def test_device_assertion_without_debug_mode():
    """Outside debug mode a bad target still fails (torch._assert_async: RuntimeError on CPU)."""
    hidden, weight, _, targets, *_ = _inputs(9)
    with K.debug_checks(False), pytest.raises(RuntimeError, match=r"targets must lie in \[0, 37\)"):
        fused_logprobs(hidden, weight, torch.full((T,), V))
    with K.debug_checks(False), pytest.raises(RuntimeError, match="every temperature must be > 0"):
        fused_logprobs(hidden, weight, targets, temperature=torch.zeros(T))
