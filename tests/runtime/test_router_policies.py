"""Every router policy the README lists starts: vllm-router 0.1.17 refuses ``power_of_two`` with fewer
than 2 workers, so the pool's router starts with its initial servers under that policy, and a
deployment that cannot give it 2 is refused at ``--dry-run`` naming the key."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from primerl.runtime.launch.servers import router_executable, router_process
from primerl.runtime.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "reverse_text.toml")


def _rl(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "primerl.runtime.cli", "rl", "--config", EXAMPLE, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def _router_or_skip():
    if not router_executable().exists():
        if os.environ.get("PRIMERL_REQUIRE_ROUTER") == "1":
            pytest.fail(f"PRIMERL_REQUIRE_ROUTER=1 but no vllm-router next to {sys.executable}")
        pytest.skip("vllm-router is not installed (requirements-ci.txt)")


@pytest.mark.parametrize("over, key", [
    (["--inference.vllm.urls", '["http://127.0.0.1:1"]', "--inference.backend", "vllm",
      "--inference.router_policy", "power_of_two"], "inference.router_policy"),
    (["--inference.pd.prefill", "1", "--inference.pd.decode", "2", "--inference.pd.policy", "power_of_two"],
     "inference.pd.policy"),
])
def test_power_of_two_with_one_worker_is_refused_at_dry_run(tmp_path, capsys, over, key):
    from primerl.runtime.cli import main  # the command's own entry point, in this process (no torch import)

    capsys.readouterr()
    rc = main(["rl", "--config", EXAMPLE, "--output_dir", str(tmp_path / "job"), *over, "--dry-run"])
    r = capsys.readouterr()
    assert rc == 2, r.out[-2000:] + r.err[-2000:]
    err = r.err.strip().splitlines()
    assert len(err) == 1 and key in err[0] and "power_of_two" in err[0] and "at least 2" in err[0], r.err
    assert not (tmp_path / "job").exists()  # nothing written


def test_the_power_of_two_router_gets_the_initial_workers_on_its_command_line(tmp_path):
    _router_or_skip()
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    args = router_process(9, tmp_path, policy="power_of_two", workers=urls, startup_timeout_s=30).args
    i = args.index("--worker-urls")
    assert args[i + 1:i + 3] == urls and args[args.index("--policy") + 1] == "power_of_two"
    with pytest.raises(ValueError, match="at least 2 workers"):
        router_process(9, tmp_path, policy="power_of_two", workers=urls[:1])


def test_a_power_of_two_pool_runs_to_the_end_and_samples_name_their_server(tmp_path):
    """Also: with ``orchestrator.save_samples``, each sample names the server that sampled it, not
    the router every request went through."""
    _router_or_skip()
    out = tmp_path / "job"
    r = _rl("--output_dir", str(out), "--max_steps", "2", "--orchestrator.batch_size", "8",
            "--orchestrator.group_size", "4", "--log.plot", "false", "--inference.num_servers", "2",
            "--inference.router_policy", "power_of_two", "--orchestrator.save_samples", "true")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [row["step"] for row in read_metrics(out / "metrics.jsonl")] == [0, 1]
    assert "Power-of-two policy requires" not in (out / "logs" / "router.log").read_text()
    procs = json.loads((out / "processes.json").read_text())
    servers = {p["url"] for p in procs if p["role"] == "inference"}
    router = next(p["url"] for p in procs if p["role"] == "router")
    named = [u for step in (0, 1) for line in (out / "samples" / f"step_{step}.jsonl").read_text().splitlines()
             for u in json.loads(line)["servers"]]
    assert len(servers) == 2 and named and set(named) <= servers and router not in named, (servers, set(named))
