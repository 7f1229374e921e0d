"""``PoolClient`` on its own, against a stand-in router (a local HTTP server): a request whose
sends fail with 5xx is sent again until it succeeds and counts ONCE in ``inference/redispatched``
(however many sends it took); a 4xx is not retried; the completion names the server that sampled it
(the body's ``server``), not the router."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from primerl.runtime.config import VLLMConfig
from primerl.runtime.inference.engine import Request, SamplingParams
from primerl.runtime.inference.pool_client import PoolClient
from primerl.runtime.inference.vllm_client import InferenceServerError

WORKER = "http://127.0.0.1:1"  # the server the stand-in router says sampled each completion


class _Router(BaseHTTPRequestHandler):
    fail = {}  # prompt[0] -> how many sends of that request answer first with this status
    status = 500
    sends = {}

    def _answer(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.startswith("/health"):
            return self._answer(200, {"status": "ok", "weights_version": 0, "instance": "a"})
        return self._answer(200, {"urls": [WORKER]})  # /list_workers

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if not self.path.startswith("/v1/completions"):
            return self._answer(200, {})
        key = body["prompt"][0]
        n = _Router.sends[key] = _Router.sends.get(key, 0) + 1
        if n <= _Router.fail.get(key, 0):
            return self._answer(_Router.status, {"error": "worker died"})
        toks = [7, 8]
        return self._answer(200, {"server": WORKER, "choices": [{
            "token_ids": toks, "finish_reason": "stop",
            "logprobs": {"tokens": [f"token_id:{t}" for t in toks], "token_logprobs": [-0.5, -0.25]}}]})

    def log_message(self, *a):
        pass


@pytest.fixture
def router():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Router)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    _Router.sends, _Router.fail, _Router.status = {}, {}, 500
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _client(router):
    return PoolClient(VLLMConfig(url=router), [], router, timeout_s=30, interval_s=60)


def test_a_request_resent_three_times_counts_once_and_names_its_server(router):
    _Router.fail = {1: 3, 2: 0, 3: 1}
    client = _client(router)
    try:
        got = [client.complete(Request(i, [i, 5], SamplingParams(max_new_tokens=2))) for i in (1, 2, 3)]
        assert _Router.sends == {1: 4, 2: 1, 3: 2}
        assert client.metrics()["inference/redispatched"] == 2  # requests 1 and 3, once each
        assert client.metrics()["inference/redispatched"] == 0  # since the previous call
        assert [c.tokens for c in got] == [[7, 8]] * 3 and got[0].logprobs == [-0.5, -0.25]
        assert {c.server for c in got} == {WORKER}  # the sampling server, not the router
    finally:
        client.close()


def test_a_client_error_is_not_retried(router):
    _Router.fail, _Router.status = {4: 1}, 400
    client = _client(router)
    try:
        with pytest.raises(InferenceServerError, match="HTTP 400"):
            client.complete(Request(4, [4, 5], SamplingParams(max_new_tokens=2)))
        assert _Router.sends == {4: 1} and client.metrics()["inference/redispatched"] == 0
    finally:
        client.close()
