"""The environment interface: a dataset of prompts, a reward, and optional environment turns.

An episode alternates model turns and environment turns (tool results, feedback) until the
environment says it is done or ``max_turns`` model turns were taken. Everything is token ids:
an environment owns its vocabulary (or a tokenizer) and the runtime never decodes text.

Contract (every method may also be ``async def``; the runtime awaits it with a timeout):
- ``prompt(index) -> Prompt``: deterministic for a given index (resumed runs replay it).
- ``prompts() -> list[str] | None`` (optional): the ids of the environment's prompt dataset, in
  index order (``prompt(i).id == prompts()[i]``); ``None`` (the default for an unbounded generator,
  ``num_prompts = None``): the environment declares no dataset. Curricula need it (per-prompt pass
  rates are keyed by id); the base class lists ``prompt(i).id`` for a finite ``num_prompts``.
- ``respond(episode) -> list[int] | None``: called after each model turn except the last
  allowed one; returns the environment's tokens, or ``None`` to end the episode.
- ``reward(episode) -> float``: scored once, when the episode ends.
- ``token_weights(episode) -> Sequence[float] | None`` (optional): called once after ``reward``;
  one weight >= 0 per transcript token (``episode.tokens``) for the policy-gradient loss (only the
  model tokens' weights are used; 0 takes a token out of the loss and of its denominator).
  ``None`` (the default): weight 1 on every model token.

The loss mask covers model tokens only (``Episode.loss_mask``).
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass(frozen=True)
class Prompt:
    """One dataset entry: the prompt tokens and whatever the reward needs (``answer``)."""

    index: int
    tokens: tuple[int, ...]
    answer: Any = None
    max_new_tokens: int | None = None  # per model turn; None = the environment's default
    id: str | None = None  # a stable name of the prompt in its dataset (None: str(index))

    @property
    def key(self) -> str:
        """The prompt's id, or ``str(index)`` when the environment gives none."""
        return str(self.index) if self.id is None else self.id


@dataclass
class Turn:
    role: str  # "model" or "env"
    tokens: list[int]


@dataclass
class Episode:
    prompt: Prompt
    turns: list[Turn] = field(default_factory=list)

    @property
    def model_turns(self) -> list[list[int]]:
        return [t.tokens for t in self.turns if t.role == "model"]

    @property
    def tokens(self) -> list[int]:
        """The whole transcript: prompt then every turn, in order."""
        out = list(self.prompt.tokens)
        for t in self.turns:
            out.extend(t.tokens)
        return out

    @property
    def loss_mask(self) -> list[bool]:
        """Per transcript token: True on model tokens only."""
        out = [False] * len(self.prompt.tokens)
        for t in self.turns:
            out.extend([t.role == "model"] * len(t.tokens))
        return out


class Environment:
    """Base class; subclasses set the class attributes and implement ``prompt`` and ``reward``."""

    vocab_size: int = 0  # smallest policy vocabulary that covers every token the env emits
    max_new_tokens: int = 16  # per model turn, unless the prompt says otherwise
    max_turns: int = 1  # model turns per episode
    stop_token_ids: tuple[int, ...] = ()
    num_prompts: int | None = None  # None: an unbounded generator of prompts

    def prompt(self, index: int) -> Prompt:
        raise NotImplementedError

    def prompts(self) -> list[str] | None:
        """The ids of the prompt dataset in index order, or None for an unbounded generator."""
        n = self.num_prompts
        if n is None:
            return None
        return [self.prompt(i).key for i in range(int(n))]

    def respond(self, episode: Episode) -> list[int] | None:
        return None

    def reward(self, episode: Episode) -> float:
        raise NotImplementedError

    def token_weights(self, episode: Episode) -> Sequence[float] | None:
        return None


def prompt_ids(env) -> list[str] | None:
    """``env.prompts()`` checked: a list of unique strings, or None (no dataset declared)."""
    fn = getattr(env, "prompts", None)
    ids = fn() if callable(fn) else None
    if ids is None:
        return None
    ids = list(ids)
    if not ids or not all(isinstance(i, str) for i in ids):
        raise ValueError(f"environment {type(env).__name__}: prompts() must return a non-empty list of str ids")
    if len(set(ids)) != len(ids):
        raise ValueError(f"environment {type(env).__name__}: prompts() ids must be unique")
    return ids


def has_token_weights(env) -> bool:
    """Whether ``env`` defines its own ``token_weights`` (the base class's returns None)."""
    own = getattr(type(env), "token_weights", None)
    return own is not None and own is not Environment.token_weights


def call_env(fn, *args, timeout: float | None = None):
    """Call an environment method that may be sync or ``async def``; async ones get ``timeout``."""
    out = fn(*args)
    if inspect.isawaitable(out):
        async def _wait():
            return await asyncio.wait_for(out, timeout)

        return asyncio.run(_wait())
    return out


def check_tokens(tokens: Sequence[int], vocab_size: int, what: str) -> list[int]:
    tokens = [int(t) for t in tokens]
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what}: token ids must be in [0, {vocab_size}), got {bad[:5]}")
    return tokens
