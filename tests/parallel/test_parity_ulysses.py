"""Gold test for Ulysses context parallelism: the model trained 3 AdamW steps on 4 gloo ranks gives
the same losses, step-0 gradients and final parameters as one process (1e-5 relative, the ring
gold test's bounds and harness: test_parity.py), with Ulysses cp=2 (x dp_shard=2), cp=4 and 2-D
2 x 2 (Ulysses inside, zigzag ring across), for

* GQA: a Qwen3-style model with 4 query heads and 1 KV head (replicated to the Ulysses degree);
* MLA + DeepSeek sparse attention: a tiny GLM-5-style model whose batches take the sparse form
  (queries all-to-all'd by head over the gathered latent KV);
* dense MLA: a tiny DeepSeek-V3-style model;

and, on Ulysses layouts, activation offloading (checkpointed blocks' saved inputs in host memory)
and FSDP2's CPUOffloadPolicy (on a CPU mesh: the same code path, unpinned, no memory saved).
"""

from __future__ import annotations

import functools

import pytest

from _parallel_dist import spawn
from primerl.models import MoETransformerConfig
from primerl.parallel.mesh import ParallelDims
from test_parity import VOCAB, reference_run, run_layout
from test_parity_mla import MLA

WORLD = 4
CONFIGS = {
    "gqa": MoETransformerConfig.tiny(vocab_size=VOCAB, dim=16, n_heads=4, n_kv_heads=1, head_dim=8, moe_dim=8,
                                     num_experts=8, top_k=2, route_norm=True),
    "glm5": MoETransformerConfig.tiny(family="glm_moe_dsa", **dict(MLA, n_heads=4, n_kv_heads=4), v_head_dim=12,
                                      index_n_heads=2, index_head_dim=8, index_topk=3,
                                      indexer_types=("full", "shared", "full")),
    "dsv3": MoETransformerConfig.tiny(family="deepseek_v3", **dict(MLA, n_heads=4, n_kv_heads=4), v_head_dim=8),
}
# name -> (config, ParallelDims kwargs, parallelize kwargs)
U = dict(cp_kind="ulysses")
UR = dict(cp_kind="ulysses_ring", cp_ulysses=2)
LAYOUTS = {
    "gqa_u2": ("gqa", dict(dp_shard=2, cp=2), U),
    "gqa_u4": ("gqa", dict(dp_shard=1, cp=4), U),
    "gqa_u2xr2": ("gqa", dict(dp_shard=1, cp=4), UR),
    "gqa_u2xr2_ep2": ("gqa", dict(dp_shard=1, cp=4, ep=2), UR),
    "glm5_u2": ("glm5", dict(dp_shard=2, cp=2), U),
    "glm5_u4": ("glm5", dict(dp_shard=1, cp=4), U),
    "glm5_u2xr2": ("glm5", dict(dp_shard=1, cp=4), UR),
    "dsv3_u4": ("dsv3", dict(dp_shard=1, cp=4), U),
    "dsv3_u2xr2": ("dsv3", dict(dp_shard=1, cp=4), UR),
    "gqa_u2_ac_offload": ("gqa", dict(dp_shard=2, cp=2), dict(U, activation_offload=True)),
    "gqa_u2xr2_cpu_offload": ("gqa", dict(dp_shard=1, cp=4), dict(UR, cpu_offload=True)),
}
CASES = list(LAYOUTS)


def _worker(rank, world_size, log):
    refs = {}
    for name, (cname, dims, kw) in LAYOUTS.items():
        cfg = CONFIGS[cname]
        p = ParallelDims(**dims, world_size=world_size, num_experts=cfg.num_experts)
        mesh = p.build_mesh("cpu")
        if cname not in refs:
            refs[cname] = reference_run(cfg, False)
        ac = "full" if kw.get("activation_offload") else None
        log.run(name, functools.partial(run_layout, **kw), cfg, p, mesh, False, refs[cname], ac)


@pytest.fixture(scope="module")
def parity_results(tmp_path_factory):
    return spawn(_worker, WORLD, tmp_path_factory.mktemp("parity_ulysses"))


# xdist_group: under `-n 2 --dist loadgroup` a module fixture is built once per worker that runs one
# of its tests; the group keeps the tests of the one multi-rank spawn on one worker.
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("parity_ulysses_results")
@pytest.mark.parametrize("case", CASES)
def test_matches_single_process(parity_results, case):
    assert case in parity_results, f"case {case} did not run"
    assert parity_results[case] == [], "\n".join(parity_results[case])
