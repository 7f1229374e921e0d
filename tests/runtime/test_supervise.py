"""``supervise.Supervisor`` (issue 45), as the P/D deployment uses it: a process that dies or hangs
is named (role, pid, URL, exit code or signal), its stacks logged when hung, restarted on the same
port; past ``max_restarts`` the failure names it. ``ProcessTable(merge=True)`` keeps another
process's rows of ``processes.json``."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from primerl.runtime.ports import reserve_port
from primerl.runtime.processes import ManagedProcess, ProcessTable
from primerl.runtime.supervise import Supervisor, describe_exit, healthy

SERVER = ("import sys, http.server\n"
          "class H(http.server.BaseHTTPRequestHandler):\n"
          "    def do_GET(self):\n"
          "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
          "    def log_message(self, *a): pass\n"
          "def serve_forever_here():\n"
          "    http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
          "serve_forever_here()\n")


def _wait(cond, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _procs(tmp_path, n, table):
    ports = [reserve_port() for _ in range(n)]
    procs = [ManagedProcess(f"prefill-{i}", "prefill", [sys.executable, "-c", SERVER, str(r.port)],
                            tmp_path / f"prefill-{i}.log", url=f"http://127.0.0.1:{r.port}", table=table).start()
             for i, r in enumerate(ports)]
    for p in procs:
        _wait(lambda: healthy(p.url, 1.0), f"{p.name} up")
    return procs, ports


def test_a_killed_and_a_hung_server_are_named_and_restarted_on_their_port(tmp_path):
    table = ProcessTable(tmp_path / "processes.json", merge=True)
    (tmp_path / "processes.json").write_text(json.dumps([{"role": "trainer", "pid": 1, "url": None, "restarts": 0}]))
    procs, ports = _procs(tmp_path, 2, table)
    ups = []
    sup = Supervisor(procs, max_restarts=1, health_timeout_s=1.0, interval_s=0.2, on_up=ups.append,
                     python_roles=("prefill",)).start()
    try:
        killed = procs[0].pid
        os.kill(killed, signal.SIGKILL)
        _wait(lambda: procs[0].restarts == 1 and healthy(procs[0].url, 1.0) and ups, "the killed server back")
        assert ups == [procs[0]] and procs[0].pid != killed
        hung = procs[1].pid
        os.kill(hung, signal.SIGSTOP)
        _wait(lambda: procs[1].restarts == 1 and healthy(procs[1].url, 1.0), "the hung server back")
        log = (tmp_path / "prefill-1.log").read_text()
        assert f"the prefill process prefill-1 (pid {hung}, {procs[1].url}) did not answer /health within 1 s twice" \
            in log and "serve_forever_here" in log  # its stack, read by py-spy from the stopped process
        rows = json.loads((tmp_path / "processes.json").read_text())
        assert [(r["role"], r["restarts"]) for r in rows] == [("trainer", 0), ("prefill", 1), ("prefill", 1)]
        os.kill(procs[0].pid, signal.SIGKILL)  # past max_restarts: the failure names it
        _wait(lambda: sup.failure is not None, "the failure")
        assert sup.failure.startswith(f"the prefill process prefill-0 (pid {procs[0].pid}, {procs[0].url}) was killed "
                                      "by signal 9 (SIGKILL) after 1 restart(s) (inference.max_restarts = 1)"), \
            sup.failure
    finally:
        _stop_all(sup, procs, ports)


def test_a_server_killed_while_its_health_is_asked_is_named_by_its_signal_not_as_hung(tmp_path, monkeypatch, caplog):
    """One slow /health (a busy server on a loaded machine: a miss), then the process is killed while the
    next /health is asked: that second miss must not make it "hung" (a P/D job's kill -9 was reported as
    "did not answer /health within 2 s twice" in a run on the loaded 2-core machine)."""
    from primerl.runtime import supervise

    procs, ports = _procs(tmp_path, 1, None)
    p, killed = procs[0], procs[0].pid
    sup = Supervisor(procs, max_restarts=1, health_timeout_s=1.0, python_roles=("prefill",))  # passes by hand

    def killed_meanwhile(url, timeout):
        os.kill(killed, signal.SIGKILL)
        _wait(lambda: _state(killed) in ("Z", "gone"), "the killed server gone")
        return None

    try:
        with caplog.at_level("ERROR", logger="primerl"):
            sup.check_once()  # up
            monkeypatch.setattr(supervise, "health_state", lambda url, timeout: None)  # alive, too slow: a miss
            sup.check_once()
            assert p.restarts == 0 and p.pid == killed
            monkeypatch.setattr(supervise, "health_state", killed_meanwhile)
            sup.check_once()
        assert p.restarts == 1 and p.pid != killed
        said = f"the prefill process prefill-0 (pid {killed}, {p.url}) was killed by signal 9 (SIGKILL): restarting it"
        assert said in caplog.text and "did not answer /health" not in caplog.text, caplog.text
    finally:
        _stop_all(sup, procs, ports)


def _stop_all(sup, procs, ports) -> None:
    """The supervisor, its processes and their held ports, whatever the test left running."""
    sup.stop()
    for p in procs:
        p.kill()
    for r in ports:
        r.close()


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_describe_exit():
    assert describe_exit(-9) == "was killed by signal 9 (SIGKILL)" and describe_exit(3) == "exited with code 3"


def test_a_killed_prefill_server_is_named_and_restarted_and_the_job_finishes(tmp_path):
    """``primerl rl`` with ``examples/reverse_text_pd.toml``: kill -9 of the prefill server mid-run;
    the orchestrator's log names it (role, pid, URL, signal), it is restarted on its port and takes
    the current weights, the job ends rc 0 with every step once and ``inference/restarts`` 1.
    Also (the job of test_pd_launch.py's former ``test_job_runs_through_pd_and_lists_processes``): the job
    runs through 1 prefill + 1 decode embedded server behind vllm-router, processes.json lists them with
    their URLs, and every one of them is stopped with the job."""
    import subprocess
    from pathlib import Path

    from primerl.runtime.metrics import read_metrics
    from primerl.runtime.ports import reserve_block

    root = Path(__file__).resolve().parents[2]
    held = reserve_block(4)
    base, out, steps = held[0].port, tmp_path / "run", 12
    proc = subprocess.Popen(
        [sys.executable, "-m", "primerl.runtime.cli", "rl", "--config", str(root / "examples/reverse_text_pd.toml"),
         "--output_dir", str(out), "--max_steps", str(steps), "--orchestrator.batch_size", "4",
         "--orchestrator.group_size", "2", "--checkpoint.interval", "0", "--log.plot", "false",
         "--inference.pd.base_port", str(base), "--inference.pd.router_port", str(base + 2),
         "--inference.pd.router_metrics_port", str(base + 3),
         # the default 10 s (was 2): a busy server missed 2 s /health checks on the loaded 2-core machine
         "--inference.health_timeout_s", "10"],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: len(read_metrics(out / "metrics.jsonl")) >= 2 or proc.poll() is not None, "2 steps", 400)
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        rows = {r["role"]: r for r in json.loads((out / "processes.json").read_text())}
        victim = rows["prefill"]
        os.kill(victim["pid"], signal.SIGKILL)
        text, _ = proc.communicate(timeout=500)
    finally:
        if proc.poll() is None:
            proc.kill()
        for r in held:
            r.close()
    log = (out / "logs" / "orchestrator.log").read_text(errors="replace")
    assert proc.returncode == 0, text[-2000:] + log[-3000:]
    said = f"the prefill process prefill-0 (pid {victim['pid']}, {victim['url']}) was killed by signal 9 (SIGKILL)"
    assert said in log, log[-3000:]
    first = next(ln for ln in log.splitlines() if " ERROR " in ln or " WARNING " in ln)
    assert said in first, first  # the first failure line names the process that died, not its victims
    metrics = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(steps))
    assert metrics[-1]["inference/restarts"] == 1
    listed = json.loads((out / "processes.json").read_text())
    after = {r["role"]: r for r in listed}
    assert after["prefill"]["restarts"] == 1 and after["prefill"]["url"] == victim["url"]
    pd = [r for r in listed if r["role"] in ("prefill", "decode", "router")]  # the launcher lists trainer and
    assert [r["role"] for r in pd] == ["prefill", "decode", "router"]       # orchestrator too
    assert pd[0]["url"] == f"http://127.0.0.1:{base}" and pd[2]["url"] == f"http://127.0.0.1:{base + 2}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len([m for m in rows if "reward/mean" in m]) >= 2
    for r in pd:  # all stopped with the job
        status = Path(f"/proc/{r['pid']}/status")
        assert not Path(f"/proc/{r['pid']}").exists() or "zombie" in status.read_text().lower(), r
    assert sorted(p.name for p in (out / "logs").glob("*.log")) == ["decode-0.log", "orchestrator.log", "prefill-0.log",
                                                                      "router.log", "trainer.log"]
