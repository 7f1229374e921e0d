"""Trainer: packing-invariant loss normalisation, mini-batches, LR schedule, NaN handling, resume state."""

import math

import pytest
import torch

from primerl.rl.packing import Sample, pack
from primerl.runtime.trainer import _rl
from primerl.runtime.trainer.checkpoint import save_checkpoint
from primerl.runtime.validate import load_config
from primerl.runtime.trainer import NonFiniteLossError, Trainer, lr_lambda, shifted_logprobs
from trainer_testing import assert_same_grads, record_grads

V = 12


def _cfg(*over):
    return load_config(None, ["--model.n_layers", "1", "--model.dim", "32", "--model.moe_dim", "16",
                              "--max_steps", "10", *over])


def _samples(n=6, seed=0, L=2):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        P, C = 3 + i % 3, 2 + i % 4
        ids = torch.randint(0, V, (P + C,), generator=g)
        mask = torch.tensor([False] * P + [True] * C)
        lp = torch.where(mask, -torch.rand(P + C, generator=g) * 2, torch.zeros(P + C))
        replay = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(P + C)])[:, None, :].expand(P + C, 1, 2)
        out.append(Sample(ids, mask, float(torch.randn(1, generator=g)), lp, 1.0, replay.contiguous()))
    return out


def _payload(samples, seq_len):
    mbs = pack(samples, seq_len, 1, pad_to_seq_len=False)[0]
    return {"micro_batches": mbs, "num_loss_tokens": sum(int(s.loss_mask.sum()) for s in samples),
            "num_loss_seqs": len(samples), "metrics": {}}


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_update_does_not_depend_on_how_samples_are_packed(aggregation):
    cfg = _cfg("--trainer.loss.aggregation", aggregation)
    a, b = Trainer(cfg, V), Trainer(cfg, V)
    ga, gb = record_grads(a), record_grads(b)
    ma = a.train_step(_payload(_samples(), seq_len=64))  # one micro-batch
    mb = b.train_step(_payload(_samples(), seq_len=10))  # several
    assert len(_payload(_samples(), 10)["micro_batches"]) > 2
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-5, abs=1e-7)
    assert_same_grads(ga, gb)


def test_logprobs_alignment_and_replay():
    cfg = _cfg()
    t = Trainer(cfg, V)
    mb = _payload(_samples(3), 64)["micro_batches"][0]
    torch.set_grad_enabled(False)
    try:
        lp, _ = shifted_logprobs(t.model, mb, replay=False)
        logits = t.model(mb.input_ids, mb.position_ids, mb.cu_seqlens, return_logits=True)
        lp_r, _ = shifted_logprobs(t.model, mb, replay=True)
    finally:
        torch.set_grad_enabled(True)
    ref = torch.log_softmax(logits.float(), -1)
    for s, e in zip(mb.cu_seqlens[:-1].tolist(), mb.cu_seqlens[1:].tolist()):
        assert lp[s] == 0
        for i in range(s + 1, e):
            assert float(lp[i]) == pytest.approx(float(ref[i - 1, mb.input_ids[i]]), abs=1e-5)
    assert torch.equal(t.model.routing().long(), mb.replay_ids.long())
    assert not torch.allclose(lp_r, lp)  # random replayed routing differs from live routing


def test_mini_batches_take_several_optimizer_steps():
    one, four = Trainer(_cfg(), V), Trainer(_cfg("--trainer.mini_batches", "4"), V)
    payload = _payload(_samples(8), seq_len=12)
    assert len(payload["micro_batches"]) >= 4
    one.train_step(payload)
    four.train_step(payload)
    assert one.optimizer.state_dict()["state"][0]["step"] == 1
    assert four.optimizer.state_dict()["state"][0]["step"] == 4
    assert one.step == four.step == 1 and one.scheduler.last_epoch == four.scheduler.last_epoch == 1


@pytest.mark.parametrize("schedule,expect", [
    ("constant", [0.5, 1.0, 1.0, 1.0]),
    ("linear", [0.5, 1.0, 0.875, 0.1 + 0.9 * (1 - 4 / 8)]),
    ("cosine", [0.5, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 8)),
                0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2))]),
])
def test_lr_schedule(schedule, expect):
    f = lr_lambda(_cfg("--trainer.lr_schedule", schedule, "--trainer.warmup_steps", "2",
                       "--trainer.min_lr_ratio", "0.1"))
    got = [f(s) for s in (0, 1, 3, 6)]
    if schedule == "linear":
        expect = [0.5, 1.0, 0.1 + 0.9 * (1 - 1 / 8), 0.1 + 0.9 * (1 - 4 / 8)]
    assert got == pytest.approx(expect)


def test_nan_loss_is_skipped_counted_then_fatal(monkeypatch):
    t = Trainer(_cfg("--trainer.nan_retries", "1"), V)
    real = _rl.policy_loss
    calls = {"n": 0}

    def flaky(*a, **k):
        loss, m = real(*a, **k)
        calls["n"] += 1
        return (loss * float("nan"), m) if calls["n"] == 1 else (loss, m)

    monkeypatch.setattr(_rl, "policy_loss", flaky)
    before = {n: p.clone() for n, p in t.model.named_parameters()}
    m = t.train_step(_payload(_samples(2), 64))
    assert m["nan_skipped"] == 1 and math.isnan(m["grad_norm"])
    assert all(torch.equal(before[n], p) for n, p in t.model.named_parameters())
    assert all(float(st["step"]) == 0 for st in t.optimizer.state.values())  # fused AdamW's found_inf: no step
    m = t.train_step(_payload(_samples(2), 64))  # recovers
    assert m["nan_skipped"] == 1 and math.isfinite(m["grad_norm"]) and t.nan_streak == 0
    state = [v for st in t.optimizer.state.values() for v in st.values()]
    assert state and all(bool(torch.isfinite(v).all()) for v in state)  # the skipped NaN gradients left no trace

    monkeypatch.setattr(_rl, "policy_loss", lambda *a, **k: (real(*a, **k)[0] * float("nan"), real(*a, **k)[1]))
    t.train_step(_payload(_samples(2), 64))
    with pytest.raises(NonFiniteLossError, match="nan_retries = 1"):
        t.train_step(_payload(_samples(2), 64))


def test_checkpoint_restores_the_exact_training_state(tmp_path):
    cfg = _cfg()
    a = Trainer(cfg, V)
    a.train_step(_payload(_samples(4, seed=1), 64))
    save_checkpoint(tmp_path, a.step, a.model.state_dict(), a.train_state())
    b = Trainer(cfg, V)
    b.load(tmp_path / "step_000001")
    for t in (a, b):
        t.train_step(_payload(_samples(4, seed=2), 64))
    assert b.step == 2
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)


def test_dcp_checkpoint_restores_the_exact_training_state(tmp_path):
    """Trainer.save_checkpoint writes a sharded DCP checkpoint (one process here); Trainer.load
    of it continues exactly as the uninterrupted trainer, counters and schedule included."""
    from primerl.runtime.trainer.dcp_checkpoint import is_dcp_checkpoint

    cfg = _cfg("--trainer.warmup_steps", "3")
    a = Trainer(cfg, V)
    a.train_step(_payload(_samples(4, seed=1), 64))
    a.nan_skipped = 2
    a.save_checkpoint(tmp_path, a.step)
    assert is_dcp_checkpoint(tmp_path / "step_000001")
    b = Trainer(cfg, V)
    b.load(tmp_path / "step_000001")
    assert (b.step, b.nan_skipped, b.scheduler.get_last_lr()) == (1, 2, a.scheduler.get_last_lr())
    for t in (a, b):
        t.train_step(_payload(_samples(4, seed=2), 64))
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)


def test_padded_attention_path_matches_the_kernel_path():
    from primerl.runtime.trainer.padded_attention import padded_forward

    t = Trainer(_cfg("--model.n_layers", "2"), V)
    mb = _payload(_samples(7), 64)["micro_batches"][0]
    w = torch.linspace(-1, 1, mb.num_tokens * t.model.config.dim).view(mb.num_tokens, -1)
    grads = []
    for fwd in (lambda: t.model(mb.input_ids, mb.position_ids, mb.cu_seqlens),
                lambda: padded_forward(t.model, mb.input_ids, mb.position_ids, mb.cu_seqlens)):
        t.model.zero_grad(set_to_none=True)
        h = fwd()
        (h * w).sum().backward()
        grads.append((h.detach(), {n: p.grad for n, p in t.model.named_parameters() if p.grad is not None}))
    (h0, g0), (h1, g1) = grads
    assert torch.allclose(h0, h1, atol=1e-5)
    assert g0.keys() == g1.keys() and len(g0) > 10
    for n in g0:
        assert torch.allclose(g0[n], g1[n], rtol=1e-4, atol=1e-6 * float(g0[n].abs().max())), n
    # the hook stays (activation checkpointing recomputes through it) and leaves the kernel path alone
    assert torch.equal(t.model(mb.input_ids, mb.position_ids, mb.cu_seqlens), h0)


MLA = ["--model.family", "deepseek_v3", "--model.n_kv_heads", "4", "--model.extra", '{"kv_lora_rank": 16, '
       '"qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16}']


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("path", ["padded", "kernel", "mla_padded"])
def test_activation_checkpointing_gives_the_same_step_on_every_attention_path(path, mode):
    """The recompute in backward takes the forward's attention path (padded SDPA's hook included):
    a step under activation checkpointing has the gradients of the step without it."""
    over = ["--model.n_layers", "2", "--trainer.router_replay", "false",
            "--trainer.attention", "kernel" if path == "kernel" else "padded",
            *(MLA if path.startswith("mla") else [])]
    plain = Trainer(_cfg(*over), V)
    ckpt = Trainer(_cfg(*over, "--trainer.parallel.activation_checkpointing", mode), V)
    assert ckpt.padded == (path != "kernel")
    ga, gb = record_grads(plain), record_grads(ckpt)
    ma, mb = plain.train_step(_payload(_samples(5), 64)), ckpt.train_step(_payload(_samples(5), 64))
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-5, abs=1e-7)
    assert_same_grads(ga, gb)
