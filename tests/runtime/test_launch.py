"""``[deployment]``: the node plan, its config errors, the sbatch script, ``primerl node``'s
identity (argument or SLURM variables) and its rendezvous checks (unreachable address, configs
that differ). In-process and quick; the multi-process runs are in test_multinode.py."""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from primerl.runtime import cli
from primerl.runtime.config import ConfigError, to_toml
from primerl.runtime.validate import load_config
from primerl.runtime.launch import config_hash, describe_nodes, node_plan
from primerl.runtime.launch.node import NodeError, join_rendezvous, resolve_node, trainer_command
from primerl.runtime.launch.slurm import render_sbatch

STANDINS = Path(__file__).resolve().parent / "slurm_standins"
NODES2 = ["--deployment.kind", "nodes", "--deployment.trainer_nodes", "2",
          "--deployment.hosts", "127.0.0.1,127.0.0.2", "--num_trainer_ranks", "4", "--device", "cpu"]


def _free_port() -> int:
    """A free port, reserved until this process exits (no other process can take it first)."""
    from primerl.runtime.ports import held_port

    return held_port()


def test_plan_of_two_trainer_nodes_and_an_orchestrator_node():
    cfg = load_config(None, [*NODES2, "--deployment.orchestrator", "own",
                             "--deployment.hosts", "10.0.0.5,10.0.0.6,10.0.0.7"])
    plan = node_plan(cfg)
    assert [(n.host, n.roles, n.ranks) for n in plan.nodes] == [
        ("10.0.0.5", ("trainer",), (0, 1)), ("10.0.0.6", ("trainer",), (2, 3)), ("10.0.0.7", ("orchestrator",), ())]
    assert plan.rdzv_endpoint == "10.0.0.5:29400"
    text = describe_nodes(cfg)
    assert "# node 1 10.0.0.6: trainer ranks 2-3 (CPU)" in text
    assert "# node 2 10.0.0.7: orchestrator + embedded engine" in text


def test_gpu_plan_puts_the_engine_first_on_trainer_node_0():
    cfg = load_config(None, ["--deployment.kind", "slurm", "--deployment.trainer_nodes", "2",
                             "--deployment.gpus_per_node", "8", "--num_trainer_ranks", "14", "--device", "cuda"])
    plan = node_plan(cfg)
    assert [n.gpus for n in plan.nodes] == [tuple(range(1, 8))] * 2
    assert plan.nodes[0].host == "$node0" and plan.nodes[0].roles == ("trainer", "orchestrator")


@pytest.mark.parametrize("over, key", [
    (["--deployment.trainer_nodes", "3"], "deployment.trainer_nodes"),  # 4 ranks do not divide over 3 nodes
    (["--deployment.ranks_per_node", "3"], "deployment.ranks_per_node"),  # 2 x 3 != 4
    (["--deployment.hosts", "127.0.0.1"], "deployment.hosts"),  # 2 nodes, 1 host
    (["--deployment.hosts", "127.0.0.1,127.0.0.1"], "deployment.hosts"),
    (["--deployment.kind", "cluster"], "deployment.kind"),
    (["--deployment.rdzv_endpoint", "127.0.0.1"], "deployment.rdzv_endpoint"),
    (["--deployment.rdzv_endpoint", "127.0.0.1:70000"], "deployment.rdzv_endpoint"),
    (["--deployment.rdzv_timeout_s", "0"], "deployment.rdzv_timeout_s"),
    (["--deployment.gpus_per_node", "2"], "deployment.gpus_per_node"),  # device = cpu
    (["--deployment.inference_nodes", "-1"], "deployment.inference_nodes"),
    (["--deployment.orchestrator", "nowhere"], "deployment.orchestrator"),
])
def test_impossible_plans_name_the_key(over, key):
    with pytest.raises(ConfigError, match=rf"^{key}:"):
        load_config(None, [*NODES2, *over])


def test_more_trainer_ranks_than_gpus_names_the_key():
    with pytest.raises(ConfigError,
                       match=r"^deployment.ranks_per_node: 8 trainer ranks per node plus the engine need 9"):
        load_config(None, ["--deployment.kind", "slurm", "--deployment.trainer_nodes", "2",
                           "--deployment.gpus_per_node", "8", "--num_trainer_ranks", "16", "--device", "cuda"])
    with pytest.raises(ConfigError, match=r"^deployment.kind: 'local' runs every process on this machine"):
        load_config(None, ["--deployment.trainer_nodes", "2"])


def test_dry_run_refuses_a_rendezvous_port_in_use(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc = cli.main(["rl", *NODES2, "--output_dir", str(tmp_path), "--deployment.rdzv_endpoint",
                       f"127.0.0.1:{port}", "--dry-run"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"primerl: config error: deployment.rdzv_endpoint: port {port} on "
                                               "127.0.0.1 is in use"), err
    rc = cli.main(["rl", *NODES2, "--output_dir", str(tmp_path), "--deployment.rdzv_endpoint",
                   f"127.0.0.1:{_free_port()}", "--orchestrator.zmq_port", str(_free_port()), "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and "# node 1 127.0.0.2: trainer ranks 2-3 (CPU)" in out
    assert "node --config" in out and "--role trainer --node-rank 1" in out


def test_slurm_dry_run_prints_the_sbatch_script(tmp_path, capsys):
    rc = cli.main(["rl", "--deployment.kind", "slurm", "--deployment.trainer_nodes", "2", "--num_trainer_ranks", "2",
                   "--device", "cpu", "--deployment.grace_s", "7", "--deployment.sbatch_args", '["--partition=x"]',
                   "--output_dir", str(tmp_path), "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0
    script = out[out.index("#!/bin/bash"):]
    assert "#SBATCH --nodes=2" in script and "#SBATCH --partition=x" in script and "GRACE=7" in script
    assert "--nnodes=2" in script and "--rdzv-backend=c10d" in script and "--kill-on-bad-exit=1" in script
    assert "wait -n" in script and 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in script
    starts = [line.strip() for line in script.splitlines() if line.strip().startswith("start ")]
    assert starts == ["start trainer 0", "start trainer 1", "start orchestrator 0"]
    assert "MAX_RESTARTS=0 " in script  # deployment.max_restarts auto: 0 for this short job
    assert not (tmp_path / "primerl.sbatch").exists()  # a dry run writes nothing


def test_a_user_template_is_rendered_and_a_missing_one_named(tmp_path):
    cfg = load_config(None, ["--deployment.kind", "slurm", "--device", "cpu", "--output_dir", str(tmp_path)])
    tmpl = tmp_path / "mine.j2"
    tmpl.write_text("#!/bin/bash\n# {{ num_nodes }} nodes, trainers {{ trainer_nodes }}, config {{ config }}\n")
    cfg.deployment.sbatch_template = str(tmpl)
    assert render_sbatch(cfg, "/x/c.toml") == "#!/bin/bash\n# 1 nodes, trainers [0], config /x/c.toml\n"
    cfg.deployment.sbatch_template = str(tmp_path / "none.j2")
    with pytest.raises(ConfigError, match="^deployment.sbatch_template: no such file"):
        render_sbatch(cfg, "/x/c.toml")


def test_node_identity_from_slurm_variables(monkeypatch):
    cfg = load_config(None, ["--deployment.kind", "slurm", "--deployment.trainer_nodes", "2",
                             "--deployment.orchestrator", "own", "--num_trainer_ranks", "2", "--device", "cpu"])
    monkeypatch.setenv("PATH", f"{STANDINS}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "hostA,hostB,hostC")
    monkeypatch.setenv("SLURM_NODEID", "1")
    plan, node = resolve_node(cfg, "trainer")
    assert (node.index, node.host, node.ranks) == (1, "hostB", (1,)) and plan.rdzv_endpoint == "hostA:29400"
    cmd = trainer_command(plan, node, ["-m", "x"], python="py")
    assert cmd[:3] == ["py", "-m", "torch.distributed.run"] and cmd[-2:] == ["-m", "x"]
    assert {"--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", "--rdzv-endpoint=hostA:29400",
            "--local-addr=hostB"} <= set(cmd)
    assert "is_host=0" in next(c for c in cmd if c.startswith("--rdzv-conf"))
    with pytest.raises(NodeError, match=r"node 1 \(hostB\) has roles \['trainer'\] in the plan, not 'orchestrator'"):
        resolve_node(cfg, "orchestrator")
    monkeypatch.setenv("SLURM_NODEID", "2")
    assert resolve_node(cfg, "orchestrator", rdzv="hostA:1234")[0].rdzv_endpoint == "hostA:1234"
    monkeypatch.delenv("SLURM_NODEID")
    with pytest.raises(NodeError, match="no node rank: pass --node-rank"):
        resolve_node(cfg, "trainer")


def _two_node_cfg(port: int, **over):
    return load_config(None, [*NODES2, "--deployment.rdzv_endpoint", f"127.0.0.1:{port}",
                              "--deployment.rdzv_timeout_s", "3", *[x for kv in over.items() for x in kv]])


def test_nodes_with_different_configs_are_refused_at_the_rendezvous():
    from torch.distributed import TCPStore

    port = _free_port()
    master = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    a, b = _two_node_cfg(port), _two_node_cfg(port, **{"--trainer.lr": "1e-4"})
    assert config_hash(a) != config_hash(b)
    same_but_output = _two_node_cfg(port, **{"--output_dir": "elsewhere"})
    assert config_hash(a) == config_hash(same_but_output)  # a node may write to its own output_dir
    plan = node_plan(a)
    errors = {}

    def join(i, cfg, role):
        try:
            join_rendezvous(plan, plan.nodes[i], role, config_hash(cfg), deadline=time.monotonic() + 10)
        except NodeError as e:
            errors[(i, role)] = str(e)

    threads = [threading.Thread(target=join, args=args) for args in
               [(0, a, "trainer"), (0, a, "orchestrator"), (1, b, "trainer")]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    del master
    assert set(errors) == {(0, "trainer"), (0, "orchestrator"), (1, "trainer")}, errors
    assert f"node 1 trainer (127.0.0.2, config {config_hash(b)})" in errors[(1, "trainer")]
    assert "started with different configs" in errors[(0, "trainer")]
    assert "node 1 trainer (127.0.0.2" in errors[(0, "trainer")]


def test_an_unreachable_rendezvous_fails_within_its_timeout_naming_the_address():
    port = _free_port()  # nobody listens there
    cfg = _two_node_cfg(port)
    plan = node_plan(cfg)
    t0 = time.monotonic()
    with pytest.raises(NodeError, match=rf"node 1 \(127.0.0.2\): cannot reach the rendezvous at 127.0.0.1:{port} "
                                        r"within 3 s \(deployment.rdzv_endpoint / --rdzv"):
        join_rendezvous(plan, plan.nodes[1], "trainer", config_hash(cfg), deadline=time.monotonic() + 3)
    assert time.monotonic() - t0 < 3 + 6  # the timeout plus one connect attempt


def test_local_deployment_has_no_node_command():
    with pytest.raises(NodeError, match="deployment.kind is 'local'"):
        resolve_node(load_config(None, []), "trainer", 0)
    assert "[deployment]" in to_toml(load_config(None, []))


def test_the_sbatch_script_stops_every_step_when_one_fails(tmp_path):
    """The rendered script's teardown, with a stand-in interpreter for the steps (no torch): trainer
    node 1 fails after a moment; the script names it, sends SIGTERM to the other steps, which
    stop, and exits with the failed step's code. The grace period (600 s) is far beyond the run's
    timeout (120 s): a script that waited it out instead of stopping on SIGTERM fails the test."""
    import subprocess

    fake = tmp_path / "fake_python"
    fake.write_text("#!/bin/bash\n# argv: -m primerl.runtime.cli node --config C --role R --node-rank N --rdzv E\n"
                    "role=$7; node=$9\n"
                    "trap 'echo got TERM; exit 143' TERM\n"
                    "echo \"started $role $node on $SLURMD_NODENAME\"\n"
                    "if [ \"$role $node\" = 'trainer 1' ]; then sleep 1; exit 3; fi\n"
                    "for i in $(seq 600); do sleep 0.1; done\n")
    fake.chmod(0o755)
    cfg = load_config(None, ["--deployment.kind", "slurm", "--deployment.trainer_nodes", "2",
                             "--num_trainer_ranks", "2", "--device", "cpu", "--deployment.grace_s", "600",
                             "--output_dir", str(tmp_path / "out")])
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(cfg, "cfg.toml", python=str(fake)))
    env = dict(os.environ, PATH=f"{STANDINS}{os.pathsep}{os.environ['PATH']}", PRIMERL_TEST_NODELIST="h0,h1")
    res = subprocess.run(["sbatch", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert res.stdout.startswith("Submitted batch job")
    logs = tmp_path / "out" / "logs"
    slurm_out = next(logs.glob("slurm-*.out"))
    assert Path(f"{slurm_out}.rc").read_text().strip() == "3"
    assert ("primerl: node 1 (h1) trainer failed (exit 3); stopping the other steps (grace 600 s)"
            in slurm_out.read_text())
    assert (logs / "node1-trainer.log").read_text() == "started trainer 1 on h1\n"
    for name, host in (("node0-trainer", "h0"), ("node0-orchestrator", "h0")):
        role = name.split("-")[1]
        assert (logs / f"{name}.log").read_text() == f"started {role} 0 on {host}\ngot TERM\n"
