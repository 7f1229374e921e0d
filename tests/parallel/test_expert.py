"""AllToAllDispatcher: round trips and gradients against a single-process reference.

The reference computes every token's k expert outputs directly (no permutation, no exchange);
the dispatcher runs on real gloo ranks (one spawn, many cases) with NaN-poisoned torch.empty.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _parallel_dist import spawn
from primerl.kernels.fp8 import dequant, quant_per_token_group
from primerl.kernels.testing import max_rel_err
from primerl.parallel.expert import AllToAllDispatcher, local_expert_range

RTOL = 1e-5


def make_data(seed, token_counts, dim, num_experts, top_k, id_pool=None, dtype=torch.float32):
    """Inputs of every rank in one draw: [(x, ids, weights, cotangent)] per rank, expert weights."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.arange(num_experts) if id_pool is None else torch.tensor(id_pool)
    data = []
    for T in token_counts:
        x = torch.randn(T, dim, generator=g).to(dtype)
        if top_k <= len(pool):  # distinct experts per token, as top-k gives
            ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:top_k]] for _ in range(T)]) \
                if T else torch.zeros(0, top_k, dtype=torch.int64)
        else:
            ids = pool[torch.randint(len(pool), (T, top_k), generator=g)]
        w = torch.rand(T, top_k, generator=g)
        cot = torch.randn(T, dim, generator=g)
        data.append((x, ids.to(torch.int32), w, cot))
    expert_w = torch.randn(num_experts, dim, dim, generator=g) / dim**0.5
    return data, expert_w


def expert_forward(rows, w):
    return torch.tanh(rows.float() @ w).to(rows.dtype)


def reference(data, expert_w, fp8_group_size=None):
    """Per rank (y, dx, dw) and d expert_w, computed with no dispatch at all."""
    expert_w = expert_w.clone().requires_grad_()
    outs, total = [], 0
    for x, ids, w, cot in data:
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        x_in = x
        if fp8_group_size and x.shape[0]:  # FP8 dispatch: quantized forward, straight-through backward
            q, sf = quant_per_token_group(x.detach(), fp8_group_size)
            x_in = x + (dequant(q, sf, group_shape=(1, fp8_group_size), out_dtype=x.dtype) - x).detach()
        y = torch.zeros(x.shape, dtype=torch.float32)
        for j in range(ids.shape[1]):
            yj = torch.tanh(torch.bmm(x_in.float().unsqueeze(1), expert_w[ids[:, j].long()]).squeeze(1)).to(x.dtype)
            y = y + yj.float() * w[:, j:j + 1]
        y = y.to(x.dtype)
        total = total + (y.float() * cot).sum()
        outs.append((y, x, w))
    total.backward()
    return [(y.detach(), x.grad, w.grad) for y, x, w in outs], expert_w.grad


def expected_recv(data, num_experts, ep_size, ep_rank, fp8_group_size=None):
    """Rows this rank must receive: by local expert, then source rank, then (token, slot) order."""
    start, end = local_expert_range(num_experts, ep_size, ep_rank)
    rows = []
    for e in range(start, end):
        for x, ids, _, _ in data:
            if fp8_group_size and x.shape[0]:
                q, sf = quant_per_token_group(x, fp8_group_size)
                x = dequant(q, sf, group_shape=(1, fp8_group_size), out_dtype=x.dtype)
            t, _ = (ids == e).nonzero(as_tuple=True)
            rows.append(x[t])
    return torch.cat(rows)


def run_dispatcher(disp, x, ids, w, cot, expert_w_local):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    ew = expert_w_local.clone().requires_grad_()
    x_recv, counts, handle = disp.dispatch(x, ids, w)
    chunks = x_recv.split(handle.local_counts_list)
    y_recv = torch.cat([expert_forward(c, ew[i]) for i, c in enumerate(chunks)])
    y = disp.combine(y_recv, handle)
    (y.float() * cot).sum().backward()
    return x_recv.detach(), counts, y.detach(), x.grad, w.grad, ew.grad


def compare(data, expert_w, ep_size, ep_rank, got, fp8_group_size=None, rtol=RTOL):
    errors = []
    x_recv, counts, y, dx, dw, dew = got
    ref, ref_dew = reference(data, expert_w, fp8_group_size)
    ry, rdx, rdw = ref[ep_rank]
    want_recv = expected_recv(data, expert_w.shape[0], ep_size, ep_rank, fp8_group_size)
    if x_recv.shape != want_recv.shape or not torch.equal(x_recv, want_recv):
        errors.append(f"x_recv differs from the expected grouped rows "
                      f"({tuple(x_recv.shape)} vs {tuple(want_recv.shape)})")
    start, end = local_expert_range(expert_w.shape[0], ep_size, ep_rank)
    want_counts = sum(torch.bincount(d[1].reshape(-1).long(), minlength=expert_w.shape[0]) for d in data)[start:end]
    if not torch.equal(counts.cpu(), want_counts):
        errors.append(f"local_counts {counts.tolist()} != {want_counts.tolist()}")
    for name, a, b in [("y", y, ry), ("dx", dx, rdx), ("dtopk_weights", dw, rdw),
                       ("dexpert_w", dew, ref_dew[start:end])]:
        if a.shape != b.shape:
            errors.append(f"{name} shape {tuple(a.shape)} != {tuple(b.shape)}")
        elif a.numel() and not (err := max_rel_err(a.float(), b.float())) <= rtol:
            errors.append(f"{name} max rel err {err:.3g} > {rtol}")
    return errors


# ---- in-process (a single rank: no process group) ------------------------------------------


@pytest.mark.parametrize("T,E,K", [(1, 4, 1), (7, 4, 2), (13, 4, 4), (5, 3, 2), (0, 4, 2)])
def test_single_rank_matches_reference(T, E, K):
    data, expert_w = make_data(T * 31 + K, [T], 8, E, K)
    got = run_dispatcher(AllToAllDispatcher(None, E), *data[0], expert_w)
    assert compare(data, expert_w, 1, 0, got) == []


def test_single_rank_fp8_matches_straight_through_reference():
    data, expert_w = make_data(3, [9], 256, 4, 2)
    got = run_dispatcher(AllToAllDispatcher(None, 4, fp8_dispatch=True), *data[0], expert_w)
    assert compare(data, expert_w, 1, 0, got, fp8_group_size=128) == []


def test_combine_sums_slots_in_float32_in_k_order():
    disp = AllToAllDispatcher(None, 4)
    x = torch.randn(6, 16, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1, 2]] * 6, dtype=torch.int32)
    w = torch.rand(6, 3)
    x_recv, _, h = disp.dispatch(x, ids, w)
    y = disp.combine(x_recv, h, out_dtype=torch.float32)
    want = x.float() * w[:, 0:1]
    for j in (1, 2):
        want = want + x.float() * w[:, j:j + 1]
    torch.testing.assert_close(y, want, rtol=0, atol=0)


def test_validation_errors():
    disp = AllToAllDispatcher(None, 4)
    x, ids, w = torch.randn(3, 8), torch.zeros(3, 2, dtype=torch.int64), torch.rand(3, 2)
    with pytest.raises(ValueError, match="x must be"):
        disp.dispatch(x[0], ids, w)
    with pytest.raises(ValueError, match="topk_ids must be"):
        disp.dispatch(x, ids[:2], w)
    with pytest.raises(ValueError, match="integer"):
        disp.dispatch(x, ids.float(), w)
    with pytest.raises(ValueError, match="topk_weights shape"):
        disp.dispatch(x, ids, w[:, :1])
    with pytest.raises(ValueError, match="outside"):
        disp.dispatch(x, torch.tensor([[0, 4], [1, 2], [0, 1]]), w)
    with pytest.raises(ValueError, match="outside"):
        disp.dispatch(x, torch.tensor([[0, -1], [1, 2], [0, 1]]), w)
    with pytest.raises(ValueError, match="divisible by fp8_group_size"):
        AllToAllDispatcher(None, 4, fp8_dispatch=True).dispatch(x, ids, w)
    with pytest.raises(ValueError, match="num_experts"):
        AllToAllDispatcher(None, 0)
    with pytest.raises(ValueError, match="divisible"):
        local_expert_range(6, 4, 0)
    x_recv, _, h = disp.dispatch(x, ids, w)
    with pytest.raises(ValueError, match="y_recv must be"):
        disp.combine(x_recv[1:], h)


# ---- real gloo ranks -------------------------------------------------------------------------

WORLD = 4
# name: (ep group: "world" or "pairs"), token counts per group rank, D, E, K, id pool, fp8 group size
CASES = {
    "uneven_splits": ("world", [7, 0, 13, 3], 8, 8, 2, None, None),
    "zero_token_experts": ("world", [5, 6, 1, 4], 8, 8, 2, [0, 3, 5], None),
    "all_to_one_expert": ("world", [3, 2, 5, 1], 8, 8, 1, [6], None),
    "k_equals_num_experts": ("world", [5, 2, 1, 3], 8, 4, 4, None, None),
    "ep2_subgroups": ("pairs", [11, 5], 8, 6, 3, None, None),
    "fp8_dispatch": ("world", [4, 9, 0, 2], 256, 8, 2, None, 128),
}


def _bad_ids_raise_on_every_rank(rank):
    """Rank 2 routes to a non-existent expert: every rank raises (none is left waiting), naming rank 2."""
    disp = AllToAllDispatcher(None, 8)
    ids = torch.tensor([[0, 8 if rank == 2 else 1]])
    try:
        disp.dispatch(torch.randn(1, 4), ids, torch.rand(1, 2))
    except ValueError as e:
        return [] if "ep rank 2: 1" in str(e) else [f"unexpected message: {e}"]
    return ["no error raised"]


def _worker(rank, world_size, log):
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    # first, so that the cases after it show the group is still usable
    log.run("bad_ids_raise_on_every_rank", _bad_ids_raise_on_every_rank, rank)
    for i, (name, (grp, counts, D, E, K, pool, fp8)) in enumerate(CASES.items()):
        group, ep_rank, ep_size = (None, rank, world_size) if grp == "world" else (pairs[rank // 2], rank % 2, 2)
        # the two pairs run different data, so a mix-up between groups cannot pass
        seed = 100 * i + (rank // 2 if grp == "pairs" else 0)

        def case(group=group, ep_rank=ep_rank, ep_size=ep_size, seed=seed, counts=counts, D=D, E=E, K=K,
                 pool=pool, fp8=fp8):
            data, expert_w = make_data(seed, counts, D, E, K, pool)
            disp = AllToAllDispatcher(group, E, fp8_dispatch=fp8 is not None, fp8_group_size=fp8 or 128)
            start, end = local_expert_range(E, ep_size, ep_rank)
            got = run_dispatcher(disp, *data[ep_rank], expert_w[start:end])
            return compare(data, expert_w, ep_size, ep_rank, got, fp8_group_size=fp8)

        log.run(name, case)


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    return spawn(_worker, WORLD, tmp_path_factory.mktemp("ep"))


# xdist_group: under `-n 2 --dist loadgroup` a module fixture is built once per worker that runs one
# of its tests (the last CI spawned this one on both); the group keeps its tests on one worker.
@pytest.mark.dist
@pytest.mark.xdist_group("expert_dispatch_results")
@pytest.mark.parametrize("case", ["bad_ids_raise_on_every_rank", *CASES])
def test_dispatch_combine_on_gloo(dist_results, case):
    assert case in dist_results, f"case {case} did not run"
    assert dist_results[case] == [], "\n".join(dist_results[case])
