"""The attention backends that read the offsets on the host, as custom ops (attention/host_ops.py):
``attention(backend="sdpa")`` and the CPU default of ``attention_forward`` / ``attention_backward``
(ring attention's block calls) under torch.compile(fullgraph=True) — bitwise equal to eager with
aot_eager (forward and every gradient), within ``TOL`` with inductor —, FakeTensorMode and meta
tensors; opcheck of the four ops. Fresh random inputs per test."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from primerl.kernels.attention import attention, attention_backward, attention_forward
from primerl.kernels.testing import assert_bitwise_equal, max_rel_err

TOL = 2e-5  # inductor vs eager, float32, relative to the tensor's scale (test_compile_attention.py's)
pytestmark = [pytest.mark.no_poison, pytest.mark.usefixtures("fresh_dynamo")]


def _inputs(seed, lens=(5, 0, 8, 8)):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(T, h, 16, generator=g).requires_grad_() for h in (4, 2, 2))
    return q, k, v, cu


FORMS = {  # attention(backend="sdpa"): causal varlen, with lse, not causal
    "causal": lambda q, k, v, cu: (attention(q, k, v, cu_seqlens=cu, backend="sdpa"),),
    "lse": lambda q, k, v, cu: attention(q, k, v, cu_seqlens=cu, backend="sdpa", return_lse=True),
    "not_causal": lambda q, k, v, cu: (attention(q, k, v, cu_seqlens=cu, causal=False, backend="sdpa"),),
}


def _sdpa_forms(q, k, v, cu):
    return tuple(o for f in FORMS.values() for o in f(q, k, v, cu))


def _ring_block(q, k, v, cu, dout, backend):
    out, lse = attention_forward(q, k, v, cu_seqlens=cu, backend=backend, out_dtype=torch.float32)
    dlse = torch.ones_like(lse) * 0.5
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, dlse=dlse, cu_seqlens=cu, backend=backend)
    return out, lse, dq, dk, dv


def _grads(outs, leaves, seed):
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g)).masked_fill(torch.isinf(o), 0).sum() for o in outs)
    return torch.autograd.grad(loss, leaves)


def _close(a, e, what):
    finite = torch.isfinite(e)
    assert torch.equal(finite, torch.isfinite(a)), f"{what}: -inf pattern differs"
    err = max_rel_err(a[finite], e[finite]) if finite.any() else 0.0
    assert err < TOL, f"{what}: inductor vs eager max rel err {err:.2e} >= {TOL}"


@pytest.mark.parametrize("compiler, form", [*(("aot_eager", f) for f in FORMS), ("inductor", "lse")])
def test_sdpa_attention_fullgraph_forward_backward(compiler, form):
    """One form a graph: several would sum q's gradients in another order than eager's autograd."""
    q, k, v, cu = _inputs(seed=11)
    fn = FORMS[form]
    want = fn(q, k, v, cu)
    want_g = _grads(want, (q, k, v), 12)
    got = torch.compile(fn, backend=compiler, fullgraph=True)(q, k, v, cu)
    got_g = _grads(got, (q, k, v), 12)
    for i, (a, e) in enumerate([*zip(got, want), *zip(got_g, want_g)]):
        if compiler == "aot_eager":
            assert_bitwise_equal(a.detach(), e.detach(), f"sdpa[{i}]")
        else:
            _close(a.detach(), e.detach(), f"sdpa[{i}]")


@pytest.mark.parametrize("backend", (None, "sdpa"))  # None: the CPU default ("torch")
def test_ring_block_ops_are_bitwise_under_aot_eager(backend):
    q, k, v, cu = (t.detach() if t.is_floating_point() else t for t in _inputs(seed=13))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(14))
    want = _ring_block(q, k, v, cu, dout, backend)
    got = torch.compile(_ring_block, backend="aot_eager", fullgraph=True)(q, k, v, cu, dout, backend)
    for i, (a, e) in enumerate(zip(got, want)):
        assert_bitwise_equal(a, e, f"ring[{i}]")


@pytest.mark.parametrize("mode", ("fake", "meta"))
def test_sdpa_and_ring_ops_under_fake_and_meta(mode):
    real = _inputs(seed=15)
    want = _sdpa_forms(*real)
    fake_mode = FakeTensorMode()

    def convert(t):
        if mode == "meta":
            return t.detach().to("meta").requires_grad_(t.requires_grad)
        return fake_mode.from_tensor(t.detach()).requires_grad_(t.requires_grad)

    q, k, v, cu = (convert(t) for t in real)
    with fake_mode if mode == "fake" else torch.device("meta"):
        got = _sdpa_forms(q, k, v, cu)
        grads = torch.autograd.grad(sum(o.sum() for o in got), (q, k, v))
        ring = _ring_block(q.detach(), k.detach(), v.detach(), cu, torch.empty(q.shape), None)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
    assert [tuple(g.shape) for g in grads] == [tuple(t.shape) for t in real[:3]]
    assert [(tuple(t.shape), t.dtype) for t in ring[2:]] == [(tuple(t.shape), torch.float32) for t in real[:3]]


@pytest.mark.parametrize("backend", ("sdpa", "torch"))
def test_opcheck_host_ops(backend):
    q, k, v, cu = (t.detach() if t.is_floating_point() else t for t in _inputs(seed=16))
    fwd = getattr(torch.ops.primerl, f"attention_fwd_{backend}").default
    bwd = getattr(torch.ops.primerl, f"attention_bwd_{backend}").default
    torch.library.opcheck(fwd, (q, k, v, cu, cu, None, None, True, 0.25, torch.float32))
    out, lse = fwd(q, k, v, cu, cu, None, None, True, 0.25, torch.float32)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(17))
    torch.library.opcheck(bwd, (dout, q, k, v, out, lse, None, cu, cu, None, None, True, 0.25))
    torch.library.opcheck(bwd, (dout, q, k, v, out, lse, torch.randn(lse.shape), cu, cu, None, None, False, 0.25))
