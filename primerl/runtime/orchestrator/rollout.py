"""Episodes in flight: model turns from the engine, environment turns, the routing record.

An ``EpisodeState`` grows one model turn per engine completion. Its per-token arrays are
aligned with the transcript ``episode.tokens``:

- ``logprobs[t]``: the sampler's log-prob of token t (0 for prompt / environment tokens),
- ``loss_mask[t]``: True on model tokens only,
- ``routing[t]``: the ``[L, k]`` experts used when token t was fed through the model, taken the
  first time it was (the pass whose outputs produced the later log-probs). The last token is
  never fed, so its row is a filler (experts ``0..k-1``); no loss depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from primerl.rl.envs import Episode, Prompt, Turn

from ..inference.engine import Completion, Request, SamplingParams


def mix_seed(*parts: int) -> int:
    """A deterministic 63-bit seed from integers (splitmix64-style mixing)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


@dataclass
class EpisodeState:
    step: int  # the batch (trainer step) this episode belongs to
    group: int
    member: int
    attempt: int
    episode: Episode
    logprobs: list[float] = field(default_factory=list)
    routing: list[torch.Tensor] = field(default_factory=list)
    routed_positions: int = 0
    version_min: int | None = None
    version_max: int | None = None
    completion_tokens: int = 0
    reward: float | None = None
    loss_weights: list[float] | None = None  # the environment's token_weights(), if it has them
    done: bool = False
    servers: list[str] = field(default_factory=list)  # who sampled its model turns (Completion.server), in order
    # [distill]: the teacher's log-probs of episode.tokens (teacher_scoring.TeacherScorer), when they came
    teacher_logprobs: list[float] | None = None
    done_at: float = 0.0  # time.monotonic() when the episode finished (reward in)
    scored_at: float = 0.0
    score_s: float = 0.0  # its share of the teacher's forward time
    env: int = 0  # index of its environment in the job's mix (orchestrator.sampling.MixEnv)
    draw: int = 0  # 0: the slot's own prompt; d >= 1: the d-th replacement (dynamic sampling)
    eval_key: tuple | None = None  # an online-eval episode: (run, eval, prompt, sample); None: training

    @classmethod
    def start(cls, step: int, group: int, member: int, attempt: int, prompt: Prompt, *, env: int = 0,
              draw: int = 0, eval_key: tuple | None = None) -> "EpisodeState":
        return cls(step, group, member, attempt, Episode(prompt), logprobs=[0.0] * len(prompt.tokens), env=env,
                   draw=draw, eval_key=eval_key)

    @property
    def turn(self) -> int:
        return len(self.episode.model_turns)

    def request(self, request_id: int, seed: int, *, max_new_tokens: int, temperature: float, top_p: float,
                stop_token_ids: tuple[int, ...]) -> Request:
        return Request(request_id, self.episode.tokens,
                       SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                      stop_token_ids=tuple(stop_token_ids), seed=seed))

    def add_model_turn(self, c: Completion) -> None:
        self.episode.turns.append(Turn("model", list(c.tokens)))
        self.logprobs.extend(c.logprobs)
        self.completion_tokens += len(c.tokens)
        self.version_min = c.policy_version if self.version_min is None else min(self.version_min, c.policy_version)
        self.version_max = max(self.version_max or 0, c.policy_version_end)
        if c.server not in self.servers:
            self.servers.append(c.server)
        if c.routing is not None:
            new = c.routing[self.routed_positions:]
            self.routing.append(new)
            self.routed_positions += new.shape[0]

    def add_env_turn(self, tokens: list[int]) -> None:
        self.episode.turns.append(Turn("env", list(tokens)))
        self.logprobs.extend([0.0] * len(tokens))

    def routing_tensor(self, top_k: int) -> torch.Tensor | None:
        """``[len(tokens), L, k]`` or None when the engine captured no routing."""
        if not self.routing:
            return None
        r = torch.cat(self.routing, 0)
        n = len(self.episode.tokens)
        if r.shape[0] < n:
            fill = torch.arange(top_k, dtype=r.dtype).expand(n - r.shape[0], r.shape[1], top_k)
            r = torch.cat([r, fill], 0)
        return r[:n]
