"""One benchmark harness for every op family.

A benchmark module ``bench/<op>.py`` defines ``run(args) -> list[Row]``; ``python -m bench <op>``
prints the rows as a table. Every row is measured in the same run as its baseline (``ratio`` is
baseline_time / this_time, so > 1 means faster than the baseline); absolute times are only
meaningful with the device and date, which the table header prints.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Row:
    op: str
    shape: str
    dtype: str
    backend: str
    median_s: float
    gbps: float | None = None
    tflops: float | None = None
    ratio: float | None = None  # baseline time / this time, same run
    baseline: str = ""
    extra: dict = field(default_factory=dict)  # printed in the table's last column
    values: dict = field(default_factory=dict)  # exact numbers for machine readers (--json), not printed

    def __post_init__(self):
        if _made_rows is not None:
            _made_rows.append(self)


# every Row made while `python -m bench` runs a module, so that a module stopped at its time limit
# (SIGTERM from bench/gpu_check.sh's `timeout`) still hands over the rows it had finished
_made_rows: list[Row] | None = None


def synchronize(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], object], *, device: str = "cpu", warmup: int = 2, repeats: int = 7,
            min_time_s: float = 0.0) -> float:
    """Median wall time of ``fn`` in seconds: triton.testing.do_bench on CUDA, repeats on CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    for _ in range(warmup):
        fn()
    times = []
    start_all = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start_all) < min_time_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 1000:
            break
    return statistics.median(times)


def time_interleaved(fns: dict[str, Callable[[], object]], *, device: str = "cpu", warmup: int = 1,
                     repeats: int = 7) -> dict[str, float]:
    """Median wall time of each of ``fns`` in seconds, the functions run in turn within each
    repeat, so that a slow phase of a shared CPU (other tenants, frequency) hits all of them alike
    and their ratios stay meaningful. On CUDA each is timed by :func:`time_fn`."""
    if device == "cuda":
        return {name: time_fn(fn, device=device) for name, fn in fns.items()}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def first_touch_mb(fn: Callable[[], object]) -> float:
    """MB of memory pages the OS had to map in (minor page faults x page size) during one call of
    ``fn`` on CPU: fresh large tensors that glibc's malloc hands back to the OS on free are
    faulted in again on every call, a cost (kernel time) that is not arithmetic."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * resource.getpagesize() / 1e6


def peak_memory(fn: Callable[[], object], device: str = "cpu") -> int:
    """Peak bytes allocated while running ``fn`` (CUDA allocator stats, or the CPU tracker)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from .cpu_memory import track_peak_cpu_bytes

    return track_peak_cpu_bytes(fn)


def header() -> str:
    if torch.cuda.is_available():
        dev = torch.cuda.get_device_name()
    else:
        dev = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "-"
    malloc = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_") or k == "LD_PRELOAD"]
    alloc = "  allocator: " + (" ".join(malloc) if malloc else "default")
    return f"# {datetime.date.today().isoformat()}  device: {dev}  torch {torch.__version__}  triton {tv}{alloc}"


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def format_table(rows: list[Row]) -> str:
    cols = ["op", "shape", "dtype", "backend", "median", "GB/s", "TFLOP/s", "ratio", "vs"]
    data = []
    for r in rows:
        med = f"{r.median_s * 1e6:.1f} us" if r.median_s < 1e-2 else f"{r.median_s * 1e3:.2f} ms"
        line = [r.op, r.shape, r.dtype, r.backend, med, _fmt(r.gbps, ".1f"), _fmt(r.tflops, ".3f"),
                _fmt(r.ratio, ".2f") + ("x" if r.ratio is not None else ""), r.baseline]
        if r.extra:
            line[-1] += ("  " if line[-1] else "") + " ".join(f"{k}={v}" for k, v in r.extra.items())
        data.append(line)
    widths = [max(len(c), *(len(str(d[i])) for d in data)) if data else len(c) for i, c in enumerate(cols)]
    out = [" | ".join(c.ljust(w) for c, w in zip(cols, widths)), "-+-".join("-" * w for w in widths)]
    out += [" | ".join(str(v).ljust(w) for v, w in zip(d, widths)) for d in data]
    return "\n".join(out)



def row_to_json(row, module: str) -> str:
    """One JSON line for ``row`` (``module`` = the bench module that made it); NaN and inf become null.
    A module whose rows are another dataclass (aot's reports) gets them written field by field."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v if v is None or isinstance(v, (str, int, float, bool)) else str(v)

    if dataclasses.is_dataclass(row):
        fields = {f.name: clean(getattr(row, f.name)) for f in dataclasses.fields(row)}
    else:
        fields = {"repr": str(row)}
    kind = "row" if isinstance(row, Row) else type(row).__name__
    return json.dumps({"kind": kind, "module": module, **fields}, allow_nan=False)


def read_jsonl(path) -> list[dict]:
    """Every record of a JSON-lines file written by ``python -m bench --json`` (or appended to it by
    bench/gpu_check.sh); a row record's null ``median_s`` reads back as NaN. A line that does not
    parse (a writer killed mid-line) is left out with a note on stderr, so one bad line cannot hide
    the rest of a GPU run."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line, strict=False)
            except json.JSONDecodeError as exc:
                print(f"{path}:{n}: unreadable line left out ({exc})", file=sys.stderr)
                continue
            if rec.get("kind") == "row" and rec.get("median_s") is None:
                rec["median_s"] = math.nan
            out.append(rec)
    return out


def row_from_json(rec: dict) -> Row:
    """The Row of a ``kind == "row"`` record (null median -> NaN)."""
    row = Row(**{k: rec[k] for k in Row.__dataclass_fields__ if k in rec})
    if row.median_s is None:
        row.median_s = math.nan
    return row
