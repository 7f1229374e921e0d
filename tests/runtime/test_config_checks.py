"""Values that used to fail seconds into a run are refused by ``--dry-run``: non-finite numbers,
loss names, the environment, model.path."""

from pathlib import Path

import pytest

from primerl.rl import losses
from primerl.runtime.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(capsys, *over) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["rl", "--config", str(ROOT / "examples" / "reverse_text.toml"), "--dry-run", *over])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("over, message", [
    (["--trainer.lr", "inf"], "trainer.lr: must be a finite number, got inf"),
    (["--trainer.lr", "nan"], "trainer.lr: must be a finite number, got nan"),
    (["--env.timeout_s", "inf"], "env.timeout_s: must be a finite number"),
    (["--trainer.loss.hparams", '{"eps_low": Infinity}'], "trainer.loss.hparams.eps_low: must be a finite number"),
    (["--trainer.loss.method", "foo"], "trainer.loss.method: policy_loss: unknown method 'foo'"),
    (["--trainer.loss.method", "os.path:no_such_fn"], "trainer.loss.method: policy_loss: method 'os.path:no_such_fn'"),
    (["--trainer.loss.method", "no_such_module:fn"], "cannot import module 'no_such_module'"),
    (["--trainer.loss.corrections", "icepop,foo"], "trainer.loss.corrections: has unknown entries ['foo']"),
    (["--trainer.loss.aggregation", "foo"], "trainer.loss.aggregation: must be one of ("),
    (["--env.id", "nosuchenv"], "env.id / env.args: unknown environment 'nosuchenv'"),
    (["--env.id", "no_such_module:Env"], "cannot import module 'no_such_module'"),
    (["--env.args.no_such_arg", "1"], "unknown argument(s) ['no_such_arg']"),
    (["--model.path", "/nonexistent"], "model.path: must be an existing directory"),
    (["--model.path", "/"], "model.path: has no config.json"),
    (["--env.max_abs_reward", "0"], "env.max_abs_reward: must be > 0"),
    (["--env.max_concurrent_calls", "0"], "env.max_concurrent_calls: must be >= 1"),
])
def test_dry_run_refuses(capsys, over, message):
    rc, err = _dry_run(capsys, *over)
    assert rc == 2 and message in err, err


def test_dry_run_accepts_every_name_the_losses_module_lists(capsys):
    for method in losses.LOSS_METHODS:  # with each method's default hyperparameters
        rc, err = _dry_run(capsys, "--trainer.loss.method", method, "--trainer.loss.hparams", "{}")
        assert rc == 0, (method, err)
    # token_sum_norm divides by hparams.norm_constant (tests/runtime/test_job_checks.py)
    for agg in losses.AGGREGATIONS:
        rc, err = _dry_run(capsys, "--trainer.loss.aggregation", agg, "--trainer.loss.hparams.norm_constant", "64")
        assert rc == 0, (agg, err)
    # tis needs old_logprobs, which the job does not compute: refused (tests/runtime/test_job_checks.py)
    rc, err = _dry_run(capsys, "--trainer.loss.corrections", ",".join(c for c in losses.CORRECTIONS if c != "tis"))
    assert rc == 0, err
