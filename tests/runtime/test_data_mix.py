"""The orchestrator's data side with a fake engine and a fake trainer: environment mixes (exact
weights, per-environment metrics, advantages per group), dynamic sampling, online evaluation and
the curriculum's state; and their config checks."""

import threading

import pytest
import torch

from primerl.runtime.config import ConfigError
from primerl.runtime.inference.engine import Completion
from primerl.runtime.orchestrator import Orchestrator
from primerl.runtime.orchestrator.evaluation import pass_at_k
from primerl.runtime.orchestrator.sampling import SlotDealer
from primerl.runtime.transport import FileTransport
from primerl.runtime.validate import load_config
from primerl.rl.envs import ReverseText, load_environment
from primerl.rl.envs.reverse_text import SEP


class TaskClient:
    """Answers each request at the next poll, each answer position right with ``p_correct`` (a
    copy-text prompt, BOS SEP ..., gets the string; a reverse-text one its reverse)."""

    def __init__(self, p_correct=0.5):
        self.queue, self.version, self.p_correct, self.requests = [], -1, p_correct, []

    def submit(self, req):
        self.queue.append(req)
        self.requests.append(req)

    def abort(self, ids):
        self.queue = [r for r in self.queue if r.request_id not in set(ids)]

    def has_pending(self):
        return bool(self.queue)

    def servers_healthy(self):
        return 1

    def metrics(self):
        return {}

    def poll(self):
        out, self.queue = self.queue[:16], self.queue[16:]
        res = []
        for r in out:
            g = torch.Generator().manual_seed(r.params.seed)
            copy = r.prompt[1] == SEP
            target = list(r.prompt[2:-1]) if copy else list(r.prompt[1:-1])[::-1]
            p = 1.0 if r.params.top_p < 1e-6 else self.p_correct  # greedy: a one-token nucleus
            toks = [t if torch.rand(1, generator=g).item() < p else 0 for t in target[: r.params.max_new_tokens]]
            res.append(Completion(r.request_id, r.prompt, toks, [-0.5] * len(toks), None, "length", self.version,
                                  self.version))
        return res

    def update_weights(self, version, transport):
        self.version = version


def _mix_cfg(tmp_path, *over):
    return load_config(str(tmp_path / "mix.toml"), ["--output_dir", str(tmp_path / "out"),
                                                    "--orchestrator.weights_timeout_s", "20", *over])


MIX = """
max_steps = 6
[orchestrator]
batch_size = 10
group_size = 4
seq_len = 64
[[env]]
name = "reverse"
id = "reverse-text"
weight = 0.7
args = {num_symbols = 8}
[[env]]
name = "copy"
id = "copy-text"
weight = 0.3
group_size = 2
args = {num_symbols = 8}
"""


def _run(cfg, client, steps, **orchestrator_kwargs):
    cfg.max_steps = steps
    tr = FileTransport(cfg.output_dir)
    seen = []

    def trainer():
        tr.publish_weights(0, {"w": torch.zeros(1)})
        for s in range(steps):
            payload = tr.get_batch(s, 0, timeout=30)
            seen.append(payload)
            tr.publish_weights(s + 1, {"w": torch.zeros(1)})

    th = threading.Thread(target=trainer, daemon=True)
    th.start()
    orch = Orchestrator(cfg, load_environment(cfg.env.id, **cfg.env.args), client, tr, **orchestrator_kwargs)
    orch.run()
    th.join(10)
    return orch, seen


def test_slot_dealer_is_exact_at_every_prefix():
    d = SlotDealer([0.7, 0.3])
    counts = [0, 0]
    for t in range(1000):
        e, k = d.env_of(t)
        assert k == counts[e]
        counts[e] += 1
        assert abs(counts[0] - 0.7 * (t + 1)) < 1 and abs(counts[1] - 0.3 * (t + 1)) < 1
    assert SlotDealer([1.0]).env_of(5) == (0, 5)  # one environment: slot t is its prompt t, as before


def test_mix_batches_follow_the_weights_with_per_env_metrics_and_group_sizes(tmp_path):
    (tmp_path / "mix.toml").write_text(MIX)
    cfg = _mix_cfg(tmp_path)
    orch, seen = _run(cfg, TaskClient(), 6)
    assert len(seen) == 6
    for p in seen:
        m = p["metrics"]
        assert m["groups/reverse"] == 7 and m["groups/copy"] == 3
        assert m["episodes/reverse"] == 28 and m["episodes/copy"] == 6  # copy's own group_size = 2
        assert 0 <= m["reward/reverse"] <= 1 and m["tokens/copy"] == 6 * 4
        seqs = [mb for mbs in p["micro_batches"] for mb in [mbs]]
        assert seqs
    assert seen[-1]["metrics"]["mix/reverse"] == pytest.approx(0.7)
    # copy prompts reach the engine marked as such; a reverse prompt is never sent as copy
    copies = [r for r in orch.client.requests if r.prompt[1] == SEP]
    assert len(copies) == 6 * 3 * 2


def test_advantages_are_computed_per_group_never_across_environments(tmp_path):
    from primerl.runtime.orchestrator.batching import build_mixed_samples
    from primerl.runtime.orchestrator.rollout import EpisodeState
    from primerl.rl.envs import Prompt

    def grp(env, rewards):
        out = []
        for m, r in enumerate(rewards):
            st = EpisodeState.start(0, 0, m, 0, Prompt(0, (1, 3, 2)), env=env)
            st.reward, st.done = r, True
            out.append(st)
        return out

    groups = [grp(0, [1.0, 0.0, 1.0, 0.0]), grp(1, [5.0, 5.0]), grp(1, [2.0, 4.0])]
    samples, m = build_mixed_samples(groups, "drgrpo", 1, replay=False, temperature=1.0)
    adv = [s.advantages for s in samples]
    assert adv == pytest.approx([0.5, -0.5, 0.5, -0.5, 0.0, 0.0, -1.0, 1.0])
    assert m["groups/zero_advantage"] == 1


def test_dapo_filter_keeps_no_uniform_group_and_counts_replacements(tmp_path):
    (tmp_path / "mix.toml").write_text(MIX)
    cfg = _mix_cfg(tmp_path, "--orchestrator.filter", "dapo", "--orchestrator.max_oversample", "8")
    orch, seen = _run(cfg, TaskClient(p_correct=0.9), 4)  # often all-correct groups
    filtered = sum(p["metrics"]["groups/filtered"] for p in seen)
    assert filtered > 0 and sum(p["metrics"]["rollouts/oversampled"] for p in seen) >= 2 * filtered
    for p in seen:
        assert p["metrics"]["groups/uniform_kept"] == 0 and p["metrics"]["groups/zero_advantage"] == 0
        assert p["metrics"]["groups/reverse"] == 7  # the batch keeps its size and its mix
    assert any(p["metrics"]["reward/all_sampled"] > p["metrics"]["reward/mean"] for p in seen)  # all-correct dropped
    # a tight budget keeps uniform groups (counted) instead of sampling forever
    cfg = _mix_cfg(tmp_path, "--orchestrator.filter", "dapo", "--orchestrator.max_oversample", "1",
                   "--overwrite", "true", "--output_dir", str(tmp_path / "out2"))
    _, seen = _run(cfg, TaskClient(p_correct=0.9), 2)
    assert sum(p["metrics"]["groups/uniform_kept"] for p in seen) > 0
    assert sum(p["metrics"]["groups/filtered"] for p in seen) == 0


def test_online_eval_reports_pass_at_k_next_to_training(tmp_path):
    (tmp_path / "mix.toml").write_text(MIX + """
[eval]
interval = 2
[[eval.env]]
name = "greedy"
env = "reverse"
args = {split = "heldout", heldout_fraction = 0.2, seed = 1}
num_prompts = 5
[[eval.env]]
name = "sampled"
env = "reverse"
num_prompts = 5
temperature = 1.0
samples = 4
pass_at = [1, 4]
""")
    cfg = _mix_cfg(tmp_path)
    orch, seen = _run(cfg, TaskClient(p_correct=0.6), 6)
    rows = [p["metrics"] for p in seen if "eval/greedy/pass@1" in p["metrics"]]
    assert len(rows) >= 2  # versions 0, 2, 4 (the last may be cut by the end of the run)
    for m in rows:
        assert m["eval/greedy/pass@1"] == 1.0 and m["eval/greedy/reward"] == 1.0  # the fake is exact at T=0
        assert 0 <= m["eval/sampled/pass@1"] <= m["eval/sampled/pass@4"] <= 1
    held = [r for r in orch.client.requests if r.params.top_p < 1e-6]
    assert held and all(ReverseText(heldout_fraction=0.2).is_heldout(r.prompt[1:-1]) for r in held)
    assert all(p["metrics"]["groups/reverse"] == 7 for p in seen)  # training batches unchanged


def test_pass_at_k_matches_brute_force():
    import itertools

    for n, c in [(4, 0), (4, 1), (4, 3), (6, 2)]:
        for k in range(1, n + 1):
            draws = list(itertools.combinations([1] * c + [0] * (n - c), k))
            assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws))


@pytest.mark.parametrize("over,key", [
    (["--env.weight", "0"], "env[0].weight"),
    (["--orchestrator.max_oversample", "0.5"], "orchestrator.max_oversample"),
    (["--orchestrator.filter", "dapo2"], "orchestrator.filter"),
    (["--orchestrator.curriculum.easy_threshold", "0.05"], "orchestrator.curriculum.hard_threshold"),
])
def test_bad_data_config_names_the_key(tmp_path, over, key):
    (tmp_path / "mix.toml").write_text(MIX)
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        _mix_cfg(tmp_path, *over)


@pytest.mark.parametrize("extra,msg", [
    ('[eval]\ninterval = 5\n[[eval.env]]\nenv = "nope"\n', r"eval.env\[0\].env: unknown environment 'nope'"),
    ('[eval]\ninterval = 5\n[[eval.env]]\nenv = "copy"\nsamples = 2\npass_at = [1, 4]\n',
     r"eval.env\[0\].pass_at: pass@4 needs at least 4 samples"),
    ('[eval]\ninterval = 5\n[[eval.env]]\nid = "reverse-txt"\n', r"eval.env\[0\].id: unknown environment"),
])
def test_bad_eval_config_names_the_key(tmp_path, extra, msg):
    (tmp_path / "mix.toml").write_text(MIX + extra)
    with pytest.raises(ConfigError, match=msg):
        _mix_cfg(tmp_path)


def test_mix_names_must_be_unique_and_single_env_keeps_working(tmp_path):
    (tmp_path / "mix.toml").write_text(MIX.replace('name = "copy"', 'name = "reverse"'))
    with pytest.raises(ConfigError, match=r"env\[1\].name: 'reverse' is already"):
        _mix_cfg(tmp_path)
    cfg = load_config("examples/reverse_text.toml", ["--output_dir", str(tmp_path / "o")])
    assert cfg.env_mix == [] and cfg.env.weight == 1.0


def test_metrics_plot_gets_an_eval_panel(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    from primerl.runtime.metrics import save_plot

    seen = {}
    orig = matplotlib.figure.Figure.savefig

    def spy(self, *a, **k):
        seen["titles"] = [ax.get_title() for ax in self.axes]
        seen["labels"] = [t.get_text() for ax in self.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        return orig(self, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    rows = [{"step": s, "reward/mean": 0.5, "mismatch_kl/mean": 1e-3, "tokens_per_s": 1.0} for s in range(5)]
    rows[1].update({"eval/held/pass@1": 0.25, "eval/held/pass@4": 0.5})
    rows[3].update({"eval/held/pass@1": 0.5, "eval/held/pass@4": 0.75})
    assert save_plot(rows, tmp_path / "m.png").is_file()
    assert seen["titles"][-1] == "eval pass@k" and seen["labels"] == ["held/pass@1", "held/pass@4"]
    save_plot(rows[:1], tmp_path / "n.png")
    assert "eval pass@k" not in seen["titles"]


def test_mix_config_round_trips_through_the_dry_run_toml(tmp_path):
    from primerl.runtime.config import to_toml

    (tmp_path / "mix.toml").write_text(MIX + '[eval]\ninterval = 3\n[[eval.env]]\nenv = "copy"\nsamples = 2\n'
                                       'pass_at = [1, 2]\n')
    cfg = _mix_cfg(tmp_path)
    text = to_toml(cfg)
    assert text.count("[[env]]") == 2 and text.count("[[eval.env]]") == 1 and "env_mix" not in text
    (tmp_path / "again.toml").write_text(text)
    again = load_config(str(tmp_path / "again.toml"))
    assert again.env == cfg.env and again.env_mix == cfg.env_mix and again.eval == cfg.eval


def test_verifiers_environments_mix_with_builtin_ones_and_what_stays_refused():
    """A verifiers environment in a mix, listed anywhere, with dynamic sampling, the curriculum and
    online evals (built-in, its held-out tasks) passes the field checks (tests/vf/test_vf_mix.py
    runs it); its own token cap, a second verifiers environment or eval with another tokenizer and a
    verifiers eval in a job without one are refused, one line naming the key."""
    from primerl.runtime.config import EvalEnvConfig, RLConfig, policy_env, validate_fields
    from primerl.runtime.config.schema import EnvConfig

    cfg = RLConfig()
    cfg.env.id, cfg.env.name, cfg.env.group_size = "verifiers", "vf", 4
    cfg.env_mix = [EnvConfig(id="reverse-text", name="rev", weight=0.5, group_size=2, max_tokens=4)]
    cfg.orchestrator.filter = "dapo"
    cfg.orchestrator.curriculum.enabled = True
    validate_fields(cfg)
    cfg.env.max_tokens = 8
    with pytest.raises(ConfigError, match=r"^env\[0\]\.max_tokens: a verifiers environment caps its model turns "
                                          r"with env\[0\]\.args\.max_tokens"):
        validate_fields(cfg)
    cfg.env.max_tokens = 0
    # listed anywhere: the verifiers entry's tokenizer sizes the policy (tests/vf/test_vf_mix.py runs it second)
    assert policy_env(cfg) is cfg.env
    cfg.env, cfg.env_mix[0] = cfg.env_mix[0], cfg.env
    validate_fields(cfg)
    assert policy_env(cfg) is cfg.env_mix[0]
    # two verifiers environments share the policy's vocabulary: one tokenizer
    cfg.env_mix.append(EnvConfig(id="verifiers", name="vf2", args={"tokenizer": "builtin:qwen3-tiny"}))
    validate_fields(cfg)
    cfg.env_mix[1].args["tokenizer"] = "/models/other-tokenizer"
    with pytest.raises(ConfigError, match=r"^env\[2\]\.args\.tokenizer: every verifiers environment of a mix must "
                                          r"use one tokenizer .* env\[1\]'s is 'builtin:qwen3-tiny', "
                                          r"got '/models/other-tokenizer'$"):
        validate_fields(cfg)
    cfg.env_mix.pop()
    cfg.env, cfg.env_mix[0] = cfg.env_mix[0], cfg.env
    cfg.eval.interval, cfg.eval.env = 10, [EvalEnvConfig(env="rev")]
    validate_fields(cfg)  # a built-in eval environment
    # ... and the verifiers one's held-out tasks, or a verifiers eval environment of its own over the same tokenizer
    cfg.eval.env = [EvalEnvConfig(env="rev"), EvalEnvConfig(env="vf", args={"split": "heldout"}),
                    EvalEnvConfig(id="verifiers", args={"tokenizer": "builtin:qwen3-tiny"})]
    validate_fields(cfg)
    cfg.eval.env[2].args["tokenizer"] = "/models/other-tokenizer"
    with pytest.raises(ConfigError, match=r"^eval.env\[2\]\.args\.tokenizer: must be the tokenizer of the job's "
                                          r"verifiers environment \('builtin:qwen3-tiny'\), got '/models/other"):
        validate_fields(cfg)
    only_builtin = RLConfig()
    only_builtin.eval.interval, only_builtin.eval.env = 10, [EvalEnvConfig(id="verifiers")]
    with pytest.raises(ConfigError, match=r"^eval.env\[0\]\.id: a verifiers eval environment runs in a job with a "
                                          r"verifiers environment"):
        validate_fields(only_builtin)


def test_distill_teachers_score_each_environment_of_a_mix_with_its_own_teacher(tmp_path):
    """`distill.teachers = {env id = PATH}` in a mix: every reverse-text episode goes to its teacher,
    every copy-text episode (prompt BOS SEP ...) to the other, and each trained sample's per-token
    advantage is its own environment's teacher's log-prob minus the sampler's."""
    (tmp_path / "mix.toml").write_text(MIX + '[distill]\nonly = true\ncoef = 1.0\n'
                                       'teachers = {"reverse-text" = "/teacher/rev", "copy-text" = "/teacher/copy"}\n')
    cfg = load_config(str(tmp_path / "mix.toml"), ["--output_dir", str(tmp_path / "out"),
                                                   "--orchestrator.weights_timeout_s", "20"], check=False)
    from test_distill_teacher import TableTeacher

    rev, cop = TableTeacher(0.1), TableTeacher(0.3)
    _, seen = _run(cfg, TaskClient(), 3, teachers={"/teacher/rev": rev, "/teacher/copy": cop})
    assert len(seen) == 3
    assert rev.seqs and all(s[1] != SEP for s in rev.seqs)
    assert cop.seqs and all(s[1] == SEP for s in cop.seqs)
    for p in seen:
        counts = {"rev": 0, "copy": 0}
        for mb in p["micro_batches"]:
            cu = mb.cu_seqlens.tolist()
            for a, b in zip(cu[:-1], cu[1:]):
                ids = mb.input_ids[a:b].tolist()
                kind, scale = ("copy", 0.3) if ids[1] == SEP else ("rev", 0.1)
                lt = torch.tensor([0.0] + [-scale * t for t in ids[1:]])
                want = torch.where(mb.loss_mask[a:b], lt - mb.inference_logprobs[a:b], 0.0)
                torch.testing.assert_close(mb.advantages[a:b], want)
                counts[kind] += 1
        assert counts == {"rev": 28, "copy": 6}  # 7 groups of 4 and 3 groups of 2, as the mix deals them
