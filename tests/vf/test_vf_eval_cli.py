"""``primerl eval`` on a config with a verifiers held-out eval (and a built-in one): the checkpoint's
policy served in-process, verifiers' episodes run with the eval's sampling on the held-out tasks,
and pass@k / reward reported from the episodes' own scores."""

import json

import pytest
from safetensors.torch import save_file

from primerl.rl.envs import Episode, Turn, load_environment
from primerl.runtime.config import EvalEnvConfig, to_toml

from vf_testing import small_cfg


def spy(monkeypatch, owner, name, record) -> None:
    """Each call of the method ``owner.name`` first calls ``record`` with its arguments."""
    real = getattr(owner, name)

    def wrapper(self, *args, **kw):
        record(*args, **kw)
        return real(self, *args, **kw)

    monkeypatch.setattr(owner, name, wrapper)


def test_primerl_eval_runs_a_verifiers_heldout_eval(tmp_path, monkeypatch, capsys):
    from primerl.runtime.cli import main
    from primerl.runtime.config import load_policy_env
    from primerl.runtime.inference.http_routes import RouteTable
    from primerl.runtime.orchestrator.evaluation import OnlineEval, pass_at_k
    from primerl.runtime.orchestrator.vf_eval import LoopEval
    from primerl.runtime.policy import build_model

    cfg = small_cfg("vf_reverse_text.toml", tmp_path / "run", "--env.args.heldout_fraction", "0.5",
                    "--env.args.max_tokens", "6")
    cfg.env.args["env"]["taskset"]["num_tasks"] = 40  # (of examples/vf_reverse_text.toml's 2000)
    cfg.eval.env = [
        EvalEnvConfig(name="held", env="verifiers", args={"split": "heldout"}, num_prompts=4, samples=2,
                      temperature=0.0, max_tokens=4, pass_at=[1, 2], pass_threshold=0.1),
        EvalEnvConfig(name="copy", id="copy-text", args={"num_symbols": 4, "max_length": 4}, num_prompts=2,
                      samples=1, temperature=0.0, pass_at=[1], max_tokens=3)]
    conf = tmp_path / "c.toml"
    conf.write_text(to_toml(cfg))
    ckpt = tmp_path / "step_000007"  # a full-state checkpoint of a random policy
    ckpt.mkdir()
    save_file(build_model(cfg, load_policy_env(cfg).vocab_size).state_dict(), str(ckpt / "model.safetensors"))

    turns, episodes, sampling = [], [], {}  # built-in eval turns, verifiers eval episodes, the server's sampling
    spy(monkeypatch, OnlineEval, "on_completion", lambda st, c: turns.append((st.eval_key, c)))
    spy(monkeypatch, LoopEval, "_score_own", lambda st, ep: episodes.append((st.eval_key, ep)))
    spy(monkeypatch, RouteTable, "start_generate",
        lambda body, session_id=None: sampling.__setitem__(session_id, body["sampling_params"]))
    assert main(["eval", "--config", str(conf), "--checkpoint", str(ckpt)]) == 0
    printed = capsys.readouterr().out
    res = json.loads((ckpt / "eval.json").read_text())
    assert res["step"] == 7 and res["eval/held/version"] == 7 and res["eval/copy/version"] == 7
    assert "eval/held/pass@2" in printed and "eval/copy/pass@1" in printed
    held = load_environment("verifiers", **{**cfg.env.args, "split": "heldout"})
    assert sorted(k for k, _ in episodes) == [(7, 0, p, s) for p in range(4) for s in range(2)]
    scores = {}
    for (_, _, p, _), ep in episodes:
        (trace,) = ep.traces
        assert trace.task.key == held.tasks[p].key  # the held-out split's task p
        sp = sampling[trace.id]
        assert (sp["temperature"], sp["top_p"], sp["max_tokens"]) == (1.0, 1e-9, 4)  # the eval's: greedy, 4 tokens
        scores.setdefault(p, []).append(trace.reward)
    rewards = [r for rs in scores.values() for r in rs]
    assert res["eval/held/reward"] == pytest.approx(sum(rewards) / 8, abs=1e-9)
    for k in (1, 2):
        per_prompt = [pass_at_k(2, sum(r >= 0.1 for r in rs), k) for rs in scores.values()]
        assert res[f"eval/held/pass@{k}"] == pytest.approx(sum(per_prompt) / 4)
    assert all(rs[0] == rs[1] for rs in scores.values())  # greedy: one reply per prompt
    assert len(set(rewards)) > 1  # (scores that tell a wrong mean apart)
    # the built-in eval in the same config: its turns, generate requests to the same server, scored by copy-text
    copy = load_environment("copy-text", num_symbols=4, max_length=4)
    assert sorted(k for k, _ in turns) == [(7, 1, p, 0) for p in range(2)]
    copied = [copy.reward(Episode(copy.prompt(k[2]), [Turn("model", list(c.tokens))])) for k, c in turns]
    assert all(c.policy_version == 7 and c.prompt == list(copy.prompt(k[2]).tokens) for k, c in turns)
    assert res["eval/copy/reward"] == pytest.approx(sum(copied) / 2, abs=1e-9)
