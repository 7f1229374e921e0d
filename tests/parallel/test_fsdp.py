"""apply_fsdp's sharding plan on fake process groups (placements, meshes, units), expert-parallel
weight slicing, and activation checkpointing (same gradients, forward recomputed)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from _tiny_moe import EXPERTS, LAYERS, TinyMoELM
from primerl.kernels.attention import attention
from primerl.parallel.expert import AllToAllDispatcher, apply_expert_parallel
from primerl.parallel.fsdp import apply_activation_checkpointing, apply_fsdp
from primerl.parallel.mesh import ParallelDims


def _attn(q, k, v):
    return attention(q, k, v, causal=True, backend="torch")


@pytest.fixture
def fake_world():
    started = []

    def start(world_size, rank):
        dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
        started.append(True)

    yield start
    if started:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "dims,rank,expert_dim",
    [
        # efsdp = 16 ranks > 8 local experts: experts sharded on dim 1
        (dict(dp_shard=16, world_size=16), 5, 1),
        # efsdp = 64 > 8 but 64 does not divide dim 1 (16): FSDP2 shards dim 1 only evenly
        (dict(dp_shard=64, world_size=64), 63, 0),
        # efsdp = 8 > 4 local experts (ep = 2)
        (dict(dp_shard=16, ep=2, world_size=16), 3, 1),
        # efsdp = 2 <= 2 local experts (ep = 4): dim 0; HSDP over dp_replicate = 2
        (dict(dp_replicate=2, dp_shard=4, cp=2, ep=4, world_size=16), 13, 0),
    ],
)
def test_fsdp_plan(fake_world, dims, rank, expert_dim):
    p = ParallelDims(**dims)
    fake_world(p.world_size, rank)
    mesh = p.build_mesh("cpu")
    model = TinyMoELM()
    full_w13 = model.layers[0].ffn.experts.w13.detach().clone()
    if p.ep > 1:
        apply_expert_parallel(model, mesh["ep"])
        ep_rank, local = mesh["ep"].get_local_rank(), EXPERTS // p.ep
        assert model.layers[0].ffn.experts.w13.shape[0] == local
        assert torch.equal(model.layers[0].ffn.experts.w13, full_w13[ep_rank * local:(ep_rank + 1) * local])
        assert isinstance(model.layers[0].ffn.dispatcher, AllToAllDispatcher)
    apply_fsdp(model, mesh, param_dtype=torch.float32)
    dense_mesh = mesh["dp_replicate", "dp_shard_cp"] if p.dp_replicate > 1 else mesh["dp_shard_cp"]
    expert_mesh = mesh["dp_replicate", "efsdp"] if p.dp_replicate > 1 else mesh["efsdp"]
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        want_mesh, dim = (expert_mesh, expert_dim) if ".experts." in name else (dense_mesh, 0)
        assert param.device_mesh == want_mesh, name
        assert param.placements[-1] == Shard(dim), (name, param.placements)
    units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    assert units == ["", "embed"] + [x for i in range(LAYERS) for x in (f"layers.{i}", f"layers.{i}.ffn.experts")] + \
        ["norm", "lm_head"]


def test_apply_fsdp_needs_layers(fake_world):
    fake_world(4, 0)
    mesh = ParallelDims(dp_shard=4, world_size=4).build_mesh("cpu")
    with pytest.raises(ValueError, match="no `layers`"):
        apply_fsdp(torch.nn.Linear(4, 4), mesh)


@pytest.mark.parametrize("mode,every,want_recomputed", [("full", 1, {0, 1}), ("selective", 2, {0})])
def test_activation_checkpointing_same_grads(mode, every, want_recomputed):
    tokens = torch.randint(0, 32, (11,))
    grads = []
    calls: list[int] = []
    for checkpoint in (False, True):
        model = TinyMoELM()
        if checkpoint:
            for i, block in enumerate(model.layers):
                block.attention_norm.register_forward_hook(lambda *a, i=i: calls.append(i))
            apply_activation_checkpointing(model, mode, every=every)
        model(tokens, _attn).float().pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=0, msg=n)
    recomputed = {i for i in set(calls) if calls.count(i) == 2}
    assert recomputed == want_recomputed


def test_activation_checkpointing_validation():
    with pytest.raises(ValueError, match="mode"):
        apply_activation_checkpointing(TinyMoELM(), "ops")
    with pytest.raises(ValueError, match="every"):
        apply_activation_checkpointing(TinyMoELM(), "selective", every=0)


def test_apply_expert_parallel_errors(fake_world):
    fake_world(4, 1)
    mesh = ParallelDims(dp_shard=4, ep=4, world_size=4).build_mesh("cpu")

    class NoExperts(torch.nn.Module):
        num_experts = 8

        def set_dispatcher(self, d):
            pass

    with pytest.raises(ValueError, match="no `experts` child"):
        apply_expert_parallel(torch.nn.Sequential(NoExperts()), mesh["ep"])
    model = TinyMoELM()
    model.layers[1].ffn.num_experts = 6  # not divisible by ep = 4
    with pytest.raises(ValueError, match="divisible"):
        apply_expert_parallel(model, mesh["ep"])
    # nothing was changed before the error
    assert model.layers[0].ffn.experts.w13.shape[0] == EXPERTS and model.layers[0].ffn.dispatcher is None
