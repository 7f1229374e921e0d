"""Every CUDA attention backend (triton, varlen_flash, cudnn, and what backend=None picks) against
the float32 reference, forward and backward including d(lse): GQA, ragged lengths, non-square
blocks, explicit positions, and the block backward from a merged out/lse (the ring's form).

Metrics: ``calc_diff`` (1 - cosine-like similarity, primerl.kernels.testing) against the float32
reference, and flash-attention's rule (max error at most twice that of the same math done by
PyTorch in bf16, plus a tiny floor)."""

from __future__ import annotations

import pytest
import torch

from attention_testing import assert_within_twice_torch, cu, inputs, run
from primerl.kernels import BackendUnavailableError
from primerl.kernels.attention import attention, attention_backward, attention_forward, merge_attn_states
from primerl.kernels.testing import assert_bitwise_equal, calc_diff

pytestmark = pytest.mark.gpu
BACKENDS = ["triton", "varlen_flash", "cudnn", None]
NAMES = ["out", "lse", "dq", "dk", "dv"]
# calc_diff bounds against float32: bf16 outputs/gradients round at ~4e-3 relative (calc_diff ~1e-6)
CALC_DIFF = {"out": 2e-5, "lse": 1e-6, "dq": 1e-4, "dk": 1e-4, "dv": 1e-4}


def _check(got, q, k, v, dout, dlse, c, tag):
    """calc_diff against float32 and flash-attention's twice-torch-at-bf16 rule."""
    ref32 = assert_within_twice_torch(got, q, k, v, dout, dlse, c, True, torch.bfloat16, tag)
    for name, g, r in zip(NAMES, got, ref32):
        fin = torch.isfinite(r)
        diff = calc_diff(g[fin].detach().float(), r[fin].detach().float())
        assert diff <= CALC_DIFF[name], f"{tag} {name}: calc_diff {diff:.2e} > {CALC_DIFF[name]:.0e}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d,hq,hkv", [(128, 32, 8), (64, 16, 2)])
@pytest.mark.parametrize("with_dlse", [True, False])
def test_backends_ragged_gqa_causal(backend, d, hq, hkv, with_dlse):
    lens = [1, 300, 1024, 77, 2000, 5]
    q, k, v, dout, dlse = inputs(lens, hq, hkv, d, torch.bfloat16, seed=d + hq + with_dlse)
    c = cu(lens)
    if with_dlse:
        got = run(backend, q, k, v, dout, dlse, cu_seqlens=c)
    else:
        dlse = torch.zeros_like(dlse)
        got = _run_no_lse(backend, q, k, v, dout, c)
    _check(got, q, k, v, dout, dlse, c, f"{backend} d={d}")


def _run_no_lse(backend, q, k, v, dout, c):
    """Gradients of out alone (the model's use: no gradient through lse); lse from the forward."""
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = attention(qq, kk, vv, cu_seqlens=c, return_lse=True, backend=backend)
    out.backward(dout)
    return out, lse, qq.grad, kk.grad, vv.grad


@pytest.mark.parametrize("backend", ["triton", "varlen_flash", None])
def test_non_square_default_positions(backend):
    """Lq != Lk per sequence, causal bottom-right; sequences with no queries or no keys."""
    lq, lk = [20, 3, 34, 0, 5, 300], [34, 5, 20, 7, 0, 700]
    q, k, v, dout, dlse = inputs(lq, 8, 2, 128, torch.bfloat16, seed=11, tk=sum(lk))
    kw = dict(cu_seqlens=cu(lq), cu_seqlens_k=cu(lk))
    got = run(backend, q, k, v, dout, dlse, **kw)
    qq, kk, vv = (t.float().requires_grad_() for t in (q, k, v))
    ref = attention(qq, kk, vv, return_lse=True, backend="torch", **kw)
    torch.autograd.backward(ref, (dout.float(), dlse))
    assert torch.isinf(got[1][:, sum(lq) - 300 - 5:sum(lq) - 300]).all(), "queries without keys: lse -inf"
    for name, g, r in zip(NAMES, got, (*ref, qq.grad, kk.grad, vv.grad)):
        fin = torch.isfinite(r)
        assert torch.equal(fin, torch.isfinite(g)), name
        assert calc_diff(g[fin].detach().float(), r[fin].detach().float()) <= CALC_DIFF[name], name


def test_cudnn_non_causal_non_square():
    lq, lk = [64, 64, 17], [100, 100, 33]
    q, k, v, dout, dlse = inputs(lq, 8, 4, 64, torch.bfloat16, seed=12, tk=sum(lk))
    kw = dict(cu_seqlens=cu(lq), cu_seqlens_k=cu(lk), causal=False)
    got = run("cudnn", q, k, v, dout, dlse, **kw)
    qq, kk, vv = (t.float().requires_grad_() for t in (q, k, v))
    ref = attention(qq, kk, vv, return_lse=True, backend="torch", **kw)
    torch.autograd.backward(ref, (dout.float(), dlse))
    for name, g, r in zip(NAMES, got, (*ref, qq.grad, kk.grad, vv.grad)):
        assert calc_diff(g.detach().float(), r.detach().float()) <= CALC_DIFF[name], name


@pytest.mark.parametrize("backend", ["triton", "varlen_flash", "cudnn", None])
def test_block_backward_from_merged_out_lse(backend):
    """A ring step's form without positions: queries = the second half of each sequence, keys in two
    blocks (first half: fully visible, non-causal; second half: causal square). The merged forward
    equals attention over all keys, and the block gradients from the merged out/lse sum to its
    gradients."""
    half = [256, 77, 128]
    q, k, v, dout, _ = inputs(half, 16, 4, 128, torch.bfloat16, seed=13, tk=2 * sum(half))
    c_half = cu(half)
    # keys laid out as [first halves of all sequences | second halves of all sequences]
    ka, kb = k[:sum(half)], k[sum(half):]
    va, vb = v[:sum(half)], v[sum(half):]
    oa, la = attention_forward(q, ka, va, cu_seqlens=c_half, causal=False, backend=backend, out_dtype=torch.float32)
    ob, lb = attention_forward(q, kb, vb, cu_seqlens=c_half, causal=True, backend=backend, out_dtype=torch.float32)
    out, lse = merge_attn_states(oa, la, ob, lb, backend="torch")
    # the reference: per sequence, keys [first half; second half] with the queries bottom-right aligned
    idx = torch.cat([torch.cat([torch.arange(s, e), sum(half) + torch.arange(s, e)])
                     for s, e in zip(c_half[:-1].tolist(), c_half[1:].tolist())]).to(q.device)
    k_full, v_full = k[idx], v[idx]
    c_full = cu([2 * h for h in half])
    qq, kk, vv = (t.float().requires_grad_() for t in (q, k_full, v_full))
    ref_out = attention(qq, kk, vv, cu_seqlens=c_half, cu_seqlens_k=c_full, backend="torch")
    ref_out.backward(dout.float())
    assert calc_diff(out, ref_out) <= CALC_DIFF["out"]
    ga = attention_backward(dout, q, ka, va, out.to(q.dtype), lse, cu_seqlens=c_half, causal=False, backend=backend)
    gb = attention_backward(dout, q, kb, vb, out.to(q.dtype), lse, cu_seqlens=c_half, causal=True, backend=backend)
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(idx.numel(), device=idx.device)
    ref_dk, ref_dv = kk.grad[inv], vv.grad[inv]  # back to the [first halves | second halves] layout
    assert calc_diff(ga[0] + gb[0], qq.grad) <= CALC_DIFF["dq"]
    assert calc_diff(torch.cat([ga[1], gb[1]]), ref_dk) <= CALC_DIFF["dk"]
    assert calc_diff(torch.cat([ga[2], gb[2]]), ref_dv) <= CALC_DIFF["dv"]


def test_positions_go_to_triton_and_named_torch_kernels_refuse_them():
    lq, lk = [40, 7], [64, 9]
    q, k, v, dout, dlse = inputs(lq, 8, 2, 128, torch.bfloat16, seed=14, tk=sum(lk))
    q_pos = torch.cat([torch.arange(24, 64), torch.arange(2, 9)]).int().cuda()
    k_pos = torch.cat([torch.arange(64), torch.arange(9)]).int().cuda()
    k_pos[5] = -1
    kw = dict(cu_seqlens=cu(lq), cu_seqlens_k=cu(lk), q_positions=q_pos, k_positions=k_pos)
    auto = run(None, q, k, v, dout, dlse, **kw)
    tri = run("triton", q, k, v, dout, dlse, **kw)
    for name, a, b in zip(NAMES, auto, tri):
        assert_bitwise_equal(a, b, name)
    for be in ("varlen_flash", "cudnn"):
        with pytest.raises(BackendUnavailableError, match="positions"):
            attention(q, k, v, backend=be, **kw)
    with pytest.raises(BackendUnavailableError, match="square"):
        attention(q, k, v, backend="cudnn", cu_seqlens=cu(lq), cu_seqlens_k=cu(lk))


@pytest.mark.parametrize("lens,expect", [([512] * 4, "cudnn"), ([512, 100, 512, 1], "cudnn"),
                                         ([64, 32, 64, 32, 64, 9], "varlen_flash")])
def test_backend_none_picks_the_documented_kernel(lens, expect):
    q, k, v, dout, dlse = inputs(lens, 8, 2, 128, torch.bfloat16, seed=15)
    auto = run(None, q, k, v, dout, dlse, cu_seqlens=cu(lens))
    named = run(expect, q, k, v, dout, dlse, cu_seqlens=cu(lens))
    for name, a, b in zip(NAMES[:2], auto, named):  # the forward is deterministic: the same kernel, the same bits
        assert_bitwise_equal(a, b, name)
    for name, a, b in zip(NAMES[2:], auto[2:], named[2:]):  # cuDNN / FA2 backward accumulate dq atomically
        assert calc_diff(a, b) < 1e-7, name
    f32 = [t.float() for t in (q, k, v)]
    out_auto = attention(*f32, cu_seqlens=cu(lens))
    assert_bitwise_equal(out_auto, attention(*f32, cu_seqlens=cu(lens), backend="triton"), "float32 -> triton")
