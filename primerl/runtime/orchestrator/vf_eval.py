"""Online evaluation (``[eval]``) in a job with a verifiers environment: ``evaluation.OnlineEval``
driven from the verifiers path's event loop.

Everything is ``OnlineEval``'s (when a run is due, its episodes and seeds, greedy as a one-token
nucleus, the environment calls, pass@k, the metrics); only the model turn differs: each is one
``POST /inference/v1/generate`` to the job's in-process server (``vf_mix.generate_turn``), next to
the training episodes' requests. A run still in flight when the job ends is dropped, as on the
built-in path.

A verifiers eval environment (``[[eval.env]]`` naming a verifiers training environment, e.g. with
``args = {split = "heldout"}``, or ``id = "verifiers"``) runs its own episodes: prompt ``p`` is
its task ``p`` (of its split), each sample one ``vf_env.run_episode`` with verifiers' train client
on the same server and the eval's sampling (temperature, top_p, max_tokens; greedy as above)
laid over the environment's; its reward is the mean ``trace.reward`` of its trainable traces, its
version the oldest policy version the server recorded for them. The episodes are never trained
on: their sessions are popped here, their groups are in no batch. An episode that is not ok, past
``env.args.episode_timeout_s`` or without a reward is an error of the eval, as a failed
environment call of a built-in one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from primerl.rl.envs.verifiers_env import BranchError, trace_reward

from ..config import ConfigError
from .env_calls import check_reward
from .evaluation import OnlineEval, eval_sampling, runs_own_episodes
from .vf_mix import fresh_renderers_lock, generate_turn


@dataclass
class VfEvalEpisode:
    """One sample of a verifiers eval environment (what ``evaluation.eval_results`` reads)."""

    eval_key: tuple  # (version, eval index, prompt, sample)
    reward: float = 0.0
    version_min: int = 0
    done: bool = False


class LoopEval:
    def __init__(self, cfg):
        self.evals = OnlineEval(cfg)
        self.tasks: set[asyncio.Task] = set()  # model turns (and verifiers eval episodes) in flight
        self._wake: asyncio.Event | None = None
        self._http = self._url = self._model = self._pop = None
        self._ctx: dict[int, object] = {}  # verifiers eval environment -> its ModelContext (the eval's sampling)
        self._sem: dict[int, asyncio.Semaphore] = {}
        for i, spec in enumerate(self.evals.specs):
            if runs_own_episodes(spec.env) and spec.cfg.num_prompts > len(spec.env.tasks):
                raise ConfigError(f"eval.env[{i}].num_prompts: {spec.cfg.num_prompts} is more than the "
                                 f"{len(spec.env.tasks)} tasks of eval {spec.name!r}")

    def own_envs(self) -> list:
        """The verifiers eval environments (the loop enters their ``vf_env.serving()``)."""
        return [s.env for s in self.evals.specs if runs_own_episodes(s.env)]

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

        for i, spec in enumerate(self.evals.specs):
            spec.calls.on_result = wake
            if runs_own_episodes(spec.env):
                x = spec.cfg
                temperature, top_p = eval_sampling(x)
                sampling = {"temperature": temperature, "top_p": top_p,
                            **({"max_tokens": x.max_tokens} if x.max_tokens else {})}
                self._ctx[i] = spec.env.model_context(url, temperature=temperature, top_p=top_p, model=model,
                                                      sampling=sampling)
                self._sem[i] = asyncio.Semaphore(spec.env.max_concurrent)

    def loaded(self, old_version: int, new_version: int) -> None:
        """The sampler moved to ``new_version``: start a run if it crosses a multiple of the interval."""
        if self.evals.due(old_version, new_version):
            self.evals.start(new_version, self._submit, self._start_own)

    async def run_once(self, server, version: int, model: str) -> dict:
        """``primerl eval``: one run of every eval environment on the policy ``server`` (a started
        ``GenerateServer.server``) holds as ``version``, on this event loop; -> its metrics."""
        import contextlib

        import httpx

        fresh_renderers_lock()
        loop = asyncio.get_running_loop()
        async with contextlib.AsyncExitStack() as stack:
            for env in self.own_envs():
                await stack.enter_async_context(env.vf_env.serving())
            http = await stack.enter_async_context(httpx.AsyncClient(
                timeout=httpx.Timeout(self.evals.cfg.inference.timeout_s, pool=None),
                limits=httpx.Limits(max_connections=64)))
            self.bind(loop, http, server.url, model, server.pop_session)
            self.evals.start(version, self._submit, self._start_own)
            try:
                while self.evals.runs:
                    dead = server.engine_error
                    if dead is not None:
                        raise RuntimeError(f"the inference engine died: {dead!r}") from dead
                    wake = self.waiter()  # an eval's environment call returned
                    done, _ = await asyncio.wait(self.tasks | {wake}, timeout=0.5,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    wake.cancel()
                    self.collect(done)
            finally:
                await self.close()
        return self.pop_ready()

    def _start_own(self, run, ei: int, spec) -> None:
        """A verifiers eval environment's episodes of ``run``: ``samples`` of each of its first
        ``num_prompts`` tasks."""
        for p in range(spec.cfg.num_prompts):
            for s in range(spec.cfg.samples):
                st = VfEvalEpisode((run.version, ei, p, s))
                run.states[(ei, p, s)] = st
                run.left += 1
                self.tasks.add(asyncio.create_task(self._own_episode(st, spec, spec.env.tasks[p])))

    async def _own_episode(self, st: VfEvalEpisode, spec, task):
        env, ei = spec.env, st.eval_key[1]
        async with self._sem[ei]:
            try:
                ep = await asyncio.wait_for(env.vf_env.run_episode(task, self._ctx[ei]), env.episode_timeout_s)
            except TimeoutError:
                ep = None
        return st, ep

    def _score_own(self, st: VfEvalEpisode, ep) -> None:
        """A verifiers eval episode came back: its sessions popped, its reward and version, or the
        eval's error."""
        spec = self.evals.specs[st.eval_key[1]]
        recs = [self._pop(t.id) for t in (ep.traces if ep is not None else [])]
        if ep is None or not ep.ok:
            why = "it took longer than env.args.episode_timeout_s" if ep is None else ep.last_error
            raise RuntimeError(f"eval {spec.name!r}: episode (prompt {st.eval_key[2]}, sample {st.eval_key[3]}) "
                               f"is not ok: {why}")
        scored = [(t, r) for t, r in zip(ep.traces, recs) if t.agent.trainable]
        if not scored or any(r is None for _, r in scored):
            raise RuntimeError(f"eval {spec.name!r}: episode (prompt {st.eval_key[2]}) has no trainable trace "
                               "with a model call on the inference server")
        try:
            reward = sum(trace_reward(t) for t, _ in scored) / len(scored)
        except BranchError as e:
            raise RuntimeError(f"eval {spec.name!r}: episode (prompt {st.eval_key[2]}): {e}") from None
        st.reward, _ = check_reward(reward, self.evals.cfg.env.max_abs_reward, f"eval {spec.name!r}")
        st.version_min, st.done = min(r.first for _, r in scored), True
        self.evals.finished(st)

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
            if isinstance(st, VfEvalEpisode):
                if st.eval_key[0] in self.evals.runs:
                    self._score_own(st, c)
                else:  # its run was dropped: nothing to score, its sessions still popped
                    for trace in getattr(c, "traces", ()):
                        self._pop(trace.id)
            elif st.eval_key[0] in self.evals.runs:
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
