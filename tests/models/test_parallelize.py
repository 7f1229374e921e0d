"""parallelize() on 2 real gloo ranks against one process: EP + FSDP (each rank its own batch,
gradients summed) and CP + EP + activation checkpointing (one batch split by ring attention)."""

from __future__ import annotations

import datetime
import os
import sys
import traceback

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from primerl.models import MoETransformer, MoETransformerConfig, parallelize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from _parallel_dist import start_ranks  # noqa: E402

WORLD = 2
LENS = ((5, 1, 7), (3, 8))  # the packed batch of rank 0 and of rank 1


def _model() -> MoETransformer:
    torch.manual_seed(0)
    model = MoETransformer(MoETransformerConfig.tiny(vocab_size=31, family="glm4_moe"))
    model.init_weights(seed=0)
    with torch.no_grad():  # weights large enough that the comparison means something
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.mul_(10.0)
        for layer in model.moe_layers:
            layer.ffn.expert_bias.copy_(0.05 * torch.randn(layer.ffn.num_experts))
    return model


def _batch(lens, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 31, (sum(lens),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor((0,) + tuple(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    return ids, pos, cu


def _loss_sum(logits, ids, cu):
    targets = torch.roll(ids, -1)
    last = cu[1:].long() - 1  # no target after a sequence's last token
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[last] = False
    return F.cross_entropy(logits[mask].float(), targets[mask], reduction="sum"), int(mask.sum())


def _full_grads(model):
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name] = g
    return out


def _compare(tag, got: dict, ref: dict, ep_range, errors):
    for name, g in got.items():
        r = ref[name]
        if ep_range is not None and name.endswith(("experts.w13", "experts.w2")):
            r = r[ep_range[0]:ep_range[1]]
        if g is None or g.shape != r.shape:
            errors.append(f"{tag} {name}: grad {None if g is None else tuple(g.shape)} vs {tuple(r.shape)}")
            continue
        err = ((g - r).abs().max() / (r.abs().max() + 1e-12)).item()
        if err > 1e-5:
            errors.append(f"{tag} {name}: max rel grad err {err:.2e}")


def _reference(batches):
    model = _model()
    total, n = 0.0, 0
    logits_all = []
    for ids, pos, cu in batches:
        logits = model(ids, pos, cu, return_logits=True)
        s, c = _loss_sum(logits, ids, cu)
        total, n = total + s, n + c
        logits_all.append(logits.detach())
    (total / n).backward()
    return logits_all, {k: p.grad for k, p in model.named_parameters()}


def _case_ep_fsdp(rank, errors):
    from primerl.parallel.expert import local_expert_range
    from primerl.parallel.mesh import ParallelDims, build_mesh

    batches = [_batch(LENS[r], seed=r) for r in range(WORLD)]
    ref_logits, ref_grads = _reference(batches)
    dims = ParallelDims(dp_shard=2, ep=2, world_size=WORLD)
    mesh = build_mesh(dims)
    model = parallelize(_model(), dims, mesh, param_dtype=torch.float32)
    ids, pos, cu = batches[rank]
    logits = model(ids, pos, cu, return_logits=True)
    err = (logits - ref_logits[rank]).abs().max().item()
    if err > 1e-4:
        errors.append(f"ep+fsdp logits max abs err {err:.2e}")
    s, c = _loss_sum(logits, ids, cu)
    n = torch.tensor(c)
    dist.all_reduce(n)
    (s / n).backward()
    _compare("ep+fsdp", _full_grads(model), ref_grads, local_expert_range(model.config.num_experts, 2, rank), errors)


def _case_cp_ep_ac(rank, errors):
    from primerl.parallel.context import ContextShardPlan
    from primerl.parallel.expert import local_expert_range
    from primerl.parallel.mesh import ParallelDims, build_mesh

    batch = _batch(LENS[0] + LENS[1], seed=5)
    ref_logits, ref_grads = _reference([batch])
    dims = ParallelDims(dp_shard=1, cp=2, ep=2, world_size=WORLD)
    mesh = build_mesh(dims)
    model = parallelize(_model(), dims, mesh, activation_checkpointing="full", param_dtype=torch.float32)
    ids, pos, cu = batch
    plan = ContextShardPlan(cu, mesh["cp"].get_group())
    local = model(plan.shard(ids), plan.shard(pos), plan, return_logits=True)
    replayed = model(plan.shard(ids), plan.shard(pos), plan, replay_ids=model.routing(), return_logits=True)
    if not torch.equal(local, replayed):
        errors.append("cp: replaying the captured routing changed the logits")
    logits = plan.unshard(local)
    err = (logits - ref_logits[0]).abs().max().item()
    if err > 1e-4:
        errors.append(f"cp+ep+ac logits max abs err {err:.2e}")
    s, c = _loss_sum(logits, ids, cu)
    (s / c).backward()  # unshard keeps this rank's part of the gradient: no double counting
    _compare("cp+ep+ac", _full_grads(model), ref_grads, local_expert_range(model.config.num_experts, 2, rank), errors)


def _case_fsdp_save(rank, errors, out_dir):
    """save_pretrained of an FSDP-sharded model gathers each tensor and writes the same checkpoint."""
    from safetensors.torch import load_file

    from primerl.parallel.mesh import ParallelDims, build_mesh

    dims = ParallelDims(dp_shard=2, world_size=WORLD)
    model = parallelize(_model(), dims, build_mesh(dims), param_dtype=torch.float32)
    model.save_pretrained(os.path.join(out_dir, "fsdp"))
    if rank == 0:
        _model().save_pretrained(os.path.join(out_dir, "single"))
        got = load_file(os.path.join(out_dir, "fsdp", "model.safetensors"))
        want = load_file(os.path.join(out_dir, "single", "model.safetensors"))
        if sorted(got) != sorted(want) or not all(torch.equal(got[k], want[k]) for k in want):
            errors.append("fsdp save_pretrained differs from the single-process save")


def _worker(rank, init_file, err_dir):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    errors = []
    for case in (_case_ep_fsdp, _case_cp_ep_ac, _case_fsdp_save):
        try:
            case(rank, errors) if case is not _case_fsdp_save else case(rank, errors, err_dir)
        except Exception:  # noqa: BLE001 - report; the other rank is in the same collectives
            errors.append(f"{case.__name__}: {traceback.format_exc()}")
    dist.destroy_process_group()
    if errors:
        with open(os.path.join(err_dir, f"rank{rank}.txt"), "w") as f:
            f.write("\n".join(errors))


@pytest.mark.dist
def test_parallelize_matches_single_process(tmp_path):
    os.environ["OMP_NUM_THREADS"] = "1"
    start_ranks(_worker, (str(tmp_path / "store"), str(tmp_path)), WORLD)
    reports = sorted(tmp_path.glob("rank*.txt"))
    assert not reports, "\n".join(p.read_text() for p in reports)


def test_parallelize_rejects_bad_options():
    from primerl.parallel.mesh import ParallelDims

    model = MoETransformer(MoETransformerConfig.tiny())
    with pytest.raises(ValueError, match="activation_checkpointing"):
        parallelize(model, ParallelDims(world_size=1), None, activation_checkpointing="some")
    with pytest.raises(ValueError, match="num_experts=4 is not divisible by ep=3"):
        parallelize(model, ParallelDims(dp_shard=3, ep=3, world_size=3), None)
