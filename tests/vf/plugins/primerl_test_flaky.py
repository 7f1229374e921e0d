"""A verifiers taskset whose judge fails on purpose (tests of the orchestrator's episode
accounting): task 0's reward always raises, task 1's raises on its first scoring only, task 2's
first score is NaN; the others score the reply's length."""

from __future__ import annotations

import collections

import verifiers.v1 as vf

CALLS: collections.Counter = collections.Counter()  # scoring calls per task id (episodes run in process)


class FlakyData(vf.TaskData):
    pass


class FlakyConfig(vf.TasksetConfig):
    num_tasks: int = 4


class FlakyTask(vf.Task[FlakyData]):
    @vf.reward
    async def length(self, trace) -> float:
        i = int(self.data.id)
        CALLS[i] += 1
        if i == 0 or (i == 1 and CALLS[i] == 1):
            raise RuntimeError(f"judge unavailable for task {i}")
        if i == 2 and CALLS[i] == 1:
            return float("nan")
        return float(len(trace.last_reply))


class FlakyTaskset(vf.Taskset[FlakyTask, FlakyConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            yield FlakyTask(FlakyData(id=str(i), prompt=f"Say {i}."), self.config.task)


__all__ = ["FlakyTaskset"]
