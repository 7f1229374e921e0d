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
- ``bucketed``: rank 0 gathers, the bucketed transfer (``weight_transfer``, 64 MB buckets, pipelined);
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


def _worker(rank, T, R, sizes, modes, store, port, tmp, out_q):
    import torch.distributed as dist

    from primerl.runtime.inference.weight_broadcast import receive_update, send_update_stream
    from primerl.runtime.inference.weight_buckets import Piece, fp8_transferable
    from primerl.runtime.inference.weight_transfer import (
        BucketSender, SourceReceiver, join_transfer_groups, receive_version
    )
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

        timed("wire limit", limit_send, limit_recv)
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


def measure(T: int, R: int, sizes, modes=MODES) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OMP_NUM_THREADS"] = "1"
        mp.start_processes(_worker, args=(T, R, list(sizes), list(modes), os.path.join(tmp, "store"), _port(), tmp, q),
                           nprocs=T + R, join=True, start_method="spawn")
        return q.get()


def run(args) -> list[Row]:
    if args.quick:
        plan = [(1, 1, [2e6]), (2, 2, [2e6])]
    else:
        plan = [(1, 1, [1e8]), (4, 1, [1e8, 5e8]), (4, 3, [1e8])]
    rows = []
    for T, R, sizes in plan:
        res = measure(T, R, sizes)
        limit = {r["params"]: r["seconds"] for r in res if r["mode"] == "wire limit"}
        for r in res:
            lim = limit[r["params"]]
            extra = {"x_limit": round(r["seconds"] / lim, 2), "wire_MB": round(r["wire_bytes"] / 2**20, 1),
                     "x_bf16_bytes": round(r["wire_bytes"] / r["total"], 3)}
            if "changed" in r:
                extra["bf16_changed"] = round(r["changed"], 3)
            rows.append(Row("weights", f"{r['params'] / 1e9:.2f}B T{T} R{R}", "bf16", r["mode"], r["seconds"],
                            gbps=r["wire_bytes"] / r["seconds"] / 1e9, ratio=lim / r["seconds"],
                            baseline="wire limit (same run)", extra=extra, values=r))
    return rows
