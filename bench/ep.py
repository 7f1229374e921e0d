"""Expert-parallel token exchange: AllToAllDispatcher dispatch / combine per MoE layer.

For 2 and 4 gloo ranks (CPU) it times, per layer: dispatch and combine with a bf16 payload, dispatch
with FP8 (per-token-group e4m3 + float32 scales), and as the baseline a bare
``all_to_all_single`` moving the same rows (so ``ratio`` < 1 is the dispatcher's overhead:
sorting, the split exchange and its host sync, regrouping by expert). ``bytes`` is what one
rank sends per call (payload only). Times are the slowest rank's median.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from pathlib import Path

import torch

from .harness import Row, time_fn


def _shapes(quick: bool):
    # (tokens per rank, hidden, experts, top-k)
    return [(256, 256, 16, 4)] if quick else [(1024, 1024, 64, 8), (4096, 512, 64, 8)]


def _worker(rank: int, world: int, tmp: str, quick: bool) -> None:
    import torch.distributed as dist

    from primerl.parallel.expert import AllToAllDispatcher, all_to_all_single_autograd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    repeats = 3 if quick else 5
    out = []

    def timed(fn):
        def run():
            dist.barrier()
            fn()
        t = torch.tensor(time_fn(run, warmup=1, repeats=repeats))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    for T, D, E, K in _shapes(quick):
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(T, D, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        w = torch.rand(T, K, generator=g)
        shape = f"W={world} T={T} D={D} E={E} k={K}"
        for fp8 in (False, True):
            disp = AllToAllDispatcher(None, E, fp8_dispatch=fp8)
            x_recv, _, h = disp.dispatch(x, ids, w)
            sent = sum(h.send_splits)
            row_bytes = D + 4 * (D // 128) if fp8 else 2 * D
            res = {"shape": shape, "fp8": fp8, "bytes": sent * row_bytes,
                   "dispatch": timed(lambda: disp.dispatch(x, ids, w)),
                   "combine": None if fp8 else timed(lambda: disp.combine(x_recv, h))}
            if not fp8:
                rows = x.new_zeros(sent, D)
                res["raw"] = timed(lambda: all_to_all_single_autograd(rows, h.recv_splits, h.send_splits))
            out.append(res)
    if rank == 0:
        Path(tmp, "result.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def run(args) -> list[Row]:
    import torch.multiprocessing as mp

    rows: list[Row] = []
    os.environ["OMP_NUM_THREADS"] = "1"
    for world in (2, 4):
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(world, tmp, bool(args.quick)), nprocs=world, join=True)
            results = json.loads(Path(tmp, "result.json").read_text())
        by_shape: dict[str, dict] = {}
        for r in results:
            by_shape.setdefault(r["shape"], {})[r["fp8"]] = r
        for shape, pair in by_shape.items():
            bf16, fp8 = pair[False], pair[True]
            rows.append(Row("ep_combine", shape, "bf16", "gloo", bf16["combine"],
                            gbps=bf16["bytes"] / bf16["combine"] / 1e9, ratio=bf16["raw"] / bf16["combine"],
                            baseline="raw all_to_all bf16", extra={"bytes": bf16["bytes"]}))
            for name, res in (("bf16", bf16), ("fp8", fp8)):
                extra = {"bytes": res["bytes"]}
                if name == "fp8":
                    extra["payload_vs_bf16"] = f"{res['bytes'] / bf16['bytes']:.3f}"
                rows.append(Row("ep_dispatch", shape, name, "gloo", res["dispatch"],
                                gbps=res["bytes"] / res["dispatch"] / 1e9, ratio=bf16["raw"] / res["dispatch"],
                                baseline="raw all_to_all bf16", extra=extra))
    return rows
