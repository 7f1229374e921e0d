"""Online evaluation (``[eval]``, ``[[eval.env]]``): the current policy on held-out prompts, every
``eval.interval`` policy versions, through the same inference client as the training rollouts.

When the orchestrator loads a version that crosses a multiple of ``eval.interval`` (version 0
included), every eval environment's prompts ``0..num_prompts-1`` are submitted, ``samples`` each,
with the eval's own temperature / top_p / max_tokens, next to the training requests: the engine
batches both, nothing waits for the eval. When the last eval episode is scored its results
(``eval/<name>/pass@k`` for each k of ``pass_at``, ``eval/<name>/reward`` the mean reward,
``eval/<name>/version`` the oldest policy version that sampled one of its tokens) join the metrics
of the next batch handed to the trainer, so they land in ``metrics.jsonl`` at that step.

Greedy sampling (``temperature = 0``): the engine has no greedy mode, so such a request is sent
with temperature 1 and ``top_p = GREEDY_TOP_P`` (1e-9): a nucleus of one token, the most likely
one, which is greedy decoding exactly.

pass@k is the unbiased estimator over the n = ``samples`` samples of a prompt of which c passed
(reward >= ``pass_threshold``): ``1 - C(n-c, k) / C(n, k)``, averaged over prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from primerl.rl.envs import Environment, check_tokens, load_environment

from .env_calls import EnvCalls
from .rollout import EpisodeState, mix_seed


GREEDY_TOP_P = 1e-9


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class EvalSpec:
    name: str
    cfg: object  # config.EvalEnvConfig
    env: Environment
    calls: EnvCalls


@dataclass
class EvalRun:
    version: int
    states: dict = field(default_factory=dict)  # (eval, prompt, sample) -> EpisodeState
    left: int = 0


def eval_results(spec: EvalSpec, states: list[EpisodeState]) -> dict:
    """Metrics of one eval environment from its finished episodes."""
    x = spec.cfg
    by_prompt: dict[int, list[float]] = {}
    for st in states:
        by_prompt.setdefault(st.eval_key[2], []).append(st.reward)
    out = {f"eval/{spec.name}/reward": sum(st.reward for st in states) / len(states)}
    for k in x.pass_at:
        vals = [pass_at_k(len(r), sum(v >= x.pass_threshold for v in r), k) for r in by_prompt.values()]
        out[f"eval/{spec.name}/pass@{k}"] = sum(vals) / len(vals)
    return out


def eval_sampling(x) -> tuple[float, float]:
    """(temperature, top_p) of an eval (``EvalEnvConfig``): greedy (temperature 0) as a one-token nucleus."""
    return (x.temperature, x.top_p) if x.temperature > 0 else (1.0, GREEDY_TOP_P)


def runs_own_episodes(env) -> bool:
    """A verifiers environment runs its episodes itself (``vf_eval.LoopEval`` drives its evals)."""
    from primerl.rl.envs.verifiers_env import VerifiersEnv

    return isinstance(env, VerifiersEnv)


class OnlineEval:
    """The eval environments and the eval runs in flight (driven by the orchestrator)."""

    def __init__(self, cfg):
        from ..config import eval_env_spec, eval_name

        self.cfg, self.interval = cfg, cfg.eval.interval
        self.specs: list[EvalSpec] = []
        for x in cfg.eval.env:
            env_id, args = eval_env_spec(cfg, x)
            env = load_environment(env_id, **args)
            e = cfg.env
            self.specs.append(EvalSpec(eval_name(x), x, env, EnvCalls(f"eval {eval_name(x)}", e.timeout_s,
                                                                      e.max_concurrent_calls)))
        self.runs: dict[int, EvalRun] = {}
        self.ready: list[dict] = []  # finished runs' metrics, for the next batch
        self.last_due = -1

    @property
    def enabled(self) -> bool:
        return bool(self.interval) and bool(self.specs)

    def due(self, old_version: int, new_version: int) -> bool:
        """Whether loading ``new_version`` (after ``old_version``) crosses a multiple of the interval."""
        if not self.enabled or new_version < 0:
            return False
        mark = (new_version // self.interval) * self.interval
        return mark > old_version and mark != self.last_due

    def start(self, version: int, submit, start_own=None) -> None:
        """Submit version ``version``'s eval episodes (``submit(st, max_new, temperature, top_p, seed)``);
        an environment that runs its own episodes (a verifiers one) is started by ``start_own(run,
        index, spec)``, which adds its episodes to ``run``."""
        self.last_due = (version // self.interval) * self.interval if self.interval else version
        run = EvalRun(version)
        self.runs[version] = run
        for ei, spec in enumerate(self.specs):
            x = spec.cfg
            if runs_own_episodes(spec.env):
                start_own(run, ei, spec)
                continue
            for p in range(x.num_prompts):
                prompt = spec.env.prompt(p)
                check_tokens(prompt.tokens, spec.env.vocab_size, f"eval {spec.name} prompt {p}")
                for s in range(x.samples):
                    st = EpisodeState.start(version, p, s, 0, prompt, eval_key=(version, ei, p, s))
                    run.states[(ei, p, s)] = st
                    run.left += 1
        for st in list(run.states.values()):
            if not runs_own_episodes(self.specs[st.eval_key[1]].env):
                self.submit_turn(st, submit)

    def submit_turn(self, st: EpisodeState, submit) -> None:
        spec = self.specs[st.eval_key[1]]
        x = spec.cfg
        max_new = st.episode.prompt.max_new_tokens or spec.env.max_new_tokens
        if x.max_tokens:
            max_new = min(max_new, x.max_tokens)
        seed = mix_seed(self.cfg.seed, 0xE7, *st.eval_key, st.turn)
        temperature, top_p = eval_sampling(x)
        submit(st, max_new, temperature, top_p, seed, tuple(spec.env.stop_token_ids))

    def env_call(self, st: EpisodeState, name: str) -> None:
        spec = self.specs[st.eval_key[1]]
        spec.calls.submit(st, name, getattr(spec.env, name), st.episode)

    def finished(self, st: EpisodeState) -> None:
        """One eval episode scored; the run's metrics are ready once all are."""
        run = self.runs.get(st.eval_key[0])
        if run is None:
            return
        run.left -= 1
        if run.left == 0:
            del self.runs[run.version]
            out = {}
            versions = []
            for ei, spec in enumerate(self.specs):
                states = [s for (e, _, _), s in run.states.items() if e == ei]
                out.update(eval_results(spec, states))
                versions += [s.version_min for s in states]
                out[f"eval/{spec.name}/version"] = min(s.version_min for s in states)
            self.ready.append(out)

    def pop_ready(self) -> dict:
        out = {}
        for r in self.ready:
            out.update(r)
        self.ready.clear()
        return out

    def on_env_result(self, st: EpisodeState, name: str, ok: bool, value, submit) -> None:
        """An eval episode's env call came back; a failure is an error of the eval (not resampled)."""
        from .env_calls import check_reward

        spec = self.specs[st.eval_key[1]]
        if not ok:
            raise RuntimeError(f"eval {spec.name!r}: {value}") from value
        if name == "respond" and value:
            st.add_env_turn(check_tokens(value, spec.env.vocab_size, "environment reply"))
            self.submit_turn(st, submit)
        elif name == "respond":
            self.env_call(st, "reward")
        elif name == "reward":
            st.reward, _ = check_reward(value, self.cfg.env.max_abs_reward, f"eval {spec.name!r}")
            st.done = True
            self.finished(st)

    def on_completion(self, st: EpisodeState, c) -> None:
        st.add_model_turn(c)
        self.env_call(st, "respond" if st.turn < self.specs[st.eval_key[1]].env.max_turns else "reward")

    def pending(self) -> int:
        return sum(s.calls.pending() for s in self.specs)

    def poll(self):
        out = []
        for s in self.specs:
            out += s.calls.poll(0.0)
        return out


__all__ = ["EvalRun", "EvalSpec", "OnlineEval", "eval_results", "eval_sampling", "pass_at_k", "runs_own_episodes"]
