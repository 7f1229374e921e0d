"""DeepSeek-V3 (MLA) and GLM-5 (MLA + DeepSeek sparse attention) against Hugging Face's
``DeepseekV3ForCausalLM`` / ``GlmMoeDsaForCausalLM`` in float32: logits over packed batches (one
sequence longer than ``index_topk``, so the sparse path runs), gradients, routing replay, save /
load round trip."""

from __future__ import annotations

import pytest
import torch

from primerl.models import MoETransformer, MoETransformerConfig
from primerl.models.checkpoint import hf_layout

from models_testing import assert_grads_match_hf, hf_packed_logits, hf_tiny, packed_batch

transformers = pytest.importorskip("transformers")

INDEX_TOPK = 6
SEQ_LENS = (5, 1, 17, 3, 9)  # 17 and 9 > INDEX_TOPK: sparse; the rest select every key


# DeepSeek-V3 and GLM-5 (glm_moe_dsa) share the MLA and routing settings
_MLA = dict(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1,
            first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16,
            qk_nope_head_dim=12, qk_rope_head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})


def hf_deepseek_v3(**overrides):
    return hf_tiny("DeepseekV3", 3, **{**_MLA, "v_head_dim": 10, **overrides})


def hf_glm_moe_dsa(**overrides):
    return hf_tiny("GlmMoeDsa", 4, **{**_MLA, "v_head_dim": 16, "index_topk": INDEX_TOPK, "index_head_dim": 16,
                                      "index_n_heads": 8, **overrides})


BUILDERS = {"deepseek_v3": hf_deepseek_v3, "glm_moe_dsa": hf_glm_moe_dsa,
            "deepseek_v3_no_q_lora": lambda: hf_deepseek_v3(q_lora_rank=None, rope_interleave=False),
            # Kimi-K2 / DeepSeek-V3 checkpoints extend the context with YaRN (mscale on the softmax scale too)
            "deepseek_v3_yarn": lambda: hf_deepseek_v3(max_position_embeddings=64, rope_parameters={
                "rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 8,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
            "glm_moe_dsa_shared_indexer": lambda: hf_glm_moe_dsa(indexer_types=["full", "shared", "full"])}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def loaded(request, tmp_path_factory):
    name = request.param
    hf_model = BUILDERS[name]()
    path = tmp_path_factory.mktemp(name)
    hf_model.save_pretrained(path)
    return name, hf_model, MoETransformer.from_pretrained(path), path


def test_config_reads_mla_fields(loaded):
    name, hf_model, model, _ = loaded
    c, h = model.config, hf_model.config
    assert c.family == h.model_type and c.is_mla
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == \
        (h.q_lora_rank, h.kv_lora_rank, h.qk_nope_head_dim, h.qk_rope_head_dim, h.v_head_dim)
    assert c.head_dim == h.qk_nope_head_dim + h.qk_rope_head_dim
    if c.is_sparse:
        assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (h.index_n_heads, h.index_head_dim, h.index_topk)
        assert list(c.indexer_types) == list(h.indexer_types)
    assert c.num_params() == _params_without_block_norms(model)


def _params_without_block_norms(model):  # num_params() leaves out the pre-norms, as for the other families
    return sum(p.numel() for n, p in model.named_parameters()
               if not (n.endswith("attention_norm.weight") or n.endswith("ffn_norm.weight") or n == "norm.weight"))


def test_logits_match_hf_packed(loaded):
    name, hf_model, model, _ = loaded
    ids, pos, cu = packed_batch(model.config.vocab_size, SEQ_LENS)
    with torch.no_grad():
        ours = model(ids, pos, cu, return_logits=True)
        ref = hf_packed_logits(hf_model, ids, cu)
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4, f"{name}: max abs logits error {err:.3e}"
    assert ref.abs().max() > 1.0


def test_sparse_path_is_exercised_and_matters():
    """With topk below the longest sequence the sparse form runs, and it differs from dense attention
    (so the logits test above could catch a wrong selection)."""
    hf_model = hf_glm_moe_dsa()
    cfg = MoETransformerConfig.from_hf(hf_model.config.to_dict())
    model = MoETransformer(cfg)
    ours = {n: p for n, p in model.named_parameters()}
    with torch.no_grad():
        for key, slot in hf_layout(model, "fused").items():
            src = dict(hf_model.named_parameters()).get(key)
            if src is None:
                src = dict(hf_model.named_buffers())[key]
                dict(model.named_buffers())[slot.param].copy_(src)
            else:
                ours[slot.param].copy_(src)
    ids, pos, cu = packed_batch(cfg.vocab_size, SEQ_LENS)
    calls = []
    import primerl.models.mla as mla

    real = mla.MLAttention._sparse
    mla.MLAttention._sparse = lambda self, *a: calls.append(1) or real(self, *a)
    try:
        with torch.no_grad():
            sparse = model(ids, pos, cu, return_logits=True)
    finally:
        mla.MLAttention._sparse = real
    assert len(calls) == cfg.n_layers
    model.config.index_topk = max(SEQ_LENS)
    with torch.no_grad():
        dense = model(ids, pos, cu, return_logits=True)
    model.config.index_topk = INDEX_TOPK
    start = sum(SEQ_LENS[:2])
    assert (sparse - dense)[start + INDEX_TOPK:start + 17].abs().max() > 1e-2
    assert (sparse - dense)[:start].abs().max() < 1e-4  # same attention, absorbed vs per-head arithmetic


def test_gradients_match_hf(loaded):
    name, hf_model, model, _ = loaded
    ids, pos, cu = packed_batch(model.config.vocab_size, SEQ_LENS, seed=1)
    # the indexer is frozen: no gradient on either side
    assert assert_grads_match_hf(name, hf_model, model, ids, pos, cu, frozen=lambda key: ".indexer." in key) > 20


def test_routing_replay_bitwise(loaded):
    _, _, model, _ = loaded
    ids, pos, cu = packed_batch(model.config.vocab_size, SEQ_LENS, seed=2)
    with torch.no_grad():
        live = model(ids, pos, cu, return_logits=True)
        routing = model.routing()
        assert routing.shape == (ids.shape[0], len(model.config.moe_layer_ids), model.config.top_k)
        replayed = model(ids, pos, cu, replay_ids=routing, return_logits=True)
    assert torch.equal(live, replayed)


def test_save_load_round_trip(loaded, tmp_path):
    name, hf_model, model, _ = loaded
    model.save_pretrained(tmp_path)
    again = MoETransformer.from_pretrained(tmp_path)
    assert again.config == model.config
    theirs = again.state_dict()
    for n, a in model.state_dict().items():
        if not n.endswith("tokens_per_expert"):  # a load counter, not part of the checkpoint
            assert torch.equal(a, theirs[n]), n
    # and Hugging Face reads what we wrote
    from transformers import AutoModelForCausalLM

    hf_again = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids, pos, cu = packed_batch(model.config.vocab_size, SEQ_LENS, seed=4)
    with torch.no_grad():
        err = (hf_packed_logits(hf_again, ids, cu) - model(ids, pos, cu, return_logits=True)).abs().max().item()
    assert err <= 1e-4, f"{name}: HF reloading our save: {err:.3e}"


@pytest.mark.parametrize("family", ["deepseek_v3", "glm_moe_dsa"])
def test_tiny_configs_build_and_run(family):
    cfg = MoETransformerConfig.tiny(vocab_size=50, family=family)
    model = MoETransformer(cfg)
    ids, pos, cu = packed_batch(50, (4, 20, 7))
    logits = model(ids, pos, cu, return_logits=True)
    assert logits.shape == (31, 50) and torch.isfinite(logits).all()
    logits.sum().backward()
    assert cfg.num_params() == _params_without_block_norms(model)


def test_mla_config_errors():
    with pytest.raises(ValueError, match="kv_lora_rank must be positive exactly"):
        MoETransformerConfig.tiny(family="deepseek_v3", kv_lora_rank=0)
    with pytest.raises(ValueError, match="MLA head_dim"):
        MoETransformerConfig.tiny(family="deepseek_v3", head_dim=16)
    with pytest.raises(ValueError, match="indexer_types"):
        MoETransformerConfig.tiny(family="glm_moe_dsa", indexer_types=("shared", "full", "full"))


def test_trainer_padded_plan_matches_packed_forward():
    """The trainer's CPU fast path (runtime.padded_attention: SDPA over padded sequences, reached
    through the context_attention hook) gives the packed forward's output on both forms."""
    from primerl.runtime.trainer.padded_attention import padded_forward

    for family in ("deepseek_v3", "glm_moe_dsa"):
        torch.manual_seed(0)
        model = MoETransformer(MoETransformerConfig.tiny(vocab_size=50, family=family, index_topk=5)
                               if family == "glm_moe_dsa" else MoETransformerConfig.tiny(vocab_size=50, family=family))
        ids, pos, cu = packed_batch(50, SEQ_LENS)
        with torch.no_grad():
            want = model(ids, pos, cu)
            got = padded_forward(model, ids, pos, cu)
        assert (got - want).abs().max() < 1e-5, family


def test_fp8_conversion_of_a_glm5_model():
    """convert_to_fp8 on GLM-5-style MLA: q/o projections go FP8; the indexer and kv_b_proj stay;
    the sparse forward runs and keeps the logits within 15 dB SQNR of bf16 (measured 17.7: below the
    dense families' 20 dB because FP8 noise in the indexer's input flips some top-k choices),
    gradients flow."""
    import copy

    from primerl.kernels.testing import sqnr_db
    from primerl.models.fp8 import convert_to_fp8

    cfg = MoETransformerConfig.tiny(vocab_size=256, family="glm_moe_dsa", dim=128, n_heads=2, n_kv_heads=2,
                                    q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=48, qk_rope_head_dim=16,
                                    head_dim=64, v_head_dim=64, moe_dim=128, ffn_dim=256, num_experts=4, top_k=2,
                                    index_n_heads=2, index_head_dim=128, index_topk=8)
    torch.manual_seed(0)
    ref = MoETransformer(cfg)
    ref.init_weights(seed=0)
    ref = ref.to(torch.bfloat16)
    fp8 = convert_to_fp8(copy.deepcopy(ref), "blockwise")
    att = fp8.layers[1].attention
    assert type(att.q_a_proj) is not torch.nn.Linear and type(att.o_proj) is not torch.nn.Linear
    assert type(att.kv_b_proj) is torch.nn.Linear and type(att.indexer.wq_b) is torch.nn.Linear
    for module in fp8.modules():
        if hasattr(module, "backend") and module.backend is None:
            module.backend = "torch"
    ids, pos, cu = packed_batch(256, (20, 7, 13))
    with torch.no_grad():
        want = ref(ids, pos, cu, return_logits=True).float()
    got = fp8(ids, pos, cu, return_logits=True)
    assert sqnr_db(want, got.detach().float()) >= 15.0
    got.float().square().mean().backward()
    assert att.q_b_proj.weight.grad is not None and att.kv_b_proj.weight.grad is not None


@pytest.mark.parametrize("name", ["deepseek_v3", "glm_moe_dsa"])
def test_triton_backend_in_the_model_matches_reference(name, tmp_path):
    """attn_backend="triton": the model's dense MLA (native two-width kernels), the indexer's scores
    and the sparse attention (absorbed form, fused dK/dV backward) run the Triton kernels (the CPU
    interpreter here) and give the reference backend's logits and gradients. (Against Hugging Face
    directly this batch would not do: its last layer has two keys of exactly zero index score at
    the top-k boundary, where HF's torch.topk and our stable sort pick different ones.)"""
    BUILDERS[name]().save_pretrained(tmp_path)
    ids, pos, cu = packed_batch(61, SEQ_LENS, seed=5)
    targets = torch.roll(ids, -1)
    runs = {}
    for backend in ("torch", "triton"):
        model = MoETransformer.from_pretrained(tmp_path)
        model.config.attn_backend = backend
        logits = model(ids, pos, cu, return_logits=True)
        torch.nn.functional.cross_entropy(logits, targets).backward()
        runs[backend] = logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    (want, want_g), (got, got_g) = runs["torch"], runs["triton"]
    assert (got - want).abs().max().item() <= 1e-4
    assert want_g.keys() == got_g.keys() and any(".attention." in n for n in got_g)
    for n, g in want_g.items():
        err = (got_g[n] - g).abs().max().item()
        assert err <= 1e-4 * max(1.0, g.abs().max().item()), f"{n}: {err:.3e}"


def test_shared_indexer_layers_under_activation_checkpointing():
    """Blocks recomputed in the backward (in reverse order) still give a shared-indexer layer its own
    source layer's selection: loss and every gradient as without checkpointing."""
    from primerl.parallel.fsdp import apply_activation_checkpointing

    cfg = MoETransformerConfig.tiny(vocab_size=50, family="glm_moe_dsa", n_layers=4, index_topk=3,
                                    indexer_types=("full", "shared", "full", "shared"))
    ids, pos, cu = packed_batch(50, SEQ_LENS, seed=6)
    runs = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = MoETransformer(cfg)
        with torch.no_grad():  # weights large enough that the selections differ between layers
            for p in model.parameters():
                if p.ndim >= 2:
                    p.mul_(20.0)
        if checkpointed:
            apply_activation_checkpointing(model, "full")
        loss = torch.nn.functional.cross_entropy(model(ids, pos, cu, return_logits=True), torch.roll(ids, -1))
        loss.backward()
        runs.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = runs
    assert l0 == l1 and g0.keys() == g1.keys()
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
