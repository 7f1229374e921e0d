"""The data side of a job: environment mixes (``[[env]]``), online evaluation (``[eval]`` with
``[[eval.env]]``), the difficulty curriculum (``[orchestrator.curriculum]``), and their checks.

A job trains on one environment (``[env]``) or a mix (``[[env]]``, each with ``weight``; the first
is ``cfg.env``, the others ``cfg.env_mix``). ``job_envs(cfg)`` lists them all with their names
(``name``, default the id; ``distill.teachers`` and the metrics ``reward/<name>`` use it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import ConfigError, _need

FILTERS = ("none", "dapo")
NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]+$")


@dataclass
class EvalEnvConfig:
    """One online evaluation: an environment (a training one by ``env``, with ``args`` laid over
    its args, e.g. ``{split = "heldout"}``, or its own ``id``), its prompts and its sampling."""

    name: str = ""  # metrics eval/<name>/...; default: env, else id
    env: str = ""  # the name of a training environment to evaluate on (its id and args)
    id: str = ""  # or an environment of its own (a built-in name or "package.module:Factory")
    args: dict = field(default_factory=dict)  # laid over the training env's args (env = ...), or the args of id
    num_prompts: int = 32  # prompts 0..num_prompts-1 of the eval environment
    samples: int = 1  # samples per prompt
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    pass_at: list = field(default_factory=lambda: [1])  # k of the pass@k reported, each <= samples
    pass_threshold: float = 1.0  # a sample passes when its reward >= this
    max_tokens: int = 0  # per model turn; 0: the environment's own


@dataclass
class EvalConfig:
    interval: int = 0  # evaluate the policy of every interval-th version (0: no online eval)
    env: list[EvalEnvConfig] = field(default_factory=list)  # [[eval.env]]


@dataclass
class CurriculumConfig:
    """Per-prompt pass rates tracked online; prompts whose rate is above ``easy_threshold`` or below
    ``hard_threshold`` are drawn with weight ``weight`` (others: 1)."""

    enabled: bool = False
    easy_threshold: float = 0.9
    hard_threshold: float = 0.1
    weight: float = 0.1  # relative sampling weight of an easy or hard prompt (0: never drawn)
    pass_threshold: float = 1.0  # a sample passes when its reward >= this
    ema: float = 0.5  # a prompt's rate <- (1 - ema) * rate + ema * (its group's pass fraction)
    envs: list = field(default_factory=list)  # names of the environments it covers ([]: all)


def job_envs(cfg) -> list:
    """``[cfg.env, *cfg.env_mix]`` (``EnvConfig``s)."""
    return [cfg.env, *cfg.env_mix]


def policy_env_index(cfg) -> int:
    """The index in ``job_envs(cfg)`` of the environment whose vocabulary sizes the policy: the first
    verifiers one (its tokenizer's; a built-in environment's token ids are the policy's first ids),
    else the first."""
    return next((i for i, e in enumerate(job_envs(cfg)) if e.id == "verifiers"), 0)


def policy_env(cfg):
    """The ``EnvConfig`` at ``policy_env_index(cfg)``."""
    return job_envs(cfg)[policy_env_index(cfg)]


def load_policy_env(cfg):
    """The environment ``policy_env(cfg)`` built (its ``vocab_size`` sizes the policy)."""
    from primerl.rl.envs import load_environment

    e = policy_env(cfg)
    return load_environment(e.id, **e.args)


def env_name(e) -> str:
    return e.name or e.id


def env_key(cfg, i: int) -> str:
    """The config key of environment ``i``: ``env`` for a single one, ``env[i]`` in a mix."""
    return f"env[{i}]" if cfg.env_mix else "env"


def check_env_list(cfg) -> None:
    """``env_mix`` holds ``[[env]]`` tables (not set directly); run before any per-env check."""
    _need(isinstance(cfg.env_mix, list) and all(hasattr(e, "id") and hasattr(e, "weight") for e in cfg.env_mix),
          "env_mix", "must be a list of environment tables (write them as [[env]])", cfg.env_mix)


def check_env_mix(cfg) -> None:
    """``[[env]]``: names unique and usable in metric keys, weights > 0, the overrides' ranges; a
    verifiers entry's token cap is its ``args.max_tokens`` (each entry's ``[env]`` ranges:
    ``schema.check_env``)."""
    envs = job_envs(cfg)
    seen: dict[str, int] = {}
    for i, e in enumerate(envs):
        key = env_key(cfg, i)
        name = env_name(e)
        _need(bool(NAME_RE.match(name)), f"{key}.name", "must be letters, digits and _ . : - (it names metrics)",
              name)
        if name in seen:
            raise ConfigError(f"{key}.name: {name!r} is already the name of env[{seen[name]}]; give each "
                              "environment of a mix its own name")
        seen[name] = i
        _need(e.weight > 0, f"{key}.weight", "must be > 0", e.weight)
        _need(e.group_size == 0 or e.group_size >= 2, f"{key}.group_size",
              "must be >= 2 (0: orchestrator.group_size)", e.group_size)
        _need(e.max_tokens >= 0, f"{key}.max_tokens", "must be >= 0 (0: the environment's own)", e.max_tokens)
        p = policy_env_index(cfg)
        _need(e.id != "verifiers" or _tokenizer(e.args) == _tokenizer(envs[p].args), f"{key}.args.tokenizer",
              f"every verifiers environment of a mix must use one tokenizer (the policy's vocabulary), and "
              f"{env_key(cfg, p)}'s is {_tokenizer(envs[p].args)!r}", _tokenizer(e.args))
        _need(e.id != "verifiers" or not e.max_tokens, f"{key}.max_tokens",
              f"a verifiers environment caps its model turns with {key}.args.max_tokens (leave this 0)", e.max_tokens)


def _tokenizer(args: dict) -> str:
    """A verifiers environment's tokenizer (``args.tokenizer``; verifiers_env.BUILTIN_TOKENIZER when unset)."""
    return str(args.get("tokenizer", "builtin:qwen3-tiny"))


def check_filter(o) -> None:
    _need(o.filter in FILTERS, "orchestrator.filter", "must be none or dapo", o.filter)
    _need(o.max_oversample >= 1, "orchestrator.max_oversample",
          "must be >= 1 (groups sampled per batch, at most max_oversample x batch_size)", o.max_oversample)


def uses_verifiers(cfg) -> bool:
    """Whether an environment of the job is a verifiers one (the job then runs the verifiers path,
    ``orchestrator.vf_orchestrator``, for all of them)."""
    return any(e.id == "verifiers" for e in job_envs(cfg))


def check_curriculum(c: CurriculumConfig, names: list[str]) -> None:
    k = "orchestrator.curriculum"
    _need(0 <= c.hard_threshold < c.easy_threshold <= 1, f"{k}.hard_threshold",
          f"must satisfy 0 <= hard_threshold < easy_threshold ({c.easy_threshold}) <= 1", c.hard_threshold)
    _need(0 <= c.weight <= 1, f"{k}.weight", "must be in [0, 1]", c.weight)
    _need(0 < c.ema <= 1, f"{k}.ema", "must be in (0, 1]", c.ema)
    _need(isinstance(c.envs, list), f"{k}.envs", "must be a list of environment names", c.envs)
    for n in c.envs:
        _need(n in names, f"{k}.envs", f"names no environment of the job ({names})", n)


def check_eval(cfg) -> None:
    """``[eval]`` / ``[[eval.env]]``: known environments, sampling ranges, pass@k within samples."""
    ev = cfg.eval
    _need(ev.interval >= 0, "eval.interval", "must be >= 0 (0: no online eval)", ev.interval)
    _need(isinstance(ev.env, list) and all(hasattr(x, "pass_at") for x in ev.env), "eval.env",
          "must be a list of eval tables (write them as [[eval.env]])", ev.env)
    names = [env_name(e) for e in job_envs(cfg)]
    seen = set()
    for i, x in enumerate(ev.env):
        key = f"eval.env[{i}]"
        if bool(x.env) == bool(x.id):
            raise ConfigError(f"{key}: set exactly one of env (a training environment's name) or id")
        if x.env and x.env not in names:
            raise ConfigError(f"{key}.env: unknown environment {x.env!r} (the job's environments: {names})")
        name = eval_name(x)
        _need(bool(NAME_RE.match(name)), f"{key}.name", "must be letters, digits and _ . : -", name)
        _need(name not in seen, f"{key}.name", "is used by another eval (give each its own name)", name)
        seen.add(name)
        _need(x.num_prompts >= 1, f"{key}.num_prompts", "must be >= 1", x.num_prompts)
        _need(x.samples >= 1, f"{key}.samples", "must be >= 1", x.samples)
        _need(x.temperature >= 0, f"{key}.temperature", "must be >= 0 (0: greedy)", x.temperature)
        _need(0 < x.top_p <= 1, f"{key}.top_p", "must be in (0, 1]", x.top_p)
        _need(x.max_tokens >= 0, f"{key}.max_tokens", "must be >= 0", x.max_tokens)
        _need(isinstance(x.pass_at, list) and bool(x.pass_at), f"{key}.pass_at", "must list at least one k",
              x.pass_at)
        for k in x.pass_at:
            _need(isinstance(k, int) and not isinstance(k, bool) and k >= 1, f"{key}.pass_at",
                  "must be ints >= 1", k)
            _need(k <= x.samples, f"{key}.pass_at", f"pass@{k} needs at least {k} samples per prompt "
                  f"({key}.samples = {x.samples})", k)
        env_id, args = eval_env_spec(cfg, x)
        if env_id == "verifiers":  # on the verifiers path, over the policy's tokenizer
            _need(uses_verifiers(cfg), f"{key}.id", "a verifiers eval environment runs in a job with a verifiers "
                  "environment (its tokenizer sizes the policy's vocabulary)", x.id)
            _need(_tokenizer(args) == _tokenizer(policy_env(cfg).args), f"{key}.args.tokenizer",
                  f"must be the tokenizer of the job's verifiers environment ({_tokenizer(policy_env(cfg).args)!r})",
                  _tokenizer(args))


def eval_name(x: EvalEnvConfig) -> str:
    return x.name or x.env or x.id


def eval_env_spec(cfg, x: EvalEnvConfig) -> tuple[str, dict]:
    """(id, args) of an eval environment: its own, or a training env's with ``args`` laid over."""
    if x.id:
        return x.id, dict(x.args)
    base = next(e for e in job_envs(cfg) if env_name(e) == x.env)
    return base.id, {**base.args, **x.args}


def check_eval_names(cfg) -> None:
    """Each eval environment's factory and arguments resolve (``--dry-run`` fails on a typo)."""
    from primerl.rl.envs import resolve_environment

    for i, x in enumerate(cfg.eval.env):
        env_id, args = eval_env_spec(cfg, x)
        try:
            resolve_environment(env_id, args)
        except ValueError as err:
            raise ConfigError(f"eval.env[{i}].{'id' if x.id else 'args'}: {err}") from None


__all__ = ["CurriculumConfig", "EvalConfig", "EvalEnvConfig", "FILTERS", "check_curriculum", "check_env_list",
           "check_env_mix", "uses_verifiers",
           "check_eval", "check_eval_names", "check_filter", "env_key", "env_name", "eval_env_spec", "eval_name",
           "job_envs", "load_policy_env", "policy_env", "policy_env_index"]
