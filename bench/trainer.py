"""python -m bench trainer [--quick]: the trainer's memory at scale, two measures on gloo ranks.

1. Context parallelism, one long sequence (16384 tokens; --quick 2048) of the tiny MoE model
   (d=64, 2 layers, 4 experts top-2, vocab 256, float32, attention on torch's fused CPU kernel
   ``attn_backend="sdpa"``): forward, fused log-probs, backward on 1 rank (the plain model, no
   plan) and on cp=2 / cp=4 ranks (``parallelize`` with ring attention, FSDP2 over the cp ranks,
   a ``ContextShardPlan`` per step). Per rank: the peak resident memory above what was resident
   before the step (Linux VmHWM reset through /proc/self/clear_refs; the largest rank is
   reported), tokens/s of the whole sequence. Each layout also runs at 1/4 and 1/2 of the length;
   the line through the peaks at 1/2 and 1 gives the longest sequence that fits the memory the
   single rank needs for the full length (``fits``, as a multiple of that length).
2. Publishing weights: rank 0's peak memory while it receives the full weights of a ~40M-parameter
   model sharded on 4 ranks (FSDP2 dp_shard=4) and writes them as safetensors, streamed one
   tensor at a time (``primerl.runtime.trainer.publish``) against the full-state-dict gather
   (``get_model_state_dict(full_state_dict=True)`` + ``FileTransport.publish_weights``); the
   ratio is baseline peak / streamed peak (> 1: the stream needs less). A streamed row for
   dp_shard=2 x ep=2 (experts gathered per ep group) has no baseline: the full-state-dict gather
   returns only local experts under expert parallelism.

Allocator: ``MALLOC_MMAP_THRESHOLD_=65536`` in the worker processes, so freed large blocks go back
to the OS and the resident high-water mark tracks tensor memory.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .harness import Row

VOCAB = 256


def _reset_peak() -> int:
    """Reset this process's resident high-water mark; returns the resident bytes now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS") * 1024


def _peak_since(base: int) -> int:
    return _status_kb("VmHWM") * 1024 - base


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


# --------------------------------------------------------------------------------------------- cp
def _cp_step(model, T: int, plan_group):
    from primerl.kernels.logprobs import fused_logprobs
    from primerl.parallel.context import ContextShardPlan

    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, model.lm_head.weight.shape[0], (T,), generator=g)  # one sequence of T tokens
    pos = torch.arange(T)
    cu = torch.tensor([0, T], dtype=torch.int32)
    targets = torch.roll(ids, -1)
    if plan_group is None:
        hidden = model(ids, pos, cu)
    else:
        plan = ContextShardPlan(cu, plan_group)
        hidden = model(plan.shard(ids), plan.shard(pos), plan)
        targets = plan.shard(targets)
    lp, _ = fused_logprobs(hidden, model.lm_head.weight, targets)
    (-lp.sum() / T).backward()
    model.zero_grad(set_to_none=True)


def _cp_model(world: int):
    from primerl.models import MoETransformer, MoETransformerConfig, parallelize

    torch.manual_seed(0)
    model = MoETransformer(MoETransformerConfig.tiny(vocab_size=VOCAB, attn_backend="sdpa"))
    if world == 1:
        return model, None
    from primerl.parallel.mesh import ParallelDims, build_mesh

    dims = ParallelDims(dp_shard=1, cp=world, world_size=world)
    mesh = build_mesh(dims)
    return parallelize(model, dims, mesh, param_dtype=torch.float32), mesh["cp"].get_group()


def _cp_worker(rank: int, world: int, lengths: list[int], repeats: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{out}/store_cp{world}", rank=rank, world_size=world)
    model, group = _cp_model(world)
    result = {}
    for T in lengths:
        _cp_step(model, T, group)  # warm-up (and first-touch of the allocator)
        if world > 1:
            dist.barrier()
        base = _reset_peak()
        _cp_step(model, T, group)
        peak = _peak_since(base)
        times = []
        for _ in range(repeats):
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            _cp_step(model, T, group)
            times.append(time.perf_counter() - t0)
        result[T] = {"peak": peak, "time": statistics.median(times)}
    Path(out, f"cp{world}_rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


def _spawn(fn, world: int, *args) -> None:
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    mp.spawn(fn, args=(world, *args), nprocs=world, join=True)


def _longest_fit(lengths: list[int], peaks: list[float], cap: float) -> float:
    """Largest T whose peak stays <= cap, on the line through the two longest measured lengths
    (per-rank memory is linear in the shard length once the attention masks are row-blocked; a
    quadratic through three noisy points extrapolates badly)."""
    (t0, p0), (t1, p1) = sorted(zip(lengths, peaks))[-2:]
    slope = (p1 - p0) / (t1 - t0)
    return t1 + (cap - p1) / slope if slope > 0 else float("inf")


def _cp_rows(T: int, repeats: int, tmp: str) -> list[Row]:
    lengths = [T // 4, T // 2, T]
    stats = {}
    for world in (1, 2, 4):
        _spawn(_cp_worker, world, lengths, repeats, tmp)
        ranks = [json.loads(Path(tmp, f"cp{world}_rank{r}.json").read_text()) for r in range(world)]
        stats[world] = {L: {"peak": max(r[str(L)]["peak"] for r in ranks),
                            "time": max(r[str(L)]["time"] for r in ranks)}
                        for L in lengths}
    base = stats[1][T]
    cap = base["peak"]
    rows = []
    for world in (1, 2, 4):
        s = stats[world][T]
        fits = _longest_fit(lengths, [stats[world][L]["peak"] for L in lengths], cap) / T
        rows.append(Row(
            op=f"cp={world} fwd+bwd", shape=f"T={T} one seq", dtype="float32",
            backend="sdpa+ring" if world > 1 else "sdpa",
            median_s=s["time"], ratio=base["time"] / s["time"], baseline="cp=1 time",
            extra={"tok/s": f"{T / s['time']:.0f}", "peak/rank MB": f"{s['peak'] / 2**20:.1f}",
                   "mem vs cp=1": f"{s['peak'] / cap:.3f}", "x 1/cp": f"{s['peak'] / cap * world:.2f}",
                   "fits (x T)": f"{fits:.2f}",
                   "peaks T/4,T/2,T MB": "/".join(f"{stats[world][L]['peak'] / 2**20:.0f}" for L in lengths)}))
    return rows


# ---------------------------------------------------------------------------------------- publish
def _publish_model(quick: bool):
    from primerl.models import MoETransformer, MoETransformerConfig

    torch.manual_seed(0)
    kw = dict(dim=128, n_layers=2, moe_dim=64, num_experts=8) if quick else \
        dict(dim=512, n_layers=4, moe_dim=512, num_experts=8, vocab_size=8192, ffn_dim=1024)
    return MoETransformer(MoETransformerConfig.tiny(**{"vocab_size": 1024, **kw}))


def _publish_worker(rank: int, world: int, quick: bool, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from primerl.models import parallelize
    from primerl.parallel.mesh import ParallelDims, build_mesh
    from primerl.runtime.trainer.publish import iter_full_weights, weight_specs, write_safetensors_stream
    from primerl.runtime.transport import FileTransport

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store_pub", rank=rank, world_size=world)
    result = {}
    for layout in ({"dp_shard": world}, {"dp_shard": world, "ep": 2}):
        dims = ParallelDims(world_size=world, **layout)
        model = parallelize(_publish_model(quick), dims, build_mesh(dims), param_dtype=torch.float32)
        tag = "x".join(f"{k}={v}" for k, v in layout.items())
        transport = FileTransport(Path(out, f"transport_{rank}"))

        def baseline():
            sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                transport.publish_weights(1, sd)

        def streamed():
            stream = iter_full_weights(model)
            if rank == 0:
                d = Path(out, "stream")
                d.mkdir(exist_ok=True)
                write_safetensors_stream(d / "model.safetensors", weight_specs(model), stream)
            else:
                for _ in stream:
                    pass

        for name, fn in (("stream", streamed),) + ((("full_state_dict", baseline),) if "ep" not in layout else ()):
            fn()  # warm-up
            dist.barrier()
            base = _reset_peak()
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
            result[f"{tag} {name}"] = {"peak": _peak_since(base), "time": elapsed}
            dist.barrier()
    if rank == 0:
        result["bytes"] = sum(p.numel() * p.element_size() for p in _publish_model(quick).state_dict().values())
        Path(out, "publish.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _publish_rows(quick: bool, tmp: str) -> list[Row]:
    _spawn(_publish_worker, 4, quick, tmp)
    res = json.loads(Path(tmp, "publish.json").read_text())
    model_mb = res.pop("bytes") / 2**20
    rows = []
    for key, r in res.items():
        layout, method = key.split(" ")
        base = res.get(f"{layout} full_state_dict")
        rows.append(Row(op=f"publish rank 0 ({method})", shape=f"4 ranks {layout}, model {model_mb:.0f} MB",
                        dtype="float32", backend="gloo", median_s=r["time"],
                        ratio=None if base is None else base["peak"] / r["peak"],
                        baseline="" if base is None else "full_state_dict peak / this peak",
                        extra={"peak MB": f"{r['peak'] / 2**20:.1f}",
                               "peak/model": f"{r['peak'] / 2**20 / model_mb:.2f}"}))
    return rows


def run(args) -> list[Row]:
    if args.device != "cpu":
        raise SystemExit("bench trainer runs on gloo CPU ranks only (--device cpu)")
    T = 2048 if args.quick else 16384
    with tempfile.TemporaryDirectory() as tmp:
        rows = _cp_rows(T, 1 if args.quick else 2, tmp)
        rows += _publish_rows(args.quick, tmp)
    return rows
