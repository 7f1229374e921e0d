"""Which environment and which prompt each group of a batch gets: environment mixes, dynamic
sampling's replacement prompts and the difficulty curriculum.

Mix (``[[env]]`` with weights): the groups of the run, slot ``t = step * batch_size + group``, are
dealt to environments by smooth weighted round-robin (each slot: every environment's credit grows
by its weight, the one with the most credit gets the slot and pays the total weight; ties go to the
earlier environment). It is exact: after any number of slots an environment's count is within one
of its share, and it depends on nothing but the weights, so a resumed run deals the same.

Prompts: the k-th slot of an environment gets its prompt ``k`` (a finite dataset wraps), as a
single environment always did; a group that dynamic sampling replaced (draw ``d >= 1``) gets a
prompt drawn from ``(seed, step, group, d)``. With the curriculum on an environment, every prompt
is drawn from its dataset (``prompts()`` ids) with weight 1, or ``curriculum.weight`` for a prompt
whose pass rate is above ``easy_threshold`` or below ``hard_threshold``. The rates used for batch
``n`` are those of batches ``<= n - max_async_level - 1`` (always handed over before ``n`` is
submitted), so the draws do not depend on timing; ``state()`` / ``load_state`` carry them
through a checkpoint.
"""

from __future__ import annotations

import bisect
import json
import random
from dataclasses import dataclass
from pathlib import Path

from primerl.rl.envs import Environment, prompt_ids

from .rollout import mix_seed

SPARE_BASE = 1 << 40  # replacement prompts of an unbounded generator: indices far past the sequential ones


@dataclass
class MixEnv:
    """One environment of the job, with its mix settings."""

    name: str
    env: Environment
    cfg: object  # config.EnvConfig
    weight: float
    group_size: int
    max_tokens: int  # 0: the environment's own

    def max_new_tokens(self, prompt) -> int:
        n = prompt.max_new_tokens or self.env.max_new_tokens
        return min(n, self.max_tokens) if self.max_tokens else n


def build_mix(cfg, policy_env: Environment) -> list[MixEnv]:
    """The job's environments: ``policy_env`` (built from ``config.policy_env(cfg)``, the one whose
    vocabulary sizes the policy) at its place, and the others built from their configs."""
    from primerl.rl.envs import load_environment

    from ..config import env_name, job_envs
    from ..config.data import policy_env_index

    p = policy_env_index(cfg)
    out = []
    for i, e in enumerate(job_envs(cfg)):
        env = policy_env if i == p else load_environment(e.id, **e.args)
        if env.vocab_size > policy_env.vocab_size:
            raise ValueError(f"env[{i}] ({env_name(e)!r}): vocab_size {env.vocab_size} is larger than env[{p}]'s "
                             f"({policy_env.vocab_size}), which sizes the policy (built-in environments only: list the "
                             "largest first)")
        out.append(MixEnv(env_name(e), env, e, float(e.weight), e.group_size or cfg.orchestrator.group_size,
                          e.max_tokens))
    return out


class SlotDealer:
    """Slot -> environment index by smooth weighted round-robin (cached; deterministic)."""

    def __init__(self, weights: list[float]):
        self.w = [float(x) for x in weights]
        self.total = sum(self.w)
        self.credit = [0.0] * len(self.w)
        self.assigned: list[int] = []  # env of slot t
        self.rank: list[int] = []  # how many earlier slots went to the same env

    def _extend(self, t: int) -> None:
        counts = [0] * len(self.w)
        for e in self.assigned:
            counts[e] += 1
        while len(self.assigned) <= t:
            for i, w in enumerate(self.w):
                self.credit[i] += w
            best = max(range(len(self.w)), key=lambda i: (self.credit[i], -i))
            self.credit[best] -= self.total
            self.assigned.append(best)
            self.rank.append(counts[best])
            counts[best] += 1

    def env_of(self, t: int) -> tuple[int, int]:
        """-> (environment index, its sequential prompt number) of slot ``t``."""
        if len(self.assigned) <= t:
            self._extend(t)
        return self.assigned[t], self.rank[t]


class Curriculum:
    """Per-prompt pass rates of the environments it covers; the draws' weights; its state."""

    def __init__(self, c, mix: list[MixEnv], seed: int, lag: int):
        self.c, self.seed, self.lag = c, seed, lag
        self.envs = {m.name for m in mix if not c.envs or m.name in c.envs}
        self.ids: dict[str, list[str]] = {}
        for m in mix:
            if m.name in self.envs:
                ids = prompt_ids(m.env)
                if ids is None:
                    raise ValueError(f"orchestrator.curriculum: environment {m.name!r} declares no prompt dataset "
                                     "(prompts() with ids); set its dataset (e.g. env.args.num_prompts) or leave it "
                                     "out of orchestrator.curriculum.envs")
                self.ids[m.name] = ids
        self.rates: dict[str, dict[str, float]] = {n: {} for n in self.envs}
        self.applied = -1  # batches <= applied are in rates
        self.pending: dict[int, list[tuple[str, str, float]]] = {}  # step -> (env, prompt id, pass fraction)
        self._cum: dict[str, list[float]] = {}

    def covers(self, name: str) -> bool:
        return name in self.envs

    def record(self, step: int, env: str, prompt_id: str, rewards: list[float]) -> None:
        if env in self.envs:
            frac = sum(r >= self.c.pass_threshold for r in rewards) / len(rewards)
            self.pending.setdefault(step, []).append((env, prompt_id, frac))

    def advance(self, step: int) -> None:
        """Apply the recorded results of batches ``<= step - lag - 1`` (in step order)."""
        upto = step - self.lag - 1
        for s in sorted(k for k in self.pending if k <= upto):
            for env, pid, frac in self.pending.pop(s):
                r = self.rates[env]
                r[pid] = frac if pid not in r else (1 - self.c.ema) * r[pid] + self.c.ema * frac
            self._cum.clear()
        self.applied = max(self.applied, upto)

    def _weight(self, env: str, pid: str) -> float:
        r = self.rates[env].get(pid)
        if r is not None and (r > self.c.easy_threshold or r < self.c.hard_threshold):
            return self.c.weight
        return 1.0

    def draw(self, env: str, key: tuple) -> int:
        """A prompt index of ``env`` drawn by the current weights with a seed from ``key``."""
        cum = self._cum.get(env)
        if cum is None:
            cum, acc = [], 0.0
            for pid in self.ids[env]:
                acc += self._weight(env, pid)
                cum.append(acc)
            self._cum[env] = cum
        rng = random.Random(mix_seed(self.seed, 0xC0, *key))
        if cum[-1] <= 0:  # every prompt easy or hard with weight 0: draw uniformly
            return rng.randrange(len(cum))
        return bisect.bisect_right(cum, rng.random() * cum[-1])

    def metrics(self) -> dict:
        out = {}
        for env in sorted(self.envs):
            rates = self.rates[env]
            vals = list(rates.values())
            easy = sum(r > self.c.easy_threshold for r in vals)
            hard = sum(r < self.c.hard_threshold for r in vals)
            out.update({f"curriculum/{env}/easy": easy, f"curriculum/{env}/hard": hard,
                        f"curriculum/{env}/normal": len(vals) - easy - hard,
                        f"curriculum/{env}/unseen": len(self.ids[env]) - len(vals),
                        f"curriculum/{env}/mean_rate": sum(vals) / len(vals) if vals else 0.0})
        return out

    def state(self) -> dict:
        return {"applied": self.applied, "rates": self.rates,
                "pending": {str(k): v for k, v in self.pending.items()}}

    def load_state(self, st: dict) -> None:
        unknown = set(st["rates"]) - self.envs
        if unknown:
            raise ValueError(f"curriculum state names environments {sorted(unknown)} this job does not cover")
        self.applied = int(st["applied"])
        self.rates = {n: dict(st["rates"].get(n, {})) for n in self.envs}
        self.pending = {int(k): [tuple(x) for x in v] for k, v in st["pending"].items()}
        self._cum.clear()


class PromptSampler:
    """Slot -> (environment, prompt index) for a batch's groups (module docstring)."""

    def __init__(self, cfg, mix: list[MixEnv]):
        self.cfg, self.mix, self.B, self.seed = cfg, mix, cfg.orchestrator.batch_size, cfg.seed
        self.dealer = SlotDealer([m.weight for m in mix])
        c = cfg.orchestrator.curriculum
        self.curriculum = Curriculum(c, mix, cfg.seed, cfg.orchestrator.max_async_level) if c.enabled else None

    def env_of(self, step: int, group: int) -> int:
        return self.dealer.env_of(step * self.B + group)[0]

    def prompt_index(self, step: int, group: int, draw: int) -> int:
        e, k = self.dealer.env_of(step * self.B + group)
        m = self.mix[e]
        n = m.env.num_prompts
        if self.curriculum is not None and self.curriculum.covers(m.name):
            return self.curriculum.draw(m.name, (step, group, draw))
        if draw == 0:
            return k % n if n else k
        x = mix_seed(self.seed, 0xD5, step, group, draw)
        return x % n if n else SPARE_BASE + x % SPARE_BASE

    # ------------------------------------------------------------ curriculum state on disk
    @staticmethod
    def state_path(output_dir, step: int) -> Path:
        return Path(output_dir) / "orchestrator_state" / f"step_{step:06d}.json"

    def save_state(self, output_dir, step: int, keep: int) -> None:
        """The curriculum's state for a run resumed at ``step`` (written before batch ``step-1`` is
        handed over); the newest ``keep`` files are kept."""
        if self.curriculum is None:
            return
        p = self.state_path(output_dir, step)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.curriculum.state()))
        tmp.replace(p)
        for old in sorted(p.parent.glob("step_*.json"))[:-keep]:
            old.unlink(missing_ok=True)

    def load_state(self, output_dir, step: int) -> None:
        if self.curriculum is None or step == 0:
            return
        p = self.state_path(output_dir, step)
        if not p.is_file():
            raise FileNotFoundError(f"orchestrator.curriculum: no saved curriculum state for step {step} ({p}); "
                                    "the run cannot resume its curriculum")
        self.curriculum.load_state(json.loads(p.read_text()))


__all__ = ["Curriculum", "MixEnv", "PromptSampler", "SlotDealer", "build_mix"]
