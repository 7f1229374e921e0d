"""MoETransformerConfig.attn_backend: the model runs its attention on the named kernel backend
("sdpa": torch's fused kernels) with the same logits and gradients as the default, and the field
is a runtime choice that never reaches config.json."""

from __future__ import annotations

import pytest
import torch

from primerl.models import MoETransformer, MoETransformerConfig

from models_testing import packed_batch


def _loss_and_grads(model, ids, pos, cu):
    model.zero_grad(set_to_none=True)
    logits = model(ids, pos, cu, return_logits=True)
    logits.logsumexp(-1).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_sdpa_backend_matches_default(family, monkeypatch):
    torch.manual_seed(0)
    model = MoETransformer(MoETransformerConfig.tiny(vocab_size=53, family=family))
    model.init_weights(seed=1)
    ids, pos, cu = packed_batch(53, seq_lens=(4, 7, 1, 7))
    ref_logits, ref_grads = _loss_and_grads(model, ids, pos, cu)

    from primerl.kernels.attention import sdpa

    calls = []
    real = sdpa.forward
    monkeypatch.setattr(sdpa, "forward", lambda *a: calls.append(1) or real(*a))
    model.config.attn_backend = "sdpa"  # settable after construction: every layer reads it per forward
    logits, grads = _loss_and_grads(model, ids, pos, cu)
    assert len(calls) == model.config.n_layers
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_attn_backend_is_not_part_of_the_checkpoint_config():
    cfg = MoETransformerConfig.tiny(vocab_size=100, attn_backend="sdpa")
    assert "attn_backend" not in cfg.to_hf()
    assert MoETransformerConfig.from_hf(cfg.to_hf()).attn_backend is None
    with pytest.raises(ValueError, match="attn_backend"):
        MoETransformerConfig.tiny(vocab_size=100, attn_backend=3)
