"""Online evaluation (``[eval]``) in a job with a verifiers environment: ``evaluation.OnlineEval``
driven from the verifiers path's event loop.

Everything is ``OnlineEval``'s (when a run is due, its episodes and seeds, greedy as a one-token
nucleus, the environment calls, pass@k, the metrics); only the model turn differs: each is one
``POST /inference/v1/generate`` to the job's in-process server (``vf_mix.generate_turn``), next to
the training episodes' requests. The eval environments are built-in ones (a verifiers one is
refused at ``--dry-run``). A run still in flight when the job ends is dropped, as on the built-in
path.
"""

from __future__ import annotations

import asyncio

from .evaluation import OnlineEval
from .vf_mix import generate_turn


class LoopEval:
    def __init__(self, cfg):
        self.evals = OnlineEval(cfg)
        self.tasks: set[asyncio.Task] = set()  # model turns in flight
        self._wake: asyncio.Event | None = None
        self._http = self._url = self._model = self._pop = None

    def bind(self, loop: asyncio.AbstractEventLoop, http, url: str, model: str, pop_session) -> None:
        """At the run's start: the HTTP client, the server, and a wake-up of ``loop`` when an eval
        environment call returns."""
        self._wake = asyncio.Event()
        self._http, self._url, self._model, self._pop = http, url, model, pop_session

        def wake():
            try:
                loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # the loop is closed: the run is over
                pass

        for spec in self.evals.specs:
            spec.calls.on_result = wake

    def loaded(self, old_version: int, new_version: int) -> None:
        """The sampler moved to ``new_version``: start a run if it crosses a multiple of the interval."""
        if self.evals.due(old_version, new_version):
            self.evals.start(new_version, self._submit)

    def _submit(self, st, max_new: int, temperature: float, top_p: float, seed: int, stop_token_ids: tuple) -> None:
        params = {"temperature": temperature, "top_p": top_p, "max_tokens": max_new,
                  "stop_token_ids": list(stop_token_ids), "seed": seed}
        self.tasks.add(asyncio.create_task(self._turn(st, params)))

    async def _turn(self, st, params: dict):
        return st, await generate_turn(self._http, self._url, self._model, st.episode.tokens, params, self._pop)

    def busy(self) -> bool:
        return bool(self.tasks) or bool(self.evals.pending())

    def waiter(self) -> asyncio.Task:
        """A task that finishes when an eval environment call returns (to wait on with the episodes)."""
        self._wake.clear()
        return asyncio.ensure_future(self._wake.wait())

    def collect(self, done: set) -> None:
        """Finished model turns among ``done`` and finished environment calls, fed to ``OnlineEval``
        (a failure is the eval's error, raised)."""
        for t in done & self.tasks:
            self.tasks.discard(t)
            st, c = t.result()
            if st.eval_key[0] in self.evals.runs:
                self.evals.on_completion(st, c)
        for st, name, ok, value in self.evals.poll():
            if st.eval_key[0] in self.evals.runs:
                self.evals.on_env_result(st, name, ok, value, self._submit)

    def pop_ready(self) -> dict:
        return self.evals.pop_ready()

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
        self.evals.runs.clear()


__all__ = ["LoopEval"]
