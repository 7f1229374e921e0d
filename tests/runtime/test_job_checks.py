"""Combinations that ``primerl rl`` used to fail on only after both processes had started (as
tracebacks, leaving files behind) are refused by ``--dry-run``: one line naming the key, exit 2,
nothing written. Also: dict overrides in TOML's inline syntax, switching the loss method on the
command line, an output_dir the lock cannot create, and a rerun after a start that failed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from primerl.runtime import cli
from primerl.runtime.config import ConfigError
from primerl.runtime.validate import load_config
from primerl.runtime.output_dir import OutputDirLock, OutputDirNotEmpty, OutputDirUnusable, claim_output_dir

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "reverse_text.toml")


def _main(capsys, config, *over, dry_run=True) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = cli.main(["rl", "--config", config, *(["--dry-run"] if dry_run else []), *over])
    return rc, capsys.readouterr().err.strip().splitlines()


REFUSED = [
    (EXAMPLE, ["--trainer.loss.corrections", "tis"], "trainer.loss.corrections: 'tis' needs"),
    (EXAMPLE, ["--trainer.loss.corrections", '["mis", "tis"]'], "trainer.loss.corrections: 'tis' needs"),
    (EXAMPLE, ["--trainer.loss.aggregation", "token_sum_norm"], "trainer.loss.hparams.norm_constant: aggregation"),
    (EXAMPLE, ["--trainer.loss.aggregation", "token_sum_norm", "--trainer.loss.hparams.norm_constant", "0"],
     "trainer.loss.hparams.norm_constant:"),
    (EXAMPLE, ["--warm_start.steps", "3"], "warm_start.steps: the warm start trains on the environment's task "
                                           "demonstrations and 'reverse-text' has none"),
    (EXAMPLE, ["--inference.capture_routing", "false"], "trainer.router_replay: replay needs the sampler's routing"),
    (EXAMPLE, ["--output_dir", "/proc/primerl_x"], "output_dir: cannot be created under /proc"),
]
for package in ("tensorboard", "wandb"):
    if importlib.util.find_spec(package) is None:
        REFUSED.append((EXAMPLE, [f"--log.{package}", "true"], f"log.{package}: needs the {package} package"))
if importlib.util.find_spec("verifiers") is None:  # else tests/vf runs these examples
    REFUSED += [(str(ROOT / "examples" / name), [], "env.id: the verifiers environment needs verifiers 0.4.0")
                for name in ("vf_reverse_text.toml", "vf_tool_use.toml")]


@pytest.mark.parametrize("config, over, message", REFUSED, ids=lambda x: x if isinstance(x, str) else None)
def test_dry_run_refuses_in_one_line_and_writes_nothing(capsys, tmp_path, config, over, message):
    out = tmp_path / "run"
    rc, err = _main(capsys, config, "--output_dir", str(out), *over)
    assert rc == 2 and len(err) == 1 and message in err[0], err
    assert err[0].startswith("primerl: config error: ")
    assert not out.exists()


def test_output_dir_that_is_a_file_is_refused(capsys, tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    for path in (f, f / "sub"):
        rc, err = _main(capsys, EXAMPLE, "--output_dir", str(path))
        assert rc == 2 and len(err) == 1 and "output_dir:" in err[0] and str(f) in err[0], err
    assert f.read_text() == "x"


def test_the_launcher_reports_an_output_dir_it_cannot_create_as_a_config_error(capsys, tmp_path, monkeypatch):
    """What only an attempt reveals (validation's look passed): one line, exit 2, not a traceback."""
    f = tmp_path / "a_file"
    f.write_text("x")
    with pytest.raises(OutputDirUnusable, match="output_dir: cannot create or write"):
        OutputDirLock(f / "sub").acquire()
    monkeypatch.setattr("primerl.runtime.job_checks.check_output_dir", lambda path: None)
    rc, err = _main(capsys, EXAMPLE, "--output_dir", str(f / "sub"), dry_run=False)
    assert rc == 2 and len(err) == 1 and err[0].startswith("primerl: config error: output_dir: cannot create"), err


def test_a_start_that_failed_before_its_first_step_does_not_block_the_rerun(tmp_path):
    """A directory holding only what the launcher writes before step 0 is reused (its logs kept);
    one with metrics or checkpoints, or files of the user's, is still refused."""
    out = tmp_path / "run"
    cfg = load_config(EXAMPLE, ["--output_dir", str(out)])
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "orchestrator.log").write_text("ImportError: ...\n")
    (out / "transport" / "weights").mkdir(parents=True)
    (out / "config.toml").write_text("")
    (out / "pids").write_text("trainer 1\n")
    (out / "metrics.jsonl").write_text("")  # the trainer opened it and logged no step
    with claim_output_dir(cfg):
        pass
    for name, text in (("metrics.jsonl", '{"step": 0}\n'), ("notes.txt", "")):
        (out / name).write_text(text)
        with pytest.raises(OutputDirNotEmpty, match=name):
            claim_output_dir(cfg)
        (out / name).unlink()


def test_dict_overrides_accept_toml_inline_tables_and_json(capsys):
    for raw in ('{delta_low = 0.1, delta_high = 0.3}', '{"delta_low": 0.1, "delta_high": 0.3}'):
        cfg = load_config(EXAMPLE, ["--trainer.loss.hparams", raw])
        assert cfg.trainer.loss.hparams == {"delta_low": 0.1, "delta_high": 0.3}
    cfg = load_config(EXAMPLE, ["--env.args", "{num_symbols = 6, min_length = 3, max_length = 3}"])
    assert cfg.env.args == {"num_symbols": 6, "min_length": 3, "max_length": 3}
    with pytest.raises(ConfigError, match=r"trainer.loss.hparams: expected a dict \(a JSON object .* or a TOML "
                                          r"inline table '\{k = 1\}'\), got 'delta_low=0.2'"):
        load_config(EXAMPLE, ["--trainer.loss.hparams", "delta_low=0.2"])


@pytest.mark.parametrize("method", ["ppo_clip", "ipo", "gspo", "gspo_token", "cispo", "reinforce"])
def test_switching_the_loss_method_drops_the_files_method_hparams(caplog, method):
    """The example pins dppo_tv's delta_low/delta_high: --trainer.loss.method X alone runs X with its
    defaults (a warning names what was dropped); kl_coef, which X also has, is kept."""
    with caplog.at_level("WARNING", logger="primerl.config"):
        cfg = load_config(EXAMPLE, ["--trainer.loss.method", method])
    assert cfg.trainer.loss.method == method and cfg.trainer.loss.hparams == {"kl_coef": 1e-3}
    assert "its hyperparameters delta_low, delta_high are dropped" in caplog.text
    # what the command line sets is kept: here a dppo_tv name under ppo_clip is still an error
    with pytest.raises(ConfigError, match="hyperparameter 'delta_low' is not used by method='ppo_clip'"):
        load_config(EXAMPLE, ["--trainer.loss.method", "ppo_clip", "--trainer.loss.hparams.delta_low", "0.1"])
    cfg = load_config(EXAMPLE, ["--trainer.loss.method", "ppo_clip", "--trainer.loss.hparams", "{eps_low = 0.1}"])
    assert cfg.trainer.loss.hparams == {"eps_low": 0.1}
