"""Gold test for the MLA families: a tiny GLM-5-style model (MLA + DeepSeek sparse attention with
a shared-indexer layer, index_topk below most sequence lengths so the sparse form runs) and a
tiny DeepSeek-V3-style model train 3 AdamW steps on 4 gloo ranks with the same losses, step-0
gradients and final parameters as one process (1e-5 relative; the harness of test_parity.py).

Layouts: cp=2 (the sparse form gathers every rank's latent KV: keys selected on the other rank),
cp=2 x ep=2, FSDP over 4 with ep=2, and DeepSeek-V3 at cp=2 x ep=2 (dense MLA: ring attention with
V zero-padded); live routing, and replayed routing at cp=2 x ep=2. The frozen indexer gets no
gradient on either side and stays unchanged.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _parallel_dist import spawn
from primerl.models import MoETransformer, MoETransformerConfig
from primerl.models.parallelize import parallelize
from primerl.parallel.mesh import ParallelDims
from test_parity import ADAM_EPS, LOSS_RTOL, GRAD_RTOL, LR, PARAM_RTOL, VOCAB, compare, local_batch, make_batches, pack, \
    token_loss_sum

WORLD = 4
MLA = dict(vocab_size=VOCAB, dim=16, n_heads=2, n_kv_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
           qk_rope_head_dim=4, head_dim=12, ffn_dim=16, moe_dim=8, num_experts=8, top_k=2)
CONFIGS = {
    "glm5": MoETransformerConfig.tiny(family="glm_moe_dsa", **MLA, v_head_dim=12, index_n_heads=2, index_head_dim=8,
                                      index_topk=3, indexer_types=("full", "shared", "full")),
    "dsv3": MoETransformerConfig.tiny(family="deepseek_v3", **MLA, v_head_dim=8),
}
LAYOUTS = {  # name -> (config, ParallelDims kwargs, replay modes)
    "glm5_cp2": ("glm5", dict(dp_shard=2, cp=2), (False,)),
    "glm5_cp2_ep2": ("glm5", dict(dp_shard=2, cp=2, ep=2), (False, True)),
    "glm5_efsdp2_ep2": ("glm5", dict(dp_shard=4, ep=2), (False,)),
    "dsv3_cp2_ep2": ("dsv3", dict(dp_shard=2, cp=2, ep=2), (False,)),
}
CASES = [f"{name}-{'replay' if r else 'live'}" for name, (_, _, modes) in LAYOUTS.items() for r in modes]


def make_model(cfg):
    torch.manual_seed(1234)
    return MoETransformer(cfg)


def reference_run(cfg, replay):
    model = make_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    losses, grads0 = [], None
    for seqs in make_batches(cfg):
        tokens, positions, labels, rep, cu = pack(seqs)
        loss = token_loss_sum(model, tokens, positions, cu, labels, rep if replay else None) / (labels != -100).sum()
        loss.backward()
        if grads0 is None:
            grads0 = {k: v.grad.clone() for k, v in model.named_parameters() if v.requires_grad}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads0, {k: v.detach().clone() for k, v in model.named_parameters()}


def full_tensors(model, mesh, p, grads):
    out = {}
    for name, param in model.named_parameters():
        if grads and not param.requires_grad:
            continue
        t = param.grad if grads else param
        full = t.full_tensor() if hasattr(t, "full_tensor") else t.detach()
        if p.ep > 1 and ".experts." in name:
            parts = [torch.zeros_like(full) for _ in range(p.ep)]
            dist.all_gather(parts, full.contiguous(), group=mesh["ep"].get_group())
            full = torch.cat(parts)
        out[name] = full
    return out


def run_layout(cfg, p, mesh, replay, ref):
    ref_losses, ref_grads0, ref_params = ref
    model = parallelize(make_model(cfg), p, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    loss_group = mesh["loss"].get_group()
    losses, errors = [], []
    for step, seqs in enumerate(make_batches(cfg)):
        tokens, positions, labels, rep, cu = local_batch(seqs, mesh, p, cfg.top_k)
        n = (labels != -100).sum()
        dist.all_reduce(n, group=loss_group)
        loss = token_loss_sum(model, tokens, positions, cu, labels, rep if replay else None) / n
        loss.backward()
        if step == 0:
            errors += compare("step-0 grad", full_tensors(model, mesh, p, grads=True), ref_grads0, GRAD_RTOL)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=loss_group)
        losses.append(total.item())
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        if not abs(a - b) <= LOSS_RTOL * abs(b):
            errors.append(f"step {step} loss {a!r} != reference {b!r}")
    errors += compare("param after 3 steps", full_tensors(model, mesh, p, grads=False), ref_params, PARAM_RTOL)
    return errors


def _worker(rank, world_size, log):
    refs = {}
    for name, (cname, dims, modes) in LAYOUTS.items():
        cfg = CONFIGS[cname]
        p = ParallelDims(**dims, world_size=world_size, num_experts=cfg.num_experts)
        mesh = p.build_mesh("cpu")
        for replay in modes:
            if (cname, replay) not in refs:
                refs[(cname, replay)] = reference_run(cfg, replay)
            log.run(f"{name}-{'replay' if replay else 'live'}", run_layout, cfg, p, mesh, replay, refs[(cname, replay)])


@pytest.fixture(scope="module")
def parity_results(tmp_path_factory):
    return spawn(_worker, WORLD, tmp_path_factory.mktemp("parity_mla"))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_matches_single_process(parity_results, case):
    assert case in parity_results, f"case {case} did not run"
    assert parity_results[case] == [], "\n".join(parity_results[case])


def test_reference_exercises_the_sparse_form():
    """Every step's batch has sequences longer than index_topk, half of them or more (the sparse form runs,
    and the cp=2 cases then select keys held by the other rank); the step-0 gradients reach every
    trainable parameter; the indexer has none."""
    cfg = CONFIGS["glm5"]
    for seqs in make_batches(cfg):
        lens = [len(s[0]) for s in seqs]
        assert sum(n > cfg.index_topk for n in lens) >= len(lens) // 2, lens
    _, grads0, _ = reference_run(cfg, False)
    model = make_model(cfg)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(".indexer." in n for n in frozen)
    for name, g in grads0.items():
        assert g.abs().max() > 0, name
