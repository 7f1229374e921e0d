"""Sharded DCP checkpoints resumed on other layouts, and the streaming weight gather, on real gloo
ranks: saved on 4 ranks (dp_shard=2, cp=2, ep=2) after a real training step, loaded on 4 ranks
as (dp_shard=4) and (ep=4), on 2 ranks as (dp_shard=2) and in one process without a process
group; every load must give the saved weights and AdamW moments bit for bit. The reference is
what the saving ranks stream with ``iter_full_weights`` (checked against an unparallelized copy
of the model trained on the same batch, independently of the checkpoint code)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from _parallel_dist import spawn  # noqa: E402

from primerl.models import MoETransformer, MoETransformerConfig, parallelize  # noqa: E402
from primerl.runtime.trainer.dcp_checkpoint import (is_dcp_checkpoint, latest_checkpoint, load_dcp_checkpoint,  # noqa: E402
                                            save_dcp_checkpoint, wait_pending_save)
from primerl.runtime.trainer.publish import iter_full_weights, weight_specs, write_safetensors_stream  # noqa: E402

LENS = (5, 9, 3, 7)
# MoE's per-rank routing-count accumulator: each rank counts its own tokens, DCP keeps one rank's
# copy (as for every replicated buffer), so it is compared nowhere.
RANK_LOCAL = "tokens_per_expert"
TRAIN_STATE = {"scheduler": {"last_epoch": 1, "_step_count": 2}, "nan_skipped": 3, "nan_streak": 0}


def _model(seed: int = 0) -> MoETransformer:
    torch.manual_seed(seed)
    model = MoETransformer(MoETransformerConfig.tiny(vocab_size=31, family="glm4_moe"))
    model.init_weights(seed=seed)
    return model


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 31, (sum(LENS),), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENS])
    cu = torch.tensor((0,) + tuple(torch.tensor(LENS).cumsum(0).tolist()), dtype=torch.int32)
    return ids, pos, cu


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _parallel(dims_kw: dict, world: int, seed: int):
    from primerl.parallel.mesh import ParallelDims, build_mesh

    dims = ParallelDims(world_size=world, **dims_kw)
    mesh = build_mesh(dims)
    model = parallelize(_model(seed), dims, mesh, param_dtype=torch.float32)
    return model, _optimizer(model), mesh


def _full_state(model, optimizer) -> tuple[dict, dict]:
    """Full weights (streamed) and full AdamW moments on rank 0 ({} elsewhere)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from primerl.runtime.trainer.publish import _ep_slices, _gather_experts

    weights = {k: v for k, v in iter_full_weights(model) if v is not None}
    ep = _ep_slices(model)
    moments = {}
    for fqn, st in sorted(get_optimizer_state_dict(model, optimizer)["state"].items()):
        for key in ("exp_avg", "exp_avg_sq"):
            t = st[key].full_tensor() if hasattr(st[key], "full_tensor") else st[key]
            if fqn in ep:
                t = _gather_experts(t, *ep[fqn], rank=dist.get_rank(), dst=0)
            if t is not None and dist.get_rank() == 0:
                moments[f"{fqn}.{key}"] = t.clone()
    return weights, moments


def _compare(tag: str, got: dict, want: dict, errors: list) -> None:
    got = {k: v for k, v in got.items() if not k.endswith(RANK_LOCAL)}
    want = {k: v for k, v in want.items() if not k.endswith(RANK_LOCAL)}
    if sorted(got) != sorted(want):
        errors.append(f"{tag}: names differ: {sorted(set(got) ^ set(want))[:6]}")
        return
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    if bad:
        errors.append(f"{tag}: {len(bad)} tensors differ, e.g. {bad[:4]}")


def _load_and_compare(tag, dims_kw, world, ckpt, ref_file):
    import torch.distributed as dist

    errors: list = []
    model, opt, _ = _parallel(dims_kw, world, seed=7)  # other weights: the load must overwrite them
    step, state = load_dcp_checkpoint(ckpt, model, opt)
    weights, moments = _full_state(model, opt)
    if dist.get_rank() == 0:
        ref = torch.load(ref_file)
        _compare(f"{tag} weights", weights, ref["weights"], errors)
        _compare(f"{tag} moments", moments, ref["moments"], errors)
    if step != 1 or state != {**TRAIN_STATE, "step": 1}:
        errors.append(f"{tag}: step {step}, train state {state}")
    if opt.param_groups[0]["lr"] != 1e-2 or opt.state_dict()["state"][0]["step"].item() != 1:
        errors.append(f"{tag}: optimizer step/param groups not restored: {opt.state_dict()['state'][0]['step']}")
    return errors


def _case_save(rank, world, tmp):
    """cp=2 ep=2 dp_shard=2: one AdamW step on a packed batch split by ring attention, then save."""
    import torch.distributed as dist

    errors: list = []
    from primerl.parallel.context import ContextShardPlan

    model, opt, mesh = _parallel(dict(dp_shard=2, cp=2, ep=2), world, seed=0)
    streamed = {k: v for k, v in iter_full_weights(model) if v is not None}
    if rank == 0:
        _compare("streamed initial weights", streamed, _model(0).state_dict(), errors)
    ids, pos, cu = _batch()
    plan = ContextShardPlan(cu, mesh["cp"].get_group())
    logits = model(plan.shard(ids), plan.shard(pos), plan, return_logits=True)
    full_logits = plan.unshard(logits)
    loss = full_logits.float().logsumexp(-1).mean() / 2  # the two dp_shard ranks see the same batch
    loss.backward()
    opt.step()
    save_dcp_checkpoint(Path(tmp, "ckpt"), 1, model, opt, TRAIN_STATE)
    weights, moments = _full_state(model, opt)
    if rank == 0:
        torch.save({"weights": weights, "moments": moments}, Path(tmp, "ref.pt"))
        # independent reference: the same step on an unparallelized model (AdamW's first step is
        # lr * sign(g) where |g| ~ eps, so gradient rounding moves a weight by up to ~lr there)
        single = _model(0)
        sopt = _optimizer(single)
        (single(ids, pos, cu, return_logits=True).float().logsumexp(-1).mean()).backward()
        sopt.step()
        sd = {k: v for k, v in single.state_dict().items() if not k.endswith(RANK_LOCAL)}
        names = sorted(k for k in weights if not k.endswith(RANK_LOCAL))
        err = max((weights[k] - sd[k]).abs().max().item() for k in sd)
        if names != sorted(sd) or err > 1e-3:
            errors.append(f"streamed weights vs the single-process step: max abs err {err:.2e}")
    dist.barrier()
    return errors


def _case_async_save_copies(rank, world, tmp):
    """async save stages a copy: weights changed right after the call do not reach the files."""
    import torch.distributed as dist

    errors: list = []
    model, opt, _ = _parallel(dict(dp_shard=4), world, seed=0)
    load_dcp_checkpoint(Path(tmp, "ckpt", "step_000001"), model, opt)
    group = dist.new_group(backend="gloo")
    final = save_dcp_checkpoint(Path(tmp, "ckpt"), 2, model, opt, TRAIN_STATE, async_save=True, process_group=group)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    wait_pending_save()
    dist.barrier()
    if not is_dcp_checkpoint(final) or latest_checkpoint(Path(tmp, "ckpt"))[1] != final:
        errors.append(f"async save did not end in {final}")
    m2, o2, _ = _parallel(dict(dp_shard=4), world, seed=3)
    load_dcp_checkpoint(final, m2, o2)
    weights, _ = _full_state(m2, o2)
    if rank == 0:
        _compare("async", weights, torch.load(Path(tmp, "ref.pt"))["weights"], errors)
    return errors


def _case_publish(rank, world, tmp):
    """Publishing from the cp=2 ep=2 layout through the backends' real weight channels: the embedded
    engine's file and vLLM's Hugging Face files hold exactly the weights (and names) a
    single-process publish of the same weights writes."""
    import torch.distributed as dist

    from primerl.runtime.validate import load_config
    from primerl.runtime.inference.hf_weights import hf_weights
    from primerl.runtime.inference.backend import get_backend
    from primerl.runtime.trainer.publish import WeightStream
    from primerl.runtime.transport import FileTransport

    errors: list = []
    model, opt, _ = _parallel(dict(dp_shard=2, cp=2, ep=2), world, seed=7)
    load_dcp_checkpoint(Path(tmp, "ckpt", "step_000001"), model, opt)
    ref = torch.load(Path(tmp, "ref.pt"))["weights"] if rank == 0 else None
    for backend in ("embedded", "vllm"):
        cfg = load_config("examples/reverse_text.toml", ["--output_dir", str(Path(tmp, backend)),
                                                         "--inference.backend", backend])
        transport = FileTransport(Path(tmp, backend, "transport"))
        channel = get_backend(cfg).weight_channel(cfg, model=model, transport=transport, rank=rank)
        channel.publish(5, WeightStream(model))  # collective: every rank gathers, rank 0 writes
        channel.close()
        dist.barrier()
        if rank == 0:
            got = transport.load_weights(5)
            single = _model(0)
            want = ref if backend == "embedded" else hf_weights(single, {k: v for k, v in ref.items()})
            _compare(f"publish {backend}", got, want, errors)
            if backend == "vllm" and not Path(transport.weights_dir(5), "config.json").exists():
                errors.append("vllm publish wrote no config.json")
    return errors


def _worker4(rank, world, log, tmp):
    ckpt, ref = Path(tmp, "ckpt", "step_000001"), Path(tmp, "ref.pt")
    log.run("save_cp2_ep2", _case_save, rank, world, tmp)
    log.run("load_dp_shard4", _load_and_compare, "dp_shard=4", dict(dp_shard=4), world, ckpt, ref)
    log.run("load_ep4", _load_and_compare, "ep=4", dict(dp_shard=4, ep=4), world, ckpt, ref)
    log.run("async_save", _case_async_save_copies, rank, world, tmp)
    log.run("publish", _case_publish, rank, world, tmp)


def _worker2(rank, world, log, tmp):
    ckpt, ref = Path(tmp, "ckpt", "step_000001"), Path(tmp, "ref.pt")
    log.run("load_dp_shard2", _load_and_compare, "2 ranks dp_shard=2", dict(dp_shard=2), world, ckpt, ref)


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp")
    (tmp / "w4").mkdir()
    (tmp / "w2").mkdir()
    results = spawn(_worker4, 4, tmp / "w4", str(tmp))
    results.update(spawn(_worker2, 2, tmp / "w2", str(tmp)))
    return tmp, results


# xdist_group: under `-n 2 --dist loadgroup` a module fixture is built once per worker that runs one
# of its tests (CI built this one twice: ~44 CPU-s each); the group keeps its tests on one worker.
@pytest.mark.dist
@pytest.mark.xdist_group("dcp_checkpoint_results")
@pytest.mark.parametrize("case", ["save_cp2_ep2", "load_dp_shard4", "load_ep4", "async_save", "publish",
                                  "load_dp_shard2"])
def test_dcp_layouts(dist_results, case):
    _, results = dist_results
    assert case in results, f"case {case} did not run: {sorted(results)}"
    assert not results[case], "\n".join(results[case])


@pytest.mark.dist
@pytest.mark.xdist_group("dcp_checkpoint_results")
def test_dcp_load_in_one_process(dist_results):
    """The 4-rank checkpoint loads into a plain model and optimizer (no process group)."""
    tmp, results = dist_results
    assert not results["save_cp2_ep2"], "the save failed"
    model = _model(seed=5)
    opt = _optimizer(model)
    step, state = load_dcp_checkpoint(tmp / "ckpt" / "step_000001", model, opt)
    ref = torch.load(tmp / "ref.pt")
    assert step == 1 and state == {**TRAIN_STATE, "step": 1}
    errors: list = []
    _compare("weights", dict(iter_full_weights(model)), ref["weights"], errors)
    names = dict(model.named_parameters())
    moments = {f"{n}.{k}": opt.state[names[n]][k] for n in names for k in ("exp_avg", "exp_avg_sq")}
    _compare("moments", moments, ref["moments"], errors)
    assert not errors, errors
    # and one process saves what another process (any layout) can load: round trip here
    save_dcp_checkpoint(tmp / "single", 1, model, opt, TRAIN_STATE, keep=1)
    m2 = _model(seed=9)
    o2 = _optimizer(m2)
    load_dcp_checkpoint(tmp / "single" / "step_000001", m2, o2)
    _compare("round trip", m2.state_dict(), model.state_dict(), errors)
    assert not errors, errors


def test_dcp_keep_and_errors(tmp_path):
    model = _model()
    opt = _optimizer(model)
    for step in (1, 2, 3):
        save_dcp_checkpoint(tmp_path, step, model, opt, {}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000003"]
    assert json.loads((tmp_path / "step_000003" / "meta.json").read_text())["format"] == "dcp"
    with pytest.raises(FileNotFoundError, match="not a complete DCP checkpoint"):
        load_dcp_checkpoint(tmp_path / "step_000009", model, opt)
    with pytest.raises(ValueError, match="keep must be >= 1"):
        save_dcp_checkpoint(tmp_path, 4, model, opt, {}, keep=0)
    with pytest.raises(Exception):  # a train state that cannot be pickled: no temp dir is left behind
        save_dcp_checkpoint(tmp_path, 4, model, opt, {"bad": lambda: 0})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000003"]


def test_safetensors_stream_matches_save_file(tmp_path):
    from safetensors.torch import load_file

    model = _model().to(torch.bfloat16)
    write_safetensors_stream(tmp_path / "m.safetensors", weight_specs(model), iter_full_weights(model),
                             metadata={"version": "3"})
    got = load_file(str(tmp_path / "m.safetensors"))
    want = model.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    bad = iter([("embed.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match="embed.weight"):
        write_safetensors_stream(tmp_path / "x.safetensors", weight_specs(model), bad)
