"""primerl.rl under torch.compile (fullgraph; aot_eager and inductor), FakeTensorMode and meta
tensors, with no host reads: the advantages, policy_loss (with and without cu_seqlens, forward and
backward) and the step's packing helpers (next_token_batch, token_aligned, seq_ids_from_cu_seqlens).
Plus the policy_loss conveniences: 0/1 float masks, per-sequence advantages [S].

Compiled vs eager: aot_eager runs eager's kernels, so bitwise; inductor generates its own
reductions, so max_rel_err (max|a - e| / max|e|) below 1e-6 (float32 losses; float64 advantages
rounded to float32).
"""

import inspect

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import primerl.kernels as K
from primerl import rl
from primerl.kernels.testing import assert_bitwise_equal, count_host_reads, max_rel_err
from primerl.rl import Sample, next_token_batch, pack, policy_loss, seq_ids_from_cu_seqlens, token_aligned

CU = [0, 5, 9, 9, 14]  # an empty sequence included
T = CU[-1]
LOSSES = {  # name -> policy_loss kwargs (cu_seqlens added where "cu")
    "ppo_token_mean": dict(),
    "dppo_tv_job": dict(method="dppo_tv", drop_zero_advantage=True, aggregation="global_token_sum",
                        global_num_tokens="tensor"),
    "gspo_cu": dict(method="gspo", cu=True),
    "dppo_seq_mean_geo_rs_cu": dict(method="dppo_tv", aggregation="seq_mean_token_mean", corrections=("geo_rs", "veto"),
                                    cu=True),
    "cispo_mis_seq_cu": dict(method="cispo", corrections=("mis",), mis_level="sequence", cu=True),
    "ppo_tis_terms_weights": dict(old=True, corrections=("tis", "icepop"), terms=True),  # ref-KL + SFT terms
}


def _loss_inputs(seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(T, generator=g)).to(device).requires_grad_()
    ilp = (lp.detach() + 0.05 * torch.randn(T, generator=g).to(device))
    adv = torch.randn(T, generator=g).to(device)
    adv[3] = 0.0
    mask = (torch.rand(T, generator=g) > 0.3).to(device)
    cu = torch.tensor(CU, dtype=torch.int32, device=device)
    return lp, ilp, adv, mask, cu


def _loss_fn(name):
    kw = dict(LOSSES[name])
    use_cu = kw.pop("cu", False)

    def f(lp, ilp, adv, mask, cu):
        k = dict(kw)
        if "global_num_tokens" in k:  # a device count, as the job's all-reduced one
            k["global_num_tokens"] = mask.sum().to(lp.dtype)
        if k.pop("old", False):
            k["old_logprobs"] = ilp + 0.02 * torch.cos(torch.arange(lp.shape[0], device=lp.device, dtype=lp.dtype))
        if k.pop("terms", False):
            k.update(ref_logprobs=ilp - 0.1, sft_weights=mask.to(lp.dtype) * 0.5,
                     loss_weights=torch.linspace(0.0, 2.0, lp.shape[0], device=lp.device, dtype=lp.dtype),
                     ref_kl_coef=0.5, sft_coef=0.1)
        loss, metrics = policy_loss(lp, ilp, adv, mask, cu_seqlens=cu if use_cu else None, **k)
        return loss, metrics["ratio_mean"], metrics["clip_frac_high"]
    return f


def _advantages(rewards, lengths):
    return (rl.grpo(rewards, 4).advantages, rl.drgrpo(rewards, 4).advantages,
            rl.rloo(rewards, 4, std_normalize="batch").advantages, rl.max_rl(rewards, 4).advantages,
            rl.grpo(rewards, 4, length_coef=0.1, lengths=lengths).advantages, rl.grpo(rewards, 4).uniform_groups)


def _rewards(seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (12,), generator=g).float()
    rewards[:4] = 1.0  # a uniform group
    return rewards, torch.randint(1, 50, (12,), generator=g)


def _close(a, e, backend, name):
    if backend == "aot_eager":  # exact: equal values (a masked gradient's 0 may come out as -0)
        assert a.shape == e.shape and a.dtype == e.dtype and torch.equal(a, e), name
    else:
        assert a.shape == e.shape and a.dtype == e.dtype, name
        assert max_rel_err(a, e) < 1e-6 if a.dtype.is_floating_point else torch.equal(a, e), name


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_losses_forward_backward_and_advantages_match_eager(backend):
    lp, ilp, adv, mask, cu = _loss_inputs(0)
    rewards, lengths = _rewards(1)

    # inductor compiles C++ per kernel (seconds each on this CPU): it gets the job's loss and the
    # sequence-level one; aot_eager every loss
    names = list(LOSSES) if backend == "aot_eager" else ["dppo_tv_job", "dppo_seq_mean_geo_rs_cu"]

    def everything(lp, ilp, adv, mask, cu, rewards, lengths):
        losses = [_loss_fn(name)(lp, ilp, adv, mask, cu) for name in names]
        return losses, _advantages(rewards, lengths)

    torch._dynamo.reset()
    with K.debug_checks(False):
        eager = everything(lp, ilp, adv, mask, cu, rewards, lengths)
        compiled = torch.compile(everything, backend=backend, fullgraph=True)(lp, ilp, adv, mask, cu, rewards, lengths)
    for name, (ce, ee) in zip(names, zip(compiled[0], eager[0])):
        for i, (a, e) in enumerate(zip(ce, ee)):
            _close(a.detach(), e.detach(), backend, f"{name} output {i}")
        _close(torch.autograd.grad(ce[0], lp, retain_graph=True)[0], torch.autograd.grad(ee[0], lp)[0], backend,
               f"{name} grad")
    for i, (a, e) in enumerate(zip(compiled[1], eager[1])):
        _close(a, e, backend, f"advantages {i}")


def _microbatch():
    g = torch.Generator().manual_seed(2)
    samples = []
    for L in (4, 6, 3):
        samples.append(Sample(input_ids=torch.randint(1, 50, (L,), generator=g),
                              loss_mask=torch.arange(L) >= 2, advantages=float(torch.randn((), generator=g)),
                              inference_logprobs=-torch.rand(L, generator=g), temperature=0.8,
                              loss_weights=torch.rand(L, generator=g)))
    return pack(samples, seq_len=16, num_ranks=1)[0][0]


def _packing_helpers(mb):
    shifted, targets = next_token_batch(mb)
    lp = -torch.arange(mb.input_ids.shape[0], dtype=torch.float32, device=mb.input_ids.device)
    return (targets, shifted.loss_mask, shifted.advantages, shifted.temperatures, shifted.loss_weights,
            token_aligned(lp, mb.cu_seqlens), seq_ids_from_cu_seqlens(mb.cu_seqlens, mb.input_ids.shape[0]))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_packing_helpers_bitwise_equal_eager(backend):
    mb = _microbatch()
    torch._dynamo.reset()
    eager = _packing_helpers(mb)
    compiled = torch.compile(_packing_helpers, backend=backend, fullgraph=True)(mb)
    for i, (a, e) in enumerate(zip(compiled, eager)):
        _close(a, e, "aot_eager", f"output {i}")  # exact for both backends: no arithmetic to reorder


def test_next_token_batch_and_token_aligned_semantics():
    mb = _microbatch()
    shifted, targets = next_token_batch(mb)
    cu = mb.cu_seqlens.tolist()
    for s in range(len(cu) - 1):
        a, b = cu[s], cu[s + 1]
        for t in range(a, b):
            nxt = t + 1 < b
            # entry t now describes token t+1 of the same sequence (or leaves the loss at the last token)
            assert shifted.loss_mask[t] == (bool(mb.loss_mask[t + 1]) if nxt else False)
            if nxt:
                assert targets[t] == mb.input_ids[t + 1] and shifted.advantages[t] == mb.advantages[t + 1]
    assert torch.equal(shifted.input_ids, mb.input_ids) and torch.equal(shifted.position_ids, mb.position_ids)
    # token_aligned undoes the shift of per-prediction values: entry t from prediction t-1, 0 at starts
    x = torch.randn(mb.num_tokens)
    y = token_aligned(x, mb.cu_seqlens)
    starts = set(cu[:-1])
    for t in range(mb.num_tokens):
        assert y[t] == (0.0 if t in starts else x[t - 1])


def test_trainer_uses_the_rl_shift():
    """One implementation: the trainer's helpers are primerl.rl's."""
    from primerl.runtime import trainer

    assert trainer.next_token_batch is rl.next_token_batch
    assert trainer.FORWARD_FIELDS is rl.next_token.FORWARD_FIELDS


def test_dynamic_packings_at_most_two_graphs():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    torch._dynamo.reset()
    f = torch.compile(_loss_fn("dppo_seq_mean_geo_rs_cu"), backend=counter, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(3)
    with K.debug_checks(False):
        for n_seq in (2, 3, 5, 4, 6, 7, 3, 8):
            lengths = torch.randint(1, 6, (n_seq,), generator=g)
            cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).int()
            t = int(cu[-1])
            lp = -torch.rand(t, generator=g)
            args = (lp, lp + 0.01, torch.randn(t, generator=g), torch.rand(t, generator=g) > 0.2, cu)
            _close(f(*args)[0], _loss_fn("dppo_seq_mean_geo_rs_cu")(*args)[0], "inductor", f"S={n_seq}")
    assert counter.frame_count <= 2


@pytest.mark.parametrize("mode", ["fake", "meta"])
def test_fake_and_meta(mode):
    def run():
        lp, ilp, adv, mask, cu = _loss_inputs(4, device="meta" if mode == "meta" else "cpu")
        out = {}
        for name in LOSSES:
            loss, ratio, _ = _loss_fn(name)(lp, ilp, adv, mask, cu)
            out[name] = (loss, torch.autograd.grad(loss, lp)[0])
        rewards = torch.rand(12, device=lp.device)
        lengths = torch.randint(1, 9, (12,), device=lp.device)
        return out, _advantages(rewards, lengths)

    if mode == "fake":
        with FakeTensorMode(), count_host_reads() as reads:
            losses, advs = run()
        assert reads.total == 0, reads.where
    else:
        losses, advs = run()
    for name, (loss, grad) in losses.items():
        assert loss.shape == () and loss.dtype == torch.float32, name
        assert grad.shape == (T,) and grad.dtype == torch.float32, name
    for a in advs[:-1]:
        assert a.shape == (12,) and a.dtype == torch.float32
    assert advs[-1].shape == (3,) and advs[-1].dtype == torch.bool


def test_no_host_reads_in_eager():
    lp, ilp, adv, mask, cu = _loss_inputs(5)
    rewards, lengths = _rewards(6)
    mb = _microbatch()
    with K.debug_checks(False), count_host_reads() as reads:
        for name in LOSSES:
            loss = _loss_fn(name)(lp, ilp, adv, mask, cu)[0]
            loss.backward()
        _advantages(rewards, lengths)
        _packing_helpers(mb)
        policy_loss(lp, ilp, adv[:4], mask.float(), cu_seqlens=cu)[0].backward()
    assert reads.total == 0, reads.where


def test_float_mask_and_per_sequence_advantages():
    lp, ilp, adv, mask, cu = _loss_inputs(7)
    seq_adv = torch.randn(len(CU) - 1)
    per_token = seq_adv[seq_ids_from_cu_seqlens(cu, T)]
    for kw in (dict(), dict(method="gspo", cu_seqlens=cu), dict(method="dppo_tv", drop_zero_advantage=True)):
        rest = {k: v for k, v in kw.items() if k != "cu_seqlens"}
        want = policy_loss(lp, ilp, per_token, mask, cu_seqlens=cu, **rest)
        for m in (mask.float(), mask.int(), mask.to(torch.bfloat16)):
            got = policy_loss(lp, ilp, seq_adv, m, cu_seqlens=cu, **rest)
            assert_bitwise_equal(got[0], want[0], "loss")
            assert_bitwise_equal(torch.autograd.grad(got[0], lp)[0],
                                 torch.autograd.grad(want[0], lp, retain_graph=True)[0], "grad")
            assert got[1].keys() == want[1].keys()
    with pytest.raises(ValueError, match=r"advantages must be a 1-D tensor \[T=14\] like logprobs or \[S=4\]"):
        policy_loss(lp, ilp, torch.zeros(3), mask, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"advantages must be a 1-D tensor \[T=14\] like logprobs, got \(4,\)"):
        policy_loss(lp, ilp, seq_adv, mask)  # [S] needs cu_seqlens
    with pytest.raises(ValueError, match=r"loss_mask must hold only 0 and 1.*loss_weights="):
        policy_loss(lp, ilp, adv, mask.float() * 0.5)


def test_argument_names_in_shape_errors():
    lp, ilp, adv, mask, cu = _loss_inputs(8)
    with pytest.raises(ValueError, match=r"policy_loss: logprobs must be a 1-D float tensor \[T\].*\(2, 7\)"):
        policy_loss(lp.detach().view(2, 7), ilp, adv, mask)
    with pytest.raises(ValueError, match=r"policy_loss: inference_logprobs must be a 1-D tensor \[T=14\] "
                                         r"like logprobs, got \(13,\)"):
        policy_loss(lp, ilp[:-1], adv, mask)


def test_bad_values_fail_on_device_without_debug_mode():
    lp, ilp, adv, mask, cu = _loss_inputs(9)
    with K.debug_checks(False):
        with pytest.raises(RuntimeError, match="cu_seqlens must start at 0"):
            policy_loss(lp, ilp, adv, mask, cu_seqlens=torch.tensor([0, 5, 3, 14]))
        with pytest.raises(RuntimeError, match="global_num_tokens must be > 0"):
            policy_loss(lp, ilp, adv, mask, aggregation="global_token_sum", global_num_tokens=torch.tensor(0.0))
        with pytest.raises(RuntimeError, match="rewards contain NaN or inf"):
            rl.grpo(torch.tensor([1.0, float("nan")]), 2)
        with pytest.raises(RuntimeError, match="lengths must be >= 0"):
            rl.linear_length_penalty(torch.zeros(2), torch.tensor([1, -1]), 0.1)
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0.*got \[0, 5, 3, 14\]"):
        policy_loss(lp, ilp, adv, mask, cu_seqlens=torch.tensor([0, 5, 3, 14]))


def test_policy_loss_defaults_are_documented_against_the_jobs():
    """policy_loss's defaults differ from the job's default loss; the docstring says so and how."""
    from primerl.runtime.config import LossConfig

    sig = inspect.signature(policy_loss).parameters
    job = LossConfig()
    assert (sig["method"].default, sig["drop_zero_advantage"].default) == ("ppo_clip", False)
    assert (job.method, job.drop_zero_advantage) == ("dppo_tv", True)
    doc = " ".join(policy_loss.__doc__.split())
    assert 'method="dppo_tv", drop_zero_advantage=True' in doc and "Defaults differ from the job's" in doc
