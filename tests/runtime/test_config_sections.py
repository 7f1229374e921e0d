"""The config's layout (issue 41): ``[model]`` takes the model's own defaults, and every
``ConfigError`` the job's check raises names a key that exists in the config."""

import copy
import dataclasses
from pathlib import Path

import pytest

from primerl.models import MoETransformerConfig
from primerl.runtime.config import ConfigError, ModelConfig, RLConfig
from primerl.runtime.config.model import MODEL_FIELDS
from primerl.runtime.policy import model_config
from primerl.runtime.validate import load_config, validate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "reverse_text.toml"


def test_model_section_defaults_are_the_models():
    model = {f.name: f for f in dataclasses.fields(MoETransformerConfig)}
    section = {f.name: f for f in dataclasses.fields(ModelConfig)}
    assert set(section) - set(model) == {"path", "extra"}, "a [model] key that is not a MoETransformerConfig field"
    assert set(MODEL_FIELDS) == set(section) - {"path", "extra", "vocab_size"}
    for name in MODEL_FIELDS:
        assert section[name].default == model[name].default, name
    assert section["vocab_size"].default == 0  # the environment's


def test_default_model_section_builds_the_models_default_config():
    cfg = RLConfig()
    assert model_config(cfg, 256) == MoETransformerConfig(vocab_size=256)


def test_model_extra_cannot_repeat_a_section_key():
    cfg = RLConfig()
    cfg.model.extra = {"dim": 32}
    with pytest.raises(ConfigError, match="model.extra"):
        model_config(cfg, 256)


def _keys(cfg, prefix: str = "") -> set[str]:
    """Every dotted key of the config (sections too), free-form tables' entries included."""
    out = set()
    for f in dataclasses.fields(cfg):
        key, val = prefix + f.name, getattr(cfg, f.name)
        out.add(key)
        if dataclasses.is_dataclass(val):
            out |= _keys(val, key + ".")
        elif isinstance(val, dict):
            out |= {f"{key}.{k}" for k in val}
    return out


def _named_keys(message: str) -> list[str]:
    """The keys a ConfigError names: ``key: ...``, ``a.b / a.c: ...``, ``a.b/c: ...`` (a.b and
    a.c), ``key (context): ...``, ``key[i]: ...``."""
    head = message.split(": ", 1)[0].split(" (", 1)[0]
    keys = []
    for part in head.split(" / "):
        first, *rest = part.strip().split("/")
        keys.append(first.split("[", 1)[0])
        keys += [first.rsplit(".", 1)[0] + "." + r for r in rest]
    return keys


def _bad_values(value):
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [-1, 0, 10**6]
    if isinstance(value, float):
        return [-1.0, 0.0, float("inf")]
    if isinstance(value, str):
        return ["no-such-choice", ""]
    if isinstance(value, list):
        return [["no-such-choice"], [-1]]
    return []


def _leaves(cfg, prefix: str = ""):
    for f in dataclasses.fields(cfg):
        val = getattr(cfg, f.name)
        if dataclasses.is_dataclass(val):
            yield from _leaves(val, prefix + f.name + ".")
        elif not isinstance(val, dict):
            yield prefix + f.name, val


def _set(cfg, dotted: str, value) -> None:
    *path, name = dotted.split(".")
    obj = cfg
    for p in path:
        obj = getattr(obj, p)
    setattr(obj, name, value)


def test_every_config_error_names_a_key_of_the_config(tmp_path):
    """Each key of the example set to values out of range, of a wrong choice or of the other
    sign: whatever the job's check refuses is a ConfigError that names keys the config has."""
    base = load_config(EXAMPLE, ["--output_dir", str(tmp_path / "run")])
    keys = _keys(base)
    refused = 0
    for dotted, value in _leaves(base):
        for bad in _bad_values(value):
            cfg = copy.deepcopy(base)
            _set(cfg, dotted, bad)
            try:
                validate(cfg)
            except ConfigError as e:
                refused += 1
                named = _named_keys(str(e))
                assert named and all(k in keys for k in named), (dotted, bad, str(e))
    assert refused > 150, refused  # the sweep reaches most checks
