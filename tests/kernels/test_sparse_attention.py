"""DeepSeek sparse attention: the indexer's top-k and the attention over selected keys, Triton
(under the interpreter on CPU) against the plain-PyTorch reference, forward and gradients."""

from __future__ import annotations

import pytest
import torch

from primerl.kernels.sparse_attention import indexer_topk, reference, sparse_attention

SEQS = [(1, 7, 33, 20), (45,), (3, 0, 16)]


def _cu(lens):
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return cu


def _indexer_inputs(lens, heads, dim, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, heads, dim, generator=g).to(dtype)
    k = torch.randn(T, dim, generator=g).to(dtype)
    w = torch.randn(T, heads, generator=g).to(dtype)
    return q, k, w


def _selected_scores(idx, q, k, w, cu, scale):
    """Reference scores at each row's selected keys, sorted: [T, K] (-inf at -1 entries)."""
    T = q.shape[0]
    full = torch.full((T, T), float("-inf"))
    b = cu.tolist()
    for s, e in zip(b[:-1], b[1:]):
        if e > s:
            full[s:e, s:e] = reference.indexer_scores(q[s:e], k[s:e], w[s:e], scale)
    vals = torch.where(idx >= 0, full.gather(1, idx.clamp(min=0).long()), float("-inf"))
    return vals.sort(dim=1, descending=True).values


@pytest.mark.parametrize("lens", SEQS)
@pytest.mark.parametrize("topk", [8, 64])
@pytest.mark.parametrize("dim", [32, 24])
def test_indexer_topk_triton_matches_reference(lens, topk, dim):
    q, k, w = _indexer_inputs(lens, 4, dim, seed=sum(lens) + topk + dim)
    cu = _cu(lens)
    scale = dim ** -0.5
    ref = indexer_topk(q, k, w, cu_seqlens=cu, topk=topk, backend="torch")
    tri = indexer_topk(q, k, w, cu_seqlens=cu, topk=topk, backend="triton")
    assert ref.shape == tri.shape == (q.shape[0], topk) and tri.dtype == torch.int32
    # same number of selected keys per row, all causal and in the query's sequence
    assert torch.equal((ref >= 0).sum(1), (tri >= 0).sum(1))
    b = cu.tolist()
    for s, e in zip(b[:-1], b[1:]):
        for t in range(s, e):
            sel = tri[t][tri[t] >= 0]
            assert sel.numel() == min(topk, t - s + 1)
            assert bool(((sel >= s) & (sel <= t)).all()) and sel.unique().numel() == sel.numel()
    # the selected scores agree (a near-tie may pick a different key of equal score)
    got = _selected_scores(tri, q, k, w, cu, scale)
    want = _selected_scores(ref, q, k, w, cu, scale)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    assert err <= 1e-4, f"selected score max abs diff {err:.3e}"


def test_indexer_topk_chunked(monkeypatch):
    """Several query chunks (the launcher's memory bound) give the same selection as one."""
    import primerl.kernels.sparse_attention.triton as st

    lens = (9, 30, 14)
    q, k, w = _indexer_inputs(lens, 3, 16, seed=5)
    cu = _cu(lens)
    whole = indexer_topk(q, k, w, cu_seqlens=cu, topk=6, backend="triton")
    monkeypatch.setattr(st, "INDEXER_CHUNK_ELEMENTS", 7 * 30)  # 7 rows per chunk
    assert torch.equal(indexer_topk(q, k, w, cu_seqlens=cu, topk=6, backend="triton"), whole)


def test_indexer_topk_bad_inputs():
    q, k, w = _indexer_inputs((4,), 2, 16, seed=0)
    with pytest.raises(ValueError, match="k must have shape"):
        indexer_topk(q, k[:, :8], w, topk=2)
    with pytest.raises(ValueError, match="topk must be >= 1"):
        indexer_topk(q, k, w, topk=0)
    with pytest.raises(TypeError, match="topk must be an int, got float"):
        indexer_topk(q, k, w, topk=2.0)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        indexer_topk(q, k, w, cu_seqlens=torch.tensor([0, 3], dtype=torch.int32), topk=2)


def _random_indices(lens, K, seed, empty_row=True):
    """Causal in-sequence selections: up to K distinct keys per query, -1 padded; one row empty."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    idx = torch.full((T, K), -1, dtype=torch.int32)
    start = 0
    for n in lens:
        for p in range(n):
            cand = torch.randperm(p + 1, generator=g)[:K] + start
            idx[start + p, :cand.numel()] = cand.int()
            idx[start + p] = idx[start + p][torch.randperm(K, generator=g)]  # -1 anywhere in the row
        start += n
    if empty_row and T > 2:
        idx[2] = -1
    return idx


ATTN_SHAPES = [  # (Hq, Hkv, Dqk, Dv): absorbed MLA (1 shared latent head), per-head MLA, GQA
    (16, 1, 48, 32),
    (4, 4, 24, 16),
    (6, 2, 32, 32),
    (20, 1, 40, 24),
]


@pytest.mark.parametrize("hq,hkv,dqk,dv", ATTN_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_triton_matches_reference(hq, hkv, dqk, dv, dtype):
    lens, K = (5, 1, 23), 12
    T = sum(lens)
    g = torch.Generator().manual_seed(hq * 100 + dqk)
    q = torch.randn(T, hq, dqk, generator=g).to(dtype)
    k = torch.randn(T, hkv, dqk, generator=g).to(dtype)
    v = torch.randn(T, hkv, dv, generator=g).to(dtype)
    idx = _random_indices(lens, K, seed=hq + dv)
    dout = torch.randn(T, hq, dv, generator=g).to(dtype)
    dlse = torch.randn(hq, T, generator=g)
    dlse[:, 2] = 0.0

    def run(backend, qq, kk, vv):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (qq, kk, vv))
        out, lse = sparse_attention(qq, kk, vv, idx, return_lse=True, backend=backend)
        ((out.float() * dout.float()).sum() + (torch.where(torch.isinf(lse), 0.0, lse) * dlse).sum()).backward()
        return out, lse, qq.grad, kk.grad, vv.grad

    gold = run("torch", q.float(), k.float(), v.float())  # float32 truth
    got = run("triton", q, k, v)
    torch_at_dtype = run("torch", q, k, v)
    assert got[0].dtype == dtype
    assert torch.isinf(got[1][:, 2]).all() and (got[1][:, 2] < 0).all() and (got[0][2] == 0).all()
    for name, a, ref, base in zip(("out", "lse", "dq", "dk", "dv"), got, gold, torch_at_dtype):
        a, ref, base = (torch.where(torch.isinf(x), 0.0, x.float()) for x in (a, ref, base))
        assert not torch.isnan(a).any(), name
        err = (a - ref).abs().max().item()
        bound = 1e-4 * max(1.0, ref.abs().max().item()) if dtype == torch.float32 else \
            2 * (base - ref).abs().max().item() + 1e-2
        assert err <= bound, f"{name}: max abs err {err:.3e} > {bound:.3e}"


def test_sparse_attention_matches_dense_when_all_keys_selected():
    """Selecting every causal key is dense causal attention (the spec's anchor to the dense op)."""
    from primerl.kernels.attention import attention

    lens = (6, 11)
    T = sum(lens)
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(T, 4, 32, generator=g), torch.randn(T, 2, 32, generator=g), torch.randn(T, 2, 32, generator=g)
    idx = _random_indices(lens, 11, seed=0, empty_row=False)
    cu = _cu(lens)
    dense = attention(q, k, v, cu_seqlens=cu, causal=True, backend="torch")
    for be in ("torch", "triton"):
        out = sparse_attention(q, k, v, idx, backend=be)
        assert (out - dense).abs().max().item() < 1e-5, be


def test_sparse_attention_bad_inputs():
    q, k, v = torch.randn(4, 2, 16), torch.randn(4, 1, 16), torch.randn(4, 1, 8)
    idx = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="indices must be in"):
        sparse_attention(q, k, v, idx + 4)
    with pytest.raises(ValueError, match="indices must be an int32 tensor"):
        sparse_attention(q, k, v, idx[:3])
    with pytest.raises(ValueError, match="k must be"):
        sparse_attention(q, k[..., :8], v, idx)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        sparse_attention(torch.randn(4, 3, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 8), idx)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_indexer_topk_non_square_matches_square(backend):
    """A context-parallel shard's queries (some rows of each sequence, any order of positions)
    against every key with padding keys mixed in select the same scores as the square form."""
    lens = (9, 1, 30)
    q, k, w = _indexer_inputs(lens, 3, 16, seed=11)
    cu = _cu(lens)
    topk = 7
    square = indexer_topk(q, k, w, cu_seqlens=cu, topk=topk, backend="torch")
    g = torch.Generator().manual_seed(2)
    q_rows, k_rows, q_pos, k_pos, cu_q, cu_k = [], [], [], [], [0], [0]
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        n = e - s
        pick = torch.randperm(n, generator=g)[: max(1, n // 2)]
        q_rows.append(pick + s)
        q_pos.append(pick)
        keys = torch.cat([torch.arange(s, e), torch.full((3,), -1)])  # 3 padding keys per sequence
        perm = torch.randperm(keys.numel(), generator=g)
        k_rows.append(keys[perm])
        k_pos.append(torch.where(keys[perm] >= 0, keys[perm] - s, -1))
        cu_q.append(cu_q[-1] + pick.numel())
        cu_k.append(cu_k[-1] + keys.numel())
    q_rows, k_rows, q_pos, k_pos = (torch.cat(x) for x in (q_rows, k_rows, q_pos, k_pos))
    kk = torch.where((k_rows >= 0)[:, None], k[k_rows.clamp(min=0)], 1e3)  # garbage in padding keys
    got = indexer_topk(q[q_rows], kk, w[q_rows], cu_seqlens=torch.tensor(cu_q, dtype=torch.int32), topk=topk,
                       cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32), q_positions=q_pos.int(),
                       k_positions=k_pos.int(), backend=backend)
    mapped = torch.where(got >= 0, k_rows[got.clamp(min=0).long()], -1)
    assert bool((mapped[got >= 0] >= 0).all())  # never a padding key
    want = square[q_rows]
    got_s = _selected_scores(mapped.int(), q, k, w, cu, 16 ** -0.5)
    want_s = _selected_scores(want, q, k, w, cu, 16 ** -0.5)
    fin = torch.isfinite(want_s)
    assert torch.equal(fin, torch.isfinite(got_s))
    assert (got_s[fin] - want_s[fin]).abs().max() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_values_as_view_of_keys(dtype):
    """The absorbed MLA form passes v = kv[..., :R] (one tensor): the Triton backward then adds dV
    into dK's columns in one accumulation; the gradient of kv matches the reference's."""
    lens, K, R = (7, 19), 10, 32
    T = sum(lens)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(T, 16, R + 16, generator=g).to(dtype)
    kv = torch.randn(T, 1, R + 16, generator=g).to(dtype)
    idx = _random_indices(lens, K, seed=4)
    dout = torch.randn(T, 16, R, generator=g).to(dtype)
    grads = {}
    for be in ("torch", "triton"):
        qq, kk = q.float().clone().requires_grad_(), kv.float().clone().requires_grad_()
        if be == "triton":
            qq, kk = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out = sparse_attention(qq, kk, kk[..., :R], idx, backend=be)
        (out.float() * dout.float()).sum().backward()
        grads[be] = (out.float(), qq.grad.float(), kk.grad.float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for name, a, b in zip(("out", "dq", "dkv"), grads["triton"], grads["torch"]):
        err = (a - b).abs().max().item()
        assert err <= tol * max(1.0, b.abs().max().item()), f"{name}: {err:.3e}"
