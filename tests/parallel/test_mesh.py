"""ParallelDims validation (in process) and build_mesh's views on a 512-rank fake process group."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from primerl.parallel.mesh import MESH_VIEWS, ParallelDims


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(dp_shard=3, world_size=4), "!= world_size=4"),
        (dict(dp_replicate=2, dp_shard=2, cp=2, world_size=4), "!= world_size=4"),
        (dict(cp=3, world_size=4), "cannot infer dp_shard"),
        (dict(dp_shard=2, ep=4, world_size=4, dp_replicate=2), "must divide dp_shard \\* cp"),
        (dict(dp_shard=4, ep=3, world_size=4), "must divide dp_shard \\* cp"),
        (dict(dp_shard=3, cp=4, ep=6, world_size=12), "must nest"),
        (dict(dp_shard=4, ep=4, world_size=4, num_experts=6), "num_experts=6 is not divisible by ep=4"),
        (dict(dp_shard=0, world_size=4), "dp_shard must be"),
        (dict(dp_shard=-2, world_size=4), "dp_shard must be"),
        (dict(cp=0, world_size=4), "cp must be"),
        (dict(ep=1.0, world_size=4), "ep must be"),
        (dict(dp_replicate=True, world_size=4), "dp_replicate must be"),
        (dict(world_size=0), "world_size must be"),
    ],
)
def test_invalid_layouts_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kwargs)


def test_world_size_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="world_size=None"):
        ParallelDims()


def test_inferred_sizes():
    p = ParallelDims(dp_replicate=2, cp=2, ep=4, world_size=16)
    assert (p.dp_shard, p.dp_shard_cp, p.efsdp, p.batch, p.loss) == (4, 8, 2, 8, 16)
    with pytest.raises(ValueError, match="num_experts=10"):
        p.check_num_experts(10)


def _expected_views(p: ParallelDims, rank: int) -> dict[str, list[int]]:
    """Independent statement of the layout: rank = (r*S + s)*C + c; ep = runs of ep positions of
    f = s*C + c; efsdp = same f mod ep."""
    S, C = p.dp_shard, p.cp
    coords = {x: ((x // (S * C)), (x // C) % S, x % C) for x in range(p.world_size)}
    r, s, c = coords[rank]
    f = s * C + c
    pos = {x: coords[x][1] * C + coords[x][2] for x in coords}
    same_r = [x for x in coords if coords[x][0] == r]
    return {
        "dp_replicate": [x for x in coords if coords[x][1:] == (s, c)],
        "dp_shard": [x for x in same_r if coords[x][2] == c],
        "cp": [x for x in same_r if coords[x][1] == s],
        "dp_shard_cp": same_r,
        "ep": [x for x in same_r if pos[x] // p.ep == f // p.ep],
        "efsdp": [x for x in same_r if pos[x] % p.ep == f % p.ep],
        "batch": [x for x in coords if coords[x][2] == c],
        "loss": list(coords),
    }


@pytest.mark.parametrize(
    "dims,ranks",
    [
        (dict(dp_shard=64, cp=8, ep=64, world_size=512), [0, 1, 7, 8, 137, 300, 511]),
        (dict(dp_replicate=2, dp_shard=16, cp=16, ep=4, world_size=512), [0, 5, 17, 255, 256, 511]),
        (dict(dp_replicate=4, dp_shard=4, cp=2, ep=8, world_size=32), [0, 3, 9, 31]),
    ],
)
def test_fake_process_group_views(dims, ranks):
    p = ParallelDims(**dims)
    for rank in ranks:
        want = _expected_views(p, rank)
        assert {k: sorted(v) for k, v in p.view_ranks(rank).items()} == want
        dist.init_process_group("fake", rank=rank, world_size=p.world_size, store=FakeStore())
        try:
            mesh = p.build_mesh("cpu")
            for view in MESH_VIEWS:
                sub = mesh[view]
                assert sub.size() == len(want[view]) == p.view_sizes()[view], view
                assert sorted(sub.mesh.flatten().tolist()) == want[view], view
                assert sub.get_local_rank() == sub.mesh.flatten().tolist().index(rank), view
                assert dist.get_process_group_ranks(sub.get_group()) == sub.mesh.flatten().tolist(), view
            # ep rank i holds experts [i*E/ep, (i+1)*E/ep): ep ranks follow global rank order
            assert mesh["ep"].get_local_rank() == want["ep"].index(rank)
            # the 2-D meshes FSDP uses for HSDP
            assert mesh["dp_replicate", "efsdp"].shape == (p.dp_replicate, p.efsdp)
            assert mesh["dp_replicate", "dp_shard_cp"].shape == (p.dp_replicate, p.dp_shard_cp)
        finally:
            dist.destroy_process_group()
