"""The control plane of ``primerl inference`` as ``VLLMClient`` drives it, over real HTTP with each
front end: an in-flight weight update (pause keeping requests, load, resume) changes the policy in
the middle of a running request without recomputing its cache, and the versions bracket it;
``VLLMClient.abort`` stops the request on the server (its slot is freed, generation stops)."""

import time

import pytest
import torch

from primerl.models.config import MoETransformerConfig
from primerl.models.transformer import MoETransformer
from primerl.runtime.validate import load_config
from primerl.runtime.inference.engine import InferenceEngine, Request, SamplingParams
from primerl.runtime.inference.server import EngineServer, http_frontends
from primerl.runtime.inference.vllm_client import VLLMClient
from primerl.runtime.transport import FileTransport

V = 11
N = 120  # tokens of the long request


def _model(seed):
    m = MoETransformer(MoETransformerConfig.tiny(vocab_size=V, max_position_embeddings=256))
    m.init_weights(seed=seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim >= 2:
                p.mul_(8.0)
    return m


@pytest.fixture(params=http_frontends())
def slow_server(request):
    """A server whose engine takes >= 4 ms a step (so a request of N tokens runs ~0.5 s) and counts
    the positions fed through the model."""
    engine = InferenceEngine(_model(0), max_batch_size=4)
    fed = []

    def hook(module, args, out):
        fed.append(args[0].numel())
        time.sleep(0.004)

    engine.model.embed.register_forward_hook(hook)
    srv = EngineServer(engine, http=request.param).start()
    srv.fed = fed
    yield srv
    srv.stop()


def _client(url):
    return VLLMClient(load_config(None, ["--inference.vllm.url", url]).inference.vllm, timeout_s=60)


def _wait(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


REQ = Request(1, [1, 3, 4, 2], SamplingParams(max_new_tokens=N, seed=3))


def test_inflight_update_keeps_the_running_request_and_its_cache(slow_server, tmp_path):
    srv = slow_server
    client = _client(srv.url)
    client.version = 0
    assert client.can_pause()
    calls = []
    pause, resume = srv.weights.start_pause, srv.weights.start_resume
    srv.weights.start_pause = lambda: calls.append("pause") or pause()
    srv.weights.start_resume = lambda: calls.append("resume") or resume()
    tr = FileTransport(tmp_path)
    tr.publish_weights(1, _model(1).state_dict())

    client.submit(REQ)
    _wait(lambda: srv.stats.read()["generated_tokens"] >= 10)
    client.update_weights(1, tr)
    assert calls == ["pause", "resume"] and srv.engine.policy_version == 1 and client.server_versions() == [1]
    _wait(lambda: all(f.done() for f in client._inflight.values()))
    (c,) = client.poll()
    assert len(c.tokens) == N and (c.policy_version, c.policy_version_end) == (0, 1)
    # no recompute: every position went through the model exactly once
    assert sum(srv.fed) == len(REQ.prompt) + N - 1
    # the same request on policy 0 alone: identical up to the update, then the new policy's log-probs
    ref = InferenceEngine(_model(0)).generate([REQ])[0]
    k = next(i for i, (a, b) in enumerate(zip(c.logprobs, ref.logprobs))
             if abs(a - b) > 1e-5 or c.tokens[i] != ref.tokens[i])
    assert 10 <= k < N - 1, k
    assert c.tokens[:k] == ref.tokens[:k]
    assert not srv.stats.read()["paused"]


def test_abort_stops_the_request_on_the_server(slow_server):
    srv = slow_server
    client = _client(srv.url)
    client.submit(REQ)
    _wait(lambda: srv.stats.read()["generated_tokens"] >= 5)
    client.abort([REQ.request_id])
    assert not client.has_pending()
    _wait(lambda: srv.stats.read()["requests"]["aborted"] == 1, timeout=5)
    s = srv.stats.read()
    assert s["requests_running"] == 0 and s["requests"]["finished"] == 0
    time.sleep(0.1)
    assert srv.stats.read()["generated_tokens"] == s["generated_tokens"] < N  # generation stopped
    # the server keeps serving
    (c,) = client.generate([Request(2, [1, 3, 4, 2], SamplingParams(max_new_tokens=3, seed=1))])
    assert len(c.tokens) == 3


def test_a_client_leaving_the_generate_proxy_aborts_upstream(slow_server):
    """The verifiers path's recording proxy (in front of vLLM; here the engine server): a harness
    that closes its connection cancels the upstream call, and the server aborts the request."""
    import http.client
    import json

    from primerl.runtime.inference.generate_proxy import GenerateProxy

    srv = slow_server
    proxy = GenerateProxy(srv.url, lambda: 0).start()
    try:
        conn = http.client.HTTPConnection(proxy.host, proxy.port, timeout=30)
        conn.request("POST", "/inference/v1/generate", body=json.dumps(
            {"token_ids": [1, 3, 4, 2], "sampling_params": {"max_tokens": N, "seed": 1}}),
            headers={"Content-Type": "application/json", "X-Session-ID": "t1"})
        _wait(lambda: srv.stats.read()["generated_tokens"] >= 5)
        conn.close()
        _wait(lambda: srv.stats.read()["requests"]["aborted"] == 1, timeout=5)
        assert srv.stats.read()["requests_running"] == 0 and proxy.pop_session("t1") is None
    finally:
        proxy.stop()


def test_a_finished_request_is_in_the_health_snapshot_before_its_waiter_has_it():
    """The engine thread refreshes the /health snapshot before it hands out completions: a client
    that reads /health right after its answer sees its tokens (the snapshot lagged one step before,
    and test_inference_server's metrics test failed on it once, in a fresh-clone run under load)."""
    from types import SimpleNamespace

    from primerl.runtime.inference.engine_thread import EngineThread
    from primerl.runtime.inference.server_metrics import ServerStats

    class OneStepEngine:  # the engine's surface that EngineThread and ServerStats use
        running, waiting, kv_cache_bytes, policy_version = {}, [], 0, 0

        def __init__(self):
            self.tokens_generated, self.pending = 0, []

        def add_request(self, req):
            self.pending.append(req)

        def has_unfinished(self):
            return bool(self.pending)

        def kv_cache_usage(self):
            return 0.0

        def step(self):
            done, self.pending = self.pending, []
            self.tokens_generated += 5 * len(done)
            return [SimpleNamespace(request_id=r.request_id) for r in done]

    stats = ServerStats()
    thread = EngineThread(OneStepEngine(), stats).start()
    try:
        seen = []
        fut = thread.submit(SimpleNamespace(request_id=thread.new_id()))
        # runs at set_result: what a client that has its completion reads from /health next
        fut.add_done_callback(lambda f: seen.append((stats.read()["generated_tokens"],
                                                     stats.read()["requests"]["finished"])))
        fut.result(timeout=10)
        assert seen == [(5, 1)]
    finally:
        thread.stop()
