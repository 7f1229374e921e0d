"""python -m bench long_context [--quick]: Ulysses vs ring context parallelism on one long sequence, gloo ranks.

The model of examples/long_context_4rank.toml (d=128, 2 layers, 8 query / 4 KV heads of 16, 4
experts top-2, float32, attention on torch's fused CPU kernel ``attn_backend="sdpa"``), one sequence
of T = 16384 tokens (--quick 2048): forward, fused log-probs, backward, per layout

* cp=1 (one rank, the plain model);
* ring cp=4, Ulysses cp=4 (2 query heads and 1 KV head per rank), Ulysses 2 x ring 2, Ulysses
  cp=2 (on 2 ranks);

each through ``parallelize`` (FSDP2 over the cp ranks) with a ``ContextShardPlan`` per step.

Per rank: the peak of live CPU tensor bytes during the step above what was live before it
(``bench.cpu_memory.track_peak_cpu_bytes``, the allocator's counter; the largest rank is reported),
the step time (median of the repeats, every rank timed, the slowest reported), and the bytes this
rank sends through the context-parallel collectives per attention layer (forward + backward):
``all_to_all_single`` (Ulysses; the part that stays on the rank is not counted) and the ring's
``isend`` — counted by wrapping those torch.distributed calls during one step, divided by the
number of layers. The analytic volumes, for comparison: per layer and rank, Ulysses sends
(U-1)/U of q, k, v, out forward and of their gradients backward; ring sends K/V (W-1) times
forward, again backward, plus the float32 dK/dV accumulators W times.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .cpu_memory import track_peak_cpu_bytes
from .harness import Row

VOCAB = 11
MODEL = dict(vocab_size=VOCAB, dim=128, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=16, moe_dim=64,
             num_experts=4, top_k=2, attn_backend="sdpa", max_position_embeddings=16384)
# name -> (ranks, cp_kind, cp_ulysses)
LAYOUTS = {
    "cp=1": (1, None, 0),
    "ring cp=4": (4, "ring", 0),
    "ulysses cp=4": (4, "ulysses", 0),
    "ulysses 2 x ring 2": (4, "ulysses_ring", 2),
    "ulysses cp=2": (2, "ulysses", 0),
}


class _CommCounter:
    """Bytes this rank sends through all_to_all_single and isend while ``active``."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.active, self.bytes = dist, False, {"all_to_all": 0, "ring p2p": 0}
        self._a2a, self._batch = dist.all_to_all_single, dist.batch_isend_irecv

        def a2a(output, input, *args, **kwargs):
            if self.active:
                group = kwargs.get("group")
                W = dist.get_world_size(group)
                self.bytes["all_to_all"] += input.numel() * input.element_size() * (W - 1) // W
            return self._a2a(output, input, *args, **kwargs)

        def batch(ops):
            if self.active:
                self.bytes["ring p2p"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                                              if op.op is dist.isend)
            return self._batch(ops)

        dist.all_to_all_single, dist.batch_isend_irecv = a2a, batch


def _step(model, T: int, group):
    """Forward, fused log-probs and backward of one T-token sequence (cp-sharded when ``group``)."""
    from .trainer import _cp_step

    _cp_step(model, T, group)


def _worker(rank: int, world: int, name: str, T: int, repeats: int, out: str) -> None:
    import torch.distributed as dist

    from primerl.models import MoETransformer, MoETransformerConfig, parallelize

    torch.set_num_threads(1)
    _, kind, ulysses = LAYOUTS[name]
    counter = _CommCounter()
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{out}/store_{name.replace(' ', '_')}", rank=rank,
                                world_size=world)
    torch.manual_seed(0)
    model = MoETransformer(MoETransformerConfig.tiny(**MODEL))
    group = None
    if world > 1:
        from primerl.parallel.mesh import ParallelDims, build_mesh

        dims = ParallelDims(dp_shard=1, cp=world, world_size=world)
        mesh = build_mesh(dims)
        model = parallelize(model, dims, mesh, param_dtype=torch.float32, cp_kind=kind, cp_ulysses=ulysses)
        group = mesh["cp"].get_group()
    _step(model, T, group)  # warm-up
    counter.active = True
    peak = track_peak_cpu_bytes(lambda: _step(model, T, group))
    counter.active = False
    times = []
    for _ in range(repeats):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        _step(model, T, group)
        times.append(time.perf_counter() - t0)
    layers = MODEL["n_layers"]
    res = {"peak": peak, "time": statistics.median(times), **{k: v / layers for k, v in counter.bytes.items()}}
    Path(out, f"{name.replace(' ', '_')}_rank{rank}.json").write_text(json.dumps(res))
    if world > 1:
        dist.destroy_process_group()


def _spawn(world: int, *args) -> None:
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(_worker, args=(world, *args), nprocs=world, join=True)


def _analytic(name: str, T: int) -> float:
    """Bytes one rank sends per layer (forward + backward), float32, from the formulas above."""
    world, kind, ulysses = LAYOUTS[name]
    H, Hkv, D, f = MODEL["n_heads"], MODEL["n_kv_heads"], MODEL["head_dim"], 4
    if world == 1:
        return 0.0
    U = world if kind == "ulysses" else (ulysses if kind == "ulysses_ring" else 1)
    R = world // U
    t = T // world
    total = 0.0
    if U > 1:
        hkv = max(Hkv, U)
        # forward q, k, v, out; backward dout, dq, dk, dv: each (U-1)/U of the rank's [t, heads, D]
        total += 2 * (U - 1) / U * t * (2 * H + 2 * hkv) * D * f
    if R > 1:
        tr = T // R  # tokens per ring rank (its Ulysses group's shards); KV heads per rank
        hk = max(Hkv, U) // U
        kv = 2 * tr * hk * D * f
        total += (R - 1) * kv * 2 + R * kv  # K/V forward and backward, dK/dV (float32) R hops
    return total


def run(args) -> list[Row]:
    if args.device != "cpu":
        raise SystemExit("bench long_context runs on gloo CPU ranks only (--device cpu)")
    T = 2048 if args.quick else 16384
    repeats = 1 if args.quick else 2
    stats = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (world, _, _) in LAYOUTS.items():
            _spawn(world, name, T, repeats, tmp)
            ranks = [json.loads(Path(tmp, f"{name.replace(' ', '_')}_rank{r}.json").read_text()) for r in range(world)]
            stats[name] = {k: max(r[k] for r in ranks) for k in ranks[0]}
    base = stats["cp=1"]
    rows = []
    for name, s in stats.items():
        world = LAYOUTS[name][0]
        sent = s["all_to_all"] + s["ring p2p"]
        rows.append(Row(
            op=f"{name} fwd+bwd", shape=f"T={T} one seq, {world} rank(s)", dtype="float32", backend="sdpa, gloo",
            median_s=s["time"], ratio=base["time"] / s["time"], baseline="cp=1 time",
            extra={"peak/rank MB": f"{s['peak'] / 2**20:.1f}", "mem vs cp=1": f"{s['peak'] / base['peak']:.3f}",
                   "sent/layer/rank MB": f"{sent / 2**20:.2f}", "analytic MB": f"{_analytic(name, T) / 2**20:.2f}"},
            values={"peak_bytes": s["peak"], "a2a_bytes_per_layer": s["all_to_all"],
                    "p2p_bytes_per_layer": s["ring p2p"]}))
    return rows
