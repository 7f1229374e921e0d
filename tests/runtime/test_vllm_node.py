"""An inference node that runs vLLM itself (``inference.vllm.launch = true``): ``primerl node
--role inference`` starts vLLM's server on the node's address and ``inference.vllm.port``, serving
the seeded init it writes to its own ``output_dir``; weights come by gloo broadcast from trainer
rank 0 (``inference.vllm.weight_update = "broadcast"``).

- three nodes on one machine (trainer 127.0.0.1, vLLM 127.0.0.2, orchestrator 127.0.0.3, each in its
  own working directory, batches over ZeroMQ): the job reaches max_steps on policy with the versions
  vLLM reports, and SIGTERM to the inference node stops vLLM's whole process group (real vLLM:
  skipped without it, required in CI);
- a server that exits before /health, or after it while the job runs, fails the node naming it
  (a stand-in interpreter, no vLLM needed);
- ``--dry-run`` says which server an inference node runs: vLLM's command line, or primerl's server.
"""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest

from primerl.runtime.metrics import read_metrics
from primerl.runtime.validate import load_config

from vllm_testing import REPO, free_port, need_vllm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_orchestrator_node import _files, _start, _stop, _wait  # noqa: E402
from test_vllm_job import _processes_mentioning  # noqa: E402

STEPS = 3
HOSTS = "127.0.0.1,127.0.0.2,127.0.0.3"


def _cfg(py: str, vport: int, *over):
    return load_config(REPO / "examples" / "reverse_text_vllm.toml", [
        "--output_dir", "out", "--max_steps", str(STEPS), "--orchestrator.batch_size", "8",
        "--orchestrator.group_size", "4", "--log.plot", "false", "--orchestrator.weights_timeout_s", "300",
        "--trainer.batch_timeout_s", "400", "--deployment.kind", "nodes", "--deployment.trainer_nodes", "1",
        "--deployment.inference_nodes", "1", "--deployment.orchestrator", "own", "--deployment.hosts", HOSTS,
        "--deployment.rdzv_endpoint", f"127.0.0.1:{free_port()}", "--deployment.rdzv_timeout_s", "120",
        "--deployment.grace_s", "20", "--orchestrator.batch_transport", "zmq", "--orchestrator.zmq_port",
        str(free_port()), "--inference.vllm.python", py, "--inference.vllm.port", str(vport),
        "--inference.vllm.url", f"http://127.0.0.2:{vport}", "--inference.vllm.launch_timeout_s", "400",
        "--inference.vllm.weight_update", "broadcast", "--inference.vllm.broadcast_host", "127.0.0.1",
        "--inference.vllm.broadcast_port", str(free_port()), "--inference.vllm.broadcast_timeout_s", "400", *over])


@pytest.mark.vllm
@pytest.mark.dist
def test_inference_node_runs_vllm_takes_broadcast_weights_and_ends_with_the_job(tmp_path):
    """Three nodes started by hand. At the job's normal end trainer node 0 posts it in the rendezvous
    and the inference node's agent stops vLLM's process group and exits 0 by itself (issue 45: a
    hand-started agent supervises its role); SIGTERM to an agent is tests/runtime/test_node_sigterm.py."""
    py = need_vllm()
    vport = free_port()
    cfg = _cfg(py, vport)
    procs = _start(tmp_path, cfg, ((1, "inference"), (0, "trainer"), (2, "orchestrator")))
    t0 = time.monotonic()
    try:
        rcs = {role: _wait(procs, role, 420) for role in ("trainer", "orchestrator")}
        wall = time.monotonic() - t0
        t1 = time.monotonic()
        rc_inf = _wait(procs, "inference", max(cfg.deployment.grace_s, 30) + 60)
        took = time.monotonic() - t1
    finally:
        _stop(procs)
    logs = {i: (tmp_path / f"host{i}" / "node.log").read_text(errors="replace") for i in range(3)}
    assert rcs == {"trainer": 0, "orchestrator": 0}, {k: v[-3000:] for k, v in logs.items()}
    print(f"3 nodes with vLLM: {STEPS} steps in {wall:.0f} s; the inference node ended {took:.1f} s after them")
    rows = read_metrics(tmp_path / "host0" / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))
    # on policy (max_async_level 0): step s sampled by vLLM holding the broadcast version s, and the
    # trainer's log-probs of those tokens are vLLM's (float32 on both sides)
    assert [r["policy_version"] for r in rows] == list(range(STEPS)), rows
    assert max(r["mismatch_kl/mean"] for r in rows) < 1e-3, [r["mismatch_kl/mean"] for r in rows]
    assert f"weights version {STEPS} broadcast to 1 receiver(s)" in logs[0]
    vlog = (tmp_path / "host1" / "out" / "logs" / "vllm.log").read_text(errors="replace")
    assert "vllm.entrypoints.openai.api_server" in logs[1] and "--host 127.0.0.2" in logs[1]
    assert vlog.count("POST /collective_rpc") >= STEPS + 1  # init_broadcast + one update per version
    assert rc_inf == 0, logs[1][-3000:]
    assert _processes_mentioning(str(tmp_path / "host1" / "out" / "vllm_init")) == []
    for i in (1, 2):  # the servers' and the orchestrator's nodes hold no weights file or marker
        assert not [f for f in _files(tmp_path / f"host{i}" / "out") if "weights" in f or f.endswith("STABLE")], i
    assert not _files(tmp_path / "host0" / "out" / "transport" / "rollouts")


def _fake_vllm(tmp_path: Path, serve_s: float, code: int) -> str:
    """A stand-in for ``inference.vllm.python``: answers /health on --host/--port for ``serve_s``
    seconds (0: never listens), then exits with ``code``."""
    path = tmp_path / "fake_vllm"
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""\
        import http.server, sys, threading, time
        a = sys.argv
        host, port = a[a.index("--host") + 1], int(a[a.index("--port") + 1])
        if {serve_s}:
            class H(http.server.BaseHTTPRequestHandler):
                def do_GET(self):
                    self.send_response(200); self.end_headers(); self.wfile.write(b"{{}}")
            srv = http.server.HTTPServer((host, port), H)
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            time.sleep({serve_s})
        print("fake vLLM exits", flush=True)
        sys.exit({code})
        """))
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("serve_s,code,says", [(0, 7, "exited with code 7 before answering /health"),
                                               (3, 3, "exited with code 3 while the job ran")])
def test_a_vllm_that_exits_fails_the_inference_node_naming_it(tmp_path, monkeypatch, serve_s, code, says):
    from primerl.runtime.launch.deployment import node_plan
    from primerl.runtime.launch.node import NodeError, run_vllm_node

    monkeypatch.chdir(tmp_path)
    vport = free_port()
    cfg = _cfg(_fake_vllm(tmp_path, serve_s, code), vport, "--inference.vllm.launch_timeout_s", "60")
    node = node_plan(cfg).nodes[1]
    # the exit is named (not "did not answer /health within 60 s"): the node did not wait out the launch timeout
    with pytest.raises(NodeError, match=r"^node 1 \(127\.0\.0\.2\) inference: the vLLM server " + says) as e:
        run_vllm_node(cfg, node, poll_s=0.1)
    assert "fake vLLM exits" in str(e.value)  # the end of its log
    assert (tmp_path / "out" / "vllm_init" / "config.json").exists()  # the seeded init, in this node's output_dir


def _dry_run(capsys, *over) -> str:
    """``primerl rl --dry-run`` in this process (the test's working directory is its tmp_path)."""
    from primerl.runtime import cli

    rc = cli.main(["rl", "--dry-run", "--config", str(REPO / "examples" / "reverse_text_vllm.toml"),
                   "--deployment.kind", "nodes", "--deployment.trainer_nodes", "1", "--deployment.inference_nodes",
                   "1", "--deployment.orchestrator", "own", "--deployment.hosts", HOSTS,
                   "--deployment.rdzv_endpoint", f"127.0.0.1:{free_port()}", "--inference.vllm.port", "8123",
                   "--inference.vllm.url", "http://127.0.0.2:8123", "--inference.vllm.weight_update", "broadcast",
                   *over])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return next(line for line in out.splitlines() if line.startswith("# node 1 "))


def test_dry_run_plan_line_names_the_inference_nodes_server(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the output_dir (outputs/...) is relative to it
    line = _dry_run(capsys)
    assert line.startswith("# node 1 127.0.0.2: inference server (GPUs none): vLLM (inference.vllm.launch) on "
                           "127.0.0.2:8123: "), line
    init = str(tmp_path.resolve() / "outputs" / "reverse_text_vllm" / "vllm_init")
    for part in (".venv-vllm/bin/python -m vllm.entrypoints.openai.api_server", f"--model {init}",
                 "--host 127.0.0.2 --port 8123", "--worker-extension-cls", "--skip-tokenizer-init"):
        assert part in line, (part, line)
    line = _dry_run(capsys, "--inference.vllm.launch", "false")
    assert line == ("# node 1 127.0.0.2: inference server (GPUs none): primerl inference on 127.0.0.2:8123 (vLLM's "
                    "protocol; inference.vllm.launch = true runs vLLM itself)"), line


def test_sbatch_script_names_the_inference_nodes_server(tmp_path, monkeypatch):
    from primerl.runtime.launch.slurm import render_sbatch

    monkeypatch.chdir(tmp_path)
    over = ["--deployment.kind", "slurm", "--deployment.trainer_nodes", "1", "--deployment.inference_nodes", "1",
            "--inference.vllm.weight_update", "broadcast"]
    cfg = load_config(REPO / "examples" / "reverse_text_vllm.toml", over)
    script = render_sbatch(cfg, "/shared/config.toml")
    line = next(li for li in script.splitlines() if li.startswith("# node 1 (inference) runs: "))
    assert "vLLM (inference.vllm.launch) on ${NODES[1]}:8011: " in line and "--host '${NODES[1]}'" in line, line
    cfg = load_config(REPO / "examples" / "reverse_text_vllm.toml", [*over, "--inference.vllm.launch", "false"])
    assert "# node 1 (inference) runs: primerl inference on ${NODES[1]}:8011" in render_sbatch(cfg, "/c.toml")
