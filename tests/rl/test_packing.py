import itertools

import pytest
import torch

from primerl.rl.losses import policy_loss
from primerl.rl.packing import MicroBatch, Sample, _balance, pack, packing_stats


def _sample(L, seed, temperature=None, replay=None, topk=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(L, generator=g) < 0.7
    mask[0] = False
    return Sample(
        input_ids=torch.randint(1, 1000, (L,), generator=g),
        loss_mask=mask,
        advantages=float(torch.randn(1, generator=g)),
        inference_logprobs=-torch.rand(L, generator=g),
        temperature=temperature,
        replay_ids=None if replay is None else torch.randint(0, 8, (L, *replay), generator=g),
        teacher_topk_ids=torch.randint(0, 1000, (L, topk), generator=g) if topk else None,
        teacher_topk_logprobs=-torch.rand(L, topk, generator=g) if topk else None,
    )


def _check_layout(per_rank, samples, seq_len):
    seen = []
    for mbs in per_rank:
        assert len(mbs) == len(per_rank[0])
        for mb in mbs:
            assert mb.num_tokens == seq_len
            cu = mb.cu_seqlens
            assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == seq_len
            for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
                assert mb.position_ids[a:b].tolist() == list(range(b - a))
            if mb.is_padding:
                assert not mb.loss_mask.any() and mb.sample_indices == () and mb.num_real_tokens == 0
            for k, i in enumerate(mb.sample_indices):
                a, b = int(cu[k]), int(cu[k + 1])
                smp = samples[i]
                assert torch.equal(mb.input_ids[a:b], smp.input_ids)
                assert torch.equal(mb.loss_mask[a:b], smp.loss_mask)
                assert torch.equal(mb.inference_logprobs[a:b], smp.inference_logprobs)
                assert (mb.advantages[a:b] == smp.advantages).all()
                seen.append(i)
            tail = slice(mb.num_real_tokens, seq_len)
            assert not mb.loss_mask[tail].any() and (mb.input_ids[tail] == 0).all()
    assert sorted(seen) == list(range(len(samples)))  # every sample exactly once


@pytest.mark.parametrize("num_ranks", [1, 3, 4])
def test_pack_places_every_sample_once_within_seq_len(num_ranks):
    g = torch.Generator().manual_seed(num_ranks)
    lengths = torch.randint(1, 64, (23,), generator=g).tolist() + [64, 1]
    samples = [_sample(L, i) for i, L in enumerate(lengths)]
    per_rank = pack(samples, seq_len=64, num_ranks=num_ranks)
    assert len(per_rank) == num_ranks
    _check_layout(per_rank, samples, 64)
    stats = packing_stats(per_rank)
    assert stats["efficiency"] == pytest.approx(sum(lengths) / (64 * num_ranks * len(per_rank[0])))


def test_first_fit_decreasing_bins():
    samples = [_sample(L, i) for i, L in enumerate([5, 3, 6, 2, 4, 4])]
    (mbs,) = pack(samples, seq_len=8, num_ranks=1)
    groups = sorted(sorted(len(samples[i]) for i in mb.sample_indices) for mb in mbs)
    # FFD: 6 -> [6], 5 -> [5], 4 -> [4], 4 -> [4, 4], 3 -> [5, 3], 2 -> [6, 2]
    assert groups == [[2, 6], [3, 5], [4, 4]]


def test_every_rank_gets_the_same_number_with_flagged_padding():
    samples = [_sample(8, i) for i in range(5)]
    per_rank = pack(samples, seq_len=8, num_ranks=4)
    assert [len(m) for m in per_rank] == [2, 2, 2, 2]
    flags = sorted(mb.is_padding for mbs in per_rank for mb in mbs)
    assert flags == [False] * 5 + [True] * 3
    assert pack([], seq_len=8, num_ranks=2) == [[], []]


def test_too_long_sample_raises_or_truncates():
    samples = [_sample(10, 0), _sample(3, 1)]
    with pytest.raises(ValueError, match=r"samples\[0\] has 10 tokens, more than seq_len=8"):
        pack(samples, seq_len=8, num_ranks=1)
    (mbs,) = pack(samples, seq_len=8, num_ranks=1, truncate=True)
    first = next(mb for mb in mbs if 0 in mb.sample_indices)
    k = first.sample_indices.index(0)
    a = int(first.cu_seqlens[k])
    assert torch.equal(first.input_ids[a:a + 8], samples[0].input_ids[:8])


def test_balance_is_close_to_the_brute_force_optimum():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        costs = (torch.rand(6, generator=g) ** 3 * 100).tolist()
        ranks = _balance(costs, 2)
        assert sorted(len(r) for r in ranks) == [3, 3]
        got = max(sum(costs[b] for b in r) for r in ranks)
        best = min(max(sum(costs[b] for b in a), sum(costs[b] for b in range(6) if b not in a))
                   for a in itertools.combinations(range(6), 3))
        assert got <= best * 4 / 3 + 1e-9


def test_quadratic_cost_balances_long_sequences():
    # one 4096-token sequence costs as much as many short ones once attention is counted
    samples = [_sample(4096, 0)] + [_sample(512, i + 1) for i in range(15)]
    per_rank = pack(samples, seq_len=4096, num_ranks=2, cost=(1.0, 1.0 / 1024))
    stats = packing_stats(per_rank)
    assert stats["imbalance"] < 1.5
    loads = [sum(mb.cost for mb in mbs) for mbs in per_rank]
    assert max(loads) / min(loads) < 2.5


def test_temperatures_and_replay_ids():
    samples = [_sample(5, 0, temperature=0.7, replay=(2, 3)), _sample(4, 1, replay=(2, 3))]
    (mbs,) = pack(samples, seq_len=16, num_ranks=1)
    (mb,) = mbs
    assert mb.replay_ids.shape == (16, 2, 3)
    i0 = mb.sample_indices.index(0)
    a = int(mb.cu_seqlens[i0])
    assert torch.equal(mb.replay_ids[a:a + 5], samples[0].replay_ids)
    assert (mb.replay_ids[9:] == torch.arange(3)).all()  # padding rows route to distinct experts
    assert torch.allclose(mb.temperatures[a:a + 5], torch.full((5,), 0.7))
    assert (mb.temperatures[mb.num_real_tokens:] == 1.0).all()
    (plain,) = pack([_sample(3, 2)], seq_len=4, num_ranks=1)
    assert plain[0].temperatures is None and plain[0].replay_ids is None
    with pytest.raises(ValueError, match="replay_ids trailing shape"):
        pack([_sample(3, 0, replay=(2, 3)), _sample(3, 1, replay=(2, 2))], seq_len=8)


def test_unpadded_micro_batches():
    samples = [_sample(L, i) for i, L in enumerate([3, 4])]
    (mbs,) = pack(samples, seq_len=16, num_ranks=1, pad_to_seq_len=False)
    assert [mb.num_tokens for mb in mbs] == [7] and mbs[0].cu_seqlens.tolist() == [0, 3, 7]  # samples keep input order


def test_bad_samples_raise():
    s = _sample(4, 0)
    bad = Sample(s.input_ids, s.loss_mask[:3], 1.0, s.inference_logprobs)
    with pytest.raises(ValueError, match=r"loss_mask must have shape \(4,\)"):
        pack([bad], seq_len=8)
    with pytest.raises(ValueError, match="num_ranks must be >= 1"):
        pack([s], seq_len=8, num_ranks=0)
    with pytest.raises(ValueError, match="must be a Sample"):
        pack([object()], seq_len=8)


def test_packed_batch_feeds_sequence_level_losses():
    samples = [_sample(L, i) for i, L in enumerate([5, 7, 3])]
    (mbs,) = pack(samples, seq_len=20, num_ranks=1)
    mb = mbs[0]
    lp = (mb.inference_logprobs.double() + 0.01).requires_grad_()
    loss, m = policy_loss(lp, mb.inference_logprobs.double(), mb.advantages.double(), mb.loss_mask, method="gspo",
                          cu_seqlens=mb.cu_seqlens, corrections=("veto", "geo_rs"), geo_rs_high=1.1)
    loss.backward()
    assert torch.isfinite(loss) and (lp.grad[~mb.loss_mask] == 0).all()
    assert float(m["num_tokens"]) == float(mb.loss_mask.sum())


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_for_context_splits_every_per_token_tensor(layout):
    from primerl.parallel import context  # primerl's own module: an import error fails, never skips
    samples = [_sample(L, i, temperature=0.5 + i, replay=(2, 2), topk=3) for i, L in enumerate([5, 6, 9])]
    samples[1].loss_weights = torch.rand(len(samples[1])) + 0.5
    (mbs,) = pack(samples, seq_len=24, num_ranks=1)
    mb = mbs[0]
    assert all(getattr(mb, name) is not None for name in MicroBatch.PER_TOKEN)
    W = 2
    loss_tokens, padded = 0, False
    for rank in range(W):
        plan = context.ContextShardPlan(mb.cu_seqlens, layout=layout, world_size=W, rank=rank)
        local = mb.shard_for_context(plan)
        for name in MicroBatch.PER_TOKEN:
            full, part = getattr(mb, name), getattr(local, name)
            assert part.shape[0] == plan.local_num_tokens
            expect = plan.shard(full, dim=0)
            if name == "loss_mask":
                expect = expect & ~plan.padding_mask
            if name == "temperatures":  # plan padding samples at 1.0 (0 is not a temperature)
                expect = expect.masked_fill(plan.padding_mask, 1.0)
            if name == "replay_ids":  # plan padding routes to experts 0..k-1 (distinct ids)
                spread = torch.arange(expect.shape[-1], dtype=expect.dtype).expand_as(expect)
                expect = torch.where(plan.padding_mask[:, None, None], spread, expect)
            assert torch.equal(part, expect), name
        padded = padded or bool(plan.padding_mask.any())
        assert torch.equal(local.cu_seqlens, plan.local_cu_seqlens) and local.context_plan is plan
        assert not local.loss_mask[plan.padding_mask].any()
        loss_tokens += int(local.loss_mask.sum())
        with pytest.raises(ValueError, match="already sharded"):
            local.shard_for_context(plan)
    assert loss_tokens == int(mb.loss_mask.sum())  # every loss token lands on exactly one rank
    assert padded  # the case exercises plan padding
    other = context.ContextShardPlan(torch.tensor([0, 24], dtype=torch.int32), world_size=W, rank=0)
    with pytest.raises(ValueError, match="different cu_seqlens"):
        mb.shard_for_context(other)


def test_teacher_topk_rides_with_its_tokens_through_pack_and_next_token_batch():
    """distill.topk: each sample's [L, k] rows land at its tokens' positions (padding rows 0), move
    one token earlier with the other loss-side fields, and a batch mixing k (or one tensor without
    the other) is refused naming the sample."""
    from primerl.rl import next_token_batch

    samples = [_sample(L, i, topk=2) for i, L in enumerate([4, 7, 3])]
    (mbs,) = pack(samples, seq_len=16, num_ranks=1)
    mb = mbs[0]
    cu = mb.cu_seqlens.tolist()
    for j, i in enumerate(mb.sample_indices):
        assert torch.equal(mb.teacher_topk_ids[cu[j]:cu[j + 1]], samples[i].teacher_topk_ids)
        assert torch.equal(mb.teacher_topk_logprobs[cu[j]:cu[j + 1]], samples[i].teacher_topk_logprobs)
    assert (mb.teacher_topk_ids[14:] == 0).all() and (mb.teacher_topk_logprobs[14:] == 0).all()
    shifted, _ = next_token_batch(mb)
    assert torch.equal(shifted.teacher_topk_ids[:-1], mb.teacher_topk_ids[1:])
    assert torch.equal(shifted.teacher_topk_logprobs[:-1], mb.teacher_topk_logprobs[1:])
    with pytest.raises(ValueError, match=r"samples\[1\] carries the teacher's top-3 and samples\[0\] its top-2"):
        pack([samples[0], _sample(5, 9, topk=3)], seq_len=16)
    half = _sample(5, 9, topk=2)
    half.teacher_topk_logprobs = None
    with pytest.raises(ValueError, match=r"samples\[0\].teacher_topk_ids \(int\) and teacher_topk_logprobs"):
        pack([half], seq_len=16)
