"""The launcher registry (``launch.launcher`` / ``launch.kinds``), the one preparation every kind
shares (``prepare_job``: the warm start included) and the one process-start helper
(``primerl.runtime.processes``)."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest

from primerl.runtime import cli
from primerl.runtime.config import ConfigError
from primerl.runtime.launch.common import JobFailed
from primerl.runtime.launch.launcher import (LAUNCHERS, LauncherCapabilities, check_launcher, get_launcher,
                                             register_launcher, run_job)
from primerl.runtime.metrics import read_metrics
from primerl.runtime.processes import ProcessTable, start_process
from primerl.runtime.validate import load_config
from primerl.runtime.zmq_transport import batch_transport

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "reverse_text.toml"
SMALL = ["--max_steps", "2", "--orchestrator.batch_size", "4", "--orchestrator.group_size", "4",
         "--orchestrator.max_async_level", "0", "--log.plot", "false", "--device", "cpu",
         "--orchestrator.weights_timeout_s", "120", "--trainer.batch_timeout_s", "120"]


def _cfg(out, *over):
    return load_config(EXAMPLE, ["--output_dir", str(out), *SMALL, *over])


# -- the registry

@pytest.fixture(autouse=True)
def _forget_test_launchers():
    """Kinds a test registers go at its end: a later test on this worker lists every registered kind."""
    yield
    for name in LAUNCHERS.names():
        if name.startswith("test-"):
            LAUNCHERS.unregister(name)



def test_an_unknown_kind_is_one_config_error_listing_the_registered_ones(capsys):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--deployment.kind", "cluster"])
    msg = str(e.value)
    assert msg.startswith("deployment.kind: unknown launcher 'cluster'; registered: "), msg
    assert {"local", "nodes", "slurm", "threads"} <= set(msg.split("registered: ")[1].split(", "))
    assert cli.main(["rl", "--deployment.kind", "cluster", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("primerl: config error: deployment.kind: unknown launcher 'cluster'")


def test_the_built_in_launchers_and_their_capabilities():
    caps = {name: get_launcher(name).capabilities for name in ("local", "nodes", "slurm", "threads")}
    assert caps == {"local": LauncherCapabilities(spans_nodes=False, server_pool=True, restarts=True),
                    "nodes": LauncherCapabilities(spans_nodes=True, server_pool=False, restarts=True),
                    "slurm": LauncherCapabilities(spans_nodes=True, server_pool=False, job_restarts=True),
                    "threads": LauncherCapabilities(spans_nodes=False, server_pool=False)}
    assert all(c.warm_start for c in caps.values())
    assert {"local", "nodes", "slurm", "threads"} <= set(LAUNCHERS.names())
    with pytest.raises(ValueError, match="registered already"):
        register_launcher("local", object())


class _Recorder:
    """A launcher registered by a test: only its capabilities and its checks matter here."""

    name = "test-spanning"
    capabilities = LauncherCapabilities(spans_nodes=True, server_pool=False)

    def __init__(self):
        self.checked = []

    def check(self, cfg):
        self.checked.append(cfg.deployment.kind)

    def describe(self, cfg):
        return "# test launcher\n"

    def start(self, job):
        raise AssertionError("not started in these tests")

    def wait(self, job):
        return []

    def stop(self, job):
        pass


def test_other_code_asks_the_capabilities_not_the_kind_name():
    rec = _Recorder()
    register_launcher("test-spanning", rec)
    cfg = load_config(None, ["--device", "cpu"], check=False)
    assert batch_transport(cfg) == "filesystem"  # local: one machine
    cfg.deployment.kind = "test-spanning"
    check_launcher(cfg)
    assert rec.checked == ["test-spanning"]
    assert batch_transport(cfg) == "zmq"  # spans nodes: no shared filesystem assumed
    cfg.inference.num_servers = 2
    with pytest.raises(ConfigError, match=r"^inference.num_servers: a server pool is started by a launcher that can "
                                          r"\(deployment.kind 'local'\) or on inference nodes "
                                          r"\(deployment.inference_nodes >= 1, inference.num_servers on each\), "
                                          r"not by deployment.kind = "
                                          r"'test-spanning'"):
        check_launcher(cfg)
    cfg.deployment.inference_nodes = 1  # a launcher spanning nodes: the pool's servers run on the inference nodes
    check_launcher(cfg)


def test_a_launcher_class_registered_by_decorator_is_served_as_an_instance():
    @register_launcher("test-class")
    class OneMachine(_Recorder):
        capabilities = LauncherCapabilities(spans_nodes=False, server_pool=False)

    launcher = get_launcher("test-class")
    assert isinstance(launcher, OneMachine) and not launcher.capabilities.spans_nodes
    register_launcher("test-not-a-launcher", object())
    with pytest.raises(ConfigError, match="^deployment.kind: 'test-not-a-launcher' is registered as .* not a launcher"):
        get_launcher("test-not-a-launcher")


@pytest.mark.parametrize("over, msg", [
    (["--deployment.kind", "threads", "--num_trainer_ranks", "2"], "num_trainer_ranks: deployment.kind = 'threads' "
                                                                   "runs one trainer rank"),
    (["--deployment.kind", "threads", "--deployment.trainer_nodes", "2"], "deployment.kind: 'threads' runs every "
                                                                         "process on this machine"),
    (["--deployment.kind", "threads", "--deployment.hosts", "127.0.0.1"], "deployment.hosts: is for kind = 'nodes'"),
    (["--deployment.kind", "slurm", "--deployment.hosts", "a"], "deployment.hosts: comes from SLURM_JOB_NODELIST"),
    (["--deployment.kind", "nodes", "--deployment.hosts", "127.0.0.1,127.0.0.1", "--deployment.trainer_nodes", "2",
      "--num_trainer_ranks", "2"], "deployment.hosts: must be distinct"),
    (["--deployment.kind", "nodes", "--deployment.trainer_nodes", "0"], "deployment.trainer_nodes: must be >= 1"),
])
def test_each_kind_checks_its_deployment_keys(over, msg):
    with pytest.raises(ConfigError, match="^" + re.escape(msg)):
        load_config(None, ["--device", "cpu", *over])


def test_threads_dry_run_describes_one_process(capsys):
    assert cli.main(["rl", "--config", str(EXAMPLE), "--deployment.kind", "threads", "--dry-run"]) == 0
    assert "# deployment: threads, the whole job in this process" in capsys.readouterr().out


# -- one preparation for every kind: the warm start


@pytest.fixture
def warm_start_calls(monkeypatch):
    """A stand-in for ``job_warm_start`` (the main task has no demonstrations to warm-start on): it
    records the call and returns a resolved copy, as the real one does (here only the seed differs),
    so the written config.toml shows the launcher used the warm start's config."""
    import primerl.runtime.trainer.vf_warmstart as vf_warmstart

    calls = []

    def job_warm_start(cfg, *, quiet=True):
        calls.append(cfg.deployment.kind)
        resolved = copy.deepcopy(cfg)
        resolved.seed = 4321
        return resolved

    monkeypatch.setattr(vf_warmstart, "job_warm_start", job_warm_start)
    return calls


def _written_seed(out: Path) -> int:
    return tomllib.loads((out / "config.toml").read_text())["seed"]


def test_primerl_rl_with_kind_threads_runs_the_main_task(tmp_path, warm_start_calls):
    out = tmp_path / "run"
    rc = cli.main(["rl", "--config", str(EXAMPLE), "--output_dir", str(out), *SMALL, "--max_steps", "3",
                   "--deployment.kind", "threads"])
    assert rc == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    assert warm_start_calls == ["threads"] and _written_seed(out) == 4321


def test_the_local_launcher_runs_the_warm_start_and_its_processes_read_the_result(tmp_path, warm_start_calls):
    out = tmp_path / "run"
    rows = run_job(_cfg(out), quiet=True)
    assert [r["step"] for r in rows] == [0, 1]
    assert warm_start_calls == ["local"] and _written_seed(out) == 4321
    table = json.loads((out / "processes.json").read_text())
    assert [(r["role"], r["restarts"]) for r in table] == [("orchestrator", 0), ("trainer", 0)]


def test_the_nodes_launcher_runs_the_warm_start_before_naming_the_per_host_commands(tmp_path, warm_start_calls):
    out = tmp_path / "run"
    cfg = _cfg(out, "--deployment.kind", "nodes", "--deployment.trainer_nodes", "2", "--num_trainer_ranks", "2",
               "--deployment.hosts", "10.0.0.1,10.0.0.2")
    with pytest.raises(JobFailed, match="not all 127.x addresses") as e:
        run_job(cfg, quiet=True)
    assert f"--config {out.resolve() / 'config.toml'} --role trainer --node-rank 1" in str(e.value)
    assert warm_start_calls == ["nodes"] and _written_seed(out) == 4321


@pytest.mark.dist
def test_the_slurm_launcher_runs_the_warm_start_before_sbatch_under_the_standins(tmp_path, warm_start_calls,
                                                                                  monkeypatch):
    """kind = "slurm": prepare_job (warm start included) runs on the submitting machine, the nodes
    (tests/runtime/slurm_standins: every srun step a local process) read its config.toml."""

    from primerl.runtime.ports import held_port

    port = held_port()
    out = tmp_path / "run"
    cfg = _cfg(out, "--deployment.kind", "slurm", "--deployment.rdzv_endpoint", f"127.0.0.1:{port}")
    standins = Path(__file__).resolve().parent / "slurm_standins"
    monkeypatch.setenv("PATH", f"{standins}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PRIMERL_TEST_NODELIST", "127.0.0.1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert run_job(cfg, quiet=True) == []  # the job runs under SLURM; the stand-in runs it to its end
    slurm_out = next((out / "logs").glob("slurm-*.out"))
    assert Path(f"{slurm_out}.rc").read_text().strip() == "0", slurm_out.read_text()[-3000:]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1]
    assert warm_start_calls == ["slurm"] and _written_seed(out) == 4321


# -- the process-start helper


def test_start_process_logs_writes_its_row_and_stops_its_whole_group(tmp_path):
    table = ProcessTable(tmp_path / "processes.json")
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
             "print('up', flush=True); time.sleep(60)"
    p = start_process([sys.executable, "-c", script], name="worker-0", role="worker", log_path=tmp_path / "w.log",
                      table=table, url="http://x:1")
    for _ in range(100):
        if "up" in (tmp_path / "w.log").read_text():
            break
        time.sleep(0.1)
    assert json.loads((tmp_path / "processes.json").read_text()) == [
        {"role": "worker", "pid": p.pid, "url": "http://x:1", "restarts": 0}]
    group = p.pid
    p.stop(2.0)
    assert p.returncode is not None and p.poll() is not None
    # the grandchild got the group's SIGTERM; on loaded cores it may take a moment to run its exit (seen
    # once in ten runs), but not its 60 s sleep: a stop that signalled the leader alone fails here
    for _ in range(100):
        alive = [d.name for d in Path("/proc").iterdir() if d.name.isdigit() and _pgid(d) == group]
        if not alive:
            break
        time.sleep(0.1)
    assert not alive, alive
    p.start()  # the same command line again
    assert json.loads((tmp_path / "processes.json").read_text())[0]["restarts"] == 1
    p.kill()


def _pgid(d: Path) -> int | None:
    try:
        stat = (d / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[2]) if fields[0] != "Z" else None


def test_stop_in_a_signal_handler_does_not_wait_on_the_interrupted_wait(tmp_path):
    """A SIGTERM handler that stops the child while the main thread sits in ``proc.wait()`` (a
    trainer node's agent): ``Popen.wait`` there would block on the lock the interrupted wait holds."""
    code = textwrap.dedent("""
        import signal, sys
        from primerl.runtime.processes import start_process
        p = start_process(["sleep", "60"], name="t", role="trainer", log_path=None, die_with_parent=False)
        def handler(*_):
            p.stop_in_signal_handler(0.5)
            sys.exit(143)
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        p.wait()
    """)
    res = subprocess.run([sys.executable, "-c", code], timeout=30, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 143, res.stderr


def test_every_job_process_starts_through_the_helper():
    """No ``subprocess.Popen`` in the runtime outside ``processes.py``."""
    found = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / "primerl" / "runtime").rglob("*.py")
             if p.name != "processes.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if "subprocess.Popen(" in line]
    assert not found, found
