"""Tiny random Hugging Face Qwen3-MoE / GLM-4.5-MoE models built locally (no download) and packed
batches, shared by the model tests."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

SEQ_LENS = (5, 1, 9, 3)


def _perturb(model, seed: int) -> None:
    """Weights large enough that routing and attention are far from uniform (HF's default 0.02
    init makes every logit ~0 and any error invisible); norms around one; GLM's correction bias
    random so it changes selection."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def hf_qwen3_moe(**overrides):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    kw = dict(vocab_size=61, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
              norm_topk_prob=True, mlp_only_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
              attn_implementation="eager")
    kw.update(overrides)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kw)).eval()
    _perturb(model, 1)
    return model


def hf_glm4_moe(**overrides):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    kw = dict(vocab_size=61, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=3,
              n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
              use_qk_norm=True, attention_bias=True,
              rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
              attn_implementation="eager")
    kw.update(overrides)
    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**kw)).eval()
    _perturb(model, 2)
    return model


HF_BUILDERS = {"qwen3_moe": hf_qwen3_moe, "glm4_moe": hf_glm4_moe}


def packed_batch(vocab_size: int, seq_lens=SEQ_LENS, seed: int = 0):
    """input_ids[T], position_ids[T], cu_seqlens[B+1] int32 for sequences of ``seq_lens``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (sum(seq_lens),), generator=g)
    pos = torch.cat([torch.arange(n) for n in seq_lens])
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(seq_lens).cumsum(0)
    return ids, pos, cu


def hf_packed_logits(hf_model, ids, cu):
    """Hugging Face's logits ``[T, V]``: each sequence run on its own, then concatenated."""
    out = []
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        out.append(hf_model(input_ids=ids[s:e][None]).logits[0])
    return torch.cat(out, 0)
