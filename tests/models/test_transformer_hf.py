"""MoETransformer against Hugging Face's Qwen3-MoE and GLM-4.5-MoE in float32: logits over packed
batches, gradients of a loss, routing capture and replay."""

from __future__ import annotations

import pytest
import torch

from primerl.models import MoETransformer

from models_testing import assert_grads_match_hf, hf_packed_logits, packed_batch


@pytest.fixture(scope="module")
def loaded(hf_checkpoint):
    family, hf_model, path = hf_checkpoint
    return family, hf_model, MoETransformer.from_pretrained(path)


def test_logits_match_hf_packed(loaded):
    family, hf_model, model = loaded
    ids, pos, cu = packed_batch(model.config.vocab_size)
    with torch.no_grad():
        ours = model(ids, pos, cu, return_logits=True)
        ref = hf_packed_logits(hf_model, ids, cu)
    assert ours.shape == ref.shape == (ids.shape[0], model.config.vocab_size)
    err = (ours - ref).abs().max().item()
    assert err < 1e-4, f"{family}: max abs logits error {err:.3e}"
    assert ref.abs().max() > 1.0  # the weights are large enough for the comparison to mean something


def test_hidden_states_are_default_output(loaded):
    _, _, model = loaded
    ids, pos, cu = packed_batch(model.config.vocab_size, seed=3)
    with torch.no_grad():
        h = model(ids, pos, cu)
        logits = model(ids, pos, cu, return_logits=True)
    assert h.shape == (ids.shape[0], model.config.dim)
    torch.testing.assert_close(model.lm_head(h), logits, rtol=0, atol=0)


def test_gradients_match_hf(loaded):
    family, hf_model, model = loaded
    ids, pos, cu = packed_batch(model.config.vocab_size, seed=1)
    checked = assert_grads_match_hf(family, hf_model, model, ids, pos, cu)
    assert checked >= len(dict(hf_model.named_parameters())) - 1


def test_routing_capture_and_replay_bitwise(loaded):
    _, _, model = loaded
    ids, pos, cu = packed_batch(model.config.vocab_size, seed=2)
    with torch.no_grad():
        live = model(ids, pos, cu, return_logits=True)
        routing = model.routing()
        L, k = len(model.config.moe_layer_ids), model.config.top_k
        assert routing.shape == (ids.shape[0], L, k) and routing.dtype == torch.uint8
        assert int(routing.max()) < model.config.num_experts
        replayed = model(ids, pos, cu, replay_ids=routing, return_logits=True)
    assert torch.equal(live, replayed)
    assert torch.equal(model.routing(), routing)
