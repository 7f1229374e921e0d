"""Per-token loss weights through the job: Environment.token_weights -> Sample/MicroBatch
.loss_weights -> the trainer's policy loss, normalised by the global weight sum."""

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from test_trainer import V, _cfg, _payload, _samples

from primerl.rl.envs import Environment, ReverseText, has_token_weights
from primerl.rl.packing import pack
from primerl.runtime.validate import load_config
from primerl.runtime.orchestrator.env_calls import check_token_weights
from primerl.runtime.launch.threads import run_threads
from primerl.runtime.trainer import Trainer
from trainer_testing import assert_same_grads, grad_gap, record_grads

ROOT = Path(__file__).resolve().parents[2]


def _weighted(samples, fn):
    return [replace(s, loss_weights=fn(i, s)) for i, s in enumerate(samples)]


def test_pack_carries_weights_with_ones_for_unweighted_samples_and_zeros_on_padding():
    s = _samples(3)
    w0 = torch.rand(len(s[0]))
    s = [replace(s[0], loss_weights=w0), s[1], s[2]]
    mb = pack(s, 64, 1, pad_to_seq_len=True)[0][0]
    assert mb.loss_weights.dtype == torch.float32 and mb.loss_weights.shape == (64,)
    cu = mb.cu_seqlens.tolist()
    for k, i in enumerate(mb.sample_indices):
        got = mb.loss_weights[cu[k]:cu[k + 1]]
        assert torch.equal(got, w0 if i == 0 else torch.ones(len(s[i])))
    assert torch.equal(mb.loss_weights[cu[len(s)]:], torch.zeros(64 - cu[len(s)]))
    assert pack(_samples(3), 64, 1)[0][0].loss_weights is None
    # every rank's micro-batches carry weights when one sample has them (the same fields everywhere)
    per_rank = pack(s, 16, 3, pad_to_seq_len=False)
    assert all(mb.loss_weights is not None for mbs in per_rank for mb in mbs)


@pytest.mark.parametrize("bad,match", [
    (lambda n: -torch.ones(n), "finite and >= 0"),
    (lambda n: torch.full((n,), float("nan")), "finite and >= 0"),
    (lambda n: torch.ones(n + 1), r"shape \("),
    (lambda n: torch.ones(n, dtype=torch.long), "float tensor"),
])
def test_pack_rejects_bad_weights(bad, match):
    s = _samples(2)
    with pytest.raises(ValueError, match=rf"samples\[1\]\.loss_weights.*{match}|{match}"):
        pack([s[0], replace(s[1], loss_weights=bad(len(s[1])))], 64)


def test_uniform_weights_give_the_unweighted_update():
    """token_mean divides by the weight sum: weight c everywhere is weight 1."""
    a, b = Trainer(_cfg(), V), Trainer(_cfg(), V)
    ga, gb = record_grads(a), record_grads(b)
    ma = a.train_step(_payload(_samples(), 64))
    mb = b.train_step(_payload(_weighted(_samples(), lambda i, s: torch.full((len(s),), 2.5)), 64))
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-5)
    assert_same_grads(ga, gb)


def test_zero_weights_equal_leaving_the_samples_out():
    samples = _samples(8)
    keep = [i for i in range(8) if i % 3]
    a, b = Trainer(_cfg(), V), Trainer(_cfg(), V)
    ga, gb = record_grads(a), record_grads(b)
    a.train_step(_payload(_weighted(samples, lambda i, s: torch.full((len(s),), float(i % 3 != 0))), 64))
    b.train_step(_payload([samples[i] for i in keep], 64))
    assert_same_grads(ga, gb)
    c = Trainer(_cfg(), V)
    gc = record_grads(c)
    c.train_step(_payload(samples, 64))
    assert grad_gap(ga[0], gc[0]) > 1e-2


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_weighted_update_does_not_depend_on_packing(aggregation):
    """The global weight sum (not the token count) is the token_mean denominator: one micro-batch
    and several give the same update with non-uniform weights."""
    g = torch.Generator().manual_seed(3)
    samples = _weighted(_samples(8), lambda i, s: torch.rand(len(s), generator=g) * 3)
    a, b = (Trainer(_cfg("--trainer.loss.aggregation", aggregation), V) for _ in range(2))
    ga, gb = record_grads(a), record_grads(b)
    ma = a.train_step(_payload(samples, 64))
    mb = b.train_step(_payload(samples, 10))
    assert len(_payload(samples, 10)["micro_batches"]) > 2
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-5, abs=1e-7)
    assert_same_grads(ga, gb)


def test_weighted_loss_is_the_weighted_token_mean_in_closed_form():
    """reinforce, no corrections: loss = -sum w A exp(lp - ilp) / sum w over the trained tokens."""
    from primerl.runtime.trainer import next_token_logprobs  # the trainer's own log-probs

    cfg = _cfg("--trainer.loss.method", "reinforce", "--trainer.loss.hparams", "{}", "--trainer.entropy_coef", "0",
               "--trainer.loss.drop_zero_advantage", "false")
    t = Trainer(cfg, V)
    g = torch.Generator().manual_seed(5)
    samples = _weighted(_samples(4), lambda i, s: torch.rand(len(s), generator=g))
    payload = _payload(samples, 64)
    mb, targets = t._local_batch(payload["micro_batches"][0])
    with torch.no_grad():
        lp = next_token_logprobs(t.model, mb, targets, replay=cfg.trainer.router_replay)[0].double()
    m = mb.loss_mask
    w, adv, ilp = mb.loss_weights.double()[m], mb.advantages.double()[m], mb.inference_logprobs.double()[m]
    expected = float(-(w * adv * torch.exp(lp[m] - ilp)).sum() / w.sum())
    got = t.train_step(payload)["loss"]
    assert got == pytest.approx(expected, rel=1e-5)


def test_check_token_weights():
    assert check_token_weights(None, 3) is None
    assert check_token_weights([0, 1, 2.5], 3) == [0.0, 1.0, 2.5]
    assert check_token_weights(torch.tensor([0.5, 1.0]), 2) == [0.5, 1.0]
    for value, match in (([1.0, 2.0], "2 weights for a transcript of 3"), ([1.0, -1.0, 0.0], "-1.0 at token 1"),
                         ([1.0, math.inf, 0.0], "inf at token 1"), ("abc", "str"), ([1, "x", 2], "'x' at token 1"),
                         ([True, 1, 1], "True at token 0")):
        with pytest.raises(ValueError, match=match):
            check_token_weights(value, 3, "environment 'e'")


def test_has_token_weights():
    class Weighted(ReverseText):
        def token_weights(self, episode):
            return None

    assert not has_token_weights(ReverseText()) and has_token_weights(Weighted())
    assert not has_token_weights(Environment())


SMALL = ["--max_steps", "2", "--orchestrator.batch_size", "4", "--orchestrator.group_size", "4",
         "--orchestrator.max_async_level", "0", "--log.plot", "false", "--log.progress", "false"]


def test_job_carries_the_environments_token_weights_to_the_trainer(tmp_path):
    cfg = load_config(ROOT / "examples" / "reverse_text.toml",
                      ["--output_dir", str(tmp_path), *SMALL, "--env.id", "tests.runtime._envs:FirstTokenWeighted"])
    rows = run_threads(cfg)
    assert [r["step"] for r in rows] == [0, 1] and all(math.isfinite(r["loss"]) for r in rows)
    files = sorted((tmp_path / "transport" / "rollouts").glob("step_*/rank_0.pt"))
    assert files, "no rollout file left to inspect"
    payload = torch.load(files[-1], weights_only=False)
    n_seq = 0
    for mb in payload["micro_batches"]:
        cu = mb.cu_seqlens.tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            m = mb.loss_mask[a:b]
            if not m.any():
                continue
            first = int(m.nonzero()[0])
            expected = torch.zeros(int(m.sum()))
            expected[0] = 3.0
            assert torch.equal(mb.loss_weights[a:b][m], expected)
            assert first == 6  # BOS s1..s4 SEP, then the completion
            n_seq += 1
    assert n_seq == 16


def test_job_counts_bad_token_weights_as_environment_errors(tmp_path):
    from primerl.runtime.orchestrator import EnvError

    cfg = load_config(ROOT / "examples" / "reverse_text.toml",
                      ["--output_dir", str(tmp_path), *SMALL, "--env.id", "tests.runtime._envs:NegativeWeights",
                       "--env.max_retries", "1"])
    with pytest.raises(EnvError, match=r"token_weights\(\) must be finite numbers >= 0"):
        run_threads(cfg)
