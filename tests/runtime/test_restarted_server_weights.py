"""A restarted P/D server gets no request before it holds the job's current weights (issue 45).

- the engine server started with ``PRIMERL_MIN_WEIGHTS_VERSION`` = v (as its supervisor restarts
  it, ``pd_client._restart_env``) answers ``/health`` 503 "waiting for weights" (a router skips
  it) and refuses sampling with 503 until a weight update brings it to v; then it samples from v;
- ``supervise.Supervisor``: a restarted process gets ``restart_env``, and counts as up
  (``wait_up``) only once ``on_up`` (the weights hand-over) succeeded, a failed one retried.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import urllib.request

import pytest

from primerl.models.config import MoETransformerConfig
from primerl.models.transformer import MoETransformer
from primerl.runtime.inference.engine import InferenceEngine, Request, SamplingParams
from primerl.runtime.inference.http_routes import MIN_WEIGHTS_ENV
from primerl.runtime.inference.server import EngineServer
from primerl.runtime.inference.vllm_client import InferenceServerError, VLLMClient
from primerl.runtime.ports import reserve_port
from primerl.runtime.processes import ManagedProcess
from primerl.runtime.supervise import Supervisor, health_state
from primerl.runtime.transport import FileTransport
from primerl.runtime.validate import load_config

V = 11


def _model(seed):
    m = MoETransformer(MoETransformerConfig.tiny(vocab_size=V, max_position_embeddings=64))
    m.init_weights(seed=seed)
    return m


def test_a_server_restarted_at_version_2_samples_nothing_before_it_holds_version_2(tmp_path, monkeypatch):
    monkeypatch.setenv(MIN_WEIGHTS_ENV, "2")
    srv = EngineServer(InferenceEngine(_model(0), max_batch_size=2), http="stdlib").start()
    try:
        client = VLLMClient(load_config(None, ["--inference.vllm.url", srv.url]).inference.vllm, timeout_s=60)
        req = Request(1, [1, 3, 4], SamplingParams(max_new_tokens=3, seed=1))
        assert health_state(srv.url, 5) == "waiting"
        with pytest.raises(urllib.request.HTTPError) as e:
            urllib.request.urlopen(srv.url + "/health", timeout=5)
        assert e.value.code == 503
        with pytest.raises(InferenceServerError, match="waiting for weights: restarted while the job's weights were at "
                                                       "version 2, it holds version 0"):
            client.complete(req)
        tr = FileTransport(tmp_path)
        tr.publish_weights(1, _model(1).state_dict())
        client.version = 0
        client.update_weights(1, tr)
        assert health_state(srv.url, 5) == "waiting"  # version 1 is not the job's current
        tr.publish_weights(2, _model(2).state_dict())
        client.update_weights(2, tr)
        assert health_state(srv.url, 5) == "ok"
        c = client.complete(req)
        assert c.policy_version == 2 and len(c.tokens) == 3
    finally:
        srv.stop()


SERVER = """import json, os, sys, http.server
need = int(os.environ.get("PRIMERL_MIN_WEIGHTS_VERSION", "0"))
have = [0]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = have[0] >= need
        body = json.dumps({"status": "ok" if ok else "waiting for weights"}).encode()
        self.send_response(200 if ok else 503); self.end_headers(); self.wfile.write(body)
    def do_POST(self):
        have[0] = int(self.path.rsplit("/", 1)[1]); self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _wait(cond, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_the_supervisor_counts_a_restarted_server_up_only_once_it_took_the_weights(tmp_path):
    held = reserve_port()
    url = f"http://127.0.0.1:{held.port}"
    p = ManagedProcess("prefill-0", "prefill", [sys.executable, "-c", SERVER, str(held.port)], tmp_path / "p.log",
                       url=url).start()
    calls = []

    def on_up(proc):  # the client's hand-over of the current weights (version 5); the first try fails
        calls.append(health_state(proc.url, 5))
        if len(calls) == 1:
            raise RuntimeError("weights transfer failed")
        urllib.request.urlopen(urllib.request.Request(proc.url + "/load/5", method="POST"), timeout=5)

    sup = None
    try:
        _wait(lambda: health_state(url, 1) == "ok", "the server up")
        sup = Supervisor([p], max_restarts=2, health_timeout_s=1.0, interval_s=0.2, on_up=on_up,
                         restart_env=lambda proc: {"PRIMERL_MIN_WEIGHTS_VERSION": "5"}).start()
        os.kill(p.pid, signal.SIGKILL)
        _wait(lambda: calls, "the restarted server answering")
        assert calls[0] == "waiting"  # alive, but the router sees 503: it is sent nothing
        assert not sup.wait_up(0.1)  # the hand-over failed once: not up
        assert sup.wait_up(30) and len(calls) == 2 and health_state(url, 1) == "ok"
        assert p.env["PRIMERL_MIN_WEIGHTS_VERSION"] == "5" and p.restarts == 1
    finally:
        if sup is not None:
            sup.stop()
        p.kill()
        held.close()
