"""Step time and inference tokens/s of the main command with 1 (in-process engine), 2 and 4
`primerl inference` servers behind vllm-router: `python -m bench._pool_scaling [STEPS] [N ...]`.

Runs `primerl rl --config examples/reverse_text.toml --max_steps STEPS --inference.num_servers N`
for each N and prints the medians of `time/step_s` and `inference/tokens_per_s` over the steps
after the first five (start-up), from metrics.jsonl. Not in `python -m bench`'s list (it runs whole
jobs, minutes each)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from primerl.runtime.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def run(n: int, steps: int, out: Path) -> dict:
    """n >= 1: inference.num_servers = n; n = 0: ONE `primerl inference` server started here, behind
    the router as an external server (inference.vllm.urls): what a pool of one would cost."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cfg = str(ROOT / "examples" / "reverse_text.toml")
    over = ["--inference.num_servers", str(n)]
    server = None
    if n == 0:
        from primerl.runtime.launch.servers import free_port

        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "primerl.runtime.cli", "inference", "--config", cfg, "--port",
                                   str(port)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        over = ["--inference.backend", "vllm", "--inference.vllm.urls", f'["http://127.0.0.1:{port}"]']
    t0 = time.perf_counter()
    try:
        subprocess.run([sys.executable, "-m", "primerl.runtime.cli", "rl", "--config", cfg, "--output_dir", str(out),
                        "--max_steps", str(steps), *over, "--log.plot", "false", "--log.progress", "false"],
                       check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    finally:
        if server is not None:
            server.terminate()
            server.wait()
    rows = read_metrics(out / "metrics.jsonl")[5:]
    return {"servers": n, "step_s": statistics.median(r["time/step_s"] for r in rows),
            "tokens_per_s": statistics.median(r["inference/tokens_per_s"] for r in rows),
            "reward_last": rows[-1]["reward/mean"], "wall_s": time.perf_counter() - t0}


LABEL = {0: "1 (one server over HTTP + router)", 1: "1 (in-process engine)"}


def main(argv: list[str]) -> None:
    steps = int(argv[0]) if argv else 40
    ns = [int(a) for a in argv[1:]] or [1, 0, 2, 4]
    with tempfile.TemporaryDirectory() as d:
        for n in ns:
            r = run(n, steps, Path(d) / f"n{n}")
            print(f"| {n} {LABEL.get(n, 'servers + vllm-router')} | {r['step_s']:.2f} s | "
                  f"{r['tokens_per_s']:.0f} | {r['reward_last']:.3f} | {r['wall_s']:.0f} s |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
