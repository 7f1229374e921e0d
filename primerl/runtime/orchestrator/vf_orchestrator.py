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
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from primerl.rl.envs.verifiers_env import (BranchError, VerifiersEnv, branch_sample, check_branch_against_requests,
                                           trace_reward)

from ..config import RLConfig
from .env_calls import RewardRejected, check_reward
from .steps import BatchSteps
from ..transport import FileTransport

log = logging.getLogger("primerl.orchestrator")

REASONS = ("not_ok", "no_reward", "bad_branch")
COUNTS = ("discarded_stale", "groups_dropped") + tuple(f"episodes_{r}" for r in REASONS) + ("rewards_rejected",
                                                                                             "rewards_clipped")


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


@dataclass
class Unit:
    """One trainable trace of a finished episode."""

    agent: str
    reward: float
    branches: list
    version_min: int
    turns: int
    tool_calls: int
    sampled_tokens: int
    version_max: int | None = None  # the newest policy version of its tokens


@dataclass
class Group:
    task_index: int
    gen: int = 0  # bumped on reset: results of an older generation are ignored
    members: list = field(default_factory=list)  # per member: list[Unit] or None while running
    failures: int = 0


class VerifiersOrchestrator(BatchSteps):
    def __init__(self, cfg: RLConfig, env: VerifiersEnv, client, transport: FileTransport, *, start_step: int = 0,
                 trainer_alive: Callable[[], bool] | None = None, top_k: int = 1, weights=None):
        """``weights``: the ``WeightVersions`` that says which versions exist (the backend's
        ``weight_receiver``); default: the trainer's markers in ``transport``."""
        from ..inference.backend import get_backend
        from ..inference.weight_sync import FileWeightVersions

        self.cfg, self.env, self.transport = cfg, env, transport
        self.weights = FileWeightVersions(transport) if weights is None else weights
        self.o = cfg.orchestrator
        self.start_step, self.trainer_alive, self.top_k = start_step, trainer_alive, top_k
        self.client = client
        # the embedded engine behind its own HTTP server (self.engine: loaded on the server's engine
        # thread), or vLLM's route behind a recording pass-through (self.engine None: the client loads)
        self.server, self.engine = get_backend(cfg).generate_server(cfg, client, policy_version=lambda: self.version,
                                                                    model_name=env.model_name)
        self._init_steps(start_step, COUNTS)  # self.batches: step -> list[Group]
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
            self.version = v

    # ---------------------------------------------------------------- submission
    def _start_member(self, step: int, g: int, m: int) -> None:
        grp = self.batches[step][g]
        task = self.env.tasks[grp.task_index % len(self.env.tasks)]
        t = asyncio.create_task(self._episode(step, g, m, grp.gen, task))
        self._inflight.add(t)

    async def _episode(self, step: int, g: int, m: int, gen: int, task):
        async with self._sem:
            try:
                ep = await asyncio.wait_for(self.env.vf_env.run_episode(task, self._ctx), self.env.episode_timeout_s)
            except TimeoutError:
                ep = EpisodeTimedOut(self.env.episode_timeout_s)
        return step, g, m, gen, ep

    def _start_group(self, step: int, g: int, task_index: int) -> None:
        old = self.batches[step][g]
        grp = Group(task_index, gen=(old.gen + 1) if old is not None else 0, members=[None] * self.o.group_size)
        self.batches[step][g] = grp
        for m in range(self.o.group_size):
            self._start_member(step, g, m)

    def _submit_batch(self, step: int) -> None:
        self.batches[step] = [None] * self.o.batch_size
        self._batch_counters[step] = dict.fromkeys(COUNTS, 0)
        for g in range(self.o.batch_size):
            self._start_group(step, g, step * self.o.batch_size + g)

    # ---------------------------------------------------------------- episodes
    def _units(self, ep) -> list[Unit]:
        """The trainable traces of a finished episode; BranchError (with a reason) when unusable."""
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
        try:
            units = self._units(ep)
            for u in units:
                u.reward, clipped = check_reward(u.reward, self.cfg.env.max_abs_reward, f"verifiers env {self._env_id}")
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
            if grp.failures > self.cfg.env.max_retries:
                self._drop_group(step, g, e)
            else:
                log.warning("verifiers episode resampled (step %d group %d member %d): %s", step, g, m, e)
                self._start_member(step, g, m)
            return
        self._tokens_since_write += sum(u.sampled_tokens for u in units)
        grp.members[m] = units

    def _drop_group(self, step: int, g: int, reason: BaseException) -> None:
        self._count(step, "groups_dropped")
        if self._batch_counters[step]["groups_dropped"] > self.o.batch_size:
            raise VerifiersEnvError(f"verifiers env {self._env_id}: more than {self.o.batch_size} groups of step "
                                    f"{step} dropped (each after env.max_retries = {self.cfg.env.max_retries} failed "
                                    f"episodes); last reason: {reason}")
        log.warning("verifiers group dropped (step %d group %d, task %d) after %d failed episodes: %s; a new task "
                    "replaces it", step, g, self.batches[step][g].task_index, self.batches[step][g].failures, reason)
        self._spare_index += 1
        self._start_group(step, g, self.cfg.max_steps * self.o.batch_size + self._spare_index)

    # ---------------------------------------------------------------- hand-over
    def _batch_done(self, step: int) -> bool:
        return step in self.batches and all(u is not None for grp in self.batches[step] for u in grp.members)

    def _advantages(self, groups: list[Group]) -> tuple[list[list[list[float]]], dict]:
        """Per group, per member, per unit: the advantage of that trace among the group's traces of
        the same agent."""
        from .batching import compute_advantages as compute

        out = [[[0.0] * len(units) for units in grp.members] for grp in groups]
        zero = 0
        agents = sorted({u.agent for grp in groups for units in grp.members for u in units})
        for agent in agents:
            slots = [[(gi, mi, ui) for mi, units in enumerate(grp.members) for ui, u in enumerate(units)
                      if u.agent == agent]
                     for gi, grp in enumerate(groups)]
            sizes = {len(s) for s in slots if s}
            chunks = [slots] if len(sizes) == 1 else [[s] for s in slots if s]
            for chunk in chunks:
                chunk = [s for s in chunk if s]
                flat = [x for s in chunk for x in s]
                rewards = torch.tensor([groups[gi].members[mi][ui].reward for gi, mi, ui in flat], dtype=torch.float32)
                adv, info = compute(rewards, len(chunk[0]), method=self.o.advantage)
                zero += info.get("num_zero_groups", 0)
                for (gi, mi, ui), a in zip(flat, adv.tolist()):
                    out[gi][mi][ui] = a
        return out, {"groups/zero_advantage": zero}

    def _finalize(self, step: int):
        groups = self.batches[step]
        stale = [g for g, grp in enumerate(groups)
                 if any(step - u.version_min > self.o.max_off_policy_steps for units in grp.members for u in units)]
        if stale:
            for g in stale:
                n = len(groups[g].members)
                self.counters["discarded_stale"] += n
                self._batch_counters[step]["discarded_stale"] += n
                self._start_group(step, g, groups[g].task_index)
            return None
        adv, adv_metrics = self._advantages(groups)
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
                    branches.append(len(u.branches))
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
            "env/errors": sum(c[f"episodes_{k}"] for k in REASONS), "env/timeouts": 0,
            "rewards/rejected": c["rewards_rejected"], "rewards/clipped": c["rewards_clipped"],
            "tool_calls/mean": sum(tools) / len(tools), "branches/per_trace": sum(branches) / len(branches),
            "groups/dropped": c["groups_dropped"], **{f"episodes/{k}": c[f"episodes_{k}"] for k in REASONS},
            "advantage/abs_mean": float(sum(abs(a) for g in adv for m in g for a in m) / max(len(rewards), 1)),
            **adv_metrics,
        }
        return samples, metrics

    def _in_flight(self) -> int:
        return len(self._inflight)

    # ---------------------------------------------------------------- main loop
    @property
    def _env_id(self) -> str:
        return repr(self.env.env_config.get("taskset", {}).get("id", "?"))

    def run(self, max_steps: int | None = None, on_batch: Callable[[int, dict], None] | None = None) -> None:
        max_steps = self.cfg.max_steps if max_steps is None else max_steps
        self.server.start()
        try:
            asyncio.run(self._run(max_steps, on_batch))
        finally:
            self.server.stop()

    async def _run(self, max_steps: int, on_batch) -> None:
        _fresh_renderers_lock()
        i = self.cfg.inference
        model = (i.vllm.model or await asyncio.to_thread(_served_model, i.vllm.url)) if self.engine is None else None
        self._ctx = self.env.model_context(self.server.url, temperature=i.temperature, top_p=i.top_p, model=model)
        self._sem = asyncio.Semaphore(self.env.max_concurrent)
        self.env.tasks  # noqa: B018 - load the taskset before the first batch
        a = self.o.max_async_level
        async with self.env.vf_env.serving():
            try:
                while self.next_write < max_steps:
                    dead = self.server.engine_error
                    if dead is not None:
                        raise RuntimeError(f"the inference engine died: {dead!r}") from dead
                    await self._refresh_weights()
                    self._submit_due(max_steps)
                    if self._hand_over(on_batch):
                        continue
                    if self._inflight:
                        done, self._inflight = await asyncio.wait(self._inflight, timeout=0.5,
                                                                  return_when=asyncio.FIRST_COMPLETED)
                        for t in done:
                            self._on_episode(*t.result())
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


def _fresh_renderers_lock() -> None:
    """``renderers.client`` holds a module-level ``asyncio.Lock`` (for its ``/v1/models`` look-up); a
    lock binds to the first event loop that waits on it, so a second orchestrator run in one
    process (tests, notebooks) would fail every contended look-up. Each run gets a new one."""
    import renderers.client as rc

    if hasattr(rc, "_max_prompt_len_lock"):
        rc._max_prompt_len_lock = asyncio.Lock()


def build_orchestrator(cfg: RLConfig, env, client, transport: FileTransport, **kw):
    """The orchestrator for ``env``: the verifiers path for a ``VerifiersEnv``, else the built-in one.
    ``kw`` include ``weights``: the backend's ``WeightVersions`` (``InferenceBackend.weight_receiver``)."""
    if isinstance(env, VerifiersEnv):
        return VerifiersOrchestrator(cfg, env, client, transport, **kw)
    from .orchestrator import Orchestrator

    return Orchestrator(cfg, env, client, transport, **kw)


__all__ = ["VerifiersOrchestrator", "VerifiersEnvError", "build_orchestrator"]
