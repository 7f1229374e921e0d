"""convert_to_fp8 on the model: logits SQNR >= 20 dB against the bf16 model, gradients flow, the
head/router/embedding stay in high precision."""

from __future__ import annotations

import copy

import torch

from primerl.kernels.testing import sqnr_db
from primerl.models import MoETransformer, MoETransformerConfig
from primerl.models.fp8 import convert_to_fp8, default_fp8_filter

from models_testing import packed_batch


def _fp8_sized_model():
    cfg = MoETransformerConfig.tiny(vocab_size=256, dim=128, n_heads=2, n_kv_heads=1, head_dim=128, moe_dim=128,
                                    ffn_dim=256, num_experts=4, top_k=2)
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    model.init_weights(seed=0)
    return model.to(torch.bfloat16)


def test_default_filter_selects_decoder_matrices():
    model = _fp8_sized_model()
    chosen = [n for n, m in model.named_modules() if default_fp8_filter(n, m)]
    assert "layers.0.attention.q_proj" in chosen and "layers.1.ffn.experts" in chosen
    assert not any(n.endswith(("gate", "lm_head", "embed")) for n in chosen)
    small = MoETransformer(MoETransformerConfig.tiny())
    assert not [n for n, m in small.named_modules() if default_fp8_filter(n, m)]  # d=64: nothing 128-aligned


def test_fp8_logits_sqnr():
    ref = _fp8_sized_model()
    fp8 = convert_to_fp8(copy.deepcopy(ref), "blockwise")
    assert type(fp8.layers[0].attention.q_proj) is not torch.nn.Linear
    assert type(fp8.lm_head) is torch.nn.Linear
    assert all(layer.ffn.experts.fp8_recipe == "blockwise" for layer in fp8.moe_layers)
    for module in fp8.modules():  # the reference backend: the Triton kernels are the GEMM tests' business,
        if hasattr(module, "backend") and module.backend is None:  # and slow under the CPU interpreter
            module.backend = "torch"
    ids, pos, cu = packed_batch(256, seq_lens=(20, 7, 37))
    with torch.no_grad():
        want = ref(ids, pos, cu, return_logits=True).float()
    got = fp8(ids, pos, cu, return_logits=True)
    sqnr = sqnr_db(want, got.detach().float())
    assert sqnr >= 20.0, f"logits SQNR {sqnr:.1f} dB"
    got.float().square().mean().backward()
    assert all(p.grad is not None for n, p in fp8.named_parameters() if n.startswith("layers.") and p.requires_grad)
