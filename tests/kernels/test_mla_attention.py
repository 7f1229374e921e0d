"""Attention with value heads narrower / wider than the query-key heads (MLA: 192/128, 256/256),
every backend against an independent float32 oracle, forward, lse and gradients; and the GPU
checks of the MLA and DeepSeek-sparse-attention kernels at model shapes."""

from __future__ import annotations

import pytest
import torch

from primerl.kernels.attention.mla import mla_attention
from primerl.kernels.sparse_attention import indexer_topk, sparse_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)


def oracle(q, k, v, lens, scale):
    """Per-sequence causal softmax attention in float64, written independently of the package."""
    outs, lses = [], []
    start = 0
    G = q.shape[1] // k.shape[1]
    for n in lens:
        qs, ks, vs = (t[start:start + n].double() for t in (q, k, v))
        ks, vs = ks.repeat_interleave(G, 1), vs.repeat_interleave(G, 1)
        s = torch.einsum("thd,shd->hts", qs, ks) * scale
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        lse = torch.logsumexp(s, -1)
        outs.append(torch.einsum("hts,she->the", torch.exp(s - lse[..., None]), vs))
        lses.append(lse)
        start += n
    return torch.cat(outs), torch.cat(lses, 1)


def _run(fn, q, k, v, dout, dlse):
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(qq, kk, vv)
    ((out.double() * dout.double()).sum() + (lse.double() * dlse.double()).sum()).backward()
    return out, lse, qq.grad, kk.grad, vv.grad


def _inputs(lens, hq, hkv, dqk, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEV, dtype)  # noqa: E731
    return mk(T, hq, dqk), mk(T, hkv, dqk), mk(T, hkv, dv), mk(T, hq, dv), torch.randn(hq, T, generator=g).to(DEV)


@pytest.mark.parametrize("backend", ["torch", "triton", "sdpa"])
@pytest.mark.parametrize("hq,hkv,dqk,dv", [(4, 4, 24, 16), (4, 2, 32, 40), (6, 6, 48, 32)])
def test_mla_attention_matches_oracle(backend, hq, hkv, dqk, dv):
    lens = [5, 1, 37, 12]
    q, k, v, dout, dlse = _inputs(lens, hq, hkv, dqk, dv, torch.float32, seed=dqk + dv)
    scale = dqk ** -0.5
    cu = _cu(lens)
    got = _run(lambda a, b, c: mla_attention(a, b, c, cu_seqlens=cu, return_lse=True, backend=backend),
               q, k, v, dout, dlse)
    want = _run(lambda a, b, c: oracle(a, b, c, lens, scale), q, k, v, dout, dlse)
    assert got[0].shape == (q.shape[0], hq, dv) and got[4].shape == v.shape
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert not torch.isnan(a).any(), name
        err = (a.double() - b).abs().max().item()
        assert err <= 2e-5 * max(1.0, b.abs().max().item()), f"{name}: max abs err {err:.3e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_triton_non_square_with_positions(dtype):
    """The native kernels on the non-square form (a query block against another key block with
    positions, padding keys at -1, GQA) against the torch backend's padded square op."""
    g = torch.Generator().manual_seed(5)
    lq, lk = [4, 9, 1], [11, 9, 6]
    T, Tk = sum(lq), sum(lk)
    q = torch.randn(T, 6, 24, generator=g).to(DEV, dtype)
    k = torch.randn(Tk, 2, 24, generator=g).to(DEV, dtype)
    v = torch.randn(Tk, 2, 16, generator=g).to(DEV, dtype)
    dout, dlse = torch.randn(T, 6, 16, generator=g).to(DEV, dtype), torch.randn(6, T, generator=g).to(DEV)
    q_pos = torch.cat([torch.randint(0, n, (m,), generator=g) for m, n in zip(lq, lk)]).int().to(DEV)
    k_pos = torch.cat([torch.randperm(n, generator=g) for n in lk]).int().to(DEV)
    k_pos[3] = -1  # a padding key
    kw = dict(cu_seqlens=_cu(lq), cu_seqlens_k=_cu(lk), q_positions=q_pos, k_positions=k_pos, return_lse=True)
    fn = lambda be: (lambda a, b, c: mla_attention(a, b, c, backend=be, **kw))  # noqa: E731
    got = _run(fn("triton"), q, k, v, dout, dlse)
    gold = _run(fn("torch"), q.float(), k.float(), v.float(), dout, dlse)
    lowp = _run(fn("torch"), q, k, v, dout, dlse)
    for name, a, b, c in zip(("out", "lse", "dq", "dk", "dv"), got, gold, lowp):
        assert not torch.isnan(a).any(), name
        err = (a.double() - b.double()).abs().max().item()
        bound = 2e-5 * max(1.0, b.abs().max().item()) if dtype == torch.float32 else \
            2 * (c.double() - b.double()).abs().max().item() + 1e-5 * (1 + b.abs().max().item())
        assert err <= bound, f"{name}: {err:.3e} > {bound:.3e}"


def test_mla_triton_dq_in_column_parts_is_bitwise_one_program(monkeypatch):
    """dQ's two column parts in two launches (what 256/256 runs on the GPU) give the bits of one
    program computing both."""
    from primerl.kernels.attention import mla_triton

    lens = [9, 1, 30]
    q, k, v, dout, dlse = _inputs(lens, 4, 2, 40, 24, torch.float32, seed=11)
    fn = lambda a, b, c: mla_attention(a, b, c, cu_seqlens=_cu(lens), return_lse=True, backend="triton")  # noqa: E731
    one = _run(fn, q, k, v, dout, dlse)
    monkeypatch.setattr(mla_triton, "_dq_parts", lambda d, dv, device: (1, 2))
    parts = _run(fn, q, k, v, dout, dlse)
    assert not torch.isnan(parts[2]).any()
    assert torch.equal(one[2], parts[2])


def test_mla_attention_bad_inputs():
    q = torch.randn(4, 2, 16)
    with pytest.raises(ValueError, match="k must be"):
        mla_attention(q, torch.randn(4, 2, 8), torch.randn(4, 2, 8))
    with pytest.raises(ValueError, match="v must be a 3-D tensor"):
        mla_attention(q, torch.randn(4, 2, 16), torch.randn(4, 8))


# --------------------------------------------------------------------------- GPU, model shapes
def _flash_rule(got, lowp, ref32, names):
    for name, g, lp, r in zip(names, got, lowp, ref32):
        fin = torch.isfinite(r)
        floor = 1e-5 * (1 + float(r[fin].abs().max()))
        e_g = float((g.double() - r.double())[fin].abs().max())
        e_lp = float((lp.double() - r.double())[fin].abs().max())
        assert e_g <= 2 * e_lp + floor, f"{name}: kernel error {e_g:.3e} vs torch-at-dtype {e_lp:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("hq,dqk,dv", [(16, 192, 128), (8, 256, 256)])
def test_mla_attention_triton_on_gpu(hq, dqk, dv):
    lens = [1, 300, 1024, 77]
    q, k, v, dout, dlse = _inputs(lens, hq, hq, dqk, dv, torch.bfloat16, seed=dqk)
    cu = _cu(lens)
    fn = lambda be, dt: (lambda a, b, c: mla_attention(a.to(dt), b.to(dt), c.to(dt), cu_seqlens=cu,  # noqa: E731
                                                      return_lse=True, backend=be))
    got = _run(fn("triton", torch.bfloat16), q, k, v, dout, dlse)
    ref32 = _run(fn("torch", torch.float32), q.float(), k.float(), v.float(), dout, dlse)
    lowp = _run(fn("torch", torch.bfloat16), q, k, v, dout, dlse)
    _flash_rule(got, lowp, ref32, ("out", "lse", "dq", "dk", "dv"))


def _causal_selection(lens, K, device, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    start = 0
    for n in lens:
        for p in range(n):
            sel = torch.full((K,), -1, dtype=torch.int32)
            cand = torch.randperm(p + 1, generator=g)[:K] + start
            sel[:cand.numel()] = cand.int()
            rows.append(sel)
        start += n
    return torch.stack(rows).to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,dqk,dv", [(64, 1, 576, 512), (16, 16, 192, 128)])
def test_sparse_attention_triton_on_gpu(hq, hkv, dqk, dv):
    """GLM-5's absorbed form (64 heads over one 576-wide latent key, 512-wide value) and the per-head
    form, 512 selected keys per query."""
    lens = [700, 1, 300]
    idx = _causal_selection(lens, 512, DEV, seed=hq)
    q, k, v, dout, dlse = _inputs(lens, hq, hkv, dqk, dv, torch.bfloat16, seed=dqk)
    fn = lambda be, dt: (lambda a, b, c: sparse_attention(a.to(dt), b.to(dt), c.to(dt), idx, return_lse=True,  # noqa: E731
                                                          backend=be))
    got = _run(fn("triton", torch.bfloat16), q, k, v, dout, dlse)
    ref32 = _run(fn("torch", torch.float32), q.float(), k.float(), v.float(), dout, dlse)
    lowp = _run(fn("torch", torch.bfloat16), q, k, v, dout, dlse)
    _flash_rule(got, lowp, ref32, ("out", "lse", "dq", "dk", "dv"))


@pytest.mark.gpu
def test_indexer_topk_triton_on_gpu():
    lens = [2500, 1, 1600]
    g = torch.Generator().manual_seed(0)
    T = sum(lens)
    q = torch.randn(T, 32, 128, generator=g).to(DEV, torch.bfloat16)
    k = torch.randn(T, 128, generator=g).to(DEV, torch.bfloat16)
    w = torch.randn(T, 32, generator=g).to(DEV, torch.float32)
    cu = _cu(lens)
    ref = indexer_topk(q, k, w, cu_seqlens=cu, topk=2048, backend="torch")
    tri = indexer_topk(q, k, w, cu_seqlens=cu, topk=2048, backend="triton")
    assert torch.equal((ref >= 0).sum(1), (tri >= 0).sum(1))
    # the kernel sums bf16 products in float32 like the reference: the selections agree up to near-ties
    same = (ref.sort(1).values == tri.sort(1).values).float().mean().item()
    assert same > 0.99, f"only {same:.4f} of the selected keys agree"
