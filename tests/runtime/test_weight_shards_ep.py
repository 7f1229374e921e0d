"""Sharded sending with expert parallelism (issue 42): 4 gloo ranks as ``dp_shard=4, ep=2`` (each
expert-parallel slice ``[E/2, ...]`` further FSDP2-sharded over 2 ranks) publish one version
through ``BucketedBroadcast``; every rank sends what it owns (``trainer.publish.owned_regions``).
Each expert's region is sent by exactly one holder, at the global offset ``ep rank * E/ep`` (+ the
FSDP2 shard's own), and the receiver in this process assembles the unparallelized model's weights
bit for bit."""

from __future__ import annotations

import datetime
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

from primerl.models import MoETransformer, MoETransformerConfig, parallelize
from primerl.runtime.inference.weight_receive import SourceReceiver, receive_version
from primerl.runtime.inference.weight_transfer import join_transfer_groups

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from _parallel_dist import start_ranks  # noqa: E402

WORLD = 4


def _port() -> int:
    """A free port, reserved until this process exits (no other process can take it first)."""
    from primerl.runtime.ports import held_port

    return held_port()


def _model() -> MoETransformer:
    torch.manual_seed(0)
    model = MoETransformer(MoETransformerConfig.tiny(vocab_size=31, family="glm4_moe"))
    model.init_weights(seed=0)
    return model


def _worker(rank, world, store, port, keys_out):
    import torch.distributed as dist

    from primerl.parallel.mesh import ParallelDims, build_mesh
    from primerl.runtime.inference.weight_channels import BucketedBroadcast
    from primerl.runtime.trainer.publish import WeightStream, _ep_slices, owned_regions

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    dims = ParallelDims(world_size=world, dp_shard=4, ep=2)
    model = parallelize(_model(), dims, build_mesh(dims), param_dtype=torch.float32)
    ep_ranks = {n: (dist.get_rank(g), size) for n, (g, size, _) in _ep_slices(model).items()}
    keys = [(n, off, tuple(t.shape), ep_ranks.get(n)) for n, _, _, off, t in owned_regions(model)]
    every: list = [None] * world
    dist.all_gather_object(every, keys)
    if rank == 0:
        torch.save(every, keys_out)
    join = lambda r: join_transfer_groups("127.0.0.1", port, sources=world, receivers=1, source=r,  # noqa: E731
                                          store_master=False, timeout_s=300)[r]
    channel = BucketedBroadcast(join, None, rank=rank, dtype=torch.float32, bucket_bytes=4096, sharded=True)
    channel.publish(1, WeightStream(model))
    channel.close()
    dist.destroy_process_group()


@pytest.mark.dist
def test_expert_parallel_shards_are_sent_once_each_at_their_offsets_and_assembled_exactly(tmp_path):
    port, got, errors = _port(), [], []

    def receive():
        try:
            groups = join_transfer_groups("127.0.0.1", port, sources=WORLD, receivers=1, receiver=0,
                                          store_master=True, timeout_s=300)
            rx = [SourceReceiver(groups[r], r) for r in range(WORLD)]
            while (out := receive_version(rx, "cpu"))[0] != -1:
                got.append(out)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    thread = threading.Thread(target=receive)
    thread.start()
    os.environ["OMP_NUM_THREADS"] = "1"
    start_ranks(_worker, (WORLD, str(tmp_path / "store"), port, str(tmp_path / "keys.pt")), WORLD)
    thread.join(300)
    assert not errors, errors
    ref = _model().state_dict()
    experts = [n for n in ref if ref[n].dim() == 3]  # the experts' [E, N, K] weights
    assert experts
    # who sent what: every expert region from one rank, and a rank of ep rank r sends within experts
    # [r*E/ep, (r+1)*E/ep); the regions tile the tensor (their elements add up, none sent twice)
    every = torch.load(tmp_path / "keys.pt")
    for name in experts:
        num_experts = ref[name].shape[0]
        sent = sorted((off, size, ep) for ks in every for n, off, size, ep in ks if n == name)
        assert sum(torch.Size(s).numel() for _, s, _ in sent) == ref[name].numel(), (name, sent)
        assert len({(off, size) for off, size, _ in sent}) == len(sent), (name, sent)
        assert {ep for *_, ep in sent} == {(0, 2), (1, 2)}, (name, sent)  # both ep ranks sent their halves
        for off, size, (ep_rank, ep_size) in sent:
            lo, hi = ep_rank * num_experts // ep_size, (ep_rank + 1) * num_experts // ep_size
            assert lo <= off[0] and off[0] + size[0] <= hi, (name, off, size, ep_rank)
    [(version, weights)] = got
    assert version == 1 and set(weights) == set(ref)
    for name, t in ref.items():
        assert torch.equal(weights[name], t), name
