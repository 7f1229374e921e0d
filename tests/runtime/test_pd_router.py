"""The embedded engine's prefill and decode servers behind the real vllm-router in P/D mode
(``--vllm-pd-disaggregation``): outputs equal a colocated server's; weight updates reach both
servers; a failed hand-off is resampled by ``PDClient`` and counted; a vanished prefill server makes
requests fail clearly after the resamples, without hanging."""

import copy
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from primerl.runtime.config import VLLMConfig
from primerl.runtime.inference.engine import InferenceEngine, Request, SamplingParams
from primerl.runtime.inference.pd_client import PDClient
from primerl.runtime.inference.server import EngineServer
from primerl.runtime.inference.vllm_client import InferenceServerError, VLLMClient
from test_engine import _model
from vllm_testing import free_port

ROUTER = Path(sys.executable).parent / "vllm-router"
pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed")


def _up(url, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer /health")


@pytest.fixture
def pd(tmp_path):
    model = _model(12)
    # one model copy per engine: the servers step concurrently and a model records its last routing
    servers = [EngineServer(InferenceEngine(copy.deepcopy(model)), role=r).start()
               for r in ("prefill", "decode", "both")]
    port, mport = free_port(), free_port()
    log = open(tmp_path / "router.log", "wb")
    router = subprocess.Popen([str(ROUTER), "--vllm-pd-disaggregation", "--prefill", servers[0].url, "--decode",
                               servers[1].url, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
                               "--prometheus-port", str(mport)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _up(url)
        yield servers, url
    finally:
        router.terminate()
        router.wait(10)
        log.close()
        for s in servers:
            s.stop()


def _reqs():
    return [Request(i, [1] + [5 + (i * 3 + j) % 8 for j in range(3 + i % 4)] + [2],
                    SamplingParams(max_new_tokens=2 + i % 5, temperature=1.0, seed=40 + i)) for i in range(6)]


def test_router_pd_equals_colocated_and_resamples_failed_handoffs(pd):
    (prefill, decode, both), url = pd
    client = PDClient(VLLMConfig(url=url), [prefill.url, decode.url], resamples=2, num_layers=2, top_k=2,
                      expect_routing=True, timeout_s=60)
    colocated = VLLMClient(VLLMConfig(url=both.url), num_layers=2, top_k=2, expect_routing=True, timeout_s=60)
    reqs = _reqs()
    got = client.generate(reqs)
    want = colocated.generate(reqs)
    for g, w, r in zip(got, want, reqs):
        assert g.tokens == w.tokens and len(g.tokens) >= 1
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=1e-5, atol=1e-6)
        assert g.routing.shape == (len(r.prompt) + len(g.tokens) - 1, 2, 2)
        assert torch.equal(g.routing, w.routing)  # prompt rows from the prefill server, the rest from decode
    assert decode.routes.health()[1]["pd"]["handoffs_received"] == len(reqs)
    assert prefill.routes.health()[1]["pd"]["handoffs_sent"] == len(reqs)

    # the prefill server loses one record: the decode server fails that hand-off, the client resamples
    take, lost = prefill.pd.state.store.take, []

    def lose_first(tid):
        if not lost:
            lost.append(tid)
            take(tid)
            return None
        return take(tid)

    prefill.pd.state.store.take = lose_first
    c = client.complete(reqs[0])
    assert c.tokens == want[0].tokens and client.counts["unknown_transfer"] == 1 and client.resampled == 1
    prefill.pd.state.store.take = take

    # the prefill server vanishes: the request fails clearly after the resamples (nothing hangs)
    prefill.stop()
    with pytest.raises(InferenceServerError, match="failed its P/D hand-off 3 times"):
        client.complete(reqs[1])
    assert client.resampled == 3


def test_weight_updates_reach_every_server(pd, tmp_path):
    (prefill, decode, _), url = pd
    from safetensors.torch import save_file

    d = tmp_path / "w"
    d.mkdir()
    new = _model(13)
    save_file({k: v.contiguous() for k, v in new.state_dict().items()}, str(d / "model.safetensors"))
    (d / "STABLE").write_text("5")

    class Transport:
        def weights_dir(self, version):
            return d

    client = PDClient(VLLMConfig(url=url), [prefill.url, decode.url], num_layers=2, top_k=2, timeout_s=60)
    client.update_weights(5, Transport())
    assert client.version == 5
    for s in (prefill, decode):
        assert s.engine.policy_version == 5
        assert all(torch.equal(p, new.state_dict()[n]) for n, p in s.engine.model.state_dict().items())
