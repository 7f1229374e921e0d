"""Optional integrations: transformers' Auto classes load a checkpoint saved through the wrapper."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from primerl.models import MoETransformerConfig  # noqa: E402


def test_auto_model_round_trip(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from primerl.models.integrations.transformers import PrimerlMoeForCausalLM, register

    register()
    register()  # idempotent
    torch.manual_seed(0)
    model = PrimerlMoeForCausalLM.from_config(MoETransformerConfig.tiny(vocab_size=50, family="glm4_moe")).eval()
    model.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).to_primerl() == model.model.config
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(again, PrimerlMoeForCausalLM)
    ref = model.state_dict()
    got = again.state_dict()
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)

    ids = torch.randint(0, 50, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=ids)
        torch.testing.assert_close(again(ids, attention_mask=mask).logits, out.logits, rtol=1e-6, atol=1e-6)
        alone = model(ids[1:, :5]).logits
    torch.testing.assert_close(out.logits[1, :5], alone[0], rtol=1e-5, atol=1e-5)
    assert torch.all(out.logits[1, 5:] == 0) and torch.isfinite(out.loss)
    with pytest.raises(ValueError, match="right padding"):
        model(ids, attention_mask=mask.flip(1))

