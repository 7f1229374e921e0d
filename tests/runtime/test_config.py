"""Typed config: TOML + overrides, unknown keys named, validation, TOML round trip, CLI dry run."""

import subprocess
import sys
from pathlib import Path

import pytest

from primerl.runtime.cli import main
from primerl.runtime.config import ConfigError, RLConfig, from_dict, parse_overrides, to_toml
from primerl.runtime.validate import load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "reverse_text.toml"


def test_example_loads_and_overrides_apply():
    cfg = load_config(EXAMPLE, ["--trainer.lr", "1e-2", "--orchestrator.max_async_level=0",
                                "--inference.kv_cache", "false", "--env.args.num_symbols", "5",
                                "--trainer.loss.hparams", '{"delta_low": 0.1}', "--log.plot"])
    assert cfg.trainer.lr == 1e-2 and cfg.orchestrator.max_async_level == 0
    assert cfg.inference.kv_cache is False and cfg.log.plot is True
    assert cfg.env.args["num_symbols"] == 5 and cfg.trainer.loss.hparams == {"delta_low": 0.1}


def test_toml_round_trip(tmp_path):
    cfg = load_config(EXAMPLE, ["--trainer.loss.corrections", '["icepop"]',
                                "--inference.vllm.extra_args", '["--x", "1"]'])
    p = tmp_path / "c.toml"
    p.write_text(to_toml(cfg))
    assert load_config(p) == cfg


@pytest.mark.parametrize("data,key", [
    ({"trainr": {}}, "trainr"),
    ({"trainer": {"lrr": 1.0}}, "trainer.lrr"),
    ({"inference": {"vllm": {"tensor_parallell": 2}}}, "inference.vllm.tensor_parallell"),
])
def test_unknown_keys_in_file_are_named(data, key):
    with pytest.raises(ConfigError, match=f"unknown config key {key}"):
        from_dict(RLConfig, data)


@pytest.mark.parametrize("override,match", [
    (["--trainer.lrr", "1"], "unknown config key trainer.lrr"),
    (["--orchestrator.batch_size", "ten"], "orchestrator.batch_size: expected an int"),
    (["--orchestrator.group_size", "1"], "orchestrator.group_size: must be >= 2"),
    (["--orchestrator.max_async_level", "-1"], "orchestrator.max_async_level"),
    (["--orchestrator.metrics_port", "70000"], "orchestrator.metrics_port: must be a TCP port"),
    (["--inference.top_p", "1.5"], "inference.top_p"),
    (["--inference.backend", "sglang"], "inference.backend"),
    (["--trainer.lr_schedule", "step"], "trainer.lr_schedule"),
    (["--model.top_k", "9"], "model.top_k"),
    (["--trainer", "3"], "trainer is a section"),
    (["--log.plot", "maybe"], "log.plot: expected a bool"),
    (["--warm_start.steps", "-1"], "warm_start.steps: must be >= 0"),
    (["--warm_start.lr", "0"], "warm_start.lr: must be > 0"),
    (["--warm_start.steps", "5", "--model.path", "some/model"],
     "warm_start.steps: the warm start trains the random init"),
    (["oops"], "expected --key.sub value"),
])
def test_bad_overrides_are_specific(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(EXAMPLE, override)


def test_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer\nlr = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")


def test_parse_overrides_forms():
    assert parse_overrides(["--a.b", "1", "--c=2", "--flag", "--d-e", "x"]) == [
        ("a.b", "1"), ("c", "2"), ("flag", "true"), ("d_e", "x")]


def test_cli_dry_run_prints_resolved_config(capsys):
    assert main(["rl", "--config", str(EXAMPLE), "--dry-run", "--trainer.lr", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "[trainer]" in out and "lr = 0.5" in out and "[inference.vllm]" in out


def test_cli_config_error_exit_code(capsys):
    assert main(["rl", "--config", str(EXAMPLE), "--dry-run", "--trainer.bogus", "1"]) == 2
    assert "trainer.bogus" in capsys.readouterr().err


def test_console_entry_point_runs_as_module():
    r = subprocess.run([sys.executable, "-m", "primerl.runtime.cli", "orchestrator", "--config", str(EXAMPLE),
                        "--dry-run"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and 'id = "reverse-text"' in r.stdout


def test_model_rope_theta_reaches_the_model_and_is_checked():
    from primerl.runtime.policy import model_config

    cfg = load_config(EXAMPLE, ["--model.rope_theta", "50"])
    assert model_config(cfg, 11).rope_theta == 50.0
    with pytest.raises(ConfigError, match="rope_theta must be > 1"):
        model_config(load_config(EXAMPLE, ["--model.rope_theta", "0.5"], check=False), 11)
    with pytest.raises(ConfigError, match="model: .*rope_theta must be > 1"):  # and --dry-run fails on it
        load_config(EXAMPLE, ["--model.rope_theta", "0.5"])
