"""Several "nodes" on one machine (hosts 127.0.0.1, 127.0.0.2: every 127.x address reaches it):
torchrun agents joined by c10d rendezvous, each node in its own working directory.

- gold: the trainer's losses, gradient norms, token counts and weights for the first steps of 2 nodes
  x 2 ranks equal those of one process (test_trainer_parallel's layout, reference and tolerance, 1e-5:
  the same layout on 1 node x 4 ranks is compared with that reference there).
- ``primerl node`` with a wrong rendezvous address fails within its timeout, naming it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from primerl.runtime.validate import load_config
from primerl.runtime.launch import node_plan, trainer_command

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_trainer_parallel import CASES, RTOL, STEPS, _compare, _reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GOLD = Path(__file__).resolve().parent / "_node_gold.py"
LAYOUT = "hsdp2_shard2_ep2"  # replicas across the nodes, FSDP and experts within: a real multi-node layout


def _free_port() -> int:
    """A free port, reserved until this process exits (no other process can take it first)."""
    from primerl.runtime.ports import held_port

    return held_port()


def _env(**extra):
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)


def _nodes_cfg(port: int, *over: str):
    return load_config(None, ["--deployment.kind", "nodes", "--deployment.trainer_nodes", "2", "--deployment.hosts",
                              "127.0.0.1,127.0.0.2", "--num_trainer_ranks", "4", "--device", "cpu",
                              "--deployment.rdzv_endpoint", f"127.0.0.1:{port}", "--deployment.rdzv_timeout_s", "120",
                              *over])


@pytest.mark.dist
def test_two_nodes_of_two_ranks_match_one_node_of_four(tmp_path):
    # the reference: test_trainer_parallel's single-process run, against which that file checks this layout on
    # 1 node x 4 ranks (test_layout_matches_single_process[hsdp2_shard2_ep2-fp32]) with the same _compare and
    # tolerance; computed here in this process (a 4-rank torchrun of its own cost 5 more processes)
    assert f"{LAYOUT}-fp32" in CASES  # the 1-node x 4-rank run of this layout is checked against this reference
    want = _reference("fp32")
    plan = node_plan(_nodes_cfg(_free_port()))
    procs = []
    for node in plan.trainer_nodes:  # each node: its own working directory, output file and torchrun agent
        wd = tmp_path / f"node{node.index}"
        wd.mkdir()
        cmd = trainer_command(plan, node, [str(GOLD), LAYOUT, str(wd / "rows.pt")], run_id="gold")
        procs.append(subprocess.Popen(cmd, cwd=wd, env=_env(PRIMERL_TEST_NODE=node.host), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert not (tmp_path / "node1" / "rows.pt").exists()  # rank 0 is on node 0 (c10d orders nodes by address)
    got = torch.load(tmp_path / "node0" / "rows.pt")
    assert got["hosts"] == ["127.0.0.1"] * 2 + ["127.0.0.2"] * 2
    assert len(got["rows"]) == STEPS
    errors = _compare(got["rows"], got["weights"], want, check_weights=True)
    assert errors == [], "\n".join(errors)
    assert RTOL == 1e-5


@pytest.mark.dist
def test_a_trainer_node_with_a_wrong_rendezvous_address_fails_in_time(tmp_path):
    port = _free_port()  # nobody listens: trainer node 0 was never started
    cfg_path = tmp_path / "cfg.toml"
    from primerl.runtime.config import to_toml

    cfg_path.write_text(to_toml(_nodes_cfg(port, "--deployment.rdzv_timeout_s", "4")))
    # the rendezvous timeout (4 s) ends it, naming the address; a node that hung would hit this run's timeout
    res = subprocess.run([sys.executable, "-m", "primerl.runtime.cli", "node", "--config", str(cfg_path), "--role",
                          "trainer", "--node-rank", "1"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 1, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"primerl node: FAILED: node 1 (127.0.0.2): cannot reach the rendezvous at 127.0.0.1:{port} "
                           "within 4 s"), res.stderr[-2000:]


SMALL = ["--max_steps", "3", "--orchestrator.batch_size", "4", "--orchestrator.group_size", "4",
         "--orchestrator.max_async_level", "0", "--log.plot", "false", "--orchestrator.weights_timeout_s", "120",
         "--trainer.batch_timeout_s", "120", "--num_trainer_ranks", "2", "--device", "cpu",
         "--deployment.trainer_nodes", "2", "--deployment.rdzv_timeout_s", "120", "--deployment.grace_s", "5"]


# the sbatch script end to end under the SLURM stand-ins: tests/runtime/test_slurm_restarts.py (its one job)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_a_killed_trainer_node_stops_the_job_naming_it_and_resume_continues(tmp_path):
    """Node 1's processes (its `primerl node`, torchrun agent and trainer rank) are killed after
    the step-2 checkpoint: ``primerl rl`` fails naming node 1 and its role, the metrics already
    written stay, and ``--checkpoint.resume true`` finishes the job, on 2 nodes, then on 1."""
    from primerl.runtime.config import to_toml
    from primerl.runtime.metrics import read_metrics

    out = tmp_path / "out"
    over = ["--output_dir", str(out), *SMALL, "--max_steps", "6", "--checkpoint.interval", "2",
            "--deployment.kind", "nodes", "--deployment.hosts", "127.0.0.1,127.0.0.2",
            "--orchestrator.zmq_port", str(_free_port())]  # not the default: a previous test's job may linger
    cfg_path = tmp_path / "cfg.toml"
    cfg_path.write_text(to_toml(load_config(ROOT / "examples" / "reverse_text.toml",
                                            [*over, "--deployment.rdzv_endpoint", f"127.0.0.1:{_free_port()}"])))

    def rl(*args):
        return subprocess.Popen([sys.executable, "-m", "primerl.runtime.cli", "rl", "--config", str(cfg_path), *args],
                                cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    proc = rl()
    deadline = time.monotonic() + 300
    # the step-2 checkpoint is written before step 1's metrics row: wait for both
    while not ((out / "checkpoints" / "step_000002").exists() and (out / "metrics.jsonl").exists()
               and len(read_metrics(out / "metrics.jsonl")) >= 2):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no step-2 checkpoint and 2 metrics rows in 300 s"
        time.sleep(0.05)
    # processes.json lists every process the launcher started: one per (node, role)
    import json

    rows = json.loads((out / "processes.json").read_text())
    assert sorted(r["role"] for r in rows) == ["orchestrator", "trainer", "trainer"], rows
    pids = dict(line.split() for line in (out / "pids").read_text().splitlines())
    assert {r["pid"] for r in rows} == {int(p) for p in pids.values()}
    for pid in _descendants(int(pids["node1-trainer"])):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    before = read_metrics(out / "metrics.jsonl")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-3000:]
    assert "primerl rl: FAILED: node 1 (127.0.0.2) trainer exited with code -9" in stderr, stderr[-3000:]
    after = read_metrics(out / "metrics.jsonl")
    assert len(before) >= 2 and after[:len(before)] == before
    assert (out / "checkpoints" / "step_000002").is_dir()

    res = rl("--checkpoint.resume", "true")
    stdout, stderr = res.communicate(timeout=400)
    assert res.returncode == 0, stderr[-3000:]
    resumed = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(6))
    # resumed, not restarted: the rows before the checkpoint are the first run's (a rerun from step 0
    # writes them again, with other timings), and the trainer says where it resumed
    assert resumed[:2] == before[:2]
    assert "step_000002 (step 2)" in (out / "logs" / "node0-trainer.log").read_text()
    # and once more on one node (the local default), 2 more steps from the step-6 checkpoint
    one = subprocess.run([sys.executable, "-m", "primerl.runtime.cli", "rl", "--config", str(cfg_path),
                          "--checkpoint.resume", "true", "--deployment.kind", "local",
                          "--deployment.trainer_nodes", "1", "--deployment.hosts", "[]", "--max_steps", "8"],
                         cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=400)
    assert one.returncode == 0, one.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(8))


@pytest.mark.dist
def test_by_hand_on_two_nodes_without_a_shared_filesystem(tmp_path):
    """The commands a user runs on two hosts, each node in its own directory with its own
    output_dir: rollout batches reach trainer node 1 over ZeroMQ (no rollout file anywhere), node
    1 writes only its checkpoint shard, and the job reaches max_steps."""
    from primerl.runtime.config import to_toml
    from primerl.runtime.metrics import read_metrics

    cfg = load_config(ROOT / "examples" / "reverse_text.toml",
                      ["--output_dir", "out", *SMALL, "--deployment.kind", "nodes",
                       "--deployment.hosts", "127.0.0.1,127.0.0.2", "--deployment.rdzv_endpoint",
                       f"127.0.0.1:{_free_port()}", "--orchestrator.batch_transport", "zmq",
                       "--orchestrator.zmq_port", str(_free_port())])
    procs = {}
    for i, role in ((0, "trainer"), (1, "trainer"), (0, "orchestrator")):
        wd = tmp_path / f"host{i}"
        wd.mkdir(exist_ok=True)
        (wd / "cfg.toml").write_text(to_toml(cfg))  # each host its own copy of the config
        procs[(i, role)] = subprocess.Popen(
            [sys.executable, "-m", "primerl.runtime.cli", "node", "--config", "cfg.toml", "--role", role,
             "--node-rank", str(i)], cwd=wd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outs = {k: p.communicate(timeout=400)[0] for k, p in procs.items() if k[1] == "trainer"}
    assert [procs[k].returncode for k in outs] == [0, 0], {k: v[-2000:] for k, v in outs.items()}
    procs[(0, "orchestrator")].wait(60)  # it leaves once its last batch is taken
    assert [r["step"] for r in read_metrics(tmp_path / "host0" / "out" / "metrics.jsonl")] == [0, 1, 2]
    assert not (tmp_path / "host1" / "out" / "metrics.jsonl").exists()
    for host in ("host0", "host1"):
        rollouts = tmp_path / host / "out" / "transport" / "rollouts"
        assert not rollouts.exists() or not any(rollouts.iterdir()), host
    assert "trainer rank 1/2 started" in outs[(1, "trainer")]
