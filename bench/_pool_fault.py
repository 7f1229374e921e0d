"""A fault run: `primerl rl --config examples/reverse_text.toml --inference.num_servers 3`, one
server killed with SIGKILL at step KILL_AT while it has requests in flight; prints the step, the
requests re-dispatched, the restart time (kill -> back in the router with the current weights)
and the reward by 25-step windows up to STOP: `python -m bench._pool_fault OUT [KILL_AT] [STOP]`.
Compare with the same command's undisturbed run (same seed) to see the fault's cost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from primerl.runtime.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    kill_at = int(argv[1]) if len(argv) > 1 else 30
    stop = int(argv[2]) if len(argv) > 2 else 150
    job = subprocess.Popen([sys.executable, "-m", "primerl.runtime.cli", "rl", "--config",
                            str(ROOT / "examples" / "reverse_text.toml"), "--output_dir", str(out),
                            "--overwrite", "true", "--inference.num_servers", "3", "--log.plot", "false"], cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not any(r["step"] >= kill_at for r in read_metrics(out / "metrics.jsonl")):
            time.sleep(0.1)
        procs = json.loads((out / "processes.json").read_text())
        victim = [p for p in procs if p["role"] == "inference"][1]
        router = [p for p in procs if p["role"] == "router"][0]["url"]
        while True:
            h = _get(victim["url"] + "/health")
            if h["requests_running"] + h["requests_waiting"]:
                break
            time.sleep(0.005)
        os.kill(victim["pid"], signal.SIGKILL)
        t_kill = time.perf_counter()
        step_kill = max(r["step"] for r in read_metrics(out / "metrics.jsonl"))
        while victim["url"] in _get(router + "/list_workers")["urls"]:
            time.sleep(0.05)
        t_out = time.perf_counter() - t_kill
        while victim["url"] not in _get(router + "/list_workers")["urls"]:
            time.sleep(0.1)
        t_back = time.perf_counter() - t_kill
        while not any(r["step"] >= stop for r in read_metrics(out / "metrics.jsonl")):
            time.sleep(0.5)
    finally:
        job.send_signal(signal.SIGTERM)
        job.wait()
    rows = read_metrics(out / "metrics.jsonl")
    print(f"killed {victim['url']} (pid {victim['pid']}) after step {step_kill} with {h['requests_running']} running + "
          f"{h['requests_waiting']} waiting; out of the router after {t_out:.1f} s, back with the current weights "
          f"after {t_back:.1f} s; re-dispatched {sum(r['inference/redispatched'] for r in rows)} requests; restarts "
          f"{rows[-1]['inference/restarts']}; servers_healthy min {min(r['inference/servers_healthy'] for r in rows)}")
    for a in range(0, stop, 25):
        w = [r["reward/mean"] for r in rows if a <= r["step"] < a + 25]
        print(f"steps {a}-{a + 24}: reward {sum(w) / len(w):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
