"""Environments: prompts, rewards and environment turns for RL rollouts.

>>> from primerl.rl.envs import load_environment
>>> env = load_environment("reverse-text", num_symbols=8, min_length=4, max_length=4)
>>> p = env.prompt(0)          # Prompt(index=0, tokens=(1, s1..s4, 2), answer=[...], ...)

Custom environments by import path: ``load_environment("my_pkg.envs:MyEnv", **args)``.
``load_environment("verifiers", env={...}, tokenizer=..., renderer=...)``: a verifiers 0.4.0
environment, run by the orchestrator's verifiers path (``primerl.rl.envs.verifiers_env``; needs
``pip install 'primerl[verifiers]'``, imported only then).
"""

from __future__ import annotations

import importlib
import inspect

from .base import Environment, Episode, Prompt, Turn, call_env, check_tokens, has_token_weights, prompt_ids
from .reverse_text import CopyText, ReverseText, ReverseTextFeedback
from .verifiers_env import VerifiersEnv

BUILTIN = {
    "reverse-text": ReverseText,
    "reverse-text-feedback": ReverseTextFeedback,
    "copy-text": CopyText,
    "verifiers": VerifiersEnv,
}

__all__ = ["Environment", "Episode", "Prompt", "Turn", "call_env", "check_tokens", "has_token_weights",
           "load_environment", "resolve_environment", "prompt_ids", "CopyText", "ReverseText",
           "ReverseTextFeedback", "BUILTIN"]


def _resolve(env_id: str):
    if env_id in BUILTIN:
        return BUILTIN[env_id]
    if ":" not in env_id:
        raise ValueError(f"unknown environment {env_id!r}: use one of {sorted(BUILTIN)} "
                         "or an import path 'package.module:ClassOrFactory'")
    mod_name, _, attr = env_id.partition(":")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"environment {env_id!r}: cannot import module {mod_name!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"environment {env_id!r}: module {mod_name!r} has no attribute {attr!r}") from None


def resolve_environment(env_id: str, args: dict | None = None):
    """The factory ``env_id`` names, with ``args`` checked against its signature, without building
    the environment (``primerl.runtime.config.validate_names`` calls it). ValueError names the problem."""
    factory = _resolve(env_id)
    args = args or {}
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        sig = None
    if sig is not None and not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        unknown = sorted(set(args) - set(sig.parameters))
        if unknown:
            raise ValueError(f"environment {env_id!r}: unknown argument(s) {unknown}; "
                             f"accepted: {sorted(sig.parameters)}")
    return factory


def load_environment(env_id: str, **args) -> Environment:
    """Build an environment from a built-in name or ``module:attr``; bad arguments name the key."""
    env = resolve_environment(env_id, args)(**args)
    for attr in ("prompt", "reward"):
        if not callable(getattr(env, attr, None)):
            raise TypeError(f"environment {env_id!r}: built object has no callable {attr}()")
    if int(getattr(env, "vocab_size", 0)) <= 0:
        raise ValueError(f"environment {env_id!r}: vocab_size must be set to a positive int")
    return env
