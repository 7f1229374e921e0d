"""``POST /inference/v1/generate`` and ``GET /v1/models`` on the embedded engine server: the wire
contract over real HTTP against the real engine, with each front end this interpreter has
(aiohttp where installed, the stdlib one always). verifiers' own client drives the same route in
``tests/vf/test_generate_route.py``."""

import base64
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from primerl.models.config import MoETransformerConfig
from primerl.models.transformer import MoETransformer
from primerl.runtime.inference.engine import InferenceEngine, Request, SamplingParams
from primerl.runtime.inference.server import EngineServer, http_frontends

V = 40


def _engine():
    torch.manual_seed(0)
    m = MoETransformer(MoETransformerConfig.tiny(vocab_size=V))
    m.init_weights(seed=0)
    return InferenceEngine(m, max_batch_size=8)


@pytest.fixture(params=http_frontends())
def server(request):
    srv = EngineServer(_engine(), http=request.param, model_name="tiny").start()
    yield srv
    srv.stop()


def _call(url, path, body=None, headers=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_reports_max_model_len(server):
    code, out = _call(server.url, "/v1/models")
    assert code == 200
    assert out["data"][0]["id"] == "tiny"
    assert out["data"][0]["max_model_len"] == server.engine.cfg.max_position_embeddings


def test_generate_matches_the_engine_token_for_token(server):
    prompt = [1, 5, 7, 9, 2]
    sp = {"temperature": 0.9, "max_tokens": 6, "stop_token_ids": [3], "logprobs": 1, "seed": 11,
          "skip_special_tokens": False, "top_k": -1, "min_tokens": 0, "repetition_penalty": 1.0}  # unknown keys ignored
    code, out = _call(server.url, "/inference/v1/generate",
                      {"model": "tiny", "token_ids": prompt, "sampling_params": sp},
                      {"X-Session-ID": "trace-1", "Authorization": "Bearer x"})
    assert code == 200, out
    ref = _engine().generate([Request(0, prompt, SamplingParams(max_new_tokens=6, temperature=0.9,
                                                                 stop_token_ids=(3,), seed=11))])[0]
    ch = out["choices"][0]
    assert ch["token_ids"] == ref.tokens
    assert ch["finish_reason"] == ref.finish_reason
    assert [e["token"] for e in ch["logprobs"]["content"]] == [f"token_id:{t}" for t in ref.tokens]
    assert [e["logprob"] for e in ch["logprobs"]["content"]] == pytest.approx(ref.logprobs, abs=1e-6)
    assert out["prompt_token_ids"] == prompt
    re = ch["routed_experts"]
    arr = np.frombuffer(base64.b64decode(re["data"]), dtype=re["dtype"]).reshape(re["shape"])
    assert re["start"] == 0 and arr.shape[0] == len(prompt) + len(ref.tokens) - 1
    assert torch.equal(torch.from_numpy(arr.copy()).to(ref.routing.dtype), ref.routing)
    assert server.session_versions("trace-1") == (0, 0, 1)
    assert server.session_versions("trace-1") is None  # popped


def test_stop_token_is_returned_and_routed_experts_start_is_honoured(server):
    # find a seed whose sample stops early on its first token's id used as the stop id
    prompt = [1, 4, 4, 2]
    base = {"temperature": 1.0, "max_tokens": 5, "seed": 3}
    _, first = _call(server.url, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": base})
    stop = first["choices"][0]["token_ids"][1]
    body = {"token_ids": prompt,
            "sampling_params": {**base, "stop_token_ids": [stop], "routed_experts_prompt_start": 3}}
    _, out = _call(server.url, "/inference/v1/generate", body)
    ch = out["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["token_ids"][-1] == stop and stop not in ch["token_ids"][:-1]
    re = ch["routed_experts"]
    full = first["choices"][0]["routed_experts"]
    assert re["start"] == 3 and re["shape"][0] == len(prompt) + len(ch["token_ids"]) - 1 - 3
    a = np.frombuffer(base64.b64decode(re["data"]), dtype=np.uint8).reshape(re["shape"])
    b = np.frombuffer(base64.b64decode(full["data"]), dtype=np.uint8).reshape(full["shape"])
    assert np.array_equal(a, b[3:3 + a.shape[0]])  # same seed, same prefix: the same routing rows


@pytest.mark.parametrize("body, needle", [
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": [1, "a"]}, "token_ids"),
    ({"token_ids": [1, 2], "sampling_params": {"temperature": 0}}, "temperature"),
    ({"token_ids": [1, 2], "sampling_params": {"max_tokens": 10**6}}, "max_model_len"),
    ({"token_ids": [1, 2], "sampling_params": {"logprobs": 5}}, "logprobs"),
    ({"token_ids": [1, 2], "sampling_params": {"routed_experts_prompt_start": 3}}, "routed_experts_prompt_start"),
    ({"token_ids": [1, V + 3]}, "outside"),
    ({"token_ids": [1, 2], "sampling_params": {"top_k": 5}}, "top_k"),
    ({"token_ids": [1, 2], "sampling_params": {"n": 2}}, "sampling_params.n"),
    ({"token_ids": [1, 2], "sampling_params": {"stop": ["x"]}}, "stop"),
    ({"token_ids": [1, 2], "sampling_params": {"repetition_penalty": 1.2}}, "repetition_penalty"),
])
def test_bad_requests_are_400_naming_the_field(server, body, needle):
    code, out = _call(server.url, "/inference/v1/generate", body)
    assert code == 400 and needle in out["error"], out


def test_concurrent_generates_are_batched(server):
    import concurrent.futures as cf

    def one(i):
        return _call(server.url, "/inference/v1/generate",
                     {"token_ids": [1, 3 + i % 7, 2], "sampling_params": {"max_tokens": 4, "seed": i}},
                     {"X-Session-ID": f"s{i % 3}"})

    with cf.ThreadPoolExecutor(12) as ex:
        outs = list(ex.map(one, range(24)))
    assert all(code == 200 and len(o["choices"][0]["token_ids"]) >= 1 for code, o in outs)
    assert sum(server.session_versions(f"s{j}")[2] for j in range(3)) == 24
