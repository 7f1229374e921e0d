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


# the size every tiny Hugging Face model of these tests shares
HF_TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=3,
               num_attention_heads=4, attn_implementation="eager")


def hf_tiny(family: str, perturb_seed: int, **kw):
    """``transformers``' ``<family>ForCausalLM`` at HF_TINY size with ``kw``, seeded, in eval mode,
    its norms and biases perturbed away from their initial values."""
    import transformers

    config = getattr(transformers, f"{family}Config")(**{**HF_TINY, **kw})
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    _perturb(model, perturb_seed)
    return model


def hf_qwen3_moe(**overrides):
    return hf_tiny("Qwen3Moe", 1, **{**dict(
        num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
        mlp_only_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 1000.0}), **overrides})


def hf_glm4_moe(**overrides):
    return hf_tiny("Glm4Moe", 2, **{**dict(
        num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1,
        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5}), **overrides})


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


def assert_grads_match_hf(tag: str, hf_model, model, ids, pos, cu, frozen=lambda hf_key: False) -> int:
    """Next-token cross-entropy gradients of ``model`` and ``hf_model`` on one packed batch agree
    per parameter (max abs error <= 1e-4 x max(1, the HF gradient's largest element)); parameters
    ``frozen`` names get no gradient on either side. -> the number of gradients compared."""
    from primerl.models.checkpoint import hf_layout

    targets = torch.roll(ids, -1)
    model.zero_grad(set_to_none=True)
    hf_model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(ids, pos, cu, return_logits=True), targets).backward()
    torch.nn.functional.cross_entropy(hf_packed_logits(hf_model, ids, cu), targets).backward()
    hf_params, ours = dict(hf_model.named_parameters()), dict(model.named_parameters())
    checked = 0
    for hf_key, slot in hf_layout(model, "fused").items():
        if hf_key not in hf_params:  # a buffer in HF (e.g. e_score_correction_bias): no gradient
            continue
        g_ref, g = hf_params[hf_key].grad, ours[slot.param].grad
        if frozen(hf_key):
            assert g is None and g_ref is None, hf_key
            continue
        assert g is not None and g_ref is not None, hf_key
        scale = g_ref.abs().max().item() + 1e-12
        err = (g.float() - g_ref.float()).abs().max().item()
        assert err <= 1e-4 * max(1.0, scale), f"{tag} grad {hf_key}: max abs err {err:.3e} (scale {scale:.3e})"
        checked += 1
    return checked
