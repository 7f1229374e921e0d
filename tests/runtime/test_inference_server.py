"""``primerl inference`` as a real process on 127.0.0.1: bad input is answered 4xx with a message
and the server keeps serving; the same through vllm-router in front of two servers (the router
passes a server's 400 through and rejects what its own request schema refuses, 400/422);
``/health`` and ``/metrics`` report the engine."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from vllm_testing import free_port

ROOT = Path(__file__).resolve().parents[2]
ROUTER = Path(sys.executable).parent / "vllm-router"
VOCAB = 11  # examples/reverse_text.toml: 8 symbols + BOS, SEP, EOS


def _call(url, path, body=None, *, raw: bytes | None = None, timeout=60):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _wait_up(url, proc, what, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if _call(url, "/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} at {url} did not answer /health within {timeout} s")


def _stop(procs):
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    ports = [free_port(), free_port()]
    log = tmp_path_factory.mktemp("inference")
    logs = [open(log / f"{p}.log", "w") for p in ports]
    procs = [subprocess.Popen([sys.executable, "-m", "primerl.runtime.cli", "inference", "--config",
                               str(ROOT / "examples/reverse_text.toml"), "--device", "cpu", "--port", str(p)], env=env,
                              cwd=log, stdout=f, stderr=subprocess.STDOUT) for p, f in zip(ports, logs)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for u, p in zip(urls, procs):
            _wait_up(u, p, "primerl inference")
        yield urls
    finally:
        _stop(procs)
        for f in logs:
            f.close()


GOOD = {"prompt": [1, 2, 3], "max_tokens": 4}

# (route, raw body) -> a 4xx naming the problem
BAD = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", b'{"prompt": []}'),
    ("/v1/completions", b'{"prompt": [1, 999]}'),
    ("/v1/completions", b'{"prompt": [1, -2]}'),
    ("/v1/completions", b'{"prompt": "abc"}'),
    ("/v1/completions", b'{"prompt": [1, 2], "max_tokens": -3}'),
    ("/v1/completions", b'{"prompt": [1, 2], "max_tokens": 0}'),
    ("/v1/completions", b'{"prompt": [1, 2], "max_tokens": 100000000}'),
    ("/v1/completions", b'{"prompt": [1, 2], "max_tokens": "x"}'),
    ("/v1/completions", b'{"prompt": [1, 2], "max_tokens": 2.5}'),
    ("/v1/completions", b'{"prompt": [1, 2], "temperature": "hot"}'),
    ("/inference/v1/generate", b"{not json"),
    ("/inference/v1/generate", b'{"token_ids": []}'),
    ("/inference/v1/generate", b'{"token_ids": [999]}'),
    ("/inference/v1/generate", b'{"token_ids": [1], "sampling_params": {"max_tokens": -1}}'),
    ("/inference/v1/generate", b'{"token_ids": [1], "sampling_params": {"max_tokens": 100000000}}'),
    ("/inference/v1/generate", b'{"token_ids": [1], "sampling_params": []}'),
    ("/collective_rpc", b'{"method": "rm_rf"}'),
]
NEEDLES = ["Expecting", "JSON object", "non-empty", "outside the vocabulary", ">= 0", "list of token ids", ">= 1",
           ">= 1", "max_model_len", "integer", "integer", "finite number", "Expecting", "non-empty",
           "outside the vocabulary", ">= 1", "max_model_len", "must be an object", "unknown method"]


def test_bad_input_is_400_naming_the_problem_and_the_server_keeps_serving(servers):
    url = servers[0]
    for (path, raw), needle in zip(BAD, NEEDLES):
        code, text = _call(url, path, raw=raw)
        assert code == 400 and needle in json.loads(text)["error"], (path, raw, code, text)
        code, text = _call(url, "/v1/completions", GOOD)  # still serving, and correctly
        assert code == 200 and len(json.loads(text)["choices"][0]["token_ids"]) == 4, text
    code, text = _call(url, "/health")
    h = json.loads(text)
    assert code == 200 and h["status"] == "ok" and h["requests"]["bad_request"] >= len(BAD), h


def test_health_and_prometheus_metrics(servers):
    url = servers[1]
    before = json.loads(_call(url, "/health")[1])
    code, text = _call(url, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 5})
    assert code == 200
    after = json.loads(_call(url, "/health")[1])
    assert after["generated_tokens"] == before["generated_tokens"] + 5
    assert after["requests"]["finished"] == before["requests"]["finished"] + 1
    assert after["requests_running"] == 0 and after["weights_version"] == 0 and after["kv_cache_bytes"] > 0
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    from prometheus_client.parser import text_string_to_metric_families

    samples = {s.name + json.dumps(s.labels, sort_keys=True): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples["primerl_inference_generated_tokens_total{}"] == after["generated_tokens"]
    assert samples['primerl_inference_requests_total{"outcome": "finished"}'] == after["requests"]["finished"]
    for name in ("requests_running", "requests_waiting", "kv_cache_usage", "weights_version", "paused"):
        assert samples[f"primerl_inference_{name}{{}}"] == float(after[name])


@pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed (requirements-ci.txt)")
def test_bad_input_through_vllm_router(servers):
    port = free_port()
    router = subprocess.Popen([str(ROUTER), "--worker-urls", *servers, "--port", str(port),
                               "--prometheus-port", str(free_port()), "--policy", "round_robin",
                               "--health-check-interval-secs", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url, router, "vllm-router", timeout=60)
        bad_before = sum(json.loads(_call(u, "/health")[1])["requests"]["bad_request"] for u in servers)
        passed = 0
        for path, raw in BAD:
            if path == "/collective_rpc":  # control plane: called on each server, not through the router
                continue
            code, text = _call(url, path, raw=raw)
            assert 400 <= code < 500 and text, (path, raw, code, text)
            try:  # a server's answer, passed through; else the router's own (plain text, 400 or 422)
                passed += "error" in json.loads(text)
            except ValueError:
                assert code in (400, 422), (code, text)
        for _ in range(4):  # 4xx answers do not open a circuit breaker: both servers still get traffic
            code, text = _call(url, "/v1/completions", GOOD)
            assert code == 200 and len(json.loads(text)["choices"][0]["token_ids"]) == 4, text
        bad_after = sum(json.loads(_call(u, "/health")[1])["requests"]["bad_request"] for u in servers)
        assert passed >= 8 and bad_after - bad_before == passed  # each reached a server once: no retry of a 4xx
    finally:
        _stop([router])


@pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed (requirements-ci.txt)")
def test_a_client_leaving_the_router_aborts_the_request_on_the_server(servers):
    """vllm-router passes a client's disconnect on: the server aborts the request (what
    VLLMClient.abort relies on when a router stands in front)."""
    import http.client

    port = free_port()
    router = subprocess.Popen([str(ROUTER), "--worker-urls", servers[0], "--port", str(port),
                               "--prometheus-port", str(free_port()), "--policy", "round_robin",
                               "--health-check-interval-secs", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    health = lambda: json.loads(_call(servers[0], "/health")[1])  # noqa: E731
    try:
        _wait_up(f"http://127.0.0.1:{port}", router, "vllm-router", timeout=60)
        before = health()
        for path, body in (("/v1/completions", {"prompt": [0, 3, 1], "max_tokens": 4000}),
                           ("/inference/v1/generate",
                            {"token_ids": [0, 3, 1], "sampling_params": {"max_tokens": 4000}})):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            deadline = time.monotonic() + 30
            while health()["requests_running"] == 0:
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.02)
            conn.close()
            while health()["requests_running"]:
                assert time.monotonic() < deadline + 10, "the server kept generating after the client left"
                time.sleep(0.02)
        after = health()
        assert after["requests"]["aborted"] - before["requests"]["aborted"] == 2
        assert after["requests"]["finished"] == before["requests"]["finished"]
        assert after["generated_tokens"] - before["generated_tokens"] < 2 * 4000
    finally:
        _stop([router])
