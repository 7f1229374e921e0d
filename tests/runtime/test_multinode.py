"""Several "nodes" on one machine (hosts 127.0.0.1, 127.0.0.2: every 127.x address reaches it):
torchrun agents joined by c10d rendezvous, each node in its own working directory.

- gold: the trainer's losses, gradient norms and token counts for the first steps of 2 nodes x
  2 ranks equal those of 1 node x 4 ranks (test_trainer_parallel's layout and tolerance, 1e-5).
- ``primerl node`` with a wrong rendezvous address fails within its timeout, naming it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from primerl.runtime.config import load_config
from primerl.runtime.launch import node_plan, trainer_command

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_trainer_parallel import RTOL, STEPS, _compare  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GOLD = Path(__file__).resolve().parent / "_node_gold.py"
LAYOUT = "hsdp2_shard2_ep2"  # replicas across the nodes, FSDP and experts within: a real multi-node layout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra):
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)


def _nodes_cfg(port: int, *over: str):
    return load_config(None, ["--deployment.kind", "nodes", "--deployment.trainer_nodes", "2", "--deployment.hosts",
                              "127.0.0.1,127.0.0.2", "--num_trainer_ranks", "4", "--device", "cpu",
                              "--deployment.rdzv_endpoint", f"127.0.0.1:{port}", "--deployment.rdzv_timeout_s", "120",
                              *over])


@pytest.mark.dist
def test_two_nodes_of_two_ranks_match_one_node_of_four(tmp_path):
    one = tmp_path / "one_node"
    one.mkdir()
    ref = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                          str(GOLD), LAYOUT, str(one / "rows.pt")], cwd=one, env=_env(PRIMERL_TEST_NODE="local"),
                         capture_output=True, text=True, timeout=400)
    assert ref.returncode == 0, ref.stderr[-3000:]
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
    got, want = torch.load(tmp_path / "node0" / "rows.pt"), torch.load(one / "rows.pt")
    assert got["hosts"] == ["127.0.0.1"] * 2 + ["127.0.0.2"] * 2 and want["hosts"] == ["local"] * 4
    assert len(got["rows"]) == STEPS
    errors = _compare(got["rows"], got["weights"], (want["rows"], want["weights"]), check_weights=True)
    assert errors == [], "\n".join(errors)
    assert RTOL == 1e-5


@pytest.mark.dist
def test_a_trainer_node_with_a_wrong_rendezvous_address_fails_in_time(tmp_path):
    port = _free_port()  # nobody listens: trainer node 0 was never started
    cfg_path = tmp_path / "cfg.toml"
    from primerl.runtime.config import to_toml

    cfg_path.write_text(to_toml(_nodes_cfg(port, "--deployment.rdzv_timeout_s", "4")))
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "primerl.runtime.cli", "node", "--config", str(cfg_path), "--role",
                          "trainer", "--node-rank", "1"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=120)
    elapsed = time.monotonic() - t0
    assert res.returncode == 1, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"primerl node: FAILED: node 1 (127.0.0.2): cannot reach the rendezvous at 127.0.0.1:{port} "
                           "within 4 s"), res.stderr[-2000:]
    assert elapsed < 4 + 30, elapsed  # the timeout plus interpreter start-up on a loaded machine
