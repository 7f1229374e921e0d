"""A mix of a verifiers environment and a built-in one (``[[env]]``) through the whole job: the
verifiers path runs both, the built-in episodes as generate requests to the same in-process
server. Checked: the groups are dealt by the weights, both environments' samples reach the trainer
token-exact (what the server sampled, with its log-probs and routing), rewards are each
environment's own, advantages stay within a group, per-environment metrics; and dynamic sampling
(``orchestrator.filter = "dapo"``) on that loop."""

import pytest

from primerl.rl.envs import Episode, Prompt, Turn, load_environment
from primerl.runtime.launch.threads import run_threads

from primerl.runtime.validate import load_config

from vf_testing import (ROOT, SMALL, Recorder, assert_replay_is_the_samplers_routing,
                        assert_samples_are_the_sampled_tokens)

BUILTIN = """
[[env]]
name = "rev"
id = "reverse-text"
weight = 1.0
group_size = 2
args = { num_symbols = 4, max_length = 4%s }
"""


def mix_cfg(tmp_path, *over, rev_args="", extra="", vf_second=False):
    """examples/vf_reverse_text.toml with its [env] as the first [[env]] (name "vf", weight 2) and
    reverse-text (name "rev", weight 1, 2 samples per prompt) as the second; ``vf_second``: listed
    the other way round (then ``--env.args.K V`` of ``over`` and SMALL, which would set
    reverse-text's args, go into the verifiers entry's [env.args] in the file)."""
    text = (ROOT / "examples" / "vf_reverse_text.toml").read_text()
    assert text.count("\n[env]\n") == 1 and text.count("\n[env.args]\n") == 1
    vf = '\n[[env]]\nname = "vf"\nweight = 2.0\n'
    flags = [*SMALL, "--orchestrator.batch_size", "3", *over]
    if vf_second:
        pairs = list(zip(flags[::2], flags[1::2]))
        args = {k.removeprefix("--env.args."): v for k, v in pairs if k.startswith("--env.args.")}
        flags = [x for k, v in pairs if not k.startswith("--env.args.") for x in (k, v)]
        text = "\n".join(ln for ln in text.split("\n") if ln.split("=")[0].strip() not in args)
        text = text.replace("\n[env.args]\n", "\n[env.args]\n" + "".join(f"{k} = {v}\n" for k, v in args.items()))
        text = text.replace("\n[env]\n", BUILTIN % rev_args + vf) + extra
    else:
        text = text.replace("\n[env]\n", vf) + BUILTIN % rev_args + extra
    (tmp_path / "mix.toml").write_text(text)
    return load_config(tmp_path / "mix.toml", ["--output_dir", str(tmp_path / "run"), *flags])


def spy_trained(monkeypatch) -> dict:
    """step -> the trained batch's groups as (env, draw, prompt id, rewards)."""
    from primerl.runtime.orchestrator.vf_orchestrator import VerifiersOrchestrator

    trained, finalize = {}, VerifiersOrchestrator._finalize

    def _finalize(self, step):
        groups = [(grp.env, grp.draw, grp.key, [u.reward for us in grp.members for u in us])
                  for grp in self.batches[step]]
        out = finalize(self, step)
        if out is not None:
            trained[step] = groups
        return out

    monkeypatch.setattr(VerifiersOrchestrator, "_finalize", _finalize)
    return trained


def is_builtin(sample) -> bool:
    return int(sample.input_ids[0]) == 1  # reverse-text's BOS; a verifiers prompt starts with <|im_start|>


def spread(self, episode) -> float:
    """A reverse-text reward that varies with the reply (a random policy rarely scores above 0)."""
    return sum(episode.model_turns[-1]) % 7 / 7


EVAL = """
[eval]
interval = 2
[[eval.env]]
name = "copy"
id = "copy-text"
args = { num_symbols = 4, max_length = 4 }
num_prompts = 3
samples = 2
temperature = 0.0
pass_at = [1, 2]
pass_threshold = 0.5
max_tokens = 3
[[eval.env]]
name = "vf_heldout"
env = "vf"
args = { split = "heldout" }
num_prompts = 2
samples = 2
temperature = 0.0
pass_at = [1, 2]
pass_threshold = 0.3
max_tokens = 4
"""


def assert_greedy(replies: dict) -> int:
    """prompt -> its samples' (reply, reward, first version, last version): greedy sampling gives
    one reply per prompt and policy version (a sample whose turns span a weight update is left out).
    -> how many pairs of samples were compared."""
    n = 0
    for pairs in replies.values():
        one = [a for a in pairs if a[2] == a[3]]
        for i, a in enumerate(one):
            for b in one[i + 1:]:
                if b[2] == a[2]:
                    assert a[0] == b[0]
                    n += 1
    return n


def test_verifiers_and_builtin_environments_train_together(tmp_path, monkeypatch):
    """... and online eval on that path: a built-in eval environment (copy-text, greedy) and the
    verifiers one's held-out tasks (greedy, its own token cap), neither trained on."""
    from primerl.rl.envs.reverse_text import ReverseText
    from primerl.runtime.inference.http_routes import RouteTable
    from primerl.runtime.orchestrator.evaluation import pass_at_k
    from primerl.runtime.orchestrator.vf_eval import LoopEval

    monkeypatch.setattr(ReverseText, "reward", spread)  # (copy-text's too: a subclass)
    cfg = mix_cfg(tmp_path, "--max_steps", "3", "--env.args.max_tokens", "6", "--env.args.heldout_fraction", "0.5",
                  extra=EVAL)
    rec, trained = Recorder(monkeypatch), spy_trained(monkeypatch)
    evals, turn = [], LoopEval._turn  # (eval key, sampling params, completion) of every eval model turn
    vf_evals, score, versions = [], LoopEval._score_own, {}  # (eval key, episode) of every verifiers eval episode
    sampling, start = {}, RouteTable.start_generate  # session -> the sampling params the server got

    async def _turn(self, st, params):
        out = await turn(self, st, params)
        evals.append((st.eval_key, params, out[1]))
        return out

    def _score_own(self, st, ep):  # (the policy versions of each trace's turns, as the server recorded them)
        pop = self._pop
        self._pop = lambda sid: versions.setdefault(sid, pop(sid))
        try:
            vf_evals.append((st.eval_key, ep))
            return score(self, st, ep)
        finally:
            self._pop = pop

    def _start(self, body, session_id=None):
        sampling[session_id] = body["sampling_params"]
        return start(self, body, session_id)

    monkeypatch.setattr(LoopEval, "_turn", _turn)
    monkeypatch.setattr(LoopEval, "_score_own", _score_own)
    monkeypatch.setattr(RouteTable, "start_generate", _start)
    rows = run_threads(cfg)
    assert [r["step"] for r in rows] == [0, 1, 2]
    vf_env = load_environment(cfg.env.id, **cfg.env.args)
    assert vf_env.tokenizer.convert_tokens_to_ids("<|im_start|>") != 1
    # every trained token, of both environments, is what the server sampled (with its log-probs and
    # the engine's routing for replay), and the packed batches hold exactly these samples
    assert assert_samples_are_the_sampled_tokens(rec) == 3 * (2 * 4 + 1 * 2)
    assert assert_replay_is_the_samplers_routing(rec) > 0
    rev = load_environment("reverse-text", num_symbols=4, max_length=4)
    spreads = 0
    for step, (samples, metrics) in rec.writes.items():
        # the weights 2 : 1 deal each batch of 3 groups exactly: 2 verifiers groups of 4, 1 reverse-text group of 2
        kinds = [is_builtin(s) for s in samples]
        assert kinds.count(False) == 2 * 4 and kinds.count(True) == 2
        assert metrics["groups/vf"] == 2 and metrics["groups/rev"] == 1
        assert metrics["mix/vf"] == pytest.approx(2 / 3) and metrics["mix/rev"] == pytest.approx(1 / 3)
        assert metrics["episodes/vf"] == 8 and metrics["episodes/rev"] == 2
        units = rec.final[step]
        built = [u for u in units if u.episode is not None]
        assert len(built) == 2 and all(u.agent == "rev" for u in built)
        assert metrics["tokens/rev"] == sum(u.sampled_tokens for u in built) > 0
        assert metrics["reward/rev"] == pytest.approx(sum(u.reward for u in built) / 2, abs=1e-6)
        vf_units = [u for u in units if u.episode is None]
        assert metrics["reward/vf"] == pytest.approx(sum(u.reward for u in vf_units) / 8, abs=1e-6)
        mine = [s for s in samples if is_builtin(s)]
        for s in mine:
            # the reward trained on is reverse-text's own for the sampled reply
            ids = s.input_ids.tolist()
            first = int(s.loss_mask.nonzero()[0])
            reward = rev.reward(Episode(Prompt(0, tuple(ids[:first])), [Turn("model", ids[first:])]))
            assert any(u.reward == pytest.approx(reward, abs=1e-9) for u in built)
            assert not s.loss_mask[:first].any() and s.loss_mask[first:].all()
        # drgrpo within the group, never across environments: the two reverse-text advantages are
        # each reward minus their group's mean
        rewards = sorted(u.reward for u in built)
        advs = sorted(s.advantages for s in mine)
        mean = sum(rewards) / 2
        assert advs == pytest.approx([r - mean for r in rewards], abs=1e-6)
        spreads += rewards[0] != rewards[1]
    assert spreads > 0  # (a group whose two rewards differ was checked)
    assert rows[0]["off_policy/max"] == 0 and rows[0]["mismatch_kl/mean"] < 1e-6
    # the first eval, launched at version 0, next to the training episodes: 3 prompts x 2 greedy samples
    # (on a loaded machine its requests may reach the engine after version 1 is loaded: the eval's
    # version is the oldest of its samples', whatever that is)
    row = next(r for r in rows if "eval/copy/pass@1" in r)
    run = [(key, params, c) for key, params, c in evals if key[0] == 0]
    assert sorted(key for key, _, _ in run) == [(0, 0, p, s) for p in range(3) for s in range(2)]
    assert all(params["top_p"] == 1e-9 and params["temperature"] == 1.0 and params["max_tokens"] == 3
               for _, params, _ in run)
    # an eval runs next to training: a later turn may be sampled by the next version (the eval's
    # version is the oldest); greedy: one reply per prompt and policy version
    assert row["eval/copy/version"] == min(c.policy_version for _, _, c in run) <= 1
    copy = load_environment("copy-text", num_symbols=4, max_length=4)
    by_prompt = {}
    for key, _, c in run:
        assert c.prompt == list(copy.prompt(key[2]).tokens)
        by_prompt.setdefault(key[2], []).append((c.tokens, sum(c.tokens) % 7 / 7, c.policy_version,
                                                 c.policy_version_end))
    assert_greedy(by_prompt)
    scores = [r for pairs in by_prompt.values() for _, r, _, _ in pairs]
    assert row["eval/copy/reward"] == pytest.approx(sum(scores) / 6, abs=1e-9)
    for k in (1, 2):  # (greedy, pass@2 = pass@1 unless a prompt's samples span a weight update)
        per_prompt = [pass_at_k(2, sum(r >= 0.5 for _, r, _, _ in pairs), k) for pairs in by_prompt.values()]
        assert row[f"eval/copy/pass@{k}"] == pytest.approx(sum(per_prompt) / 3)
    # the verifiers environment's held-out tasks, evaluated by verifiers itself on the same server with
    # the eval's sampling (greedy, 4 tokens a turn; training turns: temperature 1, 6 tokens)
    row = next(r for r in rows if "eval/vf_heldout/pass@1" in r)
    run = sorted(((key, ep) for key, ep in vf_evals if key[0] == 0), key=lambda x: x[0])
    assert [key for key, _ in run] == [(0, 1, p, s) for p in range(2) for s in range(2)]
    held = load_environment("verifiers", **{**cfg.env.args, "split": "heldout"})
    train = load_environment(cfg.env.id, **cfg.env.args)
    texts = [[t.data.prompt_text for t in env.tasks] for env in (held, train)]
    assert len(texts[0]) > 2 and not set(texts[0]) & set(texts[1])  # held-out tasks: none trained on, ever
    assert len(texts[0]) + len(texts[1]) == len(load_environment(cfg.env.id, **{**cfg.env.args,
                                                                                 "heldout_fraction": 0}).tasks)
    vf_trained = {g[2] for groups in trained.values() for g in groups if g[0] == 0}
    assert vf_trained and vf_trained <= set(train.prompts()) and not vf_trained & set(held.prompts())
    replies = {}
    for (_, _, p, s), ep in run:
        (trace,) = ep.traces
        assert trace.task.key == held.tasks[p].key
        sp = sampling[trace.id]
        assert (sp["temperature"], sp["top_p"], sp["max_tokens"]) == (1.0, 1e-9, 4)
        replies.setdefault(p, []).append((trace.last_reply, trace.reward, versions[trace.id].first,
                                          versions[trace.id].last))
    assert row["eval/vf_heldout/version"] == min(v[2] for pairs in replies.values() for v in pairs) <= 1
    assert_greedy(replies)
    vf_scores = [r for pairs in replies.values() for _, r, _, _ in pairs]
    assert row["eval/vf_heldout/reward"] == pytest.approx(sum(vf_scores) / 4, abs=1e-9)
    assert row["eval/vf_heldout/pass@1"] == pytest.approx(sum(r >= 0.3 for r in vf_scores) / 4)
    train_sessions = [sid for sid, sp in sampling.items() if sp.get("max_tokens") == 6]
    assert train_sessions and all(sampling[sid]["top_p"] == 1.0 for sid in train_sessions)


def test_dynamic_sampling_replaces_uniform_groups_on_the_verifiers_path(tmp_path, monkeypatch):
    """Every reverse-text group is uniform here (a constant reward), so it is dropped and replaced by
    a fresh prompt's group until the batch has sampled max_oversample x batch_size = 6 groups (3
    replacements, whichever environment's uniform groups finish first); the last uniform group is
    kept and counted; the trainer's batch keeps its 3 groups."""
    from primerl.rl.envs.reverse_text import ReverseText
    from primerl.runtime.orchestrator.mix_stats import MixStats

    monkeypatch.setattr(ReverseText, "reward", lambda self, episode: 0.5)
    cfg = mix_cfg(tmp_path, "--max_steps", "2", "--env.args.max_tokens", "4", "--orchestrator.filter", "dapo",
                  "--orchestrator.max_oversample", "2")
    rec = Recorder(monkeypatch)
    decided, trained = [], spy_trained(monkeypatch)  # (step, env, rewards, replaced)
    replaces = MixStats.replaces

    def _replaces(self, step, g, counters):
        out = replaces(self, step, g, counters)
        decided.append((step, g.env, list(g.rewards), out))
        return out

    monkeypatch.setattr(MixStats, "replaces", _replaces)
    rows = run_threads(cfg)
    assert [r["step"] for r in rows] == [0, 1]
    for step, row in enumerate(rows):
        dropped = [(e, r) for s, e, r, out in decided if s == step and out]
        assert all(len(set(r)) == 1 for _, r in dropped)  # only uniform groups are dropped
        assert not any(out for s, _, r, out in decided if s == step and len(set(r)) > 1)
        assert row["groups/filtered"] == len(dropped) == 3  # 3 sampled + 3 replacements = the budget
        assert row["rollouts/oversampled"] == sum(4 if e == 0 else 2 for e, _ in dropped)
        groups = trained[step]
        assert [g[0] for g in groups].count(1) == 1 and len(groups) == 3  # the replacement is of the same env
        uniform = [g for g in groups if len(set(g[3])) == 1]
        assert row["groups/uniform_kept"] == len(uniform) >= 1  # the reverse-text group, past the budget
        assert any(g[1] >= 1 for g in groups)  # a replacement's group was trained
        kept = [r for g in groups for r in g[3]]
        every = kept + [r for _, rs in dropped for r in rs]
        assert row["reward/all_sampled"] == pytest.approx(sum(every) / len(every), abs=1e-6)
        assert row["reward/mean"] == pytest.approx(sum(kept) / len(kept), abs=1e-6)
        assert len(rec.writes[step][0]) == 2 * 4 + 2  # the trainer's batch size never changes


def test_curriculum_draws_both_environments_prompts_on_the_verifiers_path(tmp_path, monkeypatch):
    """The curriculum over a mix on the verifiers path, with reverse-text listed first (the
    verifiers entry, second, sizes the policy's vocabulary): every reverse-text group fails
    (pass_threshold 1, reward 0.5), so its prompt becomes hard (weight 0) once its batch's rates
    apply, two batches later (max_async_level 1); with 2 prompts, batch 2 draws the one batch 0 did
    not. The verifiers tasks are keyed by their task keys; the state is saved for a resume."""
    from primerl.rl.envs.reverse_text import ReverseText
    from primerl.runtime.config import policy_env

    monkeypatch.setattr(ReverseText, "reward", lambda self, episode: 0.5)
    cfg = mix_cfg(tmp_path, "--max_steps", "3", "--env.args.max_tokens", "4", "--orchestrator.curriculum.enabled",
                  "true", "--orchestrator.curriculum.weight", "0", rev_args=", num_prompts = 2", vf_second=True)
    assert cfg.env.id == "reverse-text" and policy_env(cfg) is cfg.env_mix[0]
    assert cfg.env_mix[0].args["max_tokens"] == 4 and cfg.env_mix[0].args["max_concurrent"] == 8
    trained = spy_trained(monkeypatch)
    rows = run_threads(cfg)
    assert [r["step"] for r in rows] == [0, 1, 2]
    rev = [next(g[2] for g in trained[s] if g[0] == 0) for s in range(3)]
    assert rev[2] != rev[0]
    # batch 0's rates apply from batch 2's submission on (before or after batch 1's hand-over)
    assert rows[0]["curriculum/rev/hard"] == 0 and rows[2]["curriculum/rev/hard"] == 1
    assert rows[2]["curriculum/rev/unseen"] == 1
    assert all(r["groups/vf"] == 2 and r["groups/rev"] == 1 for r in rows)
    vf_env = load_environment(policy_env(cfg).id, **policy_env(cfg).args)
    tasks = vf_env.prompts()
    vf_keys = {g[2] for s in range(3) for g in trained[s] if g[0] == 1}
    assert len(vf_keys) == 6 and vf_keys <= set(tasks)
    assert rows[2]["curriculum/vf/unseen"] + sum(rows[2][f"curriculum/vf/{k}"] for k in ("easy", "hard", "normal")) \
        == len(tasks)
    assert (tmp_path / "run" / "orchestrator_state" / "step_000003.json").is_file()


def test_a_verifiers_eval_episode_that_fails_is_an_error_of_the_eval(tmp_path):
    """An eval episode that is not ok, or passed env.args.episode_timeout_s, fails the eval naming it
    (as a built-in eval environment's failed call does): never scored as a zero."""
    from types import SimpleNamespace

    from primerl.runtime.orchestrator.vf_eval import LoopEval, VfEvalEpisode

    ev = LoopEval(mix_cfg(tmp_path, "--env.args.heldout_fraction", "0.5", extra=EVAL))
    ev._pop = lambda session_id: None
    assert [s.name for s in ev.evals.specs] == ["copy", "vf_heldout"] and len(ev.own_envs()) == 1
    with pytest.raises(RuntimeError, match=r"^eval 'vf_heldout': episode \(prompt 1, sample 0\) is not ok: boom$"):
        ev._score_own(VfEvalEpisode((0, 1, 1, 0)), SimpleNamespace(ok=False, traces=[], last_error="boom"))
    with pytest.raises(RuntimeError, match="is not ok: it took longer than env.args.episode_timeout_s"):
        ev._score_own(VfEvalEpisode((0, 1, 0, 1)), None)
