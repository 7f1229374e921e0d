"""primerl.kernels.attention against the float32 reference, with flash-attention's error rule:
a kernel's error vs the float32 reference is at most twice the error of the same math done by
PyTorch at the input dtype (plus a tiny floor), for out, lse, dq, dk, dv."""

from __future__ import annotations

import pytest
import torch

from primerl.kernels.attention import (
    attention,
    attention_backward,
    attention_forward,
    merge_attn_states,
    merge_attn_states_,
    reference,
)
from primerl.kernels import BackendUnavailableError
from primerl.kernels.testing import assert_bitwise_equal
from attention_testing import (cu as _cu, inputs as _inputs, max_err as _max_err, reference_at as _reference_at,
                               run as _run, assert_within_twice_torch)

HAS_CUDA = torch.cuda.is_available()

DEV = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _one_thread():
    # Triton's interpreter issues thousands of tiny torch/numpy ops; on a shared 2-core box
    # intra-op threads only oversubscribe it (measured: 3-5x slower with the default count).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _dense_oracle(q, k, v, cu_q, cu_k, q_pos, k_pos, causal, scale):
    """Independent float64 oracle (dense mask per sequence, autograd for the gradients)."""
    q, k, v = q.double(), k.double(), v.double()
    G = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for b in range(cu_q.numel() - 1):
        qs, qe, ks, ke = (int(x) for x in (cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]))
        qb = q[qs:qe].transpose(0, 1)
        kb = k[ks:ke].repeat_interleave(G, 1).transpose(0, 1)
        vb = v[ks:ke].repeat_interleave(G, 1).transpose(0, 1)
        mask = (k_pos[ks:ke] >= 0)[None, :].expand(qe - qs, -1)
        if causal:
            mask = mask & (k_pos[ks:ke][None, :] <= q_pos[qs:qe][:, None])
        seen = mask.any(-1)
        s = (qb @ kb.transpose(-1, -2)) * scale
        s = torch.where(mask, s, float("-inf"))
        s = torch.where(seen[:, None], s, 0.0)  # rows that see nothing: finite, zeroed below
        lse = torch.where(seen, torch.logsumexp(s, -1), float("-inf"))
        p = torch.where(mask & seen[:, None], torch.softmax(s, -1), 0.0)
        outs.append((p @ vb).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


BACKENDS = ["torch", "triton"]
LENS = {"one": [37], "ragged": [1, 5, 17, 1, 9], "with_empty": [3, 0, 1, 12]}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtype,lens,hq,hkv,d,causal",
    [
        (torch.bfloat16, "ragged", 4, 2, 32, True),
        (torch.bfloat16, "one", 2, 2, 64, False),
        (torch.float16, "with_empty", 3, 1, 16, True),
        (torch.float32, "ragged", 2, 1, 24, True),
        (torch.bfloat16, "with_empty", 2, 1, 128, False),
        (torch.bfloat16, "ragged", 2, 1, 160, True),  # above 128: the two-part kernels (mla_triton)
    ],
)
def test_error_within_twice_torch_at_input_dtype(backend, dtype, lens, hq, hkv, d, causal):
    lens = LENS[lens]
    q, k, v, dout, dlse = _inputs(lens, hq, hkv, d, dtype, seed=sum(lens) * 7 + d + hq + len(str(dtype)))
    cu = _cu(lens)
    got = _run(backend, q, k, v, dout, dlse, cu_seqlens=cu, causal=causal)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32 and got[1].shape == (hq, sum(lens))
    assert_within_twice_torch(got, q, k, v, dout, dlse, cu, causal, dtype, f"{backend}")


def test_reference_matches_independent_oracle():
    lens = [1, 6, 11]
    q, k, v, dout, dlse = _inputs(lens, 4, 2, 16, torch.float32, seed=3)
    cu = _cu(lens)
    qp, kp = reference.default_positions(cu, cu)
    for causal in (True, False):
        got = _run("torch", q, k, v, dout, dlse, cu_seqlens=cu, causal=causal)
        qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
        out, lse = _dense_oracle(qq, kk, vv, cu, cu, qp, kp, causal, 0.25)
        torch.autograd.backward((out, lse), (dout.double(), dlse.double()))
        for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, (out, lse, qq.grad, kk.grad, vv.grad)):
            assert _max_err(a, b) < 2e-5, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_square_with_positions(backend, monkeypatch):
    """Queries against another key block (a ring step): explicit positions, masked (-1) keys,
    rows that see no key (out 0, lse -inf), block skipping across several 16-blocks."""
    from primerl.kernels.attention import triton as tri

    monkeypatch.setattr(tri, "INTERPRETER_BLOCK", 16)
    lq, lk = [20, 3, 34], [34, 5, 20]
    q, k, v, dout, dlse = _inputs(lq, 4, 2, 16, torch.float32, seed=5, tk=sum(lk))
    cu_q, cu_k = _cu(lq), _cu(lk)
    g = torch.Generator().manual_seed(6)
    q_pos = torch.randint(0, 40, (sum(lq),), generator=g).int().to(DEV)
    q_pos[:20] = torch.arange(30, 50)  # seq 0: a later chunk of queries against keys 0..33
    k_pos = torch.cat([torch.arange(34), torch.arange(10, 15), torch.arange(60, 80)]).int().to(DEV)
    k_pos[torch.randperm(sum(lk), generator=g)[:6].to(DEV)] = -1  # masked keys (padding)
    for causal in (True, False):
        kw = dict(cu_seqlens=cu_q, cu_seqlens_k=cu_k, q_positions=q_pos, k_positions=k_pos, causal=causal)
        got = _run(backend, q, k, v, dout, dlse, **kw)
        qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
        out, lse = _dense_oracle(qq, kk, vv, cu_q, cu_k, q_pos, k_pos, causal, 0.25)
        torch.autograd.backward((out, lse), (dout.double(), dlse.double()))
        if causal:  # sequence 2's queries are all before its keys: nothing visible
            assert torch.isinf(got[1][:, -34:]).all() and (got[0][-34:] == 0).all()
        for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, (out, lse, qq.grad, kk.grad, vv.grad)):
            assert _max_err(a, b) < 2e-5, f"{name} causal={causal}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_square_default_mask_over_several_blocks(backend, monkeypatch):
    """Default positions (bottom-right causal) with Lq != Lk, at 16-blocks so that the forward's
    unmasked blocks (fully below the diagonal), the diagonal blocks and the tails all occur."""
    from primerl.kernels.attention import triton as tri

    monkeypatch.setattr(tri, "INTERPRETER_BLOCK", 16)
    lq, lk = [20, 3, 34, 50, 7], [34, 5, 20, 50, 0]
    q, k, v, dout, dlse = _inputs(lq, 4, 2, 16, torch.float32, seed=15, tk=sum(lk))
    cu_q, cu_k = _cu(lq), _cu(lk)
    q_pos, k_pos = reference.default_positions(cu_q, cu_k)
    for causal in (True, False):
        got = _run(backend, q, k, v, dout, dlse, cu_seqlens=cu_q, cu_seqlens_k=cu_k, causal=causal)
        qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
        out, lse = _dense_oracle(qq, kk, vv, cu_q, cu_k, q_pos, k_pos, causal, 0.25)
        torch.autograd.backward((out, lse), (dout.double(), dlse.double()))
        for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, (out, lse, qq.grad, kk.grad, vv.grad)):
            assert _max_err(a, b) < 2e-5, f"{name} causal={causal}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_backward_sums_to_full_gradient(backend):
    """attention_backward on each key half with the merged out/lse sums to the full gradient
    (what ring attention does), and merging the halves' forward equals attention over all keys."""
    lens = [13, 1, 18]
    q, k, v, dout, _ = _inputs(lens, 2, 1, 32, torch.float32, seed=7)
    cu = _cu(lens)
    qp, kp = reference.default_positions(cu, cu)
    half = (kp % 2 == 0)  # interleaved split, so both halves touch every sequence
    kw = dict(cu_seqlens=cu, q_positions=qp, backend=backend)
    parts = [torch.where(half, kp, -1), torch.where(half, -1, kp)]
    (oa, la), (ob, lb) = (attention_forward(q, k, v, k_positions=p, out_dtype=torch.float32, **kw) for p in parts)
    out, lse = merge_attn_states(oa, la, ob, lb, backend=backend)
    full = _run("torch", q, k, v, dout, torch.zeros_like(la), cu_seqlens=cu)
    assert _max_err(out, full[0]) < 1e-5 and _max_err(lse, full[1]) < 1e-5
    grads = [attention_backward(dout, q, k, v, out, lse, k_positions=p, **kw) for p in parts]
    for i, name in enumerate(["dq", "dk", "dv"]):
        assert grads[0][i].dtype == torch.float32
        assert _max_err(grads[0][i] + grads[1][i], full[2 + i]) < 1e-5, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_identity_overflow_and_inplace(backend):
    g = torch.Generator().manual_seed(8)
    T, H, D = 37, 3, 24
    out_a = torch.randn(T, H, D, generator=g).to(DEV, torch.bfloat16)
    lse_a = (torch.randn(H, T, generator=g) * 3).to(DEV)
    lse_a[1, 5] = float("-inf")
    garbage = torch.full((T, H, D), float("nan"), device=DEV, dtype=torch.bfloat16)
    empty = torch.full((H, T), float("-inf"), device=DEV)
    out, lse = merge_attn_states(out_a, lse_a, garbage, empty, backend=backend)
    expect_out = out_a.clone()
    expect_out[5, 1] = 0  # both blocks empty: out 0, lse -inf
    assert_bitwise_equal(out, expect_out, "out")
    assert_bitwise_equal(lse, lse_a, "lse")
    # large lse values: no overflow, lse = log(exp(a) + exp(b)) computed stably
    big_a, big_b = torch.full((H, T), 1e4, device=DEV), torch.full((H, T), 1e4 + 2.0, device=DEV)
    o32 = out_a.float()
    out, lse = merge_attn_states(o32, big_a, -o32, big_b, backend=backend)
    wa = 1 / (1 + torch.exp(torch.tensor(2.0)))
    assert torch.allclose(lse, big_b + torch.log1p(torch.exp(torch.tensor(-2.0))), rtol=0, atol=1e-3)
    assert torch.allclose(out, o32 * wa - o32 * (1 - wa), atol=1e-6)
    # in place == out of place, into a float32 accumulator
    ob = torch.randn(T, H, D, generator=g).to(DEV)
    lb = torch.randn(H, T, generator=g).to(DEV)
    acc, acc_lse = o32.clone(), lse_a.clone()
    expect = merge_attn_states(o32, lse_a, ob, lb, backend=backend)
    res = merge_attn_states_(acc, acc_lse, ob, lb, backend=backend)
    assert res[0] is acc and res[1] is acc_lse
    assert_bitwise_equal(acc, expect[0], "inplace out")
    assert_bitwise_equal(acc_lse, expect[1], "inplace lse")


def test_merge_is_differentiable_and_matches_full_attention():
    """Gradients flow through attention's lse and the torch merge: halves merged == whole."""
    lens = [9, 1, 14]
    q, k, v, dout, _ = _inputs(lens, 4, 2, 16, torch.float32, seed=9)
    cu = _cu(lens)
    qp, kp = reference.default_positions(cu, cu)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    parts = [torch.where(kp < 5, kp, -1), torch.where(kp < 5, -1, kp)]
    (oa, la), (ob, lb) = (attention(qq, kk, vv, cu_seqlens=cu, q_positions=qp, k_positions=p, return_lse=True)
                          for p in parts)
    out, _ = merge_attn_states(oa, la, ob, lb)
    out.backward(dout)
    full = _run("torch", q, k, v, dout, torch.zeros(4, sum(lens)), cu_seqlens=cu)
    for name, a, b in zip(["out", "dq", "dk", "dv"], (out, qq.grad, kk.grad, vv.grad), (full[0], *full[2:])):
        assert _max_err(a, b) < 1e-5, name


def test_bad_input_is_rejected_with_a_named_error():
    q, k, v, *_ = _inputs([4, 4], 4, 2, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        attention(q, k, v, cu_seqlens=torch.tensor([0, 4, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention(q[:, :3], k, v)
    with pytest.raises(ValueError, match="share a dtype"):
        attention(q, k.half(), v.half())
    with pytest.raises(ValueError, match="pass cu_seqlens_k"):
        attention(q, k[:5], v[:5], cu_seqlens=_cu([4, 4]))
    with pytest.raises(ValueError, match="k_positions must be"):
        attention(q, k, v, k_positions=torch.arange(3))
    with pytest.raises(ValueError, match="not implemented"):
        attention(q, k, v, backend="cuda")
    cu = _cu([4, 4])
    attention(q, k, v, cu_seqlens=cu)  # checked values are cached per tensor (no host sync per layer)...
    cu[1] = 9  # ...but an in-place change is seen
    with pytest.raises(ValueError, match=r"got \[0, 9, 8\]"):
        attention(q, k, v, cu_seqlens=cu)
    with pytest.raises(ValueError, match="lse_b must be float32"):
        merge_attn_states(q, torch.zeros(4, 8), q, torch.zeros(4, 8, dtype=torch.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_triton_on_gpu_at_model_shapes(d):
    lens = [1, 300, 1024, 77, 2000]
    q, k, v, dout, dlse = _inputs(lens, 16, 4, d, torch.bfloat16, seed=d)
    cu = _cu(lens)
    got = _run("triton", q, k, v, dout, dlse, cu_seqlens=cu)
    ref32 = _reference_at(torch.float32, q, k, v, dout, dlse, cu, True)
    lowp = _reference_at(torch.bfloat16, q, k, v, dout, dlse, cu, True)
    for name, g, r, lp in zip(["out", "lse", "dq", "dk", "dv"], got, ref32, lowp):
        floor = 1e-5 * (1 + float(r[torch.isfinite(r)].abs().max()))
        assert _max_err(g, r) <= 2 * _max_err(lp, r) + floor, name


@pytest.mark.gpu
def test_flash_attn_backend_matches_reference():
    pytest.importorskip("flash_attn")
    lens = [1, 100, 257]
    q, k, v, *_ = _inputs(lens, 8, 2, 128, torch.bfloat16, seed=1)
    cu = _cu(lens)
    out, lse = attention_forward(q, k, v, cu_seqlens=cu, backend="flash_attn")
    ref = attention_forward(q, k, v, cu_seqlens=cu, backend="torch")
    assert _max_err(out, ref[0]) < 2e-2 and _max_err(lse, ref[1]) < 1e-3


def test_torch_cuda_backends_refuse_cpu_tensors_by_name():
    q, k, v, *_ = _inputs([4, 4], 4, 2, 16, torch.float32, seed=0)
    for be in ("cudnn", "varlen_flash"):
        with pytest.raises(BackendUnavailableError, match=f"backend '{be}' cannot run this case: needs CUDA tensors"):
            attention(q, k, v, backend=be)
        with pytest.raises(BackendUnavailableError, match="needs CUDA"):
            attention_backward(q, q, k, v, q, torch.zeros(4, 8), backend=be)


def test_cudnn_single_token_backward_matches_reference():
    """cuDNN rejects Lq = Lk = 1; its backend computes those runs in torch: check that math on CPU
    against the reference, with an external lse (as from a ring merge) and GQA."""
    from primerl.kernels.attention import cudnn

    n, hq, hkv, d = 5, 4, 2, 16
    q, k, v, dout, _ = _inputs([1] * n, hq, hkv, d, torch.float32, seed=21)
    cu = _cu([1] * n)
    qp, kp = reference.default_positions(cu, cu)
    out = torch.randn(n, hq, d, generator=torch.Generator().manual_seed(22))
    lse = torch.randn(hq, n, generator=torch.Generator().manual_seed(23))
    want = reference.attention_backward(dout, q, k, v, out, lse, None, cu, cu, True, 0.25, qp, kp)
    got = cudnn._single_token_backward(dout, q, k, v, out, lse.t(), 0.25)
    for name, a, b in zip(["dq", "dk", "dv"], got, want):
        assert _max_err(a, b) < 1e-6 * (1 + float(b.abs().max())), name
