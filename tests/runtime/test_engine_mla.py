"""The embedded engine on the MLA families: the absorbed decode over the latent cache (and GLM-5's
top-k selection at decode) gives the log-probs and routing of teacher forcing through the model."""

import pytest
import torch

from primerl.models.config import MoETransformerConfig
from primerl.models.transformer import MoETransformer
from primerl.runtime.inference.engine import InferenceEngine, Request, SamplingParams

V = 13


def _model(family, seed=0):
    torch.manual_seed(seed)
    extra = dict(index_topk=4, indexer_types=("full", "shared", "full")) if family == "glm_moe_dsa" else {}
    m = MoETransformer(MoETransformerConfig.tiny(vocab_size=V, family=family, **extra))
    m.init_weights(seed=seed)
    with torch.no_grad():  # larger weights than the 0.02 init, so attention, routing and selection matter
        for p in m.parameters():
            if p.ndim >= 2:
                p.mul_(8.0)
    return m


def _requests(n):
    reqs = []
    for i in range(n):
        prompt = [1] + [5 + (3 * i + j) % 8 for j in range(1 + (i * 5) % 7)] + [2]
        reqs.append(Request(i, prompt, SamplingParams(max_new_tokens=2 + (i * 3) % 6, temperature=0.7, seed=100 + i)))
    return reqs


@pytest.mark.parametrize("family,backend", [("deepseek_v3", None), ("glm_moe_dsa", None), ("glm_moe_dsa", "triton")])
@pytest.mark.parametrize("kv_cache", [True, False])
def test_logprobs_and_routing_match_teacher_forcing(family, backend, kv_cache):
    """backend "triton": the decode's sparse attention over the cache runs the Triton kernel."""
    model = _model(family, 1)
    engine_model = _model(family)
    engine_model.config.attn_backend = backend
    engine = InferenceEngine(engine_model, max_batch_size=3, kv_cache=kv_cache)
    engine.load_weights(model.state_dict(), version=0)
    outs = engine.generate(_requests(7))
    longest = 0
    for c in outs:
        seq = c.prompt + c.tokens
        longest = max(longest, len(seq))
        with torch.no_grad():
            logits = model(torch.tensor(seq), torch.arange(len(seq)), torch.tensor([0, len(seq)], dtype=torch.int32),
                           return_logits=True)
        lp = torch.log_softmax(logits.float() / 0.7, -1)
        P = len(c.prompt)
        want = lp[torch.arange(P - 1, len(seq) - 1), torch.tensor(c.tokens)]
        assert torch.allclose(torch.tensor(c.logprobs), want, atol=2e-5), (c.request_id, c.logprobs, want)
        n = len(seq) - 1
        assert torch.equal(c.routing, model.routing()[:n])
    assert longest > 2 * model.config.index_topk if family == "glm_moe_dsa" else True
