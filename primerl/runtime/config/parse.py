"""TOML + ``--key.sub value`` overrides to an ``RLConfig`` (``load_config``), and back (``to_toml``)."""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from pathlib import Path
from typing import Any

from .checks import validate
from .schema import ConfigError, RLConfig


# --------------------------------------------------------------------------------------------
# building from dicts, overrides, dumping


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, typ: Any, key: str) -> Any:
    if dataclasses.is_dataclass(typ):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table/section, got {value!r}")
        return from_dict(typ, value, prefix=key + ".")
    origin = typing.get_origin(typ) or typ
    if origin is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key}: expected a bool, got {value!r}")
    if origin is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an int, got {value!r}")
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected an int, got {value!r}") from None
    if origin is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if origin is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if origin is list and typing.get_args(typ) and dataclasses.is_dataclass(typing.get_args(typ)[0]):
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ConfigError(f"{key}: expected an array of tables ([[{key}]]), got {value!r}")
        return [from_dict(typing.get_args(typ)[0], v, prefix=f"{key}[{i}].") for i, v in enumerate(value)]
    if origin in (list, dict):
        if isinstance(value, str):  # from the command line: JSON or a TOML inline table / array
            parsed = _parse_scalar(value)
            if parsed is value and origin is list:
                parsed = [v for v in value.split(",") if v]
            value = parsed
        if not isinstance(value, origin):
            hint = {dict: " (a JSON object '{\"k\": 1}' or a TOML inline table '{k = 1}')",
                    list: " (a JSON or TOML array '[1, 2]', or 'a,b')"}[origin]
            raise ConfigError(f"{key}: expected a {origin.__name__}{hint}, got {value!r}")
        return value
    return value


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass ``cls`` from a nested dict; unknown keys raise naming the dotted key."""
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        if k not in names:
            raise ConfigError(f"unknown config key {prefix}{k!s} (valid keys in "
                              f"{prefix.rstrip('.') or 'the top level'}: {sorted(names)})")
        kwargs[k] = _coerce(v, hints[k], prefix + k)
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def apply_override(cfg, dotted: str, raw: Any) -> None:
    """Set ``cfg.<dotted>`` from a string (or value), coerced to the field's declared type."""
    parts = dotted.split(".")
    obj, path = cfg, []
    for i, name in enumerate(parts):
        path.append(name)
        if not dataclasses.is_dataclass(obj) or name not in {f.name for f in dataclasses.fields(obj)}:
            if isinstance(obj, dict):  # a free-form table (env.args, loss.hparams)
                rest = ".".join(parts[i:])
                obj[rest] = _parse_scalar(raw)
                return
            raise ConfigError(f"unknown config key {'.'.join(path)}")
        typ = _hints(type(obj))[name]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(typ):
                raise ConfigError(f"{dotted} is a section; set one of its keys, e.g. --{dotted}.<key>")
            value = raw if typ is str else (_parse_scalar(raw) if typ in (dict, list) or
                                            typing.get_origin(typ) in (dict, list) else raw)
            setattr(obj, name, _coerce(value, typ, dotted))
            return
        obj = getattr(obj, name)


def _parse_scalar(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        if raw.strip()[:1] in ("{", "["):  # the TOML inline syntax the config files use: {delta_low = 0.2}
            try:
                return tomllib.loads(f"v = {raw}")["v"]
            except tomllib.TOMLDecodeError:
                return raw
        low = raw.lower()
        if low in ("true", "false"):
            return low == "true"
        return raw


def parse_overrides(argv: list[str]) -> list[tuple[str, str]]:
    """``["--a.b", "1", "--c=2", "--flag"]`` -> ``[("a.b", "1"), ("c", "2"), ("flag", "true")]``."""
    out, i = [], 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--") or len(tok) == 2:
            raise ConfigError(f"expected --key.sub value, got {tok!r}")
        key = tok[2:]
        if "=" in key:
            key, _, val = key.partition("=")
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            val = argv[i + 1]
            i += 2
        else:
            val, i = "true", i + 1
        out.append((key.replace("-", "_"), val))
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *, check: bool = True) -> RLConfig:
    """The config of ``path`` with ``overrides``; ``check``: this module's ``validate`` (fields, names,
    trainer layout). The job's full check is ``primerl.runtime.validate.load_config``."""
    data = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
    cfg = from_dict(RLConfig, split_env_list(data))
    file_loss = (cfg.trainer.loss.method, dict(cfg.trainer.loss.hparams))
    pairs = parse_overrides(overrides or [])
    for key, val in pairs:
        apply_override(cfg, key, val)
    _drop_replaced_method_hparams(cfg, *file_loss, [k for k, _ in pairs])
    if check:
        validate(cfg)
    return cfg


def split_env_list(data: dict) -> dict:
    """``[[env]]`` (a list under ``env``) -> ``env`` (the first) + ``env_mix`` (the rest), with the
    keys of entry i named ``env[i].key`` in errors."""
    envs = data.get("env")
    if not isinstance(envs, list):
        return data
    if "env_mix" in data:
        raise ConfigError("env_mix: set the environments of a mix as [[env]] tables, not env_mix")
    if not envs or not all(isinstance(e, dict) for e in envs):
        raise ConfigError(f"env: [[env]] must be one or more tables, got {envs!r}")
    from .schema import EnvConfig

    first = from_dict(EnvConfig, envs[0], prefix="env[0].")
    rest = [from_dict(EnvConfig, e, prefix=f"env[{i}].") for i, e in enumerate(envs[1:], 1)]
    out = {k: v for k, v in data.items() if k != "env"}
    out["env"], out["env_mix"] = dataclasses.asdict(first), [dataclasses.asdict(e) for e in rest]
    return out


def _drop_replaced_method_hparams(cfg: RLConfig, file_method: str, file_hparams: dict, keys: list[str]) -> None:
    """``--trainer.loss.method X`` on the command line replaces the file's method, and with it that
    method's own hyperparameters in the file's ``hparams`` (dppo_tv's delta_low/delta_high under
    ppo_clip are an error, not a setting): those X does not use are dropped, with a warning. Kept:
    names X also uses (kl_coef), those of corrections/terms, and anything set on the command line."""
    import logging

    from primerl.rl.loss_spec import DEFAULT_HPARAMS

    loss = cfg.trainer.loss
    if ("trainer.loss.method" not in keys or "trainer.loss.hparams" in keys or loss.method == file_method
            or file_method not in DEFAULT_HPARAMS):
        return
    new_names = DEFAULT_HPARAMS.get(loss.method, {})
    given = {k.removeprefix("trainer.loss.hparams.") for k in keys if k.startswith("trainer.loss.hparams.")}
    drop = [k for k in file_hparams if k in DEFAULT_HPARAMS[file_method] and k not in new_names and k not in given]
    if drop:
        for k in drop:
            loss.hparams.pop(k, None)
        logging.getLogger("primerl.config").warning(
            "trainer.loss.method = %r (command line) replaces the file's %r: its hyperparameters %s are dropped "
            "(pass --trainer.loss.hparams to set the new method's)", loss.method, file_method, ", ".join(drop))
    # a random init's fields are checked by the model's own config (shapes, rope_theta, ...):
    # primerl.runtime.validate builds it through policy.model_config


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def to_toml(cfg) -> str:
    """The resolved config as TOML (loadable again with ``load_config``)."""
    lines: list[str] = []

    def emit(obj, section: str, array: bool = False) -> None:
        if section:
            lines.append(f"\n[[{section}]]" if array else f"\n[{section}]")
        subs, arrays = [], []
        for f in dataclasses.fields(obj):
            val = getattr(obj, f.name)
            if dataclasses.is_dataclass(val):
                subs.append((f.name, val))
            elif isinstance(val, list) and val and all(dataclasses.is_dataclass(v) for v in val):
                arrays.append((f.name, val))
            elif isinstance(val, list) and not val and f.name == "env_mix":
                continue
            else:
                lines.append(f"{f.name} = {_toml_value(val)}")
        for name, val in subs:
            full = f"{section}.{name}" if section else name
            if name == "env" and not section and getattr(obj, "env_mix", None):  # a mix: [[env]] for every entry
                for e in [val, *obj.env_mix]:
                    emit(e, "env", array=True)
                continue
            emit(val, full)
        for name, vals in arrays:
            if name == "env_mix" and not section:
                continue  # written with env above
            for v in vals:
                emit(v, f"{section}.{name}" if section else name, array=True)

    emit(cfg, "")
    return "\n".join(lines).lstrip("\n") + "\n"
