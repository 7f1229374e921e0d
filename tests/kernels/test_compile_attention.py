"""primerl.kernels.attention and .sparse_attention under torch.compile(fullgraph=True) (aot_eager and
inductor, forward and backward), FakeTensorMode and meta tensors, with zero host reads, and a new
packing that does not recompile.

Compiled results are compared with eager on fresh random inputs: bitwise with aot_eager (it runs
the same aten ops), and within ``TOL`` (max |a - e| / max |e|) with inductor (fused C++ kernels
reassociate float32 sums).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from primerl.kernels import debug_checks
from primerl.kernels.attention import attention, attention_backward, attention_forward, merge_attn_states, mla_attention
from primerl.kernels.sparse_attention import indexer_topk, sparse_attention
from primerl.kernels.testing import assert_bitwise_equal, count_host_reads, max_rel_err

TOL = 2e-5  # inductor vs eager, float32, relative to the tensor's scale
BACKENDS = ("aot_eager", "inductor")

# torch.compile cannot trace the tests' NaN-poisoning wrapper of torch.empty (a Python function
# around the C builtin), and the meta device context does not reach through it: compiled results are
# compared with eager instead.
pytestmark = [pytest.mark.no_poison, pytest.mark.usefixtures("fresh_dynamo")]


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _leaf(*shape, gen):
    return torch.randn(*shape, generator=gen).requires_grad_()


def _attention_forms(q, k, v, vm, cu, qk_pos):
    """Every dense form in one graph: varlen with lse, explicit positions (non-square keys with a
    padded key), one sequence, and MLA (Dv != Dqk). Returns a tuple of outputs."""
    o1, lse1 = attention(q, k, v, cu_seqlens=cu, return_lse=True)
    q_pos, k_pos = qk_pos
    o2 = attention(q, k, v, cu_seqlens=cu, cu_seqlens_k=cu, q_positions=q_pos, k_positions=k_pos)
    o3 = attention(q, k, v, causal=False)
    o4, lse4 = mla_attention(q, k, vm, cu_seqlens=cu, return_lse=True)
    return o1, lse1, o2, o3, o4, lse4


def _attention_inputs(seed, lens=(5, 0, 8)):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    cu = _cu(lens)
    q, k, v, vm = _leaf(T, 4, 16, gen=g), _leaf(T, 2, 16, gen=g), _leaf(T, 2, 16, gen=g), _leaf(T, 2, 8, gen=g)
    from primerl.kernels.attention.reference import default_positions

    q_pos, k_pos = default_positions(cu, cu, T, T)
    k_pos = k_pos.clone()
    k_pos[1] = -1  # a masked (padding) key
    return (q, k, v, vm, cu, (q_pos, k_pos))


def _loss(outs, seed):
    g = torch.Generator().manual_seed(seed + 1)
    return sum((o * torch.randn(o.shape, generator=g)).masked_fill(torch.isinf(o), 0).sum() for o in outs)


def _run(fn, args, seed):
    outs = fn(*args)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(_loss(outs, seed), leaves)
    return [o.detach() for o in outs], list(grads)


def _compare(backend, got, want, what):
    for i, (a, e) in enumerate(zip(got, want)):
        if backend == "aot_eager":
            assert_bitwise_equal(a, e, f"{what}[{i}]")
        else:
            assert a.shape == e.shape and a.dtype == e.dtype, f"{what}[{i}]"
            finite = torch.isfinite(e)
            assert torch.equal(finite, torch.isfinite(a)), f"{what}[{i}]: -inf pattern differs"
            err = max_rel_err(a[finite], e[finite]) if finite.any() else 0.0
            assert err < TOL, f"{what}[{i}]: inductor vs eager max rel err {err:.2e} >= {TOL}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_forms_fullgraph_forward_backward(backend):
    args = _attention_inputs(seed=1)
    want_out, want_grad = _run(_attention_forms, args, seed=1)
    compiled = torch.compile(_attention_forms, backend=backend, fullgraph=True)
    got_out, got_grad = _run(compiled, args, seed=1)
    _compare(backend, got_out, want_out, "out")
    _compare(backend, got_grad, want_grad, "grad")


def _ring_block(q, k, v, cu, dout):
    """attention_forward / attention_backward (ring attention's per-block calls), merge_attn_states."""
    out, lse = attention_forward(q, k, v, cu_seqlens=cu, out_dtype=torch.float32)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, cu_seqlens=cu)
    merged, mlse = merge_attn_states(out, lse, out * 0.5, lse - 1.0)
    return out, lse, dq, dk, dv, merged, mlse


@pytest.mark.parametrize("backend", ("aot_eager",))  # the same ops as the dense forms above (inductor there)
def test_ring_block_ops_fullgraph(backend):
    q, k, v, _, cu, _ = _attention_inputs(seed=2)
    q, k, v = q.detach(), k.detach(), v.detach()
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    got = torch.compile(_ring_block, backend=backend, fullgraph=True)(q, k, v, cu, dout)
    # eager takes the per-sequence trimmed form; the compiled one the whole-block form: same math
    want = _ring_block(q, k, v, cu, dout)
    for i, (a, e) in enumerate(zip(got, want)):
        finite = torch.isfinite(e)
        assert torch.equal(finite, torch.isfinite(a)), f"ring[{i}]: -inf pattern differs"
        err = max_rel_err(a[finite], e[finite]) if finite.any() else 0.0
        assert err < TOL, f"ring[{i}]: compiled vs eager max rel err {err:.2e}"


def _sparse_inputs(seed, lens=(7, 1, 9)):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    qi, ki, w = torch.randn(T, 4, 16, generator=g), torch.randn(T, 16, generator=g), torch.randn(T, 4, generator=g)
    q, kv = _leaf(T, 4, 24, gen=g), _leaf(T, 1, 24, gen=g)
    return qi, ki, w, q, kv, _cu(lens)


def _sparse_forms(qi, ki, w, q, kv, cu):
    idx = indexer_topk(qi, ki, w, cu_seqlens=cu, topk=4)
    out, lse = sparse_attention(q, kv, kv[..., :16], idx, return_lse=True)
    return idx, out, lse


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_attention_fullgraph_forward_backward(backend):
    args = _sparse_inputs(seed=4)

    def fn(*a):
        idx, out, lse = _sparse_forms(*a)
        return idx, out, lse

    def run(f):
        idx, out, lse = f(*args)
        grads = torch.autograd.grad(_loss((out, lse), 4), (args[3], args[4]))
        return [idx, out.detach(), lse.detach()], list(grads)

    want_out, want_grad = run(fn)
    got_out, got_grad = run(torch.compile(fn, backend=backend, fullgraph=True))
    assert torch.equal(got_out[0], want_out[0]), "indexer_topk: compiled selection differs from eager"
    _compare(backend, got_out[1:], want_out[1:], "sparse out")
    _compare(backend, got_grad, want_grad, "sparse grad")


@pytest.mark.parametrize("mode", ("fake", "meta"))
def test_shapes_under_fake_and_meta(mode):
    def convert(t, fake_mode):
        if not isinstance(t, torch.Tensor):
            return tuple(convert(x, fake_mode) for x in t)
        if mode == "meta":
            return t.detach().to("meta").requires_grad_(t.requires_grad)
        return fake_mode.from_tensor(t.detach()).requires_grad_(t.requires_grad)

    fake_mode = FakeTensorMode()
    real_a, real_s = _attention_inputs(seed=5), _sparse_inputs(seed=5)
    want_a, want_s = _attention_forms(*real_a), _sparse_forms(*real_s)
    a = [convert(t, fake_mode) for t in real_a]
    s = [convert(t, fake_mode) for t in real_s]
    ctx = fake_mode if mode == "fake" else torch.device("meta")
    with ctx:
        got_a, got_s = _attention_forms(*a), _sparse_forms(*s)
        loss = sum(o.sum() for o in got_a if o.dtype.is_floating_point)
        grads = torch.autograd.grad(loss, [a[0], a[1], a[2], a[3]])
    for g, w in zip((*got_a, *got_s), (*want_a, *want_s)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{mode}: {g.shape}/{g.dtype} vs {w.shape}/{w.dtype}"
    for g, leaf in zip(grads, real_a[:4]):
        assert g.shape == leaf.shape and g.dtype == leaf.dtype


def test_no_host_reads_forward_backward():
    a, s = _attention_inputs(seed=6), _sparse_inputs(seed=6)
    with debug_checks(False), count_host_reads() as reads:
        outs = _attention_forms(*a)
        _, out, lse = _sparse_forms(*s)
        _loss((*outs, out, lse), 6).backward()
    assert reads.total == 0, f"host reads: {reads.counts} at {reads.where}"


def test_bad_values_still_raise_without_debug_mode():
    q, k, v, _, cu, _ = _attention_inputs(seed=7)
    bad = cu.clone()
    bad[1] = 99
    with debug_checks(False), pytest.raises(RuntimeError, match="cu_seqlens must start at 0"):
        attention(q, k, v, cu_seqlens=bad)
    qi, ki, w, qs, kv, cu = _sparse_inputs(seed=7)
    idx = torch.full((qs.shape[0], 4), qs.shape[0], dtype=torch.int32)  # out of range
    with debug_checks(False), pytest.raises(RuntimeError, match="indices must be in"):
        sparse_attention(qs, kv, kv[..., :16], idx)
    with pytest.raises(ValueError, match="indices must be in"):  # debug mode (the tests' default): the values
        sparse_attention(qs, kv, kv[..., :16], idx)


def test_new_packings_do_not_recompile():
    """8 packings (other cu_seqlens, other token and sequence counts) through dynamic=True: at most
    2 graphs (forward and backward are counted together as one compiled frame here)."""
    frames = []

    def counting_backend(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    def fn(q, k, v, cu, qi, ki, w, qs, kv):
        o, lse = attention(q, k, v, cu_seqlens=cu, return_lse=True)
        idx = indexer_topk(qi, ki, w, cu_seqlens=cu, topk=4)
        os_ = sparse_attention(qs, kv, kv[..., :16], idx)
        return o.sum() + lse.sum() + os_.sum()

    compiled = torch.compile(fn, backend=counting_backend, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(8)
    for lens in [(5, 8), (3, 3, 4), (12,), (2, 9, 1, 6), (7, 7), (4, 1, 1, 10, 3), (9, 2), (6, 5, 4)]:
        T = sum(lens)
        args = (torch.randn(T, 4, 16, generator=g), torch.randn(T, 2, 16, generator=g),
                torch.randn(T, 2, 16, generator=g), _cu(lens), torch.randn(T, 4, 16, generator=g),
                torch.randn(T, 16, generator=g), torch.randn(T, 4, generator=g), torch.randn(T, 4, 24, generator=g),
                torch.randn(T, 1, 24, generator=g))
        got = compiled(*args)
        want = fn(*args)
        assert max_rel_err(got, want) < TOL
    assert len(frames) <= 2, f"{len(frames)} graphs compiled over 8 packings"
