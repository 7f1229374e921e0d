"""Spawn real gloo processes once per test module and report named cases back to pytest.

A worker runs many cases in one process group (start-up costs seconds per spawn on 2 cores);
each case records ``None`` (passed) or an error text, and the pytest items assert per case.
Checks inside a case must not raise between collectives (a rank that stops early would leave
its peers waiting), so cases compute first and compare at the end; a hang still ends at the
process group timeout.

Ranks start from a fork server (:func:`start_ranks`): one process per pytest worker that has imported
torch, torch._dynamo and torch.distributed once, forked for every rank of every spawn. A spawned rank
pays ~5 CPU-s of imports before its first collective (measured: 2 spawns of 4 trivial ranks, 41 CPU-s
and 71 s on 2 loaded cores; from the fork server 8 s): the suite's multi-rank tests start ~100 ranks.
The fork server is a clean single-threaded process (pytest's worker, with execnet's threads, is not
forked), and each rank takes the caller's environment of the moment, as a spawned one would.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from pathlib import Path

import multiprocessing

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# what every rank imports before its first line; the server loads them once (set before it starts)
_FORK_SERVER_PRELOAD = ["torch", "torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp",
                        "torch.distributed.checkpoint"]
multiprocessing.set_forkserver_preload(_FORK_SERVER_PRELOAD)

_INT_POISON = {torch.int8: -99, torch.uint8: 0xA5, torch.int16: -30000, torch.int32: -(2**30), torch.int64: -(2**40)}


def poison_empty() -> None:
    """NaN-poison torch.empty & co in this (worker) process, as tests/conftest.py does in pytest's."""

    def fill(t):
        if t.numel() and not t.is_meta:
            with torch.no_grad():
                if t.dtype.is_floating_point:
                    if t.element_size() == 1:
                        t.view(torch.uint8).fill_(0x7F)
                    else:
                        t.fill_(float("nan"))
                elif t.dtype in _INT_POISON:
                    t.fill_(_INT_POISON[t.dtype])
        return t

    real = (torch.empty, torch.empty_like, torch.Tensor.new_empty, torch.empty_strided)
    torch.empty = lambda *a, **k: fill(real[0](*a, **k))
    torch.empty_like = lambda *a, **k: fill(real[1](*a, **k))
    torch.Tensor.new_empty = lambda self, *a, **k: fill(real[2](self, *a, **k))
    torch.empty_strided = lambda *a, **k: fill(real[3](*a, **k))


class CaseLog:
    """Collects per-case outcomes on one rank."""

    def __init__(self):
        self.results: dict[str, str | None] = {}
        self.seconds: dict[str, float] = {}

    def record(self, name: str, errors: list[str]) -> None:
        self.results[name] = "; ".join(errors) if errors else None

    def skip(self, name: str, reason: str) -> None:
        self.results[name] = f"SKIP: {reason}"

    def run(self, name: str, fn, *args) -> None:
        t0 = time.perf_counter()
        try:
            self.record(name, fn(*args) or [])
        except Exception:  # a failed case must not kill the other cases' reports
            self.results[name] = traceback.format_exc()
        self.seconds[name] = time.perf_counter() - t0


def _entry(rank: int, world_size: int, tmp: str, worker, args) -> None:
    torch.set_num_threads(1)
    poison_empty()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    log = CaseLog()
    try:
        worker(rank, world_size, log, *args)
    finally:
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(log.results))
        if rank == 0 and os.environ.get("PRIMERL_DIST_TIMES"):
            print({k: round(v, 2) for k, v in log.seconds.items()}, flush=True)
        dist.barrier()
        dist.destroy_process_group()


def _rank_entry(rank: int, environ: dict[str, str], fn, args) -> None:
    os.environ.clear()
    os.environ.update(environ)
    fn(rank, *args)


def start_ranks(fn, args: tuple, nprocs: int, *, fresh: bool = False) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` (``fn(rank, *args)`` in ``nprocs`` processes,
    joined; a rank's exception is raised here), each rank forked from the fork server with the
    caller's current ``os.environ``; ``fresh``: spawned as new interpreters instead (a measurement
    of what a process allocates from its start)."""
    os.environ["OMP_NUM_THREADS"] = "1"  # also the fork server's, when this call starts it
    mp.start_processes(_rank_entry, args=(dict(os.environ), fn, args), nprocs=nprocs, join=True,
                       start_method="spawn" if fresh else "forkserver")


def spawn(worker, world_size: int, tmp: str | os.PathLike, *args, fresh: bool = False) -> dict[str, list[str]]:
    """Run ``worker(rank, world_size, log, *args)`` on ``world_size`` gloo ranks; returns
    ``{case: [error text of each failing rank]}`` (an empty list means every rank passed).
    ``fresh``: see :func:`start_ranks`."""
    tmp = str(tmp)
    start_ranks(_entry, (world_size, tmp, worker, args), world_size, fresh=fresh)
    merged: dict[str, list[str]] = {}
    for r in range(world_size):
        for name, err in json.loads(Path(tmp, f"rank{r}.json").read_text()).items():
            merged.setdefault(name, [])
            if err:
                merged[name].append(f"rank {r}: {err}")
    return merged
