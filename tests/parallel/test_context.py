"""primerl.parallel.context: the shard plan (offline and W=1 in-process) and ring / all-gather
attention on real gloo process groups (2 and 4 ranks, one spawn per world size running every
case), compared with single-process attention over the whole packed batch."""

from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from primerl.kernels.attention import attention
from primerl.parallel.context import LAYOUTS, ContextShardPlan, allgather_attention, ring_attention
from _parallel_dist import start_ranks


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _qkv(lens, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    return [torch.randn(*s, generator=g).to(dtype) for s in ((t, hq, d), (t, hkv, d), (t, hkv, d), (t, hq, d))]


def _err(a, b):
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


# -- offline plans (no process group) -----------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_offline_plan_partitions_every_token_once(layout):
    lens = [16, 1, 0, 13, 30]
    cu = _cu(lens)
    W = 4
    plans = [ContextShardPlan(cu, layout=layout, world_size=W, rank=r) for r in range(W)]
    n = 2 * W if layout == "zigzag" else W
    assert all(p.local_num_tokens == plans[0].local_num_tokens for p in plans)
    assert all(torch.equal(p.local_cu_seqlens, plans[0].local_cu_seqlens) for p in plans)
    assert plans[0].padded_lengths.tolist() == [(L + n - 1) // n * n for L in lens]
    x = torch.arange(1, sum(lens) + 1)
    shards = [p.shard(x) for p in plans]
    real = torch.cat([s[~p.padding_mask] for s, p in zip(shards, plans)])
    assert sorted(real.tolist()) == x.tolist()  # every token exactly once
    assert all((s[p.padding_mask] == 0).all() for s, p in zip(shards, plans))
    assert sum(int(p.padding_mask.sum()) for p in plans) == int(plans[0].padded_lengths.sum()) - sum(lens)
    # sequence 0 (16 tokens): zigzag rank r holds chunks r and 2W-1-r of 2 tokens each
    c = 16 // n
    for r, p in enumerate(plans):
        owned = [r, 2 * W - 1 - r] if layout == "zigzag" else [r]
        want = torch.cat([torch.arange(j * c, (j + 1) * c) for j in owned])
        assert p.positions[: len(want)].tolist() == want.tolist()


def test_zigzag_balances_causal_work():
    cu = _cu([4096, 1000, 37])
    pairs = {lay: [ContextShardPlan(cu, layout=lay, world_size=4, rank=r).attention_pairs(r) for r in range(4)]
             for lay in LAYOUTS}
    total = sum(L * (L + 1) // 2 for L in (4096, 1000, 37))
    assert sum(pairs["zigzag"]) == total == sum(pairs["contiguous"])
    assert max(pairs["zigzag"]) / min(pairs["zigzag"]) < 1.02
    assert max(pairs["contiguous"]) / min(pairs["contiguous"]) > 5


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_block_equals_the_positions_mask(layout, world):
    """Every ring step as the plan cuts it (pseudo-sequences, default mask) gives what the global
    positions give, for every valid query and key: out, lse and the block gradients from a merged
    out/lse. Padding (sequences of 1 and 13 tokens do not divide into chunks) and an empty sequence."""
    from primerl.kernels.attention import attention_backward, attention_forward

    lens = [16, 1, 0, 13, 30]
    plans = [ContextShardPlan(_cu(lens), layout=layout, world_size=world, rank=r) for r in range(world)]
    t = plans[0].local_num_tokens
    g = torch.Generator().manual_seed(world)
    q, k, v, dout = (torch.randn(t, h, 8, generator=g) for h in (4, 2, 2, 4))
    for causal in (True, False):
        for plan in plans:
            real_q = ~plan.padding_mask
            dout_r = torch.where(real_q[:, None, None], dout, 0)  # unshard's gradient: 0 at padding
            for src in range(world):
                real_k = plans[src].key_positions_of(src) >= 0
                pos = dict(cu_seqlens=plan.local_cu_seqlens, q_positions=plan.positions,
                           k_positions=plan.key_positions_of(src), causal=causal, backend="torch")
                want = attention_forward(q, k, v, **pos)
                block = plan.ring_block(src, causal)
                if block is None:
                    assert torch.isneginf(want[1][:, real_q]).all(), f"src {src}: no visible key expected"
                    continue
                assert block != "positions"
                cu_q, cu_k, blk_causal = block
                kw = dict(cu_seqlens=cu_q, cu_seqlens_k=cu_k, causal=blk_causal, backend="torch")
                got = attention_forward(q, k, v, **kw)
                assert _err(got[0][real_q], want[0][real_q]) < 1e-6
                assert torch.equal(torch.isneginf(got[1][:, real_q]), torch.isneginf(want[1][:, real_q]))
                fin = torch.isfinite(want[1]) & real_q[None, :]
                assert _err(got[1][fin], want[1][fin]) < 1e-6
                # block gradients from a "merged" out/lse (this block's own, rows that see nothing at -inf)
                out, lse = want
                gw = attention_backward(dout_r, q, k, v, out, lse, **pos)
                gg = attention_backward(dout_r, q, k, v, out, lse, **kw)
                assert _err(gg[0][real_q], gw[0][real_q]) < 1e-6
                for a, b in zip(gg[1:], gw[1:]):
                    assert _err(a[real_k], b[real_k]) < 1e-6


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="layout must be one of"):
        ContextShardPlan(_cu([3]), layout="striped")
    with pytest.raises(ValueError, match="non-decreasing"):
        ContextShardPlan(torch.tensor([0, 5, 3]))
    with pytest.raises(ValueError, match="rank < world_size"):
        ContextShardPlan(_cu([3]), world_size=2, rank=2)
    plan = ContextShardPlan(_cu([3, 4]))
    with pytest.raises(ValueError, match="expected 7 tokens along dim 0"):
        plan.shard(torch.zeros(6, 2))
    q = torch.zeros(7, 2, 8)
    with pytest.raises(ValueError, match="k must be this rank's shard"):
        ring_attention(q, q[:5], q[:5], plan)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_single_process_falls_back_to_local_attention(layout):
    lens = [5, 1, 12]
    plan = ContextShardPlan(_cu(lens), layout=layout)
    assert plan.world_size == 1 and plan.local_num_tokens == sum(lens) and not plan.padding_mask.any()
    q, k, v, g = _qkv(lens, 4, 2, 16, torch.float32, seed=1)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = plan.unshard(ring_attention(plan.shard(qs), plan.shard(ks), plan.shard(vs), plan))
    out.backward(g)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = attention(qr, kr, vr, cu_seqlens=_cu(lens), backend="torch")
    ref.backward(g)
    for a, b in ((out, ref), (qs.grad, qr.grad), (ks.grad, kr.grad), (vs.grad, vr.grad)):
        assert torch.equal(a, b)


# -- real process groups --------------------------------------------------------------------------

# (name, lens, Hq, Hkv, D, causal, dtype, backend, world sizes)
CASES = [
    ("gqa_causal_ragged", [1, 13, 30, 7], 4, 2, 16, True, torch.float32, "torch", (2, 4)),
    ("full_mask", [5, 22], 2, 1, 8, False, torch.float32, "torch", (2, 4)),
    ("bf16_with_empty_seq", [9, 0, 16], 2, 2, 16, True, torch.bfloat16, "torch", (2, 4)),
    ("triton_kernels", [3, 17], 2, 1, 16, True, torch.float32, "triton", (2,)),
]


def _ring_case(plan, fn, lens, hq, hkv, d, causal, dtype, backend, seed):
    """(out, dq, dk, dv) of fn over the sharded batch, gathered back, vs the fp32 reference and
    the same single-process attention at ``dtype``; returns error strings."""
    cu = _cu(lens)
    q, k, v, g = _qkv(lens, hq, hkv, d, dtype, seed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = plan.unshard(fn(*(plan.shard(t) for t in leaves), plan, causal=causal, backend=backend))
    out.backward(g)
    got = [out] + [t.grad for t in leaves]

    def single(dt):
        ls = [t.to(dt).clone().requires_grad_() for t in (q, k, v)]
        o = attention(*ls, cu_seqlens=cu, causal=causal, backend="torch")
        o.backward(g.to(dt))
        return [o] + [t.grad for t in ls]

    ref32, same_dtype = single(torch.float32), single(dtype)
    errors = []
    for name, a, r, s in zip(["out", "dq", "dk", "dv"], got, ref32, same_dtype):
        if a.dtype != dtype:
            errors.append(f"{name} dtype {a.dtype}")
        bound = 2 * _err(s, r) + 2e-6 * (1 + float(r.detach().abs().max()))
        if not _err(a, r) <= bound:
            errors.append(f"{name} err {_err(a, r):.2e} > {bound:.2e}")
    return errors


def _round_trip_case(plan, seed):
    errors = []
    g = torch.Generator().manual_seed(seed)
    T = plan.total_tokens
    x = torch.randn(3, T, 5, generator=g, dtype=torch.float64).requires_grad_()
    y = plan.unshard(plan.shard(x, dim=1), dim=1)
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    y.backward(gy)
    if not torch.equal(y, x) or not torch.equal(x.grad, gy):
        errors.append("float round trip (or its gradient) is not exact")
    ids = torch.randint(0, 1000, (T,), generator=g)
    local = plan.shard(ids)
    if local.shape[0] != plan.local_num_tokens or (local[plan.padding_mask] != 0).any():
        errors.append("token-id shard has wrong size or non-zero padding")
    if not torch.equal(plan.unshard(local), ids):
        errors.append("int round trip is not exact")
    return errors


def _worker(rank, world, init_file, err_dir):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    failures = []
    # cases only record errors (no raise between collectives: a rank that stops early would hang the others)
    for layout in LAYOUTS:
        for i, (name, lens, hq, hkv, d, causal, dtype, backend, worlds) in enumerate(CASES):
            if world not in worlds or (backend == "triton" and layout != "zigzag"):
                continue
            plan = ContextShardPlan(_cu(lens), None, layout=layout)
            tag = f"W={world} {layout} {name}"
            try:
                for e in _ring_case(plan, ring_attention, lens, hq, hkv, d, causal, dtype, backend, seed=10 + i):
                    failures.append(f"{tag} ring: {e}")
                if backend == "torch" and dtype == torch.float32:
                    for e in _ring_case(plan, allgather_attention, lens, hq, hkv, d, causal, dtype, backend,
                                        seed=20 + i):
                        failures.append(f"{tag} allgather: {e}")
                    for e in _round_trip_case(plan, seed=30 + i):
                        failures.append(f"{tag}: {e}")
            except Exception:  # noqa: BLE001 - report, the others are in the same collectives
                failures.append(f"{tag}: {traceback.format_exc()}")
    dist.destroy_process_group()
    if failures:
        with open(os.path.join(err_dir, f"rank{rank}.txt"), "w") as f:
            f.write("\n".join(failures))


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_ring_and_allgather_match_single_process(world, tmp_path):
    os.environ["OMP_NUM_THREADS"] = "1"
    start_ranks(_worker, (world, str(tmp_path / "store"), str(tmp_path)), world)
    reports = sorted(tmp_path.glob("rank*.txt"))
    assert not reports, "\n".join(p.read_text() for p in reports)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "varlen_flash", "cudnn", "triton"])
def test_ring_blocks_on_gpu_match_the_positions_kernel(backend):
    """The ring steps as the plan cuts them, on CUDA in bf16 with each backend (None picks cuDNN /
    FA2 per step), against the float32 reference with the global positions: out and lse of every
    valid query, and the block gradients from the merged out/lse (calc_diff)."""
    from primerl.kernels import BackendUnavailableError
    from primerl.kernels.attention import attention_backward, attention_forward, merge_attn_states
    from primerl.kernels.testing import calc_diff

    lens, world = [1000, 1, 0, 517, 3000], 4
    plans = [ContextShardPlan(_cu(lens).cuda(), layout="zigzag", world_size=world, rank=r) for r in range(world)]
    t = plans[0].local_num_tokens
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(t, h, 128, generator=g).cuda().bfloat16() for h in (8, 2, 2, 8))
    plan = plans[1]
    real_q = ~plan.padding_mask
    dout = torch.where(real_q[:, None, None], dout, 0)
    f32 = [x.float() for x in (q, k, v, dout)]
    # merged out/lse over all src steps (float32 reference with positions)
    ref_out, ref_lse = None, None
    for src in range(world):
        o, lse = attention_forward(*f32[:3], cu_seqlens=plan.local_cu_seqlens, q_positions=plan.positions,
                                   k_positions=plans[src].key_positions_of(src), backend="torch")
        ref_out, ref_lse = (o, lse) if ref_out is None else merge_attn_states(ref_out, ref_lse, o, lse, backend="torch")
    for src in range(world):
        block = plan.ring_block(src, True)
        pos = dict(cu_seqlens=plan.local_cu_seqlens, q_positions=plan.positions,
                   k_positions=plans[src].key_positions_of(src))
        want = attention_forward(*f32[:3], backend="torch", **pos)
        want_g = attention_backward(f32[3], *f32[:3], ref_out, ref_lse, backend="torch", **pos)
        if block is None:
            continue
        cu_q, cu_k, causal = block
        kw = dict(cu_seqlens=cu_q, cu_seqlens_k=cu_k, causal=causal, backend=backend)
        try:
            got = attention_forward(q, k, v, out_dtype=torch.float32, **kw)
        except BackendUnavailableError as exc:  # cudnn: a causal step is square, a full one any shape
            pytest.fail(f"src {src}: {exc}")
        fin = torch.isfinite(want[1]) & real_q[None, :]
        assert torch.equal(torch.isfinite(got[1]) & real_q[None, :], fin), f"src {src}: rows that see nothing"
        assert calc_diff(got[0][real_q], want[0][real_q]) < 2e-5, f"src {src} out"
        assert calc_diff(got[1][fin], want[1][fin]) < 1e-6, f"src {src} lse"
        gg = attention_backward(dout, q, k, v, ref_out.bfloat16(), ref_lse, **kw)
        real_k = plans[src].key_positions_of(src) >= 0
        assert calc_diff(gg[0][real_q], want_g[0][real_q]) < 1e-4, f"src {src} dq"
        for name, a, b in zip(("dk", "dv"), gg[1:], want_g[1:]):
            assert calc_diff(a[real_k], b[real_k]) < 1e-4, f"src {src} {name}"
