"""Prefill/decode disaggregation against colocation on this CPU, under one mixed load.

``python -m bench pd [--quick]``

Two ``primerl inference`` processes either way (the example's policy, examples/reverse_text.toml,
with 8192 positions): ``colocated`` = two ``--role both`` servers, requests alternating between
them; ``pd`` = one ``--role prefill`` + one ``--role decode`` server, every request in the two
legs vllm-router's P/D mode sends (prefill with ``max_tokens = 1`` and ``kv_transfer_params``, then
decode with the prefill's answer; the client sends them itself, so the router hop, measured by
``bench/router.py``, is not in these figures). The load, the same for both: ``short`` requests
(8-token prompt, 48 new tokens), 12 in flight at all times, while a ``long`` request (a 4096-token
prompt, 2 new tokens) starts every ``long_every_s``. Each server stamps every sampled token
(``time.monotonic``, one clock for all processes on this machine), so a short request's time to
first token (TTFT) and its inter-token latencies (ITL: gaps between its tokens) are exact. Rows:
ITL p50 / p99 and TTFT p50 / p99 of the short requests, tokens/s of the whole load; then the KV
hand-off of one 4096-token prompt (bytes, seconds); and whether P/D and colocated sample the same
tokens for the same seeded requests (each alone on its server).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from .harness import Row

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 11


def _post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return json.loads(r.read())


def _start(role: str, port: int, env: dict, device: str = "cpu") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "primerl.runtime.cli", "inference", "--config",
                             str(ROOT / "examples" / "reverse_text.toml"), "--device", device, "--port", str(port),
                             "--role", role, "--model.max_position_embeddings", "8192",
                             "--inference.max_batch_size", "64"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_up(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
        try:
            _get(url, "/health")
            return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer /health")


class Mode:
    """How a request is served: colocated (alternating over two servers) or P/D (two legs)."""

    def __init__(self, name: str, urls: list[str]):
        self.name, self.urls, self._n = name, urls, 0
        self._lock = threading.Lock()

    def complete(self, body: dict) -> dict:
        body = {**body, "return_token_times": True, "logprobs": 1}
        if self.name == "colocated":
            with self._lock:
                self._n += 1
                url = self.urls[self._n % 2]
            return _post(url, body)
        first = _post(self.urls[0], {**body, "max_tokens": 1, "min_tokens": 1,
                                     "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})
        return _post(self.urls[1], {**body, "kv_transfer_params": first["kv_transfer_params"]})


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % VOCAB for i in range(n)]


def _mixed_load(mode: Mode, seconds: float, long_every_s: float, *, in_flight: int = 12, long_len: int = 4096):
    """-> (ITLs of short requests, their TTFTs, generated tokens, wall seconds, long requests done)."""
    itl, ttft, tokens = [], [], [0]
    errors: list[str] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds
    longs = [0]

    def short_worker(w: int):
        i = 0
        while time.monotonic() < stop:
            i += 1
            t0 = time.monotonic()
            try:
                out = mode.complete({"prompt": _prompt(8, 1000 * w + i), "max_tokens": 48, "seed": 1000 * w + i})
            except urllib.error.HTTPError as e:
                with lock:
                    errors.append(f"HTTP {e.code}: {e.read()[:300]!r}")
                continue
            times = out["choices"][0]["token_times"]
            with lock:
                ttft.append(times[0] - t0)
                itl.extend(b - a for a, b in zip(times, times[1:]))
                tokens[0] += len(times)

    def long_worker():
        j = 0
        while time.monotonic() < stop:
            j += 1
            t_next = time.monotonic() + long_every_s
            try:
                out = mode.complete({"prompt": _prompt(long_len, j), "max_tokens": 2, "seed": j})
            except urllib.error.HTTPError as e:
                with lock:
                    errors.append(f"long: HTTP {e.code}: {e.read()[:300]!r}")
                continue
            with lock:
                tokens[0] += len(out["choices"][0]["token_ids"])
                longs[0] += 1
            time.sleep(max(0.0, t_next - time.monotonic()))

    t0 = time.monotonic()
    threads = [threading.Thread(target=short_worker, args=(w,)) for w in range(in_flight)]
    threads.append(threading.Thread(target=long_worker))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        print(f"{mode.name}: {len(errors)} failed requests, first: {errors[0]}", flush=True)
    return itl, ttft, tokens[0], time.monotonic() - t0, longs[0]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(args) -> list[Row]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    base = int(os.environ.get("PRIMERL_BENCH_PD_PORT", "23170"))
    seconds = 20.0 if args.quick else 60.0
    long_every_s = 1.0
    rows = []
    results = {}
    for name, roles in (("colocated", ("both", "both")), ("pd", ("prefill", "decode"))):
        ports = [base, base + 1]
        procs = [_start(r, p, env, "cuda" if args.device == "cuda" else "cpu") for r, p in zip(roles, ports)]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        try:
            for u, p in zip(urls, procs):
                _wait_up(u, p)
            mode = Mode(name, urls)
            mode.complete({"prompt": _prompt(64, 0), "max_tokens": 4, "seed": 0})  # warm-up
            itl, ttft, n_tok, wall, n_long = _mixed_load(mode, seconds, long_every_s)
            results[name] = {"itl": itl, "ttft": ttft}
            shape = f"12 x (8 + 48) in flight, 4096 + 2 every {long_every_s:g} s, {seconds:g} s"
            values = {"itl_p50_ms": _pct(itl, 0.5) * 1e3, "itl_p99_ms": _pct(itl, 0.99) * 1e3,
                      "ttft_p50_ms": _pct(ttft, 0.5) * 1e3, "ttft_p99_ms": _pct(ttft, 0.99) * 1e3,
                      "tokens_per_s": n_tok / wall, "long_requests": n_long, "short_requests": len(ttft)}
            rows.append(Row("mixed_load", shape, "fp32", name, _pct(itl, 0.5),
                            extra={k: (f"{v:.1f}" if isinstance(v, float) else str(v)) for k, v in values.items()},
                            values=values))
            # identical outputs for the same seeded requests, each alone
            same = 0
            outs = []
            for i in range(8):
                out = mode.complete({"prompt": _prompt(8 + 97 * i, i), "max_tokens": 16, "seed": 7 + i})
                outs.append(out["choices"][0]["token_ids"])
            results[name]["outputs"] = outs
            if name == "pd":
                # one 4096-token hand-off, alone: bytes and seconds (the decode server's counters)
                before = _get(urls[1], "/health")["pd"]
                mode.complete({"prompt": _prompt(4096, 99), "max_tokens": 2, "seed": 99})
                after = _get(urls[1], "/health")["pd"]
                nbytes = after["handoff_bytes"] - before["handoff_bytes"]
                secs = after["handoff_seconds"] - before["handoff_seconds"]
                rows.append(Row("kv_handoff", "4096-token prompt, 2 layers x 4 kv heads x 16 fp32", "fp32", "http pull",
                                secs, gbps=nbytes / secs / 1e9 if secs > 0 else None,
                                extra={"bytes": str(nbytes), "ms": f"{secs * 1e3:.1f}"},
                                values={"bytes": nbytes, "seconds": secs}))
                same = sum(a == b for a, b in zip(results["colocated"]["outputs"], outs))
                rows.append(Row("same_tokens", "8 seeded requests, 16 tokens, each alone", "fp32", "pd vs colocated",
                                0.0, extra={"identical": f"{same}/8"}, values={"identical": same}))
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    if "colocated" in results and rows:
        c = rows[0].values
        p = rows[1].values if len(rows) > 1 else None
        if p:
            rows[1].ratio = c["itl_p99_ms"] / p["itl_p99_ms"]
            rows[1].baseline = "colocated ITL p99"
    return rows
