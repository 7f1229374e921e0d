"""The verifiers path's groups and units, and a built-in environment's episode on that path (a
mix of verifiers and built-in environments: ``[[env]]`` with ``id = "verifiers"`` next to
``reverse-text``).

A finished episode becomes ``Unit``s: a verifiers episode one per trainable trace (its branches),
a built-in one a single unit holding its ``rollout.EpisodeState``. A built-in episode runs on the
event loop of ``vf_orchestrator.VerifiersOrchestrator``: each model turn is one ``POST
/inference/v1/generate`` to the job's in-process server (the one verifiers' client talks to), with
the transcript's token ids, the environment's token cap and stop tokens, and a seed from
``(seed, step, group, member, attempt, turn)``; the server's session record (``X-Session-ID``)
gives the turn's policy versions, the response its tokens, log-probs and routed experts. The
environment's ``respond`` / ``reward`` / ``token_weights`` run as on the built-in path
(``env_calls``: concurrent, each with ``env.timeout_s``). The unit's sample is the built-in
path's (``batching.episode_sample``).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import torch

from primerl.rl.envs import check_tokens, has_token_weights

from ..inference.engine import Completion
from ..inference.generate_api import decode_routed_experts_raw
from ..inference.sessions import SESSION_HEADER
from .env_calls import check_token_weights
from .rollout import EpisodeState


@dataclass
class Unit:
    """One trainable trace of a finished episode (a built-in episode: its only one)."""

    agent: str
    reward: float
    branches: list
    version_min: int
    turns: int
    tool_calls: int
    sampled_tokens: int
    version_max: int | None = None  # the newest policy version of its tokens
    episode: EpisodeState | None = None  # a built-in environment's episode (no branches)


@dataclass
class Group:
    task_index: int  # the prompt's index in its environment (a verifiers env: its task)
    gen: int = 0  # bumped on reset: results of an older generation are ignored
    members: list = field(default_factory=list)  # per member: list[Unit] or None while running
    failures: int = 0
    env: int = 0  # index in the job's mix
    draw: int = 0  # 0: the slot's own prompt; d >= 1: dynamic sampling's d-th replacement
    key: str = ""  # the prompt's id (curriculum)
    prompt: object = None  # a built-in environment's Prompt


class BuiltinEpisode:
    """The outcome of a built-in episode, in the shape the loop reads a verifiers episode in:
    ``ok``, ``traces`` (none: nothing to pop from the server), ``units`` or ``error``."""

    traces: tuple = ()

    def __init__(self, units: list[Unit] | None = None, error: BaseException | None = None):
        self.units, self.error = units, error

    @property
    def ok(self) -> bool:
        return self.error is None


async def builtin_episode(http, url: str, model: str, m, calls, st: EpisodeState, *, seed_of, temperature: float,
                          top_p: float, pop_session) -> BuiltinEpisode:
    """Run ``st`` (a fresh ``EpisodeState`` of ``m``, a ``sampling.MixEnv``) to its reward through
    the generate route at ``url``. ``http``: an ``httpx.AsyncClient``; ``calls``: the environment's
    ``env_calls.AsyncEnvCalls``; ``seed_of(turn)``: the turn's seed; ``pop_session(id)``: the
    server's record of a session. Any failure is the episode's ``error``."""
    env = m.env
    try:
        while True:
            params = {"temperature": temperature, "top_p": top_p, "max_tokens": m.max_new_tokens(st.episode.prompt),
                      "stop_token_ids": list(env.stop_token_ids), "seed": seed_of(st.turn)}
            st.add_model_turn(await generate_turn(http, url, model, st.episode.tokens, params, pop_session))
            if st.turn < env.max_turns:
                reply = await calls.call("respond", env.respond, st.episode)
                if reply:
                    st.add_env_turn(check_tokens(reply, env.vocab_size, "environment reply"))
                    continue
            break
        st.reward = await calls.call("reward", env.reward, st.episode)
        if has_token_weights(env):
            st.loss_weights = check_token_weights(await calls.call("token_weights", env.token_weights, st.episode),
                                                  len(st.episode.tokens), f"environment {m.name!r}")
    except Exception as e:  # noqa: BLE001 - counted by the loop, the member resampled
        return BuiltinEpisode(error=e)
    st.done = True
    return BuiltinEpisode([Unit(m.name, st.reward, [], st.version_min, st.turn, 0, st.completion_tokens,
                                version_max=st.version_max, episode=st)])


async def generate_turn(http, url: str, model: str, tokens: list[int], params: dict, pop_session) -> Completion:
    """One model turn: ``POST /inference/v1/generate`` of ``tokens`` with sampling ``params``
    (temperature, top_p, max_tokens, stop_token_ids, seed) -> the engine's ``Completion`` (its
    policy versions from the server's record of the request's session)."""
    sid = f"primerl-builtin-{uuid.uuid4().hex}"
    body = {"model": model, "token_ids": list(tokens), "sampling_params": {**params, "logprobs": 1}}
    r = await http.post(url.rstrip("/") + "/inference/v1/generate", json=body, headers={SESSION_HEADER: sid})
    rec = pop_session(sid)
    if r.status_code != 200:
        raise RuntimeError(f"POST /inference/v1/generate answered {r.status_code}: {r.text[:300]}")
    if rec is None:
        raise RuntimeError("the inference server recorded no request for the episode's session")
    return _completion(r.json()["choices"][0], tokens, rec, url)


def _completion(choice: dict, prompt: list[int], rec, url: str) -> Completion:
    routing = None
    if choice.get("routed_experts") is not None:
        routing, start = decode_routed_experts_raw(choice["routed_experts"])
        if start != 0:
            raise RuntimeError(f"routed experts from position {start}, asked from 0")
    return Completion(0, list(prompt), list(choice["token_ids"]),
                      [float(x["logprob"]) for x in choice["logprobs"]["content"]], routing,
                      choice["finish_reason"], rec.first, rec.last, server=url)


def unit_advantages(groups: list[Group], method: str) -> tuple[list[list[list[float]]], dict]:
    """Per group, per member, per unit: the advantage of that unit among its group's units of the
    same environment and agent (a batch-wide normaliser, e.g. ``rloo_std``'s, spans one environment
    and agent)."""
    from .batching import compute_advantages

    out = [[[0.0] * len(units) for units in grp.members] for grp in groups]
    zero = 0
    kinds = sorted({(grp.env, u.agent) for grp in groups for units in grp.members for u in units})
    for env, agent in kinds:
        slots = [[(gi, mi, ui) for mi, units in enumerate(grp.members) for ui, u in enumerate(units)
                  if u.agent == agent] if grp.env == env else []
                 for gi, grp in enumerate(groups)]
        sizes = {len(s) for s in slots if s}
        chunks = [slots] if len(sizes) == 1 else [[s] for s in slots if s]
        for chunk in chunks:
            chunk = [s for s in chunk if s]
            flat = [x for s in chunk for x in s]
            rewards = torch.tensor([groups[gi].members[mi][ui].reward for gi, mi, ui in flat], dtype=torch.float32)
            adv, info = compute_advantages(rewards, len(chunk[0]), method=method)
            zero += info.get("num_zero_groups", 0)
            for (gi, mi, ui), a in zip(flat, adv.tolist()):
                out[gi][mi][ui] = a
    return out, {"groups/zero_advantage": zero}


def fresh_renderers_lock() -> None:
    """``renderers.client`` holds a module-level ``asyncio.Lock`` (for its ``/v1/models`` look-up); a
    lock binds to the first event loop that waits on it, so a second orchestrator run in one
    process (tests, notebooks) would fail every contended look-up. Each run gets a new one."""
    import renderers.client as rc

    if hasattr(rc, "_max_prompt_len_lock"):
        rc._max_prompt_len_lock = asyncio.Lock()


__all__ = ["BuiltinEpisode", "Group", "Unit", "builtin_episode", "fresh_renderers_lock", "generate_turn",
           "unit_advantages"]
