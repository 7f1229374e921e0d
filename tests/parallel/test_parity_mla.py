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

from _parallel_dist import spawn
from primerl.models import MoETransformerConfig
from primerl.parallel.mesh import ParallelDims
from test_parity import VOCAB, make_batches, make_model, reference_run, run_layout

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


# xdist_group: under `-n 2 --dist loadgroup` a module fixture is built once per worker that runs one
# of its tests (the last CI spawned this one on both); the group keeps its tests on one worker.
@pytest.mark.dist
@pytest.mark.xdist_group("parity_mla_results")
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
