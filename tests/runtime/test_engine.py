"""Embedded engine: KV-cache path vs full recompute, log-probs vs teacher forcing, router capture,
continuous batching independence, sampling, FP8 experts, weight updates, errors."""

import pytest
import torch

from primerl.models.config import MoETransformerConfig
from primerl.models.transformer import MoETransformer
from primerl.runtime.inference.engine import EngineTimeout, InferenceEngine, Request, SamplingParams, sample_next

V = 13


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    m = MoETransformer(MoETransformerConfig.tiny(vocab_size=V, **kw))
    m.init_weights(seed=seed)
    with torch.no_grad():  # larger weights than the 0.02 init, so routing and sampling are not trivial
        for p in m.parameters():
            if p.ndim >= 2:
                p.mul_(8.0)
    return m


def _requests(n, temperature=1.0, top_p=1.0):
    reqs = []
    for i in range(n):
        prompt = [1] + [5 + (3 * i + j) % 8 for j in range(1 + (i * 5) % 7)] + [2]
        reqs.append(Request(i, prompt, SamplingParams(max_new_tokens=1 + (i * 3) % 6, temperature=temperature,
                                                      top_p=top_p, seed=100 + i)))
    return reqs


def _engine(model, **kw):
    e = InferenceEngine(_model(), **kw)
    e.load_weights(model.state_dict(), version=0)
    return e


def _teacher_forced(model, c, temperature=1.0):
    seq = c.prompt + c.tokens
    ids = torch.tensor(seq)
    logits = model(ids, torch.arange(len(seq)), torch.tensor([0, len(seq)], dtype=torch.int32), return_logits=True)
    lp = torch.log_softmax(logits.float() / temperature, -1)
    P = len(c.prompt)
    return lp[torch.arange(P - 1, len(seq) - 1), torch.tensor(c.tokens)], model.routing()


@pytest.mark.parametrize("kv_cache", [True, False])
def test_logprobs_and_routing_match_teacher_forcing(kv_cache):
    model = _model(1)
    engine = _engine(model, max_batch_size=4, kv_cache=kv_cache)  # 11 requests through 4 slots
    outs = engine.generate(_requests(11, temperature=0.7))
    for c in outs:
        lp, routing = _teacher_forced(model, c, 0.7)
        assert torch.allclose(torch.tensor(c.logprobs), lp, atol=2e-5), (c.request_id, c.logprobs, lp)
        n = len(c.prompt) + len(c.tokens) - 1
        assert c.routing.shape == (n, 2, 2) and c.routing.dtype == torch.uint8
        assert torch.equal(c.routing, routing[:n])
        assert c.finish_reason == "length" and len(c.tokens) == c.request_id * 3 % 6 + 1


def test_cached_and_full_paths_sample_the_same_tokens():
    model = _model(2)
    a = _engine(model, max_batch_size=3, kv_cache=True).generate(_requests(9))
    b = _engine(model, max_batch_size=16, kv_cache=False).generate(_requests(9))
    for x, y in zip(a, b):
        assert x.tokens == y.tokens
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 2e-5


def test_request_is_independent_of_its_batch():
    model = _model(3)
    alone = _engine(model).generate([_requests(6)[5]])[0]
    crowd = _engine(model, max_batch_size=2).generate(_requests(6))[5]
    assert alone.tokens == crowd.tokens


def test_replaying_captured_routing_reproduces_logits():
    model = _model(4)
    c = _engine(model).generate(_requests(4))[3]
    seq = c.prompt + c.tokens
    ids, pos, cu = torch.tensor(seq), torch.arange(len(seq)), torch.tensor([0, len(seq)], dtype=torch.int32)
    live = model(ids, pos, cu, return_logits=True)
    fill = torch.arange(2, dtype=torch.uint8).expand(1, 2, 2)
    replayed = model(ids, pos, cu, replay_ids=torch.cat([c.routing, fill]), return_logits=True)
    # the filler row changes the last token's experts (and so the grouped GEMM's row blocking)
    assert torch.allclose(live[:-1], replayed[:-1], atol=1e-5)
    assert torch.equal(model.routing()[:-1], c.routing)


def test_sample_next_distribution_and_top_p():
    torch.manual_seed(0)
    logits = torch.randn(1, 6) * 2
    probs = torch.softmax(logits, -1)[0]
    n = 6000
    u = torch.rand(n).tolist()
    tok, lp = sample_next(logits.expand(n, 6), [1.0] * n, [1.0] * n, u)
    freq = torch.bincount(tok, minlength=6).float() / n
    assert (freq - probs).abs().max() < 0.03
    assert torch.allclose(lp, torch.log(probs)[tok], atol=1e-6)
    # top_p below the largest probability: always the argmax
    tok, _ = sample_next(logits.expand(50, 6), [1.0] * 50, [1e-3] * 50, torch.rand(50).tolist())
    assert bool((tok == probs.argmax()).all())
    # top_p 0.7: only the smallest prefix of sorted tokens reaching 0.7 ever appears
    sp, si = probs.sort(descending=True)
    allowed = set(si[: int((sp.cumsum(0) < 0.7).sum()) + 1].tolist())
    tok, _ = sample_next(logits.expand(500, 6), [1.0] * 500, [0.7] * 500, torch.rand(500).tolist())
    assert set(tok.tolist()) <= allowed


def test_stop_tokens_and_versions():
    model = _model(5)
    engine = _engine(model)
    reqs = [Request(i, [1, 6, 7, 2], SamplingParams(max_new_tokens=30, stop_token_ids=tuple(range(V)), seed=i))
            for i in range(3)]
    outs = engine.generate(reqs)
    assert all(c.finish_reason == "stop" and len(c.tokens) == 1 for c in outs)
    engine.add_request(Request(10, [1, 6, 2], SamplingParams(max_new_tokens=5, seed=1)))
    engine.step()
    engine.load_weights(model.state_dict(), version=7)
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert done[0].policy_version == 0 and done[0].policy_version_end == 7


def test_fp8_experts_round_expert_weights_only():
    model = _model(6)
    engine = _engine(model, fp8_experts=True)
    sd = dict(engine.model.named_parameters())
    for name, p in model.named_parameters():
        q = sd[name]
        if ".ffn.experts." in name:
            assert not torch.equal(p, q) and (p - q).abs().max() <= 0.07 * p.abs().max()
            e2 = InferenceEngine(_model(), fp8_experts=False)
            e2.load_weights(engine.model.state_dict(), 0)
            e2._quantize_experts()  # FP8 rounding is idempotent
            assert torch.equal(dict(e2.model.named_parameters())[name], q)
        else:
            assert torch.equal(p, q), name


def test_bad_requests_and_timeout():
    engine = _engine(_model(7))
    with pytest.raises(ValueError, match="outside"):
        engine.add_request(Request(0, [1, V + 3], SamplingParams()))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(Request(0, [], SamplingParams()))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.add_request(Request(0, [1, 2], SamplingParams(max_new_tokens=10**6)))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request(Request(0, [1, 2], SamplingParams(temperature=0.0)))
    with pytest.raises(EngineTimeout):
        engine.generate([Request(1, [1, 2], SamplingParams(max_new_tokens=200))], timeout=0.0)
    with pytest.raises(Exception, match="missing"):
        engine.load_weights({"embed.weight": torch.zeros(V, 64)}, 1)


def test_router_noise_changes_routing_reproducibly():
    model = _model(8)
    clean = _engine(model).generate(_requests(6))
    noisy = [InferenceEngine(_model(), router_noise=1.0, noise_seed=3) for _ in range(2)]
    for e in noisy:
        e.load_weights(model.state_dict(), 0)
    a, b = (e.generate(_requests(6)) for e in noisy)
    assert all(torch.equal(x.routing, y.routing) and x.tokens == y.tokens for x, y in zip(a, b))
    assert any(not torch.equal(x.routing, y.routing) for x, y in zip(a, clean))
