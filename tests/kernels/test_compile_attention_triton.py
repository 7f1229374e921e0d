"""The attention and sparse-attention Triton launchers as ``primerl::`` custom ops (attention/triton_ops.py,
sparse_attention/triton_ops.py): opcheck of each op, the public ops with ``backend="triton"`` under
``torch.compile(fullgraph=True, backend="aot_eager")`` forward and backward bitwise equal to eager,
their shapes and dtypes under FakeTensorMode, and no host read of ``cu_seqlens`` when the caller
gives ``max_seqlen`` (the ops read the offsets themselves only without it).

Under TRITON_INTERPRET=1 (tests/conftest.py), tiny shapes.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from primerl.kernels import backend_status, debug_checks
from primerl.kernels.attention import attention, attention_backward, attention_forward, merge_attn_states, \
    merge_attn_states_, mla_attention
from primerl.kernels.sparse_attention import indexer_topk, sparse_attention
from primerl.kernels.testing import assert_bitwise_equal, count_host_reads

pytestmark = [pytest.mark.no_poison,  # compiled code cannot trace the tests' poisoned torch.empty
              pytest.mark.usefixtures("fresh_dynamo"),
              pytest.mark.skipif(not backend_status("triton").available, reason="Triton unavailable")]

LENS = (5, 0, 11)  # an empty sequence; 11 rows: one partial interpreter block


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    T = sum(LENS)
    leaf = lambda *s: torch.randn(*s, generator=g).requires_grad_()  # noqa: E731
    # attention: GQA 4/2 heads, D 16; MLA: Dqk 24, Dv 8; sparse: indexer 4 x 16, absorbed kv 24 wide
    return dict(q=leaf(T, 4, 16), k=leaf(T, 2, 16), v=leaf(T, 2, 16), qm=leaf(T, 4, 24), km=leaf(T, 2, 24),
                vm=leaf(T, 2, 8), qi=torch.randn(T, 4, 16, generator=g), ki=torch.randn(T, 16, generator=g),
                w=torch.randn(T, 4, generator=g), qs=leaf(T, 4, 24), kv=leaf(T, 24), cu=_cu(LENS))


def _forms(q, k, v, qm, km, vm, qi, ki, w, qs, kv, cu, max_seqlen=None, backend="triton"):
    """Every Triton form in one graph; outputs as a tuple."""
    kw = dict(cu_seqlens=cu, return_lse=True, backend=backend, max_seqlen=max_seqlen)
    o1, l1 = attention(q, k, v, **kw)
    pos = torch.arange(q.shape[0], dtype=torch.int32) - cu[:-1].repeat_interleave(cu.diff(), output_size=q.shape[0])
    o2 = attention(q, k, v, cu_seqlens=cu, q_positions=pos, k_positions=pos, backend=backend,
                   max_seqlen=max_seqlen)
    o3, l3 = mla_attention(qm, km, vm, **kw)
    idx = indexer_topk(qi, ki, w, cu_seqlens=cu, topk=4, backend=backend, max_seqlen=max_seqlen)
    kv3 = kv[:, None, :]
    o4, l4 = sparse_attention(qs, kv3, kv3[..., :16], idx, return_lse=True, backend=backend)  # fused dK/dV
    o5 = sparse_attention(qs, kv3, kv3[..., 8:], idx, backend=backend)  # a view, not k's first columns
    return o1, l1, o2, o3, l3, idx, o4, l4, o5


ARGS = ("q", "k", "v", "qm", "km", "vm", "qi", "ki", "w", "qs", "kv", "cu")
LEAVES = ("q", "k", "v", "qm", "km", "vm", "qs", "kv")


def _run(fn, d, **kw):
    outs = fn(*(d[a] for a in ARGS), **kw)
    g = torch.Generator().manual_seed(99)
    loss = sum((o * torch.randn(o.shape, generator=g)).masked_fill(torch.isinf(o), 0).sum()
               for o in outs if o.dtype.is_floating_point)
    grads = torch.autograd.grad(loss, [d[a] for a in LEAVES])
    return [o.detach() for o in outs], list(grads)


def test_triton_forms_compile_fullgraph_bitwise():
    d = _inputs(seed=1)
    want_out, want_grad = _run(_forms, d)
    got_out, got_grad = _run(torch.compile(_forms, backend="aot_eager", fullgraph=True), d)
    for i, (a, e) in enumerate(zip(got_out, want_out)):
        assert_bitwise_equal(a, e, f"out[{i}]")
    for name, a, e in zip(LEAVES, got_grad, want_grad):
        assert_bitwise_equal(a, e, f"grad {name}")


def test_triton_forms_match_the_reference():
    """The ops compute what the torch backend computes (so the bitwise test above compares right answers)."""
    from primerl.kernels.testing import max_rel_err

    d = _inputs(seed=2)
    got_out, got_grad = _run(_forms, d)

    want_out, want_grad = _run(_forms, d, backend="torch")
    assert torch.equal(got_out[5], want_out[5]), "indexer selection"
    for i, (a, e) in enumerate(zip(got_out, want_out)):
        if a.dtype.is_floating_point:
            fin = torch.isfinite(e)
            assert torch.equal(fin, torch.isfinite(a)) and max_rel_err(a[fin], e[fin]) < 1e-5, f"out[{i}]"
    for name, a, e in zip(LEAVES, got_grad, want_grad):
        assert max_rel_err(a, e) < 1e-5, f"grad {name}"


@pytest.mark.parametrize("mode", ("fake", "meta"))
def test_shapes_under_fake_tensor_mode_and_meta(mode):
    d = _inputs(seed=3)
    want_out, want_grad = _run(_forms, d)
    fake_mode = FakeTensorMode()
    if mode == "fake":
        ctx = fake_mode
        fake = {a: fake_mode.from_tensor(t.detach()).requires_grad_(t.requires_grad) for a, t in d.items()}
    else:
        ctx = torch.device("meta")
        fake = {a: t.detach().to("meta").requires_grad_(t.requires_grad) for a, t in d.items()}
    with ctx:
        got_out, got_grad = _run(_forms, fake)
    for g, w in zip((*got_out, *got_grad), (*want_out, *want_grad)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{g.shape}/{g.dtype} vs {w.shape}/{w.dtype}"


def test_no_host_read_of_the_offsets_with_max_seqlen(monkeypatch):
    """count_host_reads cannot see inside a custom op, so the ops' own reads of cu_seqlens (the grid
    sizes) are trapped where they happen: with max_seqlen given there is none."""
    import primerl.kernels.attention.spec as A
    import primerl.kernels.sparse_attention.triton as ST

    d = _inputs(seed=4)
    want_out, want_grad = _run(_forms, d)  # without max_seqlen: the ops read the offsets
    A._CU_CACHE.clear()
    reads = []
    real_values, real_longest = A._host_values, ST._longest
    monkeypatch.setattr(A, "_host_values", lambda cu: reads.append("attention") or real_values(cu))
    monkeypatch.setattr(ST, "_longest", lambda cu: reads.append("indexer") or real_longest(cu))
    with debug_checks(False), count_host_reads() as counted:
        got_out, got_grad = _run(_forms, d, max_seqlen=max(LENS))
    assert reads == [] and counted.total == 0, f"{reads} {counted.counts} at {counted.where}"
    for a, e in zip((*got_out, *got_grad), (*want_out, *want_grad)):
        assert_bitwise_equal(a, e, "max_seqlen given vs read")
    q, k, v, qi, ki, w, cu = (d[a].detach() for a in ("q", "k", "v", "qi", "ki", "w", "cu"))
    attention(q, k, v, cu_seqlens=cu, backend="triton")
    indexer_topk(qi, ki, w, cu_seqlens=cu, topk=4, backend="triton")
    assert reads == ["attention", "attention", "indexer"], reads  # without it the ops do read (the trap works)


def test_ring_block_ops_and_merge_compile():
    """attention_forward / attention_backward / merge_attn_states(_) with backend="triton"."""
    d = _inputs(seed=5)
    q, k, v, cu = (d[a].detach() for a in ("q", "k", "v", "cu"))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(6))

    def fn(q, k, v, cu, dout):
        out, lse = attention_forward(q, k, v, cu_seqlens=cu, backend="triton", out_dtype=torch.float32)
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, cu_seqlens=cu, backend="triton")
        m, ml = merge_attn_states(out, lse, out * 0.5, lse - 1.0, backend="triton")
        acc, acc_lse = out.clone(), lse.clone()
        merge_attn_states_(acc, acc_lse, out * 2.0, lse + 0.5, backend="triton")
        return out, lse, dq, dk, dv, m, ml, acc, acc_lse

    want = fn(q, k, v, cu, dout)
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, cu, dout)
    for i, (a, e) in enumerate(zip(got, want)):
        assert_bitwise_equal(a, e, f"ring[{i}]")


def _opcheck_samples():
    import primerl.kernels.attention.triton_ops  # noqa: F401  (registers the ops)
    import primerl.kernels.sparse_attention.triton_ops  # noqa: F401

    g = torch.Generator().manual_seed(7)
    T, cu = sum(LENS), _cu(LENS)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v = r(T, 4, 16), r(T, 2, 16), r(T, 2, 16)
    out, lse = torch.ops.primerl.attention_fwd_triton(q, k, v, cu, cu, None, None, True, 0.25, None, None,
                                                      torch.float32)
    qm, km, vm = r(T, 4, 24), r(T, 2, 24), r(T, 2, 8)
    outm, lsem = torch.ops.primerl.mla_attention_fwd_triton(qm, km, vm, cu, cu, None, None, True, 0.2, 11, 11,
                                                            torch.float32)
    pos = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], dtype=torch.int32)
    qs, kv = r(T, 4, 24), r(T, 1, 24)
    idx = torch.ops.primerl.indexer_topk_triton(r(T, 4, 16), r(T, 16), r(T, 4), cu, None, None, None, 4, 0.25,
                                                None, None)
    outs, lses = torch.ops.primerl.sparse_attention_fwd_triton(qs, kv, kv[..., :16], idx, 0.2, torch.float32)
    return [
        ("attention_fwd_triton", (q, k, v, cu, cu, None, None, True, 0.25, None, None, torch.float32)),
        ("attention_fwd_triton", (q, k, v, cu, cu, pos, pos, False, 0.25, 11, 11, torch.float32)),
        ("attention_bwd_triton", (r(T, 4, 16), q, k, v, out, lse, r(4, T), cu, cu, None, None, True, 0.25, None,
                                  None)),
        ("mla_attention_fwd_triton", (qm, km, vm, cu, cu, None, None, True, 0.2, 11, 11, torch.float32)),
        ("mla_attention_bwd_triton", (r(T, 4, 8), qm, km, vm, outm, lsem, None, cu, cu, None, None, True, 0.2,
                                      None, None)),
        ("merge_attn_states_triton", (out, lse, r(T, 4, 16), r(4, T))),
        ("merge_attn_states_triton_", (out.clone(), lse.clone(), r(T, 4, 16), r(4, T))),
        ("indexer_topk_triton", (r(T, 4, 16), r(T, 16), r(T, 4), cu, None, None, None, 4, 0.25, 11, None)),
        ("indexer_topk_triton", (r(T, 4, 16), r(T, 16), r(T, 4), cu, cu, pos, pos, 3, 0.25, None, None)),
        ("sparse_attention_fwd_triton", (qs, kv, r(T, 1, 16), idx, 0.2, torch.float32)),
        ("sparse_attention_bwd_triton", (r(T, 4, 16), qs, kv, r(T, 1, 16), idx, outs, lses, r(4, T), 0.2, False)),
        ("sparse_attention_bwd_triton", (r(T, 4, 16), qs, kv, kv[..., :16], idx, outs, lses, None, 0.2, True)),
    ]


_SAMPLES = _opcheck_samples() if backend_status("triton").available else []


@pytest.mark.parametrize("op,args", _SAMPLES, ids=[f"{s[0]}-{i}" for i, s in enumerate(_SAMPLES)])
def test_opcheck(op, args):
    torch.library.opcheck(getattr(torch.ops.primerl, op).default, args)


def test_new_packings_do_not_recompile():
    """6 packings (other cu_seqlens, token and sequence counts) through dynamic=True with the Triton
    ops: at most 2 graphs, each result equal to eager."""
    frames = []

    def counting_backend(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    def fn(q, k, v, cu, qi, ki, w, qs, kv):
        o, lse = attention(q, k, v, cu_seqlens=cu, return_lse=True, backend="triton")
        idx = indexer_topk(qi, ki, w, cu_seqlens=cu, topk=4, backend="triton")
        return o.sum() + lse.sum() + sparse_attention(qs, kv, kv[..., :16], idx, backend="triton").sum()

    compiled = torch.compile(fn, backend=counting_backend, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(8)
    for lens in [(5, 8), (3, 3, 4), (12,), (2, 9, 1, 6), (7, 7), (4, 1, 1, 10, 3)]:
        T = sum(lens)
        r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
        args = (r(T, 4, 16), r(T, 2, 16), r(T, 2, 16), _cu(lens), r(T, 4, 16), r(T, 16), r(T, 4), r(T, 4, 24),
                r(T, 1, 24))
        assert_bitwise_equal(compiled(*args), fn(*args), f"packing {lens}")
    assert len(frames) <= 2, f"{len(frames)} graphs compiled over 6 packings"
