"""Peak CPU memory of a callable, from torch's CPU allocator counter as the profiler records it."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Callable

from torch.profiler import ProfilerActivity, profile


def track_peak_cpu_bytes(fn: Callable[[], object]) -> int:
    """Peak of live CPU tensor bytes allocated by ``fn`` above what was live when it started.

    With ``profile_memory=True`` every CPU allocation and free is a "[memory]" trace event that
    carries the allocator's running "Total Allocated" (bytes of the allocations made while
    profiling, minus those of them freed), so the peak is exact at allocation granularity, whatever
    operator (or none) an allocation belongs to. Frees of blocks allocated before ``fn`` started are
    not subtracted (the profiler warns "Memory block of unknown size"), which can only make the
    result larger than the truth. The counter persists across profiling sessions, hence the
    baseline taken from the first event.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.remove(path)
    counts = [e["args"] for e in events if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})]
    if not counts:
        return 0
    first = counts[0]
    base = first["Total Allocated"] - first["Bytes"]
    return max(0, max(c["Total Allocated"] for c in counts) - base)
