"""Optional adapter: a ``verifiers``-style environment as a primerl :class:`Environment`.

``verifiers`` is never imported by primerl itself and is not a requirement; the adapter is
duck-typed on the surface those environments expose (sync or ``async def`` methods both work):

- ``dataset``: rows (a list of dicts or a Hugging Face ``Dataset``) with ``prompt`` (chat messages,
  or a string when ``message_type == "completion"``) or ``question`` (with the env's optional
  ``system_prompt``), and optional ``answer``, ``task``, ``info``;
- ``rubric.score_rollout(prompt=, completion=, answer=, state=, task=, info=)`` -> a float, a dict
  with ``"reward"``, or an object with ``.reward``;
- multi-turn only: ``max_turns``, ``is_completed(messages, state)``, ``env_response(messages,
  state)`` -> ``(message or messages, state)``; optional ``setup_state(state)``.

Text <-> tokens goes through a tokenizer (``apply_chat_template(messages, tokenize=True,
add_generation_prompt=True)``, ``encode``, ``decode``, ``eos_token_id``), e.g. a Hugging Face one.
An environment turn is the chat-template rendering of the environment's new messages followed by
the generation prompt; pass ``render_env_turn`` for a template that needs something else.

    env = VerifiersEnvironment(vf.load_environment("wordle"), AutoTokenizer.from_pretrained(path))

or from a config: ``env.id = "primerl.rl.envs.verifiers_env:from_verifiers"`` with
``env.args = {env_id = "wordle", tokenizer = "<path or hub id>"}``.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable

from .base import Environment, Episode, Prompt, check_tokens


async def _maybe_await(x):
    return await x if inspect.isawaitable(x) else x


def _as_messages(x) -> list[dict]:
    if x is None:
        return []
    if isinstance(x, dict):
        return [x]
    return list(x)


class VerifiersEnvironment(Environment):
    def __init__(self, vf_env, tokenizer, *, max_new_tokens: int = 256, max_turns: int | None = None,
                 num_prompts: int | None = None, stop_token_ids: tuple[int, ...] | None = None,
                 render_env_turn: Callable[[list[dict]], list[int]] | None = None):
        dataset = getattr(vf_env, "dataset", None)
        if dataset is None or not hasattr(dataset, "__getitem__"):
            raise TypeError("VerifiersEnvironment: the environment has no indexable dataset")
        if not callable(getattr(getattr(vf_env, "rubric", None), "score_rollout", None)):
            raise TypeError("VerifiersEnvironment: the environment has no rubric.score_rollout()")
        self.vf_env, self.tokenizer, self.dataset = vf_env, tokenizer, dataset
        self.message_type = getattr(vf_env, "message_type", "chat")
        if self.message_type not in ("chat", "completion"):
            raise ValueError(f"VerifiersEnvironment: message_type must be 'chat' or 'completion', got {self.message_type!r}")
        self.multi_turn = callable(getattr(vf_env, "env_response", None)) and callable(getattr(vf_env, "is_completed", None))
        turns = max_turns if max_turns is not None else (getattr(vf_env, "max_turns", 1) if self.multi_turn else 1)
        if turns is None or int(turns) <= 0:  # verifiers uses -1/None for "until is_completed"
            raise ValueError("VerifiersEnvironment: give max_turns (the environment sets no positive bound)")
        self.max_turns = int(turns)
        self.max_new_tokens = max_new_tokens
        self.num_prompts = num_prompts if num_prompts is not None else len(dataset)
        size = len(tokenizer) if hasattr(tokenizer, "__len__") else getattr(tokenizer, "vocab_size", 0)
        self.vocab_size = int(size)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_token_ids = tuple(stop_token_ids) if stop_token_ids is not None else (() if eos is None else (int(eos),))
        self._render_env_turn = render_env_turn
        self._lock = threading.Lock()
        self._live: dict[int, tuple[Episode, dict]] = {}  # id(episode) -> (episode, conversation state)

    # ------------------------------------------------------------------ text <-> tokens
    def _row(self, index: int) -> dict:
        row = self.dataset[index % len(self.dataset)]
        return dict(row)

    def _prompt_messages(self, row: dict):
        if row.get("prompt") is not None:
            p = row["prompt"]
            return p if isinstance(p, str) else [dict(m) for m in p]
        if row.get("question") is None:
            raise ValueError("VerifiersEnvironment: a dataset row has neither 'prompt' nor 'question'")
        if self.message_type == "completion":
            return str(row["question"])
        system = getattr(self.vf_env, "system_prompt", None)
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": row["question"]}]

    def _tokens(self, x) -> list[int]:
        if isinstance(x, str):
            ids = self.tokenizer.encode(x, add_special_tokens=False)
        else:
            ids = self.tokenizer.apply_chat_template(x, tokenize=True, add_generation_prompt=True)
            if isinstance(ids, dict):  # transformers may return a BatchEncoding
                ids = ids["input_ids"]
        return check_tokens(ids, self.vocab_size, "VerifiersEnvironment")

    def _env_turn_tokens(self, messages) -> list[int]:
        if self._render_env_turn is not None:
            return check_tokens(self._render_env_turn(messages), self.vocab_size, "render_env_turn")
        if self.message_type == "completion":
            return self._tokens("".join(m["content"] if isinstance(m, dict) else str(m) for m in messages))
        return self._tokens(messages)

    # ------------------------------------------------------------------ the primerl interface
    def prompt(self, index: int) -> Prompt:
        row = self._row(index)
        messages = self._prompt_messages(row)
        info = {"messages": messages, "answer": row.get("answer"), "task": row.get("task"), "info": row.get("info") or {}}
        return Prompt(index, tuple(self._tokens(messages)), info, self.max_new_tokens)

    async def _conversation(self, episode: Episode) -> dict:
        """The episode's messages and verifiers state, with every model turn so far appended."""
        with self._lock:
            found = self._live.get(id(episode))
            conv = found[1] if found is not None and found[0] is episode else None
            if conv is None:
                a = episode.prompt.answer
                p = a["messages"]
                conv = {"prompt": p, "completion": [] if not isinstance(p, str) else "", "model_turns": 0,
                        "state": {"prompt": p, "answer": a["answer"], "task": a["task"], "info": a["info"],
                                  "turn": 0, "responses": []}}
                self._live[id(episode)] = (episode, conv)
                fresh = True
            else:
                fresh = False
        if fresh and callable(getattr(self.vf_env, "setup_state", None)):
            conv["state"] = await _maybe_await(self.vf_env.setup_state(conv["state"])) or conv["state"]
        for tokens in episode.model_turns[conv["model_turns"]:]:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            if isinstance(conv["completion"], str):
                conv["completion"] += text
            else:
                conv["completion"].append({"role": "assistant", "content": text})
            conv["model_turns"] += 1
            conv["state"]["turn"] = conv["model_turns"]
            conv["state"]["responses"].append(text)
        conv["state"]["completion"] = conv["completion"]
        return conv

    @staticmethod
    def _messages(conv: dict):
        return conv["prompt"] + conv["completion"]  # both strings (completion type) or both message lists

    async def respond(self, episode: Episode) -> list[int] | None:
        if not self.multi_turn:
            return None
        conv = await self._conversation(episode)
        messages = self._messages(conv)
        if await _maybe_await(self.vf_env.is_completed(messages, conv["state"])):
            return None
        out = await _maybe_await(self.vf_env.env_response(messages, conv["state"]))
        new, state = out if isinstance(out, tuple) else (out, conv["state"])
        conv["state"] = state if state is not None else conv["state"]
        new = [new] if isinstance(new, str) else _as_messages(new)
        if isinstance(conv["completion"], str):
            conv["completion"] += "".join(m["content"] if isinstance(m, dict) else str(m) for m in new)
        else:
            conv["completion"].extend(new)
        return self._env_turn_tokens(new)

    async def reward(self, episode: Episode) -> float:
        conv = await self._conversation(episode)
        a = episode.prompt.answer
        try:
            score = await _maybe_await(self.vf_env.rubric.score_rollout(
                prompt=conv["prompt"], completion=conv["completion"], answer=a["answer"], state=conv["state"],
                task=a["task"], info=a["info"]))
        finally:
            with self._lock:
                self._live.pop(id(episode), None)
        if isinstance(score, dict):
            score = score["reward"]
        elif hasattr(score, "reward"):
            score = score.reward
        return float(score)


def from_verifiers(env_id: str, tokenizer: str, *, max_new_tokens: int = 256, max_turns: int | None = None,
                   **env_args: Any) -> VerifiersEnvironment:
    """``verifiers.load_environment(env_id, **env_args)`` with a Hugging Face tokenizer (by path or id)."""
    try:
        import verifiers as vf
    except ImportError:
        raise ImportError("primerl.rl.envs.verifiers_env.from_verifiers needs the optional 'verifiers' package "
                          "(pip install verifiers) and the environment's own package") from None
    from transformers import AutoTokenizer

    return VerifiersEnvironment(vf.load_environment(env_id, **env_args), AutoTokenizer.from_pretrained(tokenizer),
                                max_new_tokens=max_new_tokens, max_turns=max_turns)


__all__ = ["VerifiersEnvironment", "from_verifiers"]
