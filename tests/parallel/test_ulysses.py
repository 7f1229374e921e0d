"""primerl.parallel.ulysses: the head all-to-all (an exact round trip, forward and backward), Ulysses
attention alone (U = 2, 4) and inside the ring (2 x 2), for zigzag and contiguous plans, grouped-query
attention with fewer KV heads than the degree (replicated), non-causal and bf16 cases, and the
DeepSeek sparse form, on 4 real gloo ranks (one spawn), against single-process attention over the
whole packed batch at the ring test's bound (test_context.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _parallel_dist import spawn
from primerl.kernels.sparse_attention import sparse_attention
from primerl.parallel.context import LAYOUTS, ContextShardPlan
from primerl.parallel.ulysses import (UlyssesAttention, head_to_seq, replicate_kv_heads, seq_to_head,
                                      ulysses_attention, ulysses_groups)
from test_context import _cu, _err, _ring_case

WORLD = 4
# (name, lens, Hq, Hkv, D, causal, dtype)
CASES = [
    ("gqa_kv_replicated_ragged", [1, 13, 30, 7], 4, 1, 16, True, torch.float32),
    ("gqa_kv_split", [19, 2, 24], 8, 4, 8, True, torch.float32),
    ("kv2_full_mask_even", [16, 32], 4, 2, 8, False, torch.float32),
    ("full_mask_ragged", [5, 22], 4, 1, 8, False, torch.float32),  # 2-D refuses it (padding keys)
    ("bf16_with_empty_seq", [9, 0, 16], 4, 4, 16, True, torch.bfloat16),
]
SPLITS = ("u4", "u2", "u2xr2")  # U=4 over all ranks; U=2 in two cp groups of 2; 2-D over 4
CASE_NAMES = [f"{s}-{lay}-{c[0]}" for s in SPLITS for lay in LAYOUTS for c in CASES] + \
    ["a2a_round_trip", "sparse_u4", "sparse_u2xr2", "rejects_bad_heads"]


def _round_trip(group):
    g = torch.Generator().manual_seed(5 + dist.get_rank())
    x = torch.randn(6, 8, 3, generator=g, dtype=torch.float64, requires_grad=True)
    y = seq_to_head(x, group)
    errors = []
    U = dist.get_world_size(group)
    if y.shape != (6 * U, 8 // U, 3):
        errors.append(f"seq_to_head shape {tuple(y.shape)}")
    # rank u's block of rank j's tokens is rank j's heads u*H/U..: check against an all-gather
    parts = [torch.zeros_like(x) for _ in range(U)]
    dist.all_gather(parts, x.detach(), group=group)
    u = dist.get_rank(group)
    want = torch.cat([p[:, u * (8 // U):(u + 1) * (8 // U)] for p in parts])
    if not torch.equal(y.detach(), want):
        errors.append("seq_to_head does not give this rank's heads of every rank's tokens")
    z = head_to_seq(y, group)
    gz = torch.randn(z.shape, generator=g, dtype=torch.float64)
    z.backward(gz)
    if not torch.equal(z.detach(), x.detach()) or not torch.equal(x.grad, gz):
        errors.append("head_to_seq(seq_to_head(x)) or its gradient is not exact")
    return errors


def _sparse_case(plan, ctx, seed):
    """Absorbed-MLA sparse attention (one latent KV head gathered from every rank) vs single process."""
    from primerl.parallel.context import gather_shards

    g = torch.Generator().manual_seed(seed)
    lens = plan._lens
    T, H, Dk, Dv, K = sum(lens), 4, 12, 8, 3
    q = torch.randn(T, H, Dk, generator=g)
    kv = torch.randn(T, 1, Dk, generator=g)
    go = torch.randn(T, H, Dv, generator=g)
    # random causal top-k rows (into the batch, -1 = none): each query picks among its visible keys
    idx = torch.full((T, K), -1, dtype=torch.int32)
    cu = _cu(lens).tolist()
    for b in range(len(lens)):
        for i in range(cu[b], cu[b + 1]):
            pick = torch.randperm(i - cu[b] + 1, generator=g)[:K] + cu[b]
            idx[i, :len(pick)] = pick.int()
    # the same rows in the plan's padded order
    pad_cu = plan.padded_cu_seqlens.tolist()
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    remap = torch.tensor(pad_cu[:-1])[seq] - torch.tensor(cu[:-1])[seq]
    idx_pad = torch.where(idx >= 0, idx + remap[idx.clamp_min(0).long()].int(), -1)
    leaves = [t.clone().requires_grad_() for t in (q, kv)]
    ql, kvl = plan.shard(leaves[0]), plan.shard(leaves[1])
    kv_all = gather_shards(kvl, plan)
    out = plan.unshard(ctx.sparse_attention(ql, kv_all, kv_all[..., :Dv], plan.shard(idx_pad), backend="torch"))
    out.backward(go)
    rl = [t.clone().requires_grad_() for t in (q, kv)]
    ref = sparse_attention(rl[0], rl[1], rl[1][..., :Dv], idx, backend="torch")
    ref.backward(go)
    errors = []
    for name, a, r in (("out", out, ref), ("dq", leaves[0].grad, rl[0].grad), ("dkv", leaves[1].grad, rl[1].grad)):
        bound = 2e-6 * (1 + float(r.detach().abs().max()))
        if not _err(a, r) <= bound:
            errors.append(f"{name} err {_err(a, r):.2e} > {bound:.2e}")
    return errors


def _refused(plan, ctx, hq, hkv, d):
    t = plan.local_num_tokens
    try:
        ctx(torch.zeros(t, hq, d), torch.zeros(t, hkv, d), torch.zeros(t, hkv, d), plan, causal=False)
    except ValueError as e:
        return [] if "non-causal 2-D" in str(e) else [str(e)]
    return ["non-causal 2-D attention over padded sequences was not refused"]


def _worker(rank, world, log):
    world_group = dist.group.WORLD
    pairs, _ = dist.new_subgroups(2)  # cp groups {0,1} and {2,3}
    u2, r2 = ulysses_groups(world_group, 2)
    splits = {
        "u4": (world_group, UlyssesAttention(world_group)),
        "u2": (pairs, UlyssesAttention(pairs)),
        "u2xr2": (world_group, UlyssesAttention(u2, r2)),
    }
    log.run("a2a_round_trip", _round_trip, world_group)
    for split, (cp_group, ctx) in splits.items():
        for layout in LAYOUTS:
            for i, (name, lens, hq, hkv, d, causal, dtype) in enumerate(CASES):
                plan = ContextShardPlan(_cu(lens), cp_group, layout=layout)
                if split == "u2xr2" and name == "full_mask_ragged":
                    log.run(f"{split}-{layout}-{name}", _refused, plan, ctx, hq, hkv, d)
                    continue
                log.run(f"{split}-{layout}-{name}", _ring_case, plan, ctx, lens, hq, hkv, d, causal, dtype, "torch",
                        10 + i)
    for split in ("u4", "u2xr2"):
        plan = ContextShardPlan(_cu([1, 13, 30, 7]), world_group, layout="zigzag")
        log.run(f"sparse_{split}", _sparse_case, plan, splits[split][1], 3)

    def bad_heads():
        plan = ContextShardPlan(_cu([8]), world_group)
        q = torch.zeros(plan.local_num_tokens, 6, 4)
        errs = []
        for hq, hkv, match in ((6, 2, "6 query heads"), (4, 3, "3 KV heads")):
            try:
                ulysses_attention(q[:, :hq], q[:, :hkv], q[:, :hkv], plan)
                errs.append(f"Hq={hq} Hkv={hkv} was not refused")
            except ValueError as e:
                if match not in str(e):
                    errs.append(str(e))
        return errs

    log.run("rejects_bad_heads", bad_heads)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn(_worker, WORLD, tmp_path_factory.mktemp("ulysses"))


# xdist_group: under `-n 2 --dist loadgroup` a module fixture is built once per worker that runs one
# of its tests (the last CI spawned this one on both); the group keeps its tests on one worker.
@pytest.mark.dist
@pytest.mark.xdist_group("ulysses_results")
@pytest.mark.parametrize("case", CASE_NAMES)
def test_ulysses_matches_single_process(results, case):
    assert case in results, f"case {case} did not run"
    assert results[case] == [], "\n".join(results[case])


def test_replicate_kv_heads_maps_every_query_head_to_its_kv_head():
    """After replication, rank u's KV heads are the ones its query heads use (GQA h -> h // (H/Hkv))."""
    for H, Hkv, U in ((4, 1, 4), (8, 2, 4), (8, 4, 4), (8, 8, 2), (16, 2, 8)):
        k = torch.arange(Hkv).float().view(1, Hkv, 1)
        kr = replicate_kv_heads(k, U, H)
        per_q, per_kv = H // U, kr.shape[1] // U
        for u in range(U):
            local = kr[0, u * per_kv:(u + 1) * per_kv, 0].long().tolist()
            for h in range(u * per_q, (u + 1) * per_q):
                want = h // (H // Hkv)
                assert local[(h - u * per_q) // (per_q // per_kv)] == want, (H, Hkv, U, u, h)
    with pytest.raises(ValueError, match="3 KV heads"):
        replicate_kv_heads(torch.zeros(1, 3, 1), 4, 12)
    with pytest.raises(ValueError, match="6 query heads"):
        replicate_kv_heads(torch.zeros(1, 2, 1), 4, 6)
