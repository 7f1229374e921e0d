"""The orchestrator's verifiers path: verifiers runs the episodes, primerl trains on the traces.

With ``env.id = "verifiers"`` (``primerl.rl.envs.verifiers_env.VerifiersEnv``) the job's embedded
engine is served over HTTP (``server.EngineServer``: ``/inference/v1/generate``, ``/v1/models``)
inside the orchestrator process (with ``inference.backend = "vllm"``: vLLM's own route, behind a
recording pass-through, ``generate_proxy.GenerateProxy``), and each episode is
``vf_env.run_episode(task, ctx)`` with verifiers' train client pointed at that server; up to
``env.args.max_concurrent`` episodes run at once on this process's event loop (the engine batches
their requests).

Batch n holds ``batch_size`` groups of ``group_size`` episodes of one task each (task
``(n * batch_size + g) mod len(tasks)``), submitted under the same async-level rule as the
built-in path (``orchestrator.Orchestrator``). A finished episode becomes, per trainable trace
and trainable branch, one sample (``verifiers_env.branch_sample``): the branch's token ids with
the loss on the model's sampled tokens only, the sampling log-probs, the routed experts for
replay; every model turn is first checked against what the server sampled for that trace
(``X-Session-ID`` = trace id), tokens and log-probs, and the trace's oldest policy version comes
from the same record. Advantages are per task group over the traces' rewards (``trace.reward``,
the weighted sum of the task's ``@vf.reward``s); every branch of a trace gets its trace's.

An episode that is not ok (an error in the harness, a tool, scoring; longer than
``env.args.episode_timeout_s``), has no reward, or whose
branch cannot be trained on is counted by reason (``episodes/not_ok``, ``episodes/no_reward``,
``episodes/bad_branch``) and resampled; a group with more than ``env.max_retries`` such episodes
is dropped (``groups/dropped``, the last reason logged) and replaced by a fresh task. A group with
a trace older than ``max_off_policy_steps`` is resampled (``samples/discarded_stale``).
Seeds come from the server's request order, so unlike the built-in path a rerun is not
token-for-token identical.

A mix (``[[env]]``: verifiers environments and built-in ones) runs here too: each group slot goes to
an environment as on the built-in path (``sampling.PromptSampler``: dealt by the weights, its own
``group_size``, the curriculum's draws), a built-in environment's episode is generate requests to
the same server plus its ``reward`` (``vf_mix.builtin_episode``), advantages stay within a group's
units of one environment (``vf_mix.unit_advantages``), and the per-environment metrics, dynamic
sampling (``orchestrator.filter = "dapo"``) and the curriculum's records are the built-in path's
(``mix_stats.MixStats``); ``[eval]`` runs its eval environments, built-in and verifiers ones, here
(``vf_eval.LoopEval``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable

from primerl.rl.envs import check_tokens
from primerl.rl.envs.verifiers_env import (BranchError, VerifiersEnv, branch_sample, check_branch_against_requests,
                                           trace_reward)

from ..config import RLConfig
from .env_calls import AsyncEnvCalls, EnvCalls, EnvCallTimeout, RewardRejected, check_reward
from .mix_stats import MixStats, Outcome
from .rollout import EpisodeState, mix_seed
from .steps import BatchSteps
from .vf_eval import LoopEval
from .vf_mix import BuiltinEpisode, Group, Unit, builtin_episode, fresh_renderers_lock, unit_advantages
from ..transport import FileTransport

log = logging.getLogger("primerl.orchestrator")

REASONS = ("not_ok", "no_reward", "bad_branch")
COUNTS = ("discarded_stale", "groups_dropped") + tuple(f"episodes_{r}" for r in REASONS) + (
    "rewards_rejected", "rewards_clipped", "env_timeouts", "groups_filtered", "rollouts_oversampled", "groups_sampled",
    "groups_uniform_kept")


class VerifiersEnvError(RuntimeError):
    pass


class EpisodeTimedOut:
    """Stands for an episode that passed ``env.args.episode_timeout_s`` (its task was cancelled)."""

    ok = False
    traces: list = []

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    @property
    def last_error(self):
        from types import SimpleNamespace

        return SimpleNamespace(type="TimeoutError", message=f"the episode took longer than env.args.episode_timeout_s "
                                                            f"= {self.timeout_s} s")


class VerifiersOrchestrator(BatchSteps):
    def __init__(self, cfg: RLConfig, env: VerifiersEnv, client, transport: FileTransport, *, start_step: int = 0,
                 trainer_alive: Callable[[], bool] | None = None, top_k: int = 1, weights=None):
        """``weights``: the ``WeightVersions`` that says which versions exist (the backend's
        ``weight_receiver``); default: the trainer's markers in ``transport``."""
        from ..inference.backend import get_backend
        from ..inference.weight_sync import FileWeightVersions
        from .sampling import PromptSampler, build_mix

        self.cfg, self.env, self.transport = cfg, env, transport
        self.mix = build_mix(cfg, env)  # the job's environments ([env] or [[env]])
        self.sampler = PromptSampler(cfg, self.mix)
        self.sampler.load_state(cfg.output_dir, start_step)  # the curriculum's, when resuming
        self.stats = MixStats(cfg, self.mix, self.sampler)
        self.evals = LoopEval(cfg)  # [eval]: OnlineEval on this loop
        vf_envs = [m.env for m in self.mix if isinstance(m.env, VerifiersEnv)]
        self.weights = FileWeightVersions(transport) if weights is None else weights
        self.o = cfg.orchestrator
        self.start_step, self.trainer_alive, self.top_k = start_step, trainer_alive, top_k
        self.client = client
        self.server_model_name = vf_envs[0].model_name
        # the embedded engine behind its own HTTP server (self.engine: loaded on the server's engine
        # thread), or vLLM's route behind a recording pass-through (self.engine None: the client loads)
        self.server, self.engine = get_backend(cfg).generate_server(cfg, client, policy_version=lambda: self.version,
                                                                    model_name=self.server_model_name)
        self._init_steps(start_step, COUNTS)  # self.batches: step -> list[Group]
        self._env_calls = [None if isinstance(m.env, VerifiersEnv) else
                           EnvCalls(m.name, m.cfg.timeout_s, m.cfg.max_concurrent_calls) for m in self.mix]
        self._spare_index = 0  # replacement tasks for dropped groups, after every scheduled one
        self._inflight: set[asyncio.Task] = set()
        self.replay = cfg.trainer.router_replay and cfg.inference.capture_routing
        # per-request / per-rollout INFO lines of the HTTP clients and verifiers (several per episode)
        for name in ("httpx", "httpcore", "mcp", "verifiers", "renderers"):
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)

    # ---------------------------------------------------------------- weights
    async def _refresh_weights(self, *, block_for: int | None = None) -> None:
        if block_for is not None:
            await asyncio.to_thread(self.weights.wait_version, block_for, timeout=self.o.weights_timeout_s,
                                    alive=self.trainer_alive)
        versions = [v for v in self.weights.versions() if v <= self.next_submit]
        if versions and versions[-1] > self.version:
            v = versions[-1]
            if self.engine is None:  # vLLM: the client loads and verifies it on every worker
                await asyncio.to_thread(self.client.update_weights, v, self.transport)
            else:
                sd = await asyncio.to_thread(self.transport.load_weights, v)
                await asyncio.to_thread(self.server.call_in_engine, lambda: self.engine.load_weights(sd, v),
                                        self.cfg.inference.timeout_s)
            old, self.version = self.version, v
            self.evals.loaded(old, v)

    # ---------------------------------------------------------------- submission
    def _start_member(self, step: int, g: int, m: int) -> None:
        grp = self.batches[step][g]
        me = self.mix[grp.env]
        if isinstance(me.env, VerifiersEnv):
            coro = self._episode(grp.env, me.env.tasks[grp.task_index])
        else:
            seed = mix_seed(self.cfg.seed, step, g, m, grp.failures, grp.gen)
            if grp.draw:  # a replacement group (dynamic sampling): seeds of its own
                seed = mix_seed(seed, 0xD5, grp.draw)
            st = EpisodeState.start(step, g, m, grp.failures, grp.prompt, env=grp.env, draw=grp.draw)
            i = self.cfg.inference
            coro = builtin_episode(self._http, self.server.url, self._model, me, self._async_calls[grp.env], st,
                                   seed_of=lambda turn: mix_seed(seed, turn), temperature=i.temperature,
                                   top_p=i.top_p, pop_session=self.server.pop_session)
        t = asyncio.create_task(self._tagged(step, g, m, grp.gen, coro))
        self._inflight.add(t)

    @staticmethod
    async def _tagged(step: int, g: int, m: int, gen: int, coro):
        return step, g, m, gen, await coro

    async def _episode(self, e: int, task):
        env = self.mix[e].env
        async with self._sem[e]:
            try:
                return await asyncio.wait_for(env.vf_env.run_episode(task, self._ctx[e]), env.episode_timeout_s)
            except TimeoutError:
                return EpisodeTimedOut(env.episode_timeout_s)

    def _start_group(self, step: int, g: int, task_index: int | None = None, draw: int = 0) -> None:
        """Group ``g`` of batch ``step``: the sampler's prompt (``draw``: dynamic sampling's
        replacement), or ``task_index`` (a resample, a dropped group's fresh task)."""
        old = self.batches[step][g]
        e = self.sampler.env_of(step, g)
        me = self.mix[e]
        index = self.sampler.prompt_index(step, g, draw) if task_index is None else task_index
        grp = Group(index, gen=(old.gen + 1) if old is not None else 0, members=[None] * me.group_size, env=e,
                    draw=draw)
        if isinstance(me.env, VerifiersEnv):
            grp.task_index = index % len(me.env.tasks)
            grp.key = str(me.env.tasks[grp.task_index].key)
        else:
            n = me.env.num_prompts
            grp.task_index = index % n if n else index
            grp.prompt = me.env.prompt(grp.task_index)
            check_tokens(grp.prompt.tokens, me.env.vocab_size, f"environment {me.name!r} prompt {grp.task_index}")
            grp.key = grp.prompt.key
        self.batches[step][g] = grp
        self._batch_counters[step]["groups_sampled"] += 1
        for m in range(me.group_size):
            self._start_member(step, g, m)

    def _submit_batch(self, step: int) -> None:
        self.batches[step] = [None] * self.o.batch_size
        self._batch_counters[step] = dict.fromkeys(COUNTS, 0)
        if self.sampler.curriculum is not None:
            self.sampler.curriculum.advance(step)
        for g in range(self.o.batch_size):
            self._start_group(step, g)

    # ---------------------------------------------------------------- episodes
    def _units(self, ep) -> list[Unit]:
        """The trainable traces of a finished episode; BranchError (with a reason) when unusable."""
        if isinstance(ep, BuiltinEpisode):
            if ep.error is not None:
                raise BranchError(f"not_ok: {type(ep.error).__name__}: {ep.error}")
            n = len(ep.units[0].episode.episode.tokens)
            if n > self.o.seq_len:
                raise BranchError(f"bad_branch: {n} tokens, more than orchestrator.seq_len = {self.o.seq_len}")
            return ep.units
        if not ep.ok:
            err = ep.last_error or next((t.last_error for t in ep.traces if t.last_error is not None), None)
            raise BranchError("not_ok: " + (f"{err.type}: {err.message[:300]}" if err else "the episode is not ok"))
        units = []
        for trace in ep.traces:
            rec = self.server.pop_session(trace.id)
            if not trace.agent.trainable:
                continue
            if rec is None:
                raise BranchError("bad_branch: no model call of the trace reached the inference server")
            try:
                reward = trace_reward(trace)
            except BranchError as e:
                raise BranchError(f"no_reward: {e}") from None
            branches = [b for b in trace.branches if b.trainable and any(b.sampled_mask)]
            if not branches:
                raise BranchError("bad_branch: the trace has no trainable branch with a sampled token")
            for b in branches:
                check_branch_against_requests(b, rec.requests)
                if len(b.token_ids) > self.o.seq_len:
                    raise BranchError(f"bad_branch: {len(b.token_ids)} tokens, more than orchestrator.seq_len = "
                                      f"{self.o.seq_len}")
            units.append(Unit(trace.agent.name, reward, branches, rec.first, trace.num_turns, len(trace.tool_messages),
                              sum(len(r[1]) for r in rec.requests), version_max=rec.last))
        if not units:
            raise BranchError("bad_branch: the episode has no trainable trace")
        return units

    def _on_episode(self, step: int, g: int, m: int, gen: int, ep) -> None:
        grp = self.batches[step][g] if step in self.batches else None
        if grp is None or grp.gen != gen:  # its group was reset meanwhile
            for trace in ep.traces:
                self.server.pop_session(trace.id)
            return
        me = self.mix[grp.env]
        if isinstance(ep, BuiltinEpisode) and isinstance(ep.error, EnvCallTimeout):
            self._count(step, "env_timeouts")
        try:
            units = self._units(ep)
            for u in units:
                u.reward, clipped = check_reward(u.reward, me.cfg.max_abs_reward, f"environment {me.name!r}")
                if clipped:
                    self._count(step, "rewards_clipped")
        except (BranchError, RewardRejected) as e:
            for trace in ep.traces:
                self.server.pop_session(trace.id)
            reason = "no_reward" if isinstance(e, RewardRejected) else str(e).split(":", 1)[0]
            if isinstance(e, RewardRejected):
                self._count(step, "rewards_rejected")
            self._count(step, f"episodes_{reason if reason in REASONS else 'bad_branch'}")
            grp.failures += 1
            if grp.failures > me.cfg.max_retries:
                self._drop_group(step, g, e)
            else:
                log.warning("verifiers episode resampled (step %d group %d member %d): %s", step, g, m, e)
                self._start_member(step, g, m)
            return
        self._tokens_since_write += sum(u.sampled_tokens for u in units)
        grp.members[m] = units
        if all(x is not None for x in grp.members) and self.stats.replaces(step, _outcome(grp),
                                                                            self._batch_counters[step]):
            self._count(step, "groups_filtered")  # dapo: uniform rewards, a fresh prompt's group instead
            self._start_group(step, g, draw=grp.draw + 1)
            n = len(self.batches[step][g].members)
            self.counters["rollouts_oversampled"] += n
            self._batch_counters[step]["rollouts_oversampled"] += n

    def _drop_group(self, step: int, g: int, reason: BaseException) -> None:
        self._count(step, "groups_dropped")
        me = self.mix[self.batches[step][g].env]
        if self._batch_counters[step]["groups_dropped"] > self.o.batch_size:
            raise VerifiersEnvError(f"environment {me.name!r}: more than {self.o.batch_size} groups of step "
                                    f"{step} dropped (each after env.max_retries = {me.cfg.max_retries} failed "
                                    f"episodes); last reason: {reason}")
        log.warning("verifiers group dropped (step %d group %d, task %d) after %d failed episodes: %s; a new task "
                    "replaces it", step, g, self.batches[step][g].task_index, self.batches[step][g].failures, reason)
        self._spare_index += 1
        spare = self.cfg.max_steps * self.o.batch_size + self._spare_index
        self._start_group(step, g, spare, self.batches[step][g].draw)

    # ---------------------------------------------------------------- hand-over
    def _batch_done(self, step: int) -> bool:
        return step in self.batches and all(u is not None for grp in self.batches[step] for u in grp.members)

    def _finalize(self, step: int):
        groups = self.batches[step]
        stale = [g for g, grp in enumerate(groups)
                 if any(step - u.version_min > self.o.max_off_policy_steps for units in grp.members for u in units)]
        if stale:
            for g in stale:
                n = len(groups[g].members)
                self.counters["discarded_stale"] += n
                self._batch_counters[step]["discarded_stale"] += n
                self._start_group(step, g, groups[g].task_index, groups[g].draw)
            return None
        from .batching import episode_sample

        adv, adv_metrics = unit_advantages(groups, self.o.advantage)
        samples, rewards, off, lens, turns, tools, branches = [], [], [], [], [], [], []
        records = []  # orchestrator.save_samples
        T = self.cfg.inference.temperature
        for gi, grp in enumerate(groups):
            for mi, units in enumerate(grp.members):
                for ui, u in enumerate(units):
                    rewards.append(u.reward)
                    off.append(step - u.version_min)
                    turns.append(u.turns)
                    tools.append(u.tool_calls)
                    branches.append(max(len(u.branches), 1))
                    if u.episode is not None:  # a built-in environment's episode
                        samples.append(episode_sample(u.episode, adv[gi][mi][ui], self.top_k, replay=self.replay,
                                                      temperature=T))
                        lens.append(len(u.episode.episode.tokens))
                        if self.o.save_samples:
                            from .samples_log import episode_record

                            records.append(episode_record(u.episode, samples[-1]))
                    for bi, b in enumerate(u.branches):
                        samples.append(branch_sample(b, advantage=adv[gi][mi][ui], temperature=T, replay=self.replay,
                                                     vocab_size=self.env.vocab_size))
                        lens.append(len(b.token_ids))
                        if self.o.save_samples:
                            from .samples_log import sample_record

                            records.append(sample_record(
                                samples[-1], step=step, group=gi, member=mi, reward=u.reward, version_min=u.version_min,
                                version_max=u.version_max, servers=[self.server.url], turns=u.turns,
                                extra={"agent": u.agent, "trace": ui, "branch": bi}))
        if self.o.save_samples:
            from .samples_log import write_samples

            write_samples(self.cfg.output_dir, step, records)
        c = self._batch_counters[step]
        metrics = {
            **self._step_metrics(step, rewards, off, lens, turns),
            "env/errors": sum(c[f"episodes_{k}"] for k in REASONS), "env/timeouts": c["env_timeouts"],
            "rewards/rejected": c["rewards_rejected"], "rewards/clipped": c["rewards_clipped"],
            "tool_calls/mean": sum(tools) / len(tools), "branches/per_trace": sum(branches) / len(branches),
            "groups/dropped": c["groups_dropped"], **{f"episodes/{k}": c[f"episodes_{k}"] for k in REASONS},
            "advantage/abs_mean": float(sum(abs(a) for g in adv for m in g for a in m) / max(len(rewards), 1)),
            **adv_metrics, **self.stats.metrics(step, [_outcome(grp) for grp in groups], c), **self.evals.pop_ready(),
        }
        return samples, metrics

    def _in_flight(self) -> int:
        return len(self._inflight)

    # ---------------------------------------------------------------- main loop
    def run(self, max_steps: int | None = None, on_batch: Callable[[int, dict], None] | None = None) -> None:
        max_steps = self.cfg.max_steps if max_steps is None else max_steps
        self.server.start()
        try:
            asyncio.run(self._run(max_steps, on_batch))
        finally:
            self.server.stop()

    async def _run(self, max_steps: int, on_batch) -> None:
        import httpx

        fresh_renderers_lock()
        i = self.cfg.inference
        model = (i.vllm.model or await asyncio.to_thread(_served_model, i.vllm.url)) if self.engine is None else None
        self._model = model or self.server_model_name
        self._ctx, self._sem, self._async_calls = {}, {}, {}
        loop = asyncio.get_running_loop()
        for e, m in enumerate(self.mix):
            if isinstance(m.env, VerifiersEnv):
                self._ctx[e] = m.env.model_context(self.server.url, temperature=i.temperature, top_p=i.top_p,
                                                   model=model)
                self._sem[e] = asyncio.Semaphore(m.env.max_concurrent)
                m.env.tasks  # noqa: B018 - load the taskset before the first batch
            else:
                self._async_calls[e] = AsyncEnvCalls(self._env_calls[e], loop)
        a = self.o.max_async_level
        async with contextlib.AsyncExitStack() as stack:
            for env in [self.mix[e].env for e in self._ctx] + self.evals.own_envs():
                await stack.enter_async_context(env.vf_env.serving())
            self._http = await stack.enter_async_context(httpx.AsyncClient(
                timeout=httpx.Timeout(i.timeout_s, pool=None), limits=httpx.Limits(max_connections=64)))
            self.evals.bind(loop, self._http, self.server.url, self._model, self.server.pop_session)
            try:
                while self.next_write < max_steps:
                    dead = self.server.engine_error
                    if dead is not None:
                        raise RuntimeError(f"the inference engine died: {dead!r}") from dead
                    await self._refresh_weights()
                    self._submit_due(max_steps)
                    if self._hand_over(on_batch):
                        continue
                    if self._inflight or self.evals.busy():
                        wake = self.evals.waiter()  # an eval's environment call returned
                        done, _ = await asyncio.wait(self._inflight | self.evals.tasks | {wake}, timeout=0.5,
                                                     return_when=asyncio.FIRST_COMPLETED)
                        wake.cancel()
                        for t in done & self._inflight:
                            self._inflight.discard(t)
                            self._on_episode(*t.result())
                        self.evals.collect(done)
                        continue
                    if self.next_write not in self.batches:
                        await self._refresh_weights(block_for=self.next_submit - a)
                        continue
                    raise RuntimeError(f"orchestrator stalled: batch {self.next_write} is incomplete with no episode "
                                       "in flight")
            finally:
                for t in self._inflight:
                    t.cancel()
                if self._inflight:
                    await asyncio.gather(*self._inflight, return_exceptions=True)
                await self.evals.close()


def _served_model(url: str) -> str:
    """The model name a vLLM server serves (its ``/v1/models`` first entry): a launched server
    serves the checkpoint path under its own name."""
    import json
    import urllib.request

    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as r:
        data = json.loads(r.read()).get("data") or []
    if not data:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return data[0]["id"]


def _outcome(grp: Group) -> Outcome:
    units = [u for us in grp.members for u in us]
    return Outcome(grp.env, grp.key, [u.reward for u in units], sum(u.sampled_tokens for u in units))


def build_orchestrator(cfg: RLConfig, env, client, transport: FileTransport, **kw):
    """The orchestrator for the job whose policy environment (``config.policy_env``: the one that
    sizes the vocabulary) is ``env``: the verifiers path when any environment of the job is a
    verifiers one, else the built-in one. ``kw`` include ``weights``: the backend's
    ``WeightVersions`` (``InferenceBackend.weight_receiver``)."""
    from ..config.data import uses_verifiers

    if isinstance(env, VerifiersEnv) or uses_verifiers(cfg):
        return VerifiersOrchestrator(cfg, env, client, transport, **kw)
    from .orchestrator import Orchestrator

    return Orchestrator(cfg, env, client, transport, **kw)


__all__ = ["VerifiersOrchestrator", "VerifiersEnvError", "build_orchestrator"]
