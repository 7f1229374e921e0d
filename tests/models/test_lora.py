"""LoRA on MoETransformer against Hugging Face + peft 0.21 (float32): the same adapters give the
same logits, adapters saved by one load in the other both ways; routed-expert LoRA against a
per-expert loop of lora_linear; merge / unmerge; the errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

from primerl.models import (LoRAError, MoETransformer, MoETransformerConfig, apply_lora, load_lora, merge_lora,
                            save_lora, unmerge_lora)
from primerl.models.lora import lora_parameters

from models_testing import hf_packed_logits, hf_qwen3_moe, packed_batch
from test_mla import hf_deepseek_v3

peft = pytest.importorskip("peft")

# what peft 0.21 can adapt on each family: the attention projections as modules, the routed experts'
# fused 3D weights as target_parameters. (peft converts the names gate_proj / up_proj / down_proj in
# target_modules to the routed experts on these model types, so the dense MLP and the shared experts
# are not targets peft reaches there; they are tested against Hugging Face through merge_lora.)
PEFT_TARGETS = {
    "qwen3_moe": (["q_proj", "k_proj", "v_proj", "o_proj"], hf_qwen3_moe),
    "deepseek_v3": (["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"], hf_deepseek_v3),
}
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
RANK, ALPHA = 4, 8.0
TOL = 1e-5


@pytest.fixture(scope="module", params=sorted(PEFT_TARGETS))
def family(request, tmp_path_factory):
    name = request.param
    hf = PEFT_TARGETS[name][1]()
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return name, path


def _randomize_adapters(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))


def _hf(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def _peft_lora_state(pm) -> dict[str, torch.Tensor]:
    return {k.replace(".default", ""): v for k, v in pm.state_dict().items() if "lora_" in k}


def test_ours_to_peft_same_logits(family, tmp_path):
    name, path = family
    ids, pos, cu = packed_batch(61)
    model = MoETransformer.from_pretrained(path)
    apply_lora(model, RANK, ALPHA, targets=PEFT_TARGETS[name][0] + ["experts"])
    _randomize_adapters(model)
    save_lora(model, tmp_path / "ad")
    hf = _hf(path)
    with torch.no_grad():
        base = hf_packed_logits(hf, ids, cu)
        pm = peft.PeftModel.from_pretrained(hf, tmp_path / "ad")
        ref = hf_packed_logits(pm, ids, cu)
        ours = model(ids, pos, cu, return_logits=True)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "ad" / "adapter_model.safetensors")
    loaded = _peft_lora_state(pm)
    assert set(loaded) == set(saved), sorted(set(loaded) ^ set(saved))[:4]  # every tensor reached a PEFT layer
    err = (ours - ref).abs().max().item()
    assert err <= TOL, f"{name}: max abs logits error vs peft {err:.3e}"
    assert (ref - base).abs().max() > 0.5  # the adapters matter


def test_peft_to_ours_same_logits(family, tmp_path):
    name, path = family
    ids, pos, cu = packed_batch(61, seed=1)
    hf = _hf(path)
    cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=PEFT_TARGETS[name][0],
                          target_parameters=EXPERT_PARAMS, init_lora_weights=False)
    pm = peft.get_peft_model(hf, cfg).eval()
    pm.save_pretrained(tmp_path / "ad")
    model = load_lora(MoETransformer.from_pretrained(path), tmp_path / "ad")
    assert model.lora.rank == RANK and "experts" in model.lora.targets
    with torch.no_grad():
        ref = hf_packed_logits(pm, ids, cu)
        ours = model(ids, pos, cu, return_logits=True)
        plain = hf_packed_logits(_hf(path), ids, cu)
    err = (ours - ref).abs().max().item()
    assert err <= TOL, f"{name}: max abs logits error vs peft {err:.3e}"
    assert (ref - plain).abs().max() > 0.5


def test_merge_matches_hf_with_merged_weights_every_target(family, tmp_path):
    """Every target incl. the dense MLP and shared experts: our adapted forward == Hugging Face on
    the merged weights; unmerge restores the base; save/load round trip keeps the logits."""
    name, path = family
    ids, pos, cu = packed_batch(61, seed=2)
    model = MoETransformer.from_pretrained(path)
    before = {k: v.clone() for k, v in model.named_parameters()}
    apply_lora(model, RANK, ALPHA)  # the default: every target
    kinds = {n.split(".")[-1] for n in model.lora.modules}
    assert {"experts", "gate_proj", "o_proj"} <= kinds
    _randomize_adapters(model, seed=3)
    with torch.no_grad():
        adapted = model(ids, pos, cu, return_logits=True)
        merge_lora(model)
        merged = model(ids, pos, cu, return_logits=True)
        model.save_pretrained(tmp_path / "merged")
        ref = hf_packed_logits(_hf(tmp_path / "merged"), ids, cu)
        unmerge_lora(model)
    tol = TOL * max(1.0, ref.abs().max().item())  # merged: W + s*B@A rounds once more in float32
    assert (adapted - merged).abs().max().item() <= tol
    assert (adapted - ref).abs().max().item() <= tol, f"{name}: vs HF on merged weights"
    after = dict(model.named_parameters())
    for k, v in before.items():
        assert torch.allclose(after[k], v, atol=1e-6), k
    save_lora(model, tmp_path / "ad")
    again = load_lora(MoETransformer.from_pretrained(path), tmp_path / "ad")
    with torch.no_grad():
        assert torch.equal(again(ids, pos, cu, return_logits=True), adapted)
    cfg = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == RANK and cfg["target_parameters"] == sorted(EXPERT_PARAMS)
    assert "mlp.gate_proj" in cfg["target_modules"]
    assert ("shared_experts.down_proj" in cfg["target_modules"]) == bool(model.config.num_shared_experts)
    assert again.lora.modules == model.lora.modules


def test_only_adapters_train():
    model = MoETransformer(MoETransformerConfig.tiny(vocab_size=50, family="deepseek_v3"))
    apply_lora(model, 2, 4.0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_parameters(model)) and trainable
    _randomize_adapters(model)
    ids, pos, cu = packed_batch(50)
    model(ids, pos, cu, return_logits=True).logsumexp(-1).sum().backward()
    for n, p in model.named_parameters():
        assert (p.grad is not None and p.grad.abs().sum() > 0) == (n in trainable), n


def test_routed_expert_lora_matches_per_expert_loop_of_lora_linear():
    from primerl.kernels.lora import lora_linear
    from primerl.models.moe import MoE

    torch.manual_seed(0)
    moe = MoE(32, 16, 6, 2).float()
    holder = torch.nn.Module()
    holder.config = MoETransformerConfig.tiny()
    spec_model = type("M", (), {})  # apply_lora works on models; wrap the experts directly here
    del spec_model
    from primerl.models.lora import LoRASpec, _wrap_experts

    for p in moe.parameters():
        p.requires_grad_(False)
    _wrap_experts("experts", moe.experts, LoRASpec(rank=3, alpha=6.0, targets=("experts",)))
    ex = moe.experts
    with torch.no_grad():
        for p in (ex.lora_B13, ex.lora_B2):
            p.normal_(0, 0.5)
    x = torch.randn(11, 32)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(11)])
    w = torch.rand(11, 2)
    y = ex(x, ids, w)
    grads = torch.autograd.grad(y.square().sum(), [ex.lora_A13, ex.lora_B13, ex.lora_A2, ex.lora_B2])
    ref = torch.zeros_like(x)
    for t in range(11):
        for j in range(2):
            e = int(ids[t, j])
            gu = lora_linear(x[t:t + 1], ex.w13[e], ex.lora_A13[e], ex.lora_B13[e], 2.0)
            g, u = gu.chunk(2, -1)
            h = torch.nn.functional.silu(g) * u
            ref[t] += w[t, j] * lora_linear(h, ex.w2[e], ex.lora_A2[e], ex.lora_B2[e], 2.0)[0]
    ref_grads = torch.autograd.grad(ref.square().sum(), [ex.lora_A13, ex.lora_B13, ex.lora_A2, ex.lora_B2])
    assert (y - ref).abs().max().item() <= 1e-5
    for name, g, r in zip(("A13", "B13", "A2", "B2"), grads, ref_grads):
        assert (g - r).abs().max().item() <= 1e-4 * max(1.0, r.abs().max().item()), name
    # the expert-parallel entry (rows already grouped by expert) computes the same rows
    order = torch.argsort(ids.flatten(), stable=True)
    counts = torch.bincount(ids.flatten(), minlength=6)
    x_recv = x.repeat_interleave(2, 0)[order]
    y_recv = ex.forward_grouped(x_recv, counts)
    y2 = torch.zeros_like(x).index_add_(0, order // 2, y_recv * w.flatten()[order, None])
    assert (y2 - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("bad, match", [
    (dict(rank=0), "rank must be an integer >= 1"),
    (dict(targets=["q_proj", "qkv"]), "unknown target 'qkv'"),
    (dict(targets=["k_proj"]), "target 'k_proj' matches no module"),
    (dict(dropout=0.1), "dropout=0.1 with target 'experts'"),
    (dict(alpha=0), "alpha must be a positive number"),
])
def test_apply_lora_errors(bad, match):
    model = MoETransformer(MoETransformerConfig.tiny(vocab_size=50, family="deepseek_v3"))
    args = dict(rank=2, alpha=4.0, targets=("attention", "experts"), dropout=0.0)
    args.update(bad)
    with pytest.raises(LoRAError, match=match):
        apply_lora(model, **args)


def test_lora_where_the_base_cannot_pair_is_refused():
    sparse = MoETransformer(MoETransformerConfig.tiny(vocab_size=50, family="glm_moe_dsa"))
    with pytest.raises(LoRAError, match="kv_b_proj"):
        apply_lora(sparse, 2, 4.0, targets=["attention"])
    apply_lora(sparse, 2, 4.0, targets=["q_a_proj", "o_proj"])  # the rest of its attention is fine
    model = MoETransformer(MoETransformerConfig.tiny(vocab_size=50))
    model.layers[0].attention.q_proj.weight.data = model.layers[0].attention.q_proj.weight.data.to(
        torch.float8_e4m3fn)
    with pytest.raises(LoRAError, match=r"layers\.0\.attention\.q_proj\.weight is stored as torch.float8_e4m3fn"):
        apply_lora(model, 2, 4.0, targets=["q_proj"])


def test_load_lora_errors_name_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = MoETransformerConfig.tiny(vocab_size=50)
    model = apply_lora(MoETransformer(cfg), 2, 4.0, targets=["q_proj", "experts"])
    save_lora(model, tmp_path / "ok")
    tensors = load_file(tmp_path / "ok" / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

    def variant(name, change):
        d = tmp_path / name
        os.makedirs(d)
        (d / "adapter_config.json").write_text((tmp_path / "ok" / "adapter_config.json").read_text())
        save_file(change(dict(tensors)), d / "adapter_model.safetensors")
        return d

    wrong_shape = variant("shape", lambda t: {**t, key: torch.zeros(2, 63)})
    with pytest.raises(LoRAError, match=rf"tensor '{key}' has shape \(2, 63\).*expects \(2, 64\)"):
        load_lora(MoETransformer(cfg), wrong_shape)
    extra = variant("extra", lambda t: {**t, key.replace("q_proj", "k_proj"): torch.zeros(2, 64)})
    with pytest.raises(LoRAError, match="k_proj.lora_A.weight', which no adapter"):
        load_lora(MoETransformer(cfg), extra)
    missing = variant("missing", lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(LoRAError, match="lacks 1 adapter tensor"):
        load_lora(MoETransformer(cfg), missing)
    other_rank = apply_lora(MoETransformer(cfg), 3, 4.0, targets=["q_proj", "experts"])
    with pytest.raises(LoRAError, match="r=2"):
        load_lora(other_rank, tmp_path / "ok")
    with pytest.raises(LoRAError, match="adapter_config.json does not exist"):
        load_lora(MoETransformer(cfg), tmp_path)
