"""Peak CPU memory of a callable, from torch's CPU allocator events as seen by the profiler."""

from __future__ import annotations

from typing import Callable

from torch.profiler import ProfilerActivity, profile


def track_peak_cpu_bytes(fn: Callable[[], object]) -> int:
    """Peak of live CPU tensor bytes allocated by ``fn`` above what was live when it started.

    Each event's *self* memory is summed in start-time order (an operator's total includes its
    children's allocations and would count them twice; frees outside operators arrive as
    "[memory]" events). A temporary allocated and freed inside one operator is not seen, so this
    is a lower bound on the true peak at operator granularity.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    deltas = sorted(
        (evt.time_range.start, evt.self_cpu_memory_usage) for evt in prof.events() if evt.self_cpu_memory_usage
    )
    live = peak = 0
    for _, delta in deltas:
        live += delta
        peak = max(peak, live)
    return peak
