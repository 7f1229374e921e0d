"""trainer.loss and orchestrator.advantage through the job's config: the prime-rl default, the
reference model, the SFT term, zero-advantage tokens, custom methods by import path, max_rl."""

import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from test_trainer import V, _cfg, _payload, _samples as _trainer_samples

from primerl.rl.losses import DEFAULT_HPARAMS
from primerl.rl.packing import pack
from primerl.runtime.config import ConfigError, LossConfig
from primerl.runtime.validate import load_config
from primerl.runtime.launch.threads import run_threads
from primerl.runtime.trainer import Trainer
from trainer_testing import assert_same_grads, grad_gap, record_grads

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "parallel"))
from _parallel_dist import spawn  # noqa: E402


def pg_only(inputs, scale=1.0):
    """A custom method for the tests: -scale * r * A (REINFORCE with the importance ratio)."""
    r = torch.exp(inputs.logprobs - inputs.behaviour_logprobs)
    return -scale * r * inputs.advantages, {"scale": torch.tensor(scale)}


def _samples(n=8, seed=0, zero_every=3):
    """test_trainer's samples; every ``zero_every``-th has advantage 0."""
    return [replace(s, advantages=0.0) if i % zero_every == 0 else s for i, s in enumerate(_trainer_samples(n, seed))]


def test_the_default_loss_is_prime_rls():
    loss = LossConfig()
    assert (loss.method, loss.aggregation, loss.corrections, loss.hparams) == ("dppo_tv", "token_mean", [], {})
    assert loss.drop_zero_advantage and loss.ref_kl_coef == 0 and loss.sft_coef == 0
    assert DEFAULT_HPARAMS["dppo_tv"] == {"delta_low": 0.2, "delta_high": 0.2, "kl_coef": 1e-3}


@pytest.mark.parametrize("over", [
    ["--trainer.loss.ref_kl_coef", "0.5", "--trainer.loss.sft_coef", "0.1"],
    ["--trainer.loss.method", "ipo", "--trainer.loss.corrections", '["sequence_mask"]'],
    ["--trainer.loss.aggregation", "seq_mean_token_mean"],
])
def test_update_does_not_depend_on_packing_with_zero_advantages_and_extra_terms(over):
    """The global counts (policy-gradient tokens without the zero-advantage ones, the terms' own
    tokens, sequences) make one micro-batch and several give the same update."""
    cfg = _cfg(*over)
    a, b = Trainer(cfg, V), Trainer(cfg, V)
    ga, gb = record_grads(a), record_grads(b)
    ma = a.train_step(_payload(_samples(), seq_len=64))
    mb = b.train_step(_payload(_samples(), seq_len=10))
    assert len(_payload(_samples(), 10)["micro_batches"]) > 2
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-5, abs=1e-7)
    for key in ma:
        if key.startswith("loss/"):
            assert ma[key] == pytest.approx(mb[key], rel=1e-5, abs=1e-7), key
    assert_same_grads(ga, gb)


def test_zero_advantage_tokens_are_out_of_the_denominator():
    """Dropping them equals training on the other samples alone (prime-rl filters them out)."""
    samples = _samples(zero_every=2)
    informative = [s for s in samples if s.advantages != 0.0]
    a, b = Trainer(_cfg(), V), Trainer(_cfg(), V)
    ga, gb = record_grads(a), record_grads(b)
    ma = a.train_step(_payload(samples, 64))
    b.train_step(_payload(informative, 64))
    assert_same_grads(ga, gb)
    n_zero = sum(int(s.loss_mask.sum()) for s in samples if s.advantages == 0.0)
    assert ma["loss/zero_adv_frac"] == pytest.approx(n_zero / sum(int(s.loss_mask.sum()) for s in samples))
    c = Trainer(_cfg("--trainer.loss.drop_zero_advantage", "false"), V)
    gc = record_grads(c)
    c.train_step(_payload(samples, 64))
    assert grad_gap(ga[0], gc[0]) > 1e-2  # kept in the denominator, they scale the gradient


def test_reference_model_is_a_frozen_copy_of_the_initial_policy():
    # (no router replay: the samples' replayed routing is random, the reference routes by itself)
    t = Trainer(_cfg("--trainer.loss.ref_kl_coef", "1.0", "--trainer.router_replay", "false"), V)
    assert Trainer(_cfg(), V).ref_model is None
    init = {k: v.clone() for k, v in t.model.state_dict().items()}
    assert all(torch.equal(init[k], v) for k, v in t.ref_model.state_dict().items())
    assert not any(p.requires_grad for p in t.ref_model.parameters())
    m0 = t.train_step(_payload(_samples(), 64))
    m1 = t.train_step(_payload(_samples(seed=1), 64))
    assert m0["loss/ref_kl"] == 0.0  # the policy still is the reference at the first step
    assert m1["loss/ref_kl"] > 0 and math.isfinite(m1["loss/ref_kl_loss"])
    assert all(torch.equal(init[k], v) for k, v in t.ref_model.state_dict().items())
    assert not all(torch.equal(init[k], v) for k, v in t.model.state_dict().items())


def test_custom_method_by_import_path_in_the_trainer():
    custom = Trainer(_cfg("--trainer.loss.method", f"{__name__}:pg_only", "--trainer.loss.hparams", '{"scale": 2.0}'),
                     V)
    builtin = Trainer(_cfg("--trainer.loss.method", "reinforce"), V)
    mc = custom.train_step(_payload(_samples(), 64))
    mb = builtin.train_step(_payload(_samples(), 64))
    assert mc["loss"] == pytest.approx(2 * mb["loss"], rel=1e-5)
    assert mc["loss/custom/scale"] == 2.0


def test_loss_config_errors_name_the_key():
    for over, match in ((["--trainer.loss.ref_kl_coef", "-1"], "trainer.loss.ref_kl_coef"),
                        (["--trainer.loss.sft_coef", "inf"], "trainer.loss.sft_coef"),
                        (["--orchestrator.advantage", "maxrl"], "orchestrator.advantage"),
                        (["--trainer.loss.hparams", '{"eps_low": 0.1}'],
                         "trainer.loss.hparams: .*'eps_low' is not used"),
                        (["--trainer.loss.hparams", '{"ref_kl_delta": 0.1}'],
                         "trainer.loss.hparams: .*'ref_kl_delta'")):
        with pytest.raises(ConfigError, match=match):
            _cfg(*over)


SMALL = ["--max_steps", "3", "--orchestrator.batch_size", "4", "--orchestrator.group_size", "4",
         "--orchestrator.max_async_level", "0", "--log.plot", "false", "--log.progress", "false",
         "--trainer.loss.method", "dppo_tv", "--trainer.loss.hparams", "{}"]


@pytest.mark.parametrize("over", [
    ["--trainer.loss.ref_kl_coef", "0.5", "--trainer.loss.sft_coef", "0.01", "--orchestrator.advantage", "max_rl",
     "--trainer.loss.corrections", '["sequence_mask"]'],
    ["--trainer.loss.method", "ipo", "--orchestrator.advantage", "rloo_std"],
])
def test_job_runs_with_the_loss_options(tmp_path, over):
    cfg = load_config(ROOT / "examples" / "reverse_text.toml", ["--output_dir", str(tmp_path), *SMALL, *over])
    rows = run_threads(cfg)
    assert len(rows) == 3
    for row in rows:
        assert all(math.isfinite(v) for k, v in row.items() if k.startswith("loss"))
        # every completion has the same length: the zero-advantage tokens are at least the uniform
        # groups' (a sample whose reward equals its group's mean has advantage 0 too)
        assert row["groups/zero_advantage"] / 4 <= row["loss/zero_adv_frac"] <= 1
    if "--trainer.loss.ref_kl_coef" in over:
        assert rows[0]["loss/ref_kl"] == 0.0 and rows[-1]["loss/ref_kl"] > 0
        assert rows[0]["loss/sft_nll"] > 0


TERMS = ["--trainer.loss.ref_kl_coef", "0.5", "--trainer.loss.sft_coef", "0.1"]


def _ranked_payload(step: int, ranks: int, rank: int) -> dict:
    return {"micro_batches": pack(_samples(8, seed=step), 16, ranks, pad_to_seq_len=False)[rank], "metrics": {}}


def _fsdp_case(rank, world_size, ref):
    t = Trainer(_cfg(*TERMS, "--num_trainer_ranks", str(world_size)), V, rank=rank, world_size=world_size)
    rows = [t.train_step(_ranked_payload(step, world_size, rank)) for step in range(len(ref))]
    return [f"step {i} {k}: {a[k]!r} != one process {b[k]!r}" for i, (a, b) in enumerate(zip(rows, ref))
            for k in b if (k == "loss" or k.startswith("loss/")) and not abs(a[k] - b[k]) <= 1e-5 * abs(b[k]) + 1e-7]


def _two_ranks(rank, world_size, log, ref):
    log.run("fsdp", _fsdp_case, rank, world_size, ref)


@pytest.mark.dist
def test_terms_counts_and_metrics_agree_between_one_process_and_two_fsdp_ranks(tmp_path):
    """Zero-advantage tokens, the reference-KL and SFT terms and their metrics under FSDP2 on two
    gloo ranks: the global counts and the all-reduced metrics give the one-process numbers."""
    one = Trainer(_cfg(*TERMS), V)
    ref = [one.train_step(_ranked_payload(step, 1, 0)) for step in range(2)]
    assert ref[0]["loss/zero_adv_frac"] > 0 and ref[1]["loss/ref_kl"] > 0
    assert spawn(_two_ranks, 2, tmp_path, ref) == {"fsdp": []}
