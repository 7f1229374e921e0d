"""The curriculum's state survives kill -9 + resume through ``primerl rl``: the resumed run's
per-prompt pass rates (pool sizes, mean rate) continue exactly where an uninterrupted run has them,
and the run can also evaluate its checkpoint with ``primerl eval``."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from primerl.runtime.config import EvalEnvConfig, to_toml
from primerl.runtime.launch.common import JobFailed
from primerl.runtime.launch.machine import run_rl
from primerl.runtime.launch.threads import run_threads
from primerl.runtime.metrics import read_metrics
from primerl.runtime.validate import load_config

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--max_steps", "6", "--orchestrator.batch_size", "4", "--orchestrator.group_size", "4",
         "--orchestrator.max_async_level", "0", "--checkpoint.interval", "2", "--log.plot", "false",
         "--orchestrator.weights_timeout_s", "120", "--trainer.batch_timeout_s", "120",
         "--env.args.num_prompts", "12", "--orchestrator.curriculum.enabled", "true",
         "--orchestrator.curriculum.easy_threshold", "0.5", "--orchestrator.curriculum.hard_threshold", "0.2",
         "--orchestrator.curriculum.pass_threshold", "0.5"]
CUR = ("curriculum/reverse-text/easy", "curriculum/reverse-text/hard", "curriculum/reverse-text/unseen",
       "curriculum/reverse-text/mean_rate")


def _cfg(out, *over):
    return load_config(ROOT / "examples" / "reverse_text.toml", ["--output_dir", str(out), *SMALL, *over])


def _cli(*args):
    return subprocess.Popen([sys.executable, "-m", "primerl.runtime.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.mark.slow
def test_curriculum_state_survives_kill_and_resume(tmp_path):
    full = run_threads(_cfg(tmp_path / "full"))
    assert full[-1]["curriculum/reverse-text/unseen"] < 12  # the rates are tracked
    cfg = _cfg(tmp_path / "killed")
    cfg_path = tmp_path / "killed.toml"
    cfg_path.write_text(to_toml(cfg))
    proc = _cli("rl", "--config", str(cfg_path))
    ckpt = tmp_path / "killed" / "checkpoints" / "step_000002"
    deadline = time.monotonic() + 180
    while not ckpt.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no checkpoint within 180 s"
        time.sleep(0.05)
    pids = dict(line.split() for line in (tmp_path / "killed" / "pids").read_text().splitlines())
    os.kill(int(pids["trainer"]), signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert (tmp_path / "killed" / "orchestrator_state" / "step_000002.json").is_file()
    # the resumes: ``primerl rl``'s launcher (run_rl) in this process, not a third and fourth launcher process
    cfg.checkpoint.resume = True
    run_rl(cfg, quiet=True)  # raises JobFailed (the failing process's log) unless the job ends with rc 0
    resumed = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(6))
    for a, b in zip(full, resumed):
        assert [a[k] for k in CUR] == [b[k] for k in CUR], (a["step"], [a[k] for k in CUR], [b[k] for k in CUR])
    # a resume whose curriculum state is gone is refused, not restarted from scratch
    for f in (tmp_path / "killed" / "orchestrator_state").glob("*.json"):
        f.unlink()
    cfg.max_steps = 8
    with pytest.raises(JobFailed, match="the orchestrator exited with code 1") as e:
        run_rl(cfg, quiet=True)
    assert "no saved curriculum state for step 6" in str(e.value), str(e.value)[-3000:]


@pytest.mark.slow
def test_primerl_eval_scores_a_checkpoint(tmp_path, capsys):
    cfg = _cfg(tmp_path / "run", "--max_steps", "2", "--orchestrator.curriculum.enabled", "false")
    run_threads(cfg)
    conf = tmp_path / "c.toml"
    cfg.eval.env = [EvalEnvConfig(name="held", env="reverse-text", args={"split": "heldout", "heldout_fraction": 0.3},
                                  num_prompts=6, samples=2, temperature=1.0, pass_at=[1, 2])]
    conf.write_text(to_toml(cfg))
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    proc = _cli("eval", "--config", str(conf), "--checkpoint", str(ckpt))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    res = json.loads((ckpt / "eval.json").read_text())
    assert res["step"] == 2 and res["eval/held/version"] == 2
    assert 0 <= res["eval/held/pass@1"] <= res["eval/held/pass@2"] <= 1
    assert "eval/held/pass@2" in out
    from primerl.runtime.cli import main  # a missing checkpoint: the command's own entry point, in this process

    capsys.readouterr()
    rc = main(["eval", "--config", str(conf), "--checkpoint", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert rc == 2 and "--checkpoint" in err
