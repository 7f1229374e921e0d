"""Peak CPU memory of a callable, from torch's CPU allocator as seen by the profiler."""

from __future__ import annotations

from typing import Callable

import torch


def track_peak_cpu_bytes(fn: Callable[[], object]) -> int:
    """Peak of live CPU tensor bytes allocated by ``fn`` above what was live when it started."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        fn()
    live, peak = 0, 0
    events = []
    for evt in prof.events():
        if evt.cpu_memory_usage:
            events.append((evt.time_range.start, evt.cpu_memory_usage))
    # self memory usage of leaf allocation events, in time order
    for _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak
