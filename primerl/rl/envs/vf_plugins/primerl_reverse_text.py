"""Reverse-text as a verifiers 0.4.0 taskset: one user turn ``Reverse: <text>``, the reply is scored
by its similarity to the reversed text (``difflib.SequenceMatcher`` ratio in [0, 1]: partial
credit, so a policy learning from scratch gets a signal before it is exact).

    taskset id: primerl-reverse-text
    knobs:      num_tasks, min_length, max_length, alphabet, seed  ([env.args.env.taskset])
"""

from __future__ import annotations

import difflib
import random

import verifiers.v1 as vf


class ReverseTextData(vf.TaskData):
    text: str
    """The string to reverse."""


class ReverseTextConfig(vf.TasksetConfig):
    num_tasks: int = 1000
    min_length: int = 3
    max_length: int = 5
    alphabet: str = "abcdefgh"
    seed: int = 0


class ReverseTextTask(vf.Task[ReverseTextData]):
    @vf.reward
    async def similarity(self, trace) -> float:
        target = self.data.text[::-1]
        return difflib.SequenceMatcher(None, trace.last_reply, target, autojunk=False).ratio()

    @vf.metric
    async def exact(self, trace) -> float:
        return float(trace.last_reply == self.data.text[::-1])


class ReverseTextTaskset(vf.Taskset[ReverseTextTask, ReverseTextConfig]):
    def load(self):
        c = self.config
        if not 1 <= c.min_length <= c.max_length or not c.alphabet:
            raise ValueError(f"reverse_text: need 1 <= min_length <= max_length and an alphabet, got {c}")
        rng = random.Random(c.seed)
        for i in range(c.num_tasks):
            text = "".join(rng.choice(c.alphabet) for _ in range(rng.randint(c.min_length, c.max_length)))
            yield ReverseTextTask(ReverseTextData(id=str(i), prompt=f"Reverse: {text}", text=text), self.config.task)


__all__ = ["ReverseTextTaskset"]
