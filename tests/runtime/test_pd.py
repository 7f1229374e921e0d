"""Prefill/decode disaggregation (``primerl.runtime.inference.pd``): the hand-off reproduces a
colocated engine's tokens, log-probs and routed experts bitwise; replay training on the joined
record equals replay training on the colocated one, gradients included; the wire format round-trips;
a bad hand-off (unknown transfer, wrong cache shape, vanished prefill peer) is a clear error."""

import dataclasses
import json
import urllib.error
import urllib.request

import pytest
import torch

from primerl.runtime.inference.engine import InferenceEngine, Prefilled, Request
from primerl.runtime.inference.pd import KVTransferError, decode_prefilled, encode_prefilled
from primerl.runtime.inference.server import EngineServer
from test_engine import _model, _requests


def _prefill(engine, req):
    """The prefill role in-process: -> Prefilled (the prompt's cache, first token, prompt routing)."""
    one = dataclasses.replace(req, params=dataclasses.replace(req.params, max_new_tokens=1), export_kv=True)
    c = engine.generate([one])[0]
    k, v = c.kv
    return Prefilled(k, v, c.tokens[0], c.logprobs[0], c.routing[:len(req.prompt)], c.policy_version)


@pytest.mark.parametrize("kv_cache", [True, False])
def test_handoff_matches_colocated(kv_cache):
    model = _model(7)
    reqs = _requests(6, temperature=0.9)
    colocated = InferenceEngine(model, kv_cache=True).generate(reqs)
    prefill, decode = InferenceEngine(model), InferenceEngine(model, kv_cache=kv_cache)
    pds = []
    for r in reqs:
        pf = _prefill(prefill, r)
        pf = decode_prefilled(encode_prefilled(pf, seed=r.params.seed, prompt=r.prompt))[0]  # through the wire format
        pds.append(dataclasses.replace(r, prefilled=pf))
    out = decode.generate(pds)  # decoded together: continuous batching over handed-over caches
    for a, b, r in zip(colocated, out, reqs):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        # the prompts were prefilled in another batch composition than on the colocated engine: the
        # float rounding of the batched MoE GEMMs may differ in the last bits (bitwise: the test below)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-5, atol=1e-6)
        assert b.routing.shape == (len(r.prompt) + len(b.tokens) - 1, 2, 2)
        assert torch.equal(a.routing, b.routing)


def _replay_loss_grads(model, c):
    """Replay training on one sample: -sum log p(generated) with the recorded experts -> (loss, grads)."""
    model.zero_grad(set_to_none=True)
    seq = c.prompt + c.tokens
    ids, pos, cu = torch.tensor(seq), torch.arange(len(seq)), torch.tensor([0, len(seq)], dtype=torch.int32)
    fill = torch.arange(c.routing.shape[2], dtype=c.routing.dtype).expand(1, *c.routing.shape[1:])
    logits = model(ids, pos, cu, replay_ids=torch.cat([c.routing, fill]), return_logits=True)
    P = len(c.prompt)
    lp = torch.log_softmax(logits.float(), -1)[torch.arange(P - 1, len(seq) - 1), torch.tensor(c.tokens)]
    loss = -lp.sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_replay_training_on_pd_record_equals_colocated():
    model = _model(8)
    req = _requests(4, temperature=1.0)[3]
    req = dataclasses.replace(req, params=dataclasses.replace(req.params, max_new_tokens=6, stop_token_ids=()))
    col = InferenceEngine(model).generate([req])[0]
    pd = InferenceEngine(model).generate([dataclasses.replace(req, prefilled=_prefill(InferenceEngine(model), req))])[0]
    assert col.tokens == pd.tokens and len(pd.tokens) == 6
    assert col.logprobs == pd.logprobs and torch.equal(col.routing, pd.routing)  # one request each: bitwise
    trainer = _model(8)
    for p in trainer.parameters():
        p.requires_grad_(True)
    l1, g1 = _replay_loss_grads(trainer, col)
    l2, g2 = _replay_loss_grads(trainer, pd)
    assert torch.equal(l1, l2) and g1.keys() == g2.keys() and len(g1) > 0
    assert all(torch.equal(g1[n], g2[n]) for n in g1)
    # the replayed experts are what the gradients follow: other experts give another loss and other
    # expert gradients (a MoE that ignored replay_ids would give the same, so the equality above proves nothing)
    E = trainer.config.num_experts
    other = dataclasses.replace(pd, routing=((pd.routing.long() + 1) % E).to(pd.routing.dtype))
    l3, g3 = _replay_loss_grads(trainer, other)
    assert not torch.equal(l3, l1)
    assert any(not torch.equal(g1[n], g3[n]) for n in g1 if "expert" in n)


def test_prefilled_first_token_can_finish_the_request():
    model = _model(9)
    req = _requests(3)[2]
    pf = _prefill(InferenceEngine(model), req)
    for params, reason in ((dataclasses.replace(req.params, max_new_tokens=1), "length"),
                           (dataclasses.replace(req.params, stop_token_ids=(pf.first_token,)), "stop")):
        c = InferenceEngine(model).generate([Request(0, req.prompt, params, prefilled=pf)])[0]
        assert c.tokens == [pf.first_token] and c.finish_reason == reason
        assert torch.equal(c.routing, pf.routing)


def test_bad_cache_shape_is_named():
    model = _model(10)
    req = _requests(2)[1]
    pf = _prefill(InferenceEngine(model), req)
    e = InferenceEngine(model)
    for bad, what in ((dataclasses.replace(pf, k=pf.k[:, :-1]), "k has shape"),
                      (dataclasses.replace(pf, v=pf.v[..., :-1]), "v has shape"),
                      (dataclasses.replace(pf, k=pf.k.double()), "torch.float64"),
                      (dataclasses.replace(pf, routing=pf.routing[:-1]), "routing covers"),
                      (dataclasses.replace(pf, first_token=10**6), "first token")):
        with pytest.raises(ValueError, match=what):
            e.add_request(Request(1, req.prompt, req.params, prefilled=bad))
    with pytest.raises(KVTransferError, match="malformed"):
        decode_prefilled(encode_prefilled(pf, seed=1, prompt=req.prompt)[:-3])


# ------------------------------------------------------------------------------------ over HTTP
def _post(url, path, body, timeout=60):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def pd_servers():
    model = _model(11)
    srv = [EngineServer(InferenceEngine(model), http="stdlib", role=role).start()
           for role in ("prefill", "decode", "both")]
    yield srv
    for s in srv:
        s.stop()


def _legs(prefill, decode, body):
    """What vllm-router's P/D mode sends (tests/runtime/test_pd_router.py checks the router itself)."""
    first = {**body, "max_tokens": 1, "min_tokens": 1,
             "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                    "remote_block_ids": None, "remote_host": None, "remote_port": None}}
    code, out = _post(prefill.url, "/v1/completions", first)
    assert code == 200, out
    return _post(decode.url, "/v1/completions", {**body, "kv_transfer_params": out["kv_transfer_params"]})


def test_http_legs_match_colocated_and_bad_handoffs(pd_servers):
    prefill, decode, both = pd_servers
    body = {"prompt": [1, 5, 6, 7, 8, 2], "max_tokens": 5, "temperature": 0.8, "seed": 4, "logprobs": 1}
    code, pd = _legs(prefill, decode, body)
    assert code == 200, pd
    code, col = _post(both.url, "/v1/completions", body)
    assert code == 200
    assert pd["choices"][0]["token_ids"] == col["choices"][0]["token_ids"]
    assert pd["choices"][0]["logprobs"] == col["choices"][0]["logprobs"]
    assert pd["choices"][0]["routed_experts"] == col["choices"][0]["routed_experts"]
    h = decode.routes.health()[1]["pd"]
    assert h["handoffs_received"] == 1 and h["handoff_bytes"] > 0

    # unknown transfer: the id was pulled already (one-shot)
    prefill_only = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    code, out = _post(prefill.url, "/v1/completions", prefill_only)
    ktp = out["kv_transfer_params"]
    assert _post(decode.url, "/v1/completions", {**body, "kv_transfer_params": ktp})[0] == 200
    code, out = _post(decode.url, "/v1/completions", {**body, "kv_transfer_params": ktp})
    assert code == 500 and "KVTransferError" in out["error"] and "does not hold transfer" in out["error"]
    # a cache for another prompt length (the shape does not match the request)
    code, out = _post(prefill.url, "/v1/completions", prefill_only)
    code, out = _post(decode.url, "/v1/completions", {**body, "prompt": body["prompt"][:-1],
                                                      "kv_transfer_params": out["kv_transfer_params"]})
    assert code == 500 and "KVTransferError" in out["error"] and "prompt has 6 tokens" in out["error"]
    # the prefill peer vanished
    code, out = _post(prefill.url, "/v1/completions", prefill_only)
    prefill.stop()
    code, out = _post(decode.url, "/v1/completions", {**body, "kv_transfer_params": out["kv_transfer_params"]})
    assert code == 500 and "unreachable" in out["error"]
    c = decode.routes.health()[1]["pd"]
    assert (c["unknown_transfer"], c["bad_cache"], c["peer_unreachable"]) == (1, 1, 1)
    # the decode server keeps serving, and a role refuses the other role's leg
    assert _post(decode.url, "/v1/completions", body)[0] == 200
    code, out = _post(decode.url, "/v1/completions", {**body, "kv_transfer_params": {"do_remote_decode": True}})
    assert code == 400 and "role is decode" in out["error"]
