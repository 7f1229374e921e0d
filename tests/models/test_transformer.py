"""MoETransformer on its own: the tiny configs, packing invariance, replay semantics, input checks."""

from __future__ import annotations

import pytest
import torch

from primerl.models import MoETransformer, MoETransformerConfig

from models_testing import packed_batch


@pytest.fixture(params=["qwen3_moe", "glm4_moe"])
def tiny(request):
    torch.manual_seed(0)
    model = MoETransformer(MoETransformerConfig.tiny(vocab_size=53, family=request.param))
    model.init_weights(seed=1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(20.0)  # std 0.4: routing and attention far from uniform
    return model


def test_tiny_config_shape():
    cfg = MoETransformerConfig.tiny(vocab_size=100)
    assert (cfg.n_layers, cfg.dim, cfg.num_experts) == (2, 64, 4)
    glm = MoETransformerConfig.tiny(vocab_size=100, family="glm4_moe")
    assert glm.dense_layers == (0,) and glm.moe_layer_ids == (1, 2) and glm.rotary_dim == 8
    assert MoETransformerConfig.from_hf(glm.to_hf()) == glm
    assert MoETransformerConfig.from_hf(cfg.to_hf()) == cfg


def test_packing_is_invariant(tiny):
    """A sequence's logits do not depend on what else is packed with it (up to summation order)."""
    ids, pos, cu = packed_batch(53, seq_lens=(4, 7, 2))
    with torch.no_grad():
        packed = tiny(ids, pos, cu, return_logits=True)
        alone = tiny(ids[4:11], pos[4:11], torch.tensor([0, 7], dtype=torch.int32), return_logits=True)
    torch.testing.assert_close(packed[4:11], alone, rtol=1e-5, atol=1e-5)


def test_forward_backward_and_structure(tiny):
    ids, pos, cu = packed_batch(53)
    h = tiny(ids, pos, cu)
    assert h.shape == (ids.shape[0], 64)
    h.square().mean().backward()
    missing = [n for n, p in tiny.named_parameters() if p.grad is None]
    assert missing == ["lm_head.weight"]  # only the head is unused by the hidden-state loss
    q, k, v = tiny.layers[0].attention.project_qkv(torch.randn(3, 64), torch.arange(3))
    assert q.shape == (3, 4, 16) and k.shape == v.shape == (3, 2, 16)


def test_replay_of_other_ids_changes_the_output(tiny):
    ids, pos, cu = packed_batch(53)
    with torch.no_grad():
        live = tiny(ids, pos, cu, return_logits=True)
        routing = tiny.routing()
        other = routing.roll(1, dims=-1)  # same sets, different order: the same experts, weights re-gathered
        same_set = tiny(ids, pos, cu, replay_ids=other, return_logits=True)
        flipped = (tiny.config.num_experts - 1 - routing.long())
        moved = tiny(ids, pos, cu, replay_ids=flipped, return_logits=True)
    torch.testing.assert_close(same_set, live, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(moved, live, atol=1e-3)
    assert torch.equal(tiny.routing(), flipped.to(torch.uint8))


def test_routing_dtype():
    assert MoETransformerConfig.tiny(num_experts=256, top_k=2).routing_dtype() == torch.uint8
    assert MoETransformerConfig.tiny(num_experts=257, top_k=2).routing_dtype() == torch.uint16
    with pytest.raises(RuntimeError, match="forward first"):
        MoETransformer(MoETransformerConfig.tiny()).routing()


def test_input_errors(tiny):
    ids, pos, cu = packed_batch(53)
    L, k = len(tiny.config.moe_layer_ids), tiny.config.top_k
    with pytest.raises(ValueError, match="input_ids must be a 1-D integer"):
        tiny(ids[None], pos, cu)
    with pytest.raises(ValueError, match="position_ids must have shape"):
        tiny(ids, pos[:-1], cu)
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing from 0 to T"):
        tiny(ids, pos, cu[:-1])
    with pytest.raises(ValueError, match="cu_seqlens must be an int32"):
        tiny(ids, pos, cu.float())
    with pytest.raises(ValueError, match=r"replay_ids must have shape \[T, L, k\]"):
        tiny(ids, pos, cu, replay_ids=torch.zeros(ids.shape[0], L, k + 1, dtype=torch.int32))
    bad = torch.zeros(ids.shape[0], L, k, dtype=torch.int64)  # a repeated expert in every row
    with pytest.raises(ValueError, match="repeated expert"):
        tiny(ids, pos, cu, replay_ids=bad)


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_heads=3, n_kv_heads=2), "multiple of n_kv_heads"),
    (dict(top_k=5), "top_k"),
    (dict(partial_rotary_factor=0.1), "rotary dim"),
    (dict(dense_layers=(7,)), "dense_layers"),
    (dict(family="llama"), "family"),
    (dict(score_func="relu"), "score_func"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoETransformerConfig.tiny(**kwargs)
