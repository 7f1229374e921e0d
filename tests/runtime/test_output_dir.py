"""One job per output_dir (an flock naming its holder), no silent deletion of a previous run, and
trainer/orchestrator processes that do not outlive the launcher."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from primerl.runtime.cli import main
from primerl.runtime.validate import load_config
from primerl.runtime.launch.machine import first_failure
from primerl.runtime.launch.threads import run_threads
from primerl.runtime.output_dir import LOCK_NAME, OutputDirBusy, OutputDirNotEmpty, claim_output_dir

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def _cfg(out, *over):
    return load_config(None, ["--output_dir", str(out), *over])


def _cli(capsys, *args) -> tuple[int, str]:
    """``primerl rl ...`` in this process -> (exit code, stderr)."""
    capsys.readouterr()
    rc = main(["rl", "--config", str(ROOT / "examples" / "reverse_text.toml"), *args])
    return rc, capsys.readouterr().err


@pytest.fixture
def holder(tmp_path):
    """Another process holding tmp_path/'run''s lock (as a running job's launcher does)."""
    out = tmp_path / "run"
    code = ("import sys, time; from primerl.runtime.output_dir import OutputDirLock; "
            f"OutputDirLock({str(out)!r}).acquire(); print('locked', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    yield out, proc
    proc.kill()
    proc.wait()


def test_second_job_fails_naming_the_holder_and_touches_nothing(holder, capsys):
    out, proc = holder
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    (out / "checkpoints" / "step_000001").mkdir(parents=True)
    # resume or overwrite would make run_threads delete or rewrite files: the lock comes first
    for over in (["--checkpoint.resume", "true"], ["--overwrite", "true"]):
        with pytest.raises(OutputDirBusy, match=rf"in use by another primerl job \(holder: pid {proc.pid} on "):
            run_threads(_cfg(out, *over))
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n' and (out / "checkpoints" / "step_000001").is_dir()
    assert not (out / "transport").exists() and not (out / "config.toml").exists()
    rc, err = _cli(capsys, "--output_dir", str(out), "--overwrite", "true")
    assert rc == 1 and f"FAILED: output_dir {out} is in use by another primerl job (holder: pid {proc.pid}" in err, err
    proc.kill()
    proc.wait()  # the kernel drops a dead holder's lock: no stale lock to clean up
    claim_output_dir(_cfg(out, "--checkpoint.resume", "true")).release()


def test_non_empty_output_dir_needs_resume_or_overwrite(tmp_path):
    out = tmp_path / "run"
    claim_output_dir(_cfg(out)).release()  # a new directory
    claim_output_dir(_cfg(out)).release()  # only our lock file in it
    assert sorted(os.listdir(out)) == [LOCK_NAME]
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(OutputDirNotEmpty,
                       match=r"not empty \(metrics.jsonl\).*--checkpoint.resume true.*--overwrite true"):
        claim_output_dir(_cfg(out))
    claim_output_dir(_cfg(out, "--checkpoint.resume", "true")).release()
    claim_output_dir(_cfg(out, "--overwrite", "true")).release()
    # the refusal released its lock: a later claim in the same process succeeds
    with claim_output_dir(_cfg(out, "--overwrite", "true")):
        pass


def test_rl_command_refuses_a_previous_run_and_keeps_its_files(tmp_path, capsys):
    (tmp_path / "checkpoints" / "step_000004").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 3}\n')
    rc, err = _cli(capsys, "--output_dir", str(tmp_path))
    assert rc == 1 and "is not empty (checkpoints, metrics.jsonl)" in err, err
    assert (tmp_path / "checkpoints" / "step_000004").is_dir()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 3}\n'


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may be slow to collect it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc")
def test_child_started_with_die_with_parent_gets_sigterm_when_its_parent_is_killed():
    code = ("import subprocess, sys, os, time; from primerl.runtime.lifetime import die_with_parent; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
            "preexec_fn=die_with_parent(os.getpid())); print(c.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert _running(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(child)
    finally:
        if _running(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_watchdog_ends_a_child_whose_launcher_is_gone():
    fake_launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    code = ("import time; from primerl.runtime.lifetime import watch_launcher; "
            "watch_launcher(interval_s=0.1); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT,
                             env=dict(ENV, PRIMERL_LAUNCHER_PID=str(fake_launcher.pid)))
    fake_launcher.wait()
    assert child.wait(timeout=20) == -signal.SIGTERM


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc")
def test_killing_the_launcher_ends_trainer_and_orchestrator(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "primerl.runtime.cli", "rl", "--config", "examples/reverse_text.toml", "--output_dir",
         str(tmp_path), "--max_steps", "1000", "--orchestrator.batch_size", "2", "--orchestrator.group_size", "2",
         "--log.plot", "false"], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 60
        while not pids:
            assert launcher.poll() is None and time.monotonic() < deadline
            text = (tmp_path / "pids").read_text() if (tmp_path / "pids").exists() else ""
            if text.count("\n") == 2:  # both lines written
                pids = {k: int(v) for k, v in (line.split() for line in text.splitlines())}
            time.sleep(0.05)
        assert all(_running(p) for p in pids.values())
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 15
        while any(_running(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [name for name, p in pids.items() if _running(p)], "children outlived the launcher"
    finally:
        for p in pids.values():
            if _running(p):
                os.kill(p, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


class _Exited:
    def __init__(self, rc):
        self.returncode = rc

    def poll(self):
        return self.returncode


def test_launcher_reports_the_cause_not_the_peer_that_died_of_it(tmp_path):
    (tmp_path / "trainer.log").write_text("primerl.runtime.transport.ProducerDied: gave up waiting for batch 3\n")
    (tmp_path / "orchestrator.log").write_text("EnvError: environment 'x' failed: reward() did not return\n")
    procs = {"trainer": _Exited(1), "orchestrator": _Exited(1)}
    assert first_failure(procs, tmp_path).startswith("the orchestrator exited with code 1")
    assert first_failure({"trainer": _Exited(1), "orchestrator": _Exited(None)}, tmp_path).startswith("the trainer")
    assert first_failure({"trainer": _Exited(None), "orchestrator": _Exited(0)}, tmp_path) is None


def test_a_filesystem_without_flock_is_a_clear_error(tmp_path, monkeypatch):
    import errno
    import fcntl

    from primerl.runtime.output_dir import OutputDirError

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(OutputDirError, match=f"cannot lock output_dir {tmp_path} .*may not support flock"):
        claim_output_dir(_cfg(tmp_path))
