"""Weight update time and bytes on the wire (issue 42), against the wire limit of the same run.

``python -m bench weights [--quick]`` (run it under ``nice -n 5``)

One ``mp.spawn`` per (trainer ranks T, receivers R): ranks 0..T-1 are trainer ranks, each holding a
dim-0 chunk of every tensor of a synthetic bf16 transformer (an embedding + layers of attention and
MLP matrices: ~0.1B and ~0.5B parameters, 2M with ``--quick``), ranks T.. the receivers. A row's
``median_s`` is the update time: every trainer rank stamps the end of its "optimizer step" (after a
barrier), every receiver stamps the moment it holds the whole version (assembled full tensors, or the
file loaded); update time = last receiver's stamp - first trainer's (one clock: ``time.monotonic``
on one machine). ``wire limit``: one buffer of the version's bf16 bytes broadcast by trainer rank 0
over the same gloo group the transfer uses (``{trainer rank 0, receivers}``); ``x_limit`` = update
time / that. Modes:

- ``files``: rank 0 gathers each tensor (``dist.gather`` over the trainer ranks) and streams a
  safetensors file (``write_safetensors_stream``), then every receiver loads it;
- ``broadcast``: today's ``EngineBroadcast`` protocol (``weight_broadcast.send_update_stream``): rank 0
  gathers and broadcasts one full tensor at a time;
- ``bucketed``: rank 0 gathers, the bucketed transfer (``weight_transfer``, 64 MB buckets, pipelined;
  without deltas each bucket's pieces go as messages of their own, unpacked, and land in the
  assembled tensors directly);
- ``sharded``: every trainer rank sends its own chunks on its own group, bucketed;
- ``fp8``: sharded, every 2-D weight block-FP8 (128x128 blocks + float32 scales);
- ``delta``: sharded, the second of two versions (a synthetic step moved every weight by N(0, 1e-4),
  the bf16 values changed reported) as xor + zstd deltas.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time

import torch

from .harness import Row

MODES = ("files", "broadcast", "bucketed", "sharded", "fp8", "delta")


def model_shapes(params: float) -> list[tuple[str, tuple[int, int]]]:
    """A transformer-like list of bf16 matrices with about ``params`` parameters."""
    d, ffn, vocab = (1024, 2816, 32000) if params < 3e8 else (1536, 4096, 32000)
    if params < 1e7:
        d, ffn, vocab = 256, 704, 2048
    shapes = [("embed.weight", (vocab, d))]
    n = vocab * d
    i = 0
    while n < params * 0.97:
        for name, s in (("wq", (d, d)), ("wk", (d, d)), ("wv", (d, d)), ("wo", (d, d)), ("w1", (ffn, d)),
                        ("w3", (ffn, d)), ("w2", (d, ffn))):
            shapes.append((f"layers.{i}.{name}.weight", s))
            n += s[0] * s[1]
        i += 1
    return shapes


def _chunk(rows: int, r: int, T: int) -> tuple[int, int]:
    per = -(-rows // T)
    return min(r * per, rows), min((r + 1) * per, rows)


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def _worker(rank, T, R, sizes, modes, repeats, store, port, tmp, out_q):
    import torch.distributed as dist

    from primerl.runtime.inference.weight_broadcast import receive_update, send_update_stream
    from primerl.runtime.inference.weight_buckets import Piece, fp8_transferable
    from primerl.runtime.inference.weight_transfer import (
        BucketSender, join_transfer_groups
    )
    from primerl.runtime.inference.weight_receive import SourceReceiver, receive_version
    from primerl.runtime.trainer.publish import write_safetensors_stream

    import primerl.kernels.fp8  # noqa: F401 - imported before any timing

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=T + R)
    trainers = dist.new_group(list(range(T)))
    trainer = rank < T
    groups = join_transfer_groups("127.0.0.1", port, sources=T, receivers=R,
                                  **({"source": rank} if trainer else {"receiver": rank - T}),
                                  store_master=rank == T, timeout_s=600)
    g0 = groups[0] if 0 in groups else None
    bucket = 64 << 20
    results = []
    for params in sizes:
        shapes = model_shapes(params)
        total = sum(a * b for _, (a, b) in shapes) * 2
        chunks = {}
        if trainer:
            gen = torch.Generator().manual_seed(rank)
            for name, (a, b) in shapes:
                lo, hi = _chunk(a, rank, T)
                chunks[name] = (torch.randn(hi - lo, b, generator=gen) * 0.02).bfloat16()

        def full_tensors():
            """Rank 0: every full tensor in turn (gathered over the trainer ranks); others: None."""
            for name, (a, b) in shapes:
                mine = chunks[name]
                if T == 1:
                    yield name, mine
                    continue
                per = -(-a // T)
                padded = torch.zeros(per, b, dtype=mine.dtype)
                padded[:mine.shape[0]] = mine
                parts = [torch.empty_like(padded) for _ in range(T)] if rank == 0 else None
                dist.gather(padded, parts, dst=0, group=trainers)
                yield name, (torch.cat(parts)[:a] if rank == 0 else None)

        def regions(fp8=False, whole=False):
            out = []
            for name, (a, b) in shapes:
                lo, hi = (0, a) if whole else _chunk(a, rank, T)
                if hi > lo:
                    out.append(Piece(name, "bfloat16", (a, b), (lo, 0), (hi - lo, b),
                                     fp8 and fp8_transferable(name, torch.bfloat16, (a, b))))
            return out

        senders = {}

        def timed(label, send, receive):
            dist.barrier()
            t = time.monotonic()
            info = {}
            if trainer:
                info = send() or {}
            else:
                receive()
            t_end = time.monotonic()
            stamps = [None] * (T + R)
            dist.all_gather_object(stamps, (t, t_end, info))
            if rank == 0:
                start = min(s[0] for s in stamps[:T])
                end = max(s[1] for s in stamps[T:])
                wire = sum(s[2].get("wire_bytes", 0) for s in stamps[:T]) or total
                raw = sum(s[2].get("raw_bytes", 0) for s in stamps[:T]) or total
                extra = {k: v for k, v in stamps[0][2].items() if k in ("changed",)}
                results.append({"params": sum(a * b for _, (a, b) in shapes), "T": T, "R": R, "mode": label,
                                "seconds": end - start, "wire_bytes": wire, "raw_bytes": raw, "total": total,
                                **extra})

        rx = [SourceReceiver(groups[r], r) for r in range(T)] if not trainer else []
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(T) if not trainer else None

        def recv_bucketed(sources):
            v, got = receive_version(rx[:sources], "cpu", pool if sources > 1 else None)
            del got

        # the wire limit: one buffer of the version's bytes over the group of trainer rank 0
        def limit_send():
            if rank == 0:
                buf = torch.empty(total, dtype=torch.uint8)
                _b(g0, buf)

        def limit_recv():
            _b(g0, torch.empty(total, dtype=torch.uint8))

        def _modes(modes):
            for mode in modes:
                if mode == "files":
                    path = os.path.join(tmp, f"v{params}.safetensors")
                    specs = [(n, torch.bfloat16, s) for n, s in shapes]

                    def fsend():
                        it = full_tensors()
                        if rank == 0:
                            write_safetensors_stream(path, specs, it)
                        else:
                            for _ in it:
                                pass
                        dist.barrier()

                    def frecv():
                        from safetensors.torch import load_file

                        dist.barrier()
                        load_file(path)

                    timed("files", fsend, frecv)
                    if rank == 0:
                        os.remove(path)
                elif mode == "broadcast":
                    def bsend():
                        it = full_tensors()
                        if rank == 0:
                            send_update_stream(g0, 1, [(n, torch.bfloat16, s) for n, s in shapes], it)
                        else:
                            for _ in it:
                                pass

                    timed("broadcast", bsend, lambda: receive_update(g0))
                elif mode == "bucketed":
                    def ksend():
                        it = full_tensors()
                        if rank != 0:
                            for _ in it:
                                pass
                            return {}
                        s = senders.setdefault("bucketed", BucketSender(g0, bucket_bytes=bucket))
                        return s.send(1, regions(whole=True), (t for _, t in it))

                    timed("bucketed", ksend, lambda: recv_bucketed(1))
                elif mode in ("sharded", "fp8"):
                    def ssend(fp8=mode == "fp8"):
                        s = senders.setdefault(mode, BucketSender(groups[rank], bucket_bytes=bucket))
                        return s.send(1, regions(fp8), (chunks[p.name] for p in regions(fp8)))

                    timed(mode, ssend, lambda: recv_bucketed(T))
                elif mode == "delta":
                    def dsend(step):
                        s = senders.setdefault("delta", BucketSender(groups[rank], bucket_bytes=bucket, delta=True))
                        info = {}
                        if step:
                            changed = n = 0
                            gen = torch.Generator().manual_seed(100 + rank)
                            for name, t in chunks.items():
                                new = (t.float() + torch.randn(t.shape, generator=gen) * 1e-4).bfloat16()
                                changed += int((new.view(torch.int16) != t.view(torch.int16)).sum())
                                n += t.numel()
                                chunks[name] = new
                            info["changed"] = changed / n
                        out = s.send(step, regions(), (chunks[p.name] for p in regions()))
                        return {**out, **info}

                    timed("delta (first, full)", lambda: dsend(0), lambda: recv_bucketed(T))
                    timed("delta", lambda: dsend(1), lambda: recv_bucketed(T))
        for _rep in range(repeats):
            timed("wire limit", limit_send, limit_recv)
            _modes(modes)
        for s in senders.values():
            s._base = None
        chunks.clear()
    if trainer:
        for s in [BucketSender(groups[rank], bucket_bytes=bucket)]:
            s.close()
    else:
        receive_version(rx, "cpu", pool if T > 1 else None)
    dist.barrier()
    if rank == 0:
        out_q.put(results)
    dist.destroy_process_group()


def _b(group, t):
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([t], opts).wait()


def measure(T: int, R: int, sizes, modes=MODES, repeats: int = 1) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OMP_NUM_THREADS"] = "1"
        args = (T, R, list(sizes), list(modes), repeats, os.path.join(tmp, "store"), _port(), tmp, q)
        mp.start_processes(_worker, args=args, nprocs=T + R, join=True, start_method="spawn")
        return q.get()


def run(args) -> list[Row]:
    """``--quick``: 2M parameters, (1, 1) and (2, 2). Otherwise: every mode once at 0.1B (T1 R1,
    T4 R1, T4 R3) and 0.5B (T4 R1), then the done-when case (0.5B, T4 R1: wire limit, bucketed,
    sharded) three times interleaved, medians; then the generation stall during an update."""
    if args.quick:
        plan = [(1, 1, [2e6], MODES, 1), (2, 2, [2e6], MODES, 1)]
    else:
        plan = [(1, 1, [1e8], MODES, 1), (4, 1, [1e8, 5e8], MODES, 1), (4, 3, [1e8], MODES, 1),
                (4, 1, [5e8], ("bucketed", "sharded"), 3)]
    rows = []
    for T, R, sizes, modes, repeats in plan:
        res = measure(T, R, sizes, modes, repeats)
        by: dict = {}
        for r in res:
            by.setdefault((r["params"], r["mode"]), []).append(r)
        for (params, mode), rs in by.items():
            r = sorted(rs, key=lambda x: x["seconds"])[len(rs) // 2]
            lim = sorted(x["seconds"] for x in by[(params, "wire limit")])[len(rs) // 2]
            extra = {"x_limit": round(r["seconds"] / lim, 2), "wire_MB": round(r["wire_bytes"] / 2**20, 1),
                     "x_bf16_bytes": round(r["wire_bytes"] / r["total"], 3), "n": len(rs)}
            if "changed" in r:
                extra["bf16_changed"] = round(r["changed"], 3)
            rows.append(Row("weights", f"{params / 1e9:.2f}B T{T} R{R}", "bf16", mode, r["seconds"],
                            gbps=r["wire_bytes"] / r["seconds"] / 1e9, ratio=lim / r["seconds"],
                            baseline="wire limit (same run)", extra=extra, values=r))
    st = measure_stall(dim=128 if args.quick else 512, n_layers=2 if args.quick else 8,
                       bucket_mb=1.0 if args.quick else 4.0)
    rows.append(Row("weights stall", f"engine {st['model_mb']:.0f} MB", "fp32", "swap between steps",
                    st["max_gap_during_s"], ratio=st["max_gap_before_s"] / st["max_gap_during_s"],
                    baseline="longest gap before the update",
                    extra={k: (round(v, 4) if isinstance(v, float) else v) for k, v in st.items()}, values=st))
    return rows


def measure_stall(*, dim: int = 512, n_layers: int = 8, bucket_mb: float = 4.0, steps_before: int = 20) -> dict:
    """The longest gap between two decode steps of running requests while a version arrives by the
    bucketed transfer (a sender thread, the engine's receiver threads) and is swapped in between two
    steps (``load_weights(assign=True)``), against the longest gap before the transfer and against
    one bucket's load (a copy of ``bucket_mb``)."""
    import threading
    from pathlib import Path

    from primerl.runtime.inference.engine import InferenceEngine, Request, SamplingParams
    from primerl.runtime.inference.weight_buckets import Piece
    from primerl.runtime.inference.weight_receive import bucketed_engine_receiver
    from primerl.runtime.inference.weight_transfer import BucketSender, join_transfer_groups
    from primerl.runtime.policy import build_model
    from primerl.runtime.validate import load_config

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "examples" / "reverse_text.toml", ["--model.dim", str(dim), "--model.n_layers",
                                                                 str(n_layers)], check=False)
    torch.manual_seed(0)
    model = build_model(cfg, 64, device="cpu", dtype=torch.float32)
    engine = InferenceEngine(model, max_batch_size=8)
    new = {k: (v + 0.01).clone() if v.is_floating_point() else v.clone() for k, v in model.state_dict().items()}
    nbytes = sum(v.numel() * v.element_size() for v in new.values())
    for i in range(4):
        engine.add_request(Request(i, [1, 2, 3], SamplingParams(max_new_tokens=4000, seed=i)))
    port = _port()
    rx = bucketed_engine_receiver("127.0.0.1", port, sources=1, backend="gloo", device="cpu", timeout_s=300)
    go, joined = threading.Event(), threading.Event()

    def send():  # both ends join the group before the steps are timed
        group = join_transfer_groups("127.0.0.1", port, sources=1, receivers=1, source=0, store_master=False,
                                     timeout_s=300)[0]
        s = BucketSender(group, bucket_bytes=int(bucket_mb * 2**20))
        regions = [Piece(k, str(v.dtype).removeprefix("torch."), tuple(v.shape), (0,) * v.dim(), tuple(v.shape))
                   for k, v in new.items()]
        joined.set()
        go.wait()
        s.send(1, regions, list(new.values()))
        s.close()

    th = threading.Thread(target=send)
    th.start()
    joined.wait(300)
    while not rx.receivers:
        time.sleep(0.05)
    gaps_before, gaps_during = [], []
    t = time.monotonic()
    for _ in range(steps_before):
        engine.step()
        now = time.monotonic()
        gaps_before.append(now - t)
        t = now
    go.set()
    swap = None
    while swap is None or len(gaps_during) < steps_before:
        if swap is None and not th.is_alive():
            rx.wait_version(1, timeout=60)  # raises when the sender ended without delivering the version
        if swap is None and rx.versions():
            t_swap = time.monotonic()
            engine.load_weights(rx.take(1), 1, assign=True)
            swap = time.monotonic() - t_swap
        engine.step()
        now = time.monotonic()
        gaps_during.append(now - t)
        t = now
    th.join()
    rx.close(timeout=30)
    assert engine.policy_version == 1 and torch.equal(model.state_dict()[next(iter(new))], next(iter(new.values())))
    a = torch.empty(int(bucket_mb * 2**20), dtype=torch.uint8)
    b = torch.empty_like(a)
    t = time.monotonic()
    for _ in range(5):
        b.copy_(a)
    bucket_load = (time.monotonic() - t) / 5
    return {"model_mb": nbytes / 2**20, "step_median_s": sorted(gaps_before)[len(gaps_before) // 2],
            "max_gap_before_s": max(gaps_before), "max_gap_during_s": max(gaps_during), "swap_s": swap,
            "bucket_load_s": bucket_load, "steps_during": len(gaps_during)}
