"""The cost of the vllm-router hop: one ``/v1/completions`` request to a ``primerl inference``
server directly, and through ``vllm-router`` (round_robin) in front of the same server.

``python -m bench router [--quick]``

Rows ``completion`` per generated length (1 and 8 tokens): the median latency of a sequential
request, ``backend`` ``direct`` and ``router``; ``ratio`` of the router row is direct / router (< 1:
the hop costs time), and ``hop_ms`` the difference of the medians. The two are timed in turn
within each repeat (``time_interleaved``), so a busy shared CPU hits both alike. The server runs
the example's policy (examples/reverse_text.toml) on the CPU (``--device cpu``) in its own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .harness import Row, time_interleaved

ROOT = Path(__file__).resolve().parents[1]
ROUTER = Path(sys.executable).parent / "vllm-router"


def _free_port() -> int:
    """A free port, reserved until this process exits (no other process can take it first)."""
    from primerl.runtime.ports import held_port

    return held_port()


def _wait_up(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer /health within {timeout} s")


def _post(url: str, body: bytes) -> None:
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


def run(args) -> list[Row]:
    if not ROUTER.exists():
        raise RuntimeError(f"vllm-router is not installed next to {sys.executable} (requirements-ci.txt)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    sp, rp = _free_port(), _free_port()
    server = subprocess.Popen([sys.executable, "-m", "primerl.runtime.cli", "inference", "--config",
                               str(ROOT / "examples" / "reverse_text.toml"), "--device", "cpu", "--port", str(sp)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    router = None
    rows = []
    try:
        direct = f"http://127.0.0.1:{sp}"
        _wait_up(direct, server)
        router = subprocess.Popen([str(ROUTER), "--worker-urls", direct, "--port", str(rp), "--policy", "round_robin",
                                   "--health-check-interval-secs", "1"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        routed = f"http://127.0.0.1:{rp}"
        _wait_up(routed, router, timeout=60)
        repeats = 50 if args.quick else 300
        for n in (1, 8):
            body = json.dumps({"prompt": [0, 3, 4, 5, 6, 1], "max_tokens": n}).encode()
            t = time_interleaved({"direct": lambda: _post(direct, body), "router": lambda: _post(routed, body)},
                                 warmup=10, repeats=repeats)
            shape = f"1 request, 6 + {n} tokens, example policy"
            rows.append(Row("completion", shape, "fp32", "direct", t["direct"]))
            rows.append(Row("completion", shape, "fp32", "router", t["router"], ratio=t["direct"] / t["router"],
                            baseline="direct", extra={"hop_ms": f"{(t['router'] - t['direct']) * 1e3:.2f}"},
                            values={"hop_s": t["router"] - t["direct"]}))
    finally:
        for p in (router, server):
            if p is not None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    return rows
