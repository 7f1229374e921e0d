"""The orchestrator: schedules rollouts, enforces the async level, computes advantages, packs and
hands batches to the trainer through the transport.

Batch n (trained at trainer step n, whose weights are version n) holds ``batch_size`` groups of
``group_size`` episodes. Its requests may be submitted once the sampler holds policy version
>= n - max_async_level, so with level 0 sampling and training alternate, and with level 1 the
engine samples batch n+1 (and finishes batch n's long tail) while the trainer optimises on batch
n. Requests of several batches share the engine (continuous batching). Every sample records
the oldest policy version that produced one of its tokens; at hand-over a group with a sample
older than ``max_off_policy_steps`` (n - version) is discarded, counted and resampled.

Seeds and prompts derive from (seed, step, group, member, attempt, turn) only, so a resumed run
replays the same episodes as an uninterrupted one.

Several environments (``[[env]]``, ``sampling.PromptSampler``): each group slot of a batch belongs
to one environment (dealt exactly by the weights), with that environment's group size and token
cap; advantages are computed per environment, within each group; the metrics add, per
environment name, ``reward/<name>``, ``episodes/<name>``, ``tokens/<name>`` and ``groups/<name>``.
``orchestrator.filter = "dapo"``: a finished group whose rewards are all equal is replaced by a
fresh prompt's group of the same environment (``groups/filtered``, ``rollouts/oversampled``) while
the batch has sampled fewer than ``max_oversample x batch_size`` groups; past that it is kept
(``groups/uniform_kept``). ``[eval]``: ``evaluation.OnlineEval`` runs next to the rollouts.

Environment calls (``respond``, ``reward``) run concurrently between engine steps, each with the
deadline ``env.timeout_s`` (``env_calls.EnvCalls``): a hanging grader fails only its own group,
with an error naming the environment and the call. Rewards are checked as they arrive: a value
that is not a finite real number is rejected (the group is resampled), one beyond
``env.max_abs_reward`` is clipped; both are counted (``rewards/rejected``, ``rewards/clipped``).
An environment that defines ``token_weights`` gets that call after the reward (same deadline);
its weights (checked: one finite number >= 0 per transcript token) become the samples'
``loss_weights``, the per-token weights of the policy-gradient loss.

With ``[distill]`` every finished episode goes to the teacher's scoring thread
(``teacher_scoring.TeacherScorer``) while sampling goes on; a batch is handed over once all its
episodes are scored, with per-token advantages ``reward advantage + coef * (log pi_T - log pi_S)``
(``primerl.rl.distill_advantages``) and the ``distill/*`` metrics.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from primerl.rl.envs import Environment, check_tokens, has_token_weights

from ..config import RLConfig
from .env_calls import EnvCalls, EnvCallTimeout, RewardRejected, check_reward, check_token_weights
from .rollout import EpisodeState, mix_seed
from .steps import BatchSteps
from ..heartbeat import beat
from ..transport import FileTransport, ProducerDied, TransportTimeout

log = logging.getLogger("primerl.orchestrator")


class EnvError(RuntimeError):
    pass


# counted per batch and in total: stale groups resampled, env calls that failed (of which timed
# out), rewards rejected (not a finite real number) and rewards clipped to env.max_abs_reward
COUNTS = ("discarded_stale", "env_errors", "env_timeouts", "rewards_rejected", "rewards_clipped", "groups_filtered",
          "rollouts_oversampled", "groups_sampled", "groups_uniform_kept")


class Orchestrator(BatchSteps):
    def __init__(self, cfg: RLConfig, env: Environment, client, transport: FileTransport, *, start_step: int = 0,
                 trainer_alive: Callable[[], bool] | None = None, top_k: int = 1, weights=None,
                 teachers: dict | None = None):
        """``weights``: the ``WeightVersions`` that says which versions exist (the backend's
        ``weight_receiver``); default: the trainer's markers in ``transport``. ``teachers``: the
        distillation teachers' clients by path (default, with ``[distill]``: the backend's
        ``make_teacher_client``)."""
        from ..inference.weight_sync import FileWeightVersions

        self.cfg, self.env, self.client, self.transport = cfg, env, client, transport
        self.weights = FileWeightVersions(transport) if weights is None else weights
        self.o = cfg.orchestrator
        self.start_step = start_step
        self.trainer_alive = trainer_alive
        self.top_k = top_k
        self._init_steps(start_step, COUNTS)  # self.batches: step -> groups -> EpisodeState
        self.episodes: dict[int, EpisodeState] = {}  # request id -> episode waiting on the engine
        self._rid = 0
        from .evaluation import OnlineEval
        from .mix_stats import MixStats
        from .sampling import PromptSampler, build_mix

        self.mix = build_mix(cfg, env)  # the job's environments ([env] or [[env]])
        self.sampler = PromptSampler(cfg, self.mix)
        self.sampler.load_state(cfg.output_dir, start_step)  # the curriculum's, when resuming
        self._env_calls = [EnvCalls(m.cfg.id, m.cfg.timeout_s, m.cfg.max_concurrent_calls) for m in self.mix]
        self.evals = OnlineEval(cfg)
        self.stats = MixStats(cfg, self.mix, self.sampler)  # per-env metrics, dapo's choice, the curriculum's records
        self.scorer = None
        from ..config import distill_enabled

        if distill_enabled(cfg.distill):
            from .teacher_scoring import TeacherScorer, build_teachers, teacher_key

            self.scorer = TeacherScorer(build_teachers(cfg) if teachers is None else teachers, topk=cfg.distill.topk)
            self._teacher_keys = [teacher_key(cfg.distill, m.cfg.id) for m in self.mix]

    # ---------------------------------------------------------------- env calls (concurrent, timeout + retry)
    def _submit_env(self, st: EpisodeState, name: str) -> None:
        if st.eval_key is not None:
            self.evals.env_call(st, name)
            return
        self._env_calls[st.env].submit(st, name, getattr(self.mix[st.env].env, name), st.episode)

    def _poll_env_calls(self, wait_s: float) -> list:
        out = self.evals.poll()
        for c in self._env_calls:
            out += c.poll(0.0)
        if not out and wait_s > 0:
            busy = next((c for c in self._env_calls if c.pending()), None)
            if busy is not None:
                out += busy.poll(wait_s)
            elif self.evals.pending():
                time.sleep(min(wait_s, 0.01))
        return out

    def _live(self, st: EpisodeState) -> bool:
        if st.eval_key is not None:
            return st.eval_key[0] in self.evals.runs
        groups = self.batches.get(st.step)
        return groups is not None and any(s is st for s in groups[st.group])

    def _on_env_result(self, st: EpisodeState, name: str, ok: bool, value) -> None:
        if not self._live(st):  # its group was resampled while the call ran
            return
        if st.eval_key is not None:
            self.evals.on_env_result(st, name, ok, value, self._submit_eval)
            return
        m = self.mix[st.env]
        try:
            if not ok:
                raise value
            if name == "respond":
                if value:
                    st.add_env_turn(check_tokens(value, m.env.vocab_size, "environment reply"))
                    self._submit(st)
                else:
                    self._submit_env(st, "reward")
                return
            if name == "token_weights":
                st.loss_weights = check_token_weights(value, len(st.episode.tokens), f"environment {m.name!r}")
                self._episode_done(st)
                return
            st.reward, clipped = check_reward(value, m.cfg.max_abs_reward, f"environment {m.name!r}")
            if clipped:
                self._count(st.step, "rewards_clipped")
            if has_token_weights(m.env):
                self._submit_env(st, "token_weights")
            else:
                self._episode_done(st)
        except Exception as e:  # noqa: BLE001 - any env failure is counted and retried
            if isinstance(e, RewardRejected):
                self._count(st.step, "rewards_rejected")
            if isinstance(e, EnvCallTimeout):
                self._count(st.step, "env_timeouts")
            self._count(st.step, "env_errors")
            log.warning("environment error (step %d group %d attempt %d): %s; resampling the group",
                        st.step, st.group, st.attempt, e)
            self._retry_group(st, "env_error", e)

    def _episode_done(self, st: EpisodeState) -> None:
        st.done = True
        if self.scorer is not None:
            self.scorer.submit(st, self._teacher_keys[st.env])
        self._group_maybe_done(st)

    # ---------------------------------------------------------------- weights
    def _refresh_weights(self, *, block_for: int | None = None) -> None:
        """Load the newest published version not newer than the next batch to sample."""
        cap = self.next_submit
        if block_for is not None:
            self.weights.wait_version(block_for, timeout=self.o.weights_timeout_s, alive=self.trainer_alive)
        versions = [v for v in self.weights.versions() if v <= cap]
        if versions and versions[-1] > self.version:
            v = versions[-1]
            self.client.update_weights(v, self.transport)
            old, self.version = self.version, v
            if self.evals.due(old, v):
                self.evals.start(v, self._submit_eval)

    def _submit_eval(self, st: EpisodeState, max_new: int, temperature: float, top_p: float, seed: int,
                     stop_token_ids: tuple) -> None:
        self._rid += 1
        req = st.request(self._rid, seed, max_new_tokens=max_new, temperature=temperature, top_p=top_p,
                         stop_token_ids=stop_token_ids)
        self.episodes[self._rid] = st
        self.client.submit(req)

    # ---------------------------------------------------------------- submission
    def _submit(self, st: EpisodeState) -> None:
        m = self.mix[st.env]
        seed = mix_seed(self.cfg.seed, st.step, st.group, st.member, st.attempt, st.turn)
        if st.draw:  # a replacement group (dynamic sampling): seeds of its own
            seed = mix_seed(seed, 0xD5, st.draw)
        self._rid += 1
        req = st.request(self._rid, seed, max_new_tokens=m.max_new_tokens(st.episode.prompt),
                         temperature=self.cfg.inference.temperature, top_p=self.cfg.inference.top_p,
                         stop_token_ids=tuple(m.env.stop_token_ids))
        self.episodes[self._rid] = st
        self.client.submit(req)

    def _start_group(self, step: int, group: int, attempt: int, draw: int = 0) -> list[EpisodeState]:
        e = self.sampler.env_of(step, group)
        m = self.mix[e]
        index = self.sampler.prompt_index(step, group, draw)
        prompt = m.env.prompt(index)
        check_tokens(prompt.tokens, m.env.vocab_size, f"environment {m.name!r} prompt {index}")
        states = [EpisodeState.start(step, group, k, attempt, prompt, env=e, draw=draw) for k in range(m.group_size)]
        self._batch_counters[step]["groups_sampled"] += 1
        for st in states:
            self._submit(st)
        return states

    def _submit_batch(self, step: int) -> None:
        self._batch_counters[step] = dict.fromkeys(COUNTS, 0)
        if self.sampler.curriculum is not None:
            self.sampler.curriculum.advance(step)
        self.batches[step] = []
        for g in range(self.o.batch_size):
            self.batches[step].append(self._start_group(step, g, 0))

    def _drop_group(self, step: int, g: int) -> list[EpisodeState]:
        old = self.batches[step][g]
        live = {id(s) for s in old}
        stale_ids = [rid for rid, s in self.episodes.items() if id(s) in live]
        self.client.abort(stale_ids)
        for rid in stale_ids:
            del self.episodes[rid]
        return old

    def _retry_group(self, st: EpisodeState, reason: str, error: BaseException | None = None) -> None:
        step, g = st.step, st.group
        old = self.batches[step][g]
        attempt = old[0].attempt + 1
        m = self.mix[old[0].env]
        if reason == "env_error" and attempt > m.cfg.max_retries:
            raise EnvError(f"environment {m.name!r} failed on prompt of step {step} group {g} "
                           f"{attempt} times (env.max_retries = {m.cfg.max_retries}); "
                           f"last error: {error!r}") from error
        self._drop_group(step, g)
        self.batches[step][g] = self._start_group(step, g, attempt, old[0].draw)

    def _group_maybe_done(self, st: EpisodeState) -> None:
        """A group just finished: record it for the curriculum; with the dapo filter replace it by a
        fresh prompt's group when its rewards are all equal and the batch's budget allows."""
        grp = self.batches[st.step][st.group]
        if not all(s.done for s in grp):
            return
        step = st.step
        if not self.stats.replaces(step, _outcome(grp), self._batch_counters[step]):
            return
        self._count(step, "groups_filtered")
        self._drop_group(step, st.group)
        new = self._start_group(step, st.group, grp[0].attempt, grp[0].draw + 1)
        self.batches[step][st.group] = new
        self.counters["rollouts_oversampled"] += len(new)
        self._batch_counters[step]["rollouts_oversampled"] += len(new)

    # ---------------------------------------------------------------- completions
    def _on_completion(self, c) -> None:
        st = self.episodes.pop(c.request_id, None)
        if st is None:  # aborted
            return
        if st.eval_key is not None:
            self.evals.on_completion(st, c)
            return
        st.add_model_turn(c)
        self._tokens_since_write += len(c.tokens)
        self._submit_env(st, "respond" if st.turn < self.mix[st.env].env.max_turns else "reward")

    # ---------------------------------------------------------------- hand-over
    def _in_flight(self) -> int:
        return len(self.episodes)

    def _batch_done(self, step: int) -> bool:
        if step not in self.batches:
            return False
        sts = [st for grp in self.batches[step] for st in grp]
        scored = self.scorer is None or all(st.teacher_logprobs is not None for st in sts)
        return scored and all(st.done for st in sts)

    def _finalize(self, step: int):
        """-> (samples, metrics), or None when stale groups were sent back for resampling."""
        groups = self.batches[step]
        stale = [grp for grp in groups if any(step - st.version_min > self.o.max_off_policy_steps for st in grp)]
        if stale:
            for grp in stale:
                self.counters["discarded_stale"] += len(grp)
                self._batch_counters[step]["discarded_stale"] += len(grp)
                self._retry_group(grp[0], "stale")
            return None
        from .batching import build_mixed_samples

        replay = self.cfg.trainer.router_replay and self.cfg.inference.capture_routing
        samples, adv_metrics = build_mixed_samples(groups, self.o.advantage, self.top_k, replay=replay,
                                                   temperature=self.cfg.inference.temperature)
        eps = [st for grp in groups for st in grp]
        if self.scorer is not None:
            from .teacher_scoring import distill_batch

            adv_metrics = {**adv_metrics, **distill_batch(samples, eps, self.cfg.distill),
                           "distill/behind_seqs": self.scorer.queued()}
        if self.o.save_samples:
            from .samples_log import episode_record, write_samples

            write_samples(self.cfg.output_dir, step, [episode_record(st, s) for st, s in zip(eps, samples)])
        c = self._batch_counters[step]
        metrics = {
            **self._step_metrics(step, [st.reward for st in eps], [step - st.version_min for st in eps],
                                 [len(st.episode.tokens) for st in eps], [st.turn for st in eps]),
            "env/errors": c["env_errors"], "env/timeouts": c["env_timeouts"], "rewards/rejected": c["rewards_rejected"],
            "rewards/clipped": c["rewards_clipped"], **adv_metrics,
        }
        metrics.update(self._data_metrics(step, groups))
        return samples, metrics

    def _data_metrics(self, step: int, groups) -> dict:
        """Per environment (a mix), dynamic sampling's counts, the curriculum (``mix_stats.MixStats``),
        finished evals."""
        out = self.stats.metrics(step, [_outcome(grp) for grp in groups], self._batch_counters[step])
        out.update(self.evals.pop_ready())
        return out

    # ---------------------------------------------------------------- main loop
    def run(self, max_steps: int | None = None, on_batch: Callable[[int, dict], None] | None = None) -> None:
        max_steps = self.cfg.max_steps if max_steps is None else max_steps
        try:
            self._run(max_steps, on_batch)
        finally:
            if self.scorer is not None:
                self.scorer.close()

    def _run(self, max_steps: int, on_batch) -> None:
        a = self.o.max_async_level
        while self.next_write < max_steps:
            if self.scorer is not None:
                self.scorer.check()
            self._refresh_weights()
            self._submit_due(max_steps)
            if self._hand_over(on_batch):
                continue
            engine_busy = self.client.has_pending()
            # results of env calls that finished meanwhile (wait briefly when there is nothing else to do)
            for st, name, ok, value in self._poll_env_calls(wait_s=0.0 if engine_busy else 0.05):
                self._on_env_result(st, name, ok, value)
            if not engine_busy:
                if any(c.pending() for c in self._env_calls) or self.evals.pending() or self.client.has_pending():
                    continue
                if self.scorer is not None and self.scorer.queued():
                    self.scorer.wait(0.05)  # the teacher is behind: this batch waits on its scores
                    continue
                if self.next_write not in self.batches:
                    # nothing to sample until the trainer publishes a newer policy
                    self._refresh_weights(block_for=self.next_submit - a)
                    continue
                if self._batch_done(self.next_write):
                    continue
                raise RuntimeError(f"orchestrator stalled: batch {self.next_write} is incomplete with no request "
                                   "in flight")
            for c in self.client.poll():
                self._on_completion(c)
                beat(f"batch {self.next_write}: a request finished")
        self._abort_evals()

    def _abort_evals(self) -> None:
        """The run is over: eval episodes still in the engine are aborted (their run is not reported)."""
        ids = [rid for rid, st in self.episodes.items() if st.eval_key is not None]
        if ids:
            self.client.abort(ids)
            for rid in ids:
                del self.episodes[rid]
        self.evals.runs.clear()


def _outcome(grp):
    from .mix_stats import Outcome

    return Outcome(grp[0].env, grp[0].episode.prompt.key, [st.reward for st in grp],
                   sum(st.completion_tokens for st in grp))


class EmbeddedClient:
    """The orchestrator's view of the in-process engine (same interface as the vLLM client)."""

    def __init__(self, engine, *, timeout_s: float = 300.0, receiver=None):
        self.engine = engine
        self.timeout_s = timeout_s
        self.receiver = receiver  # weight_sync.EngineWeightReceiver (broadcast), or None: files
        self._last_progress = time.monotonic()

    def submit(self, req) -> None:
        self.engine.add_request(req)

    def servers_healthy(self) -> int:
        """The engine runs in this process: it is healthy while this code runs (a dead engine raises)."""
        return 1

    def metrics(self) -> dict:
        """``memory/engine_peak_gb`` of an engine on a GPU; nothing on the CPU."""
        dev = self.engine.device
        if dev.type == "cuda":
            return {"memory/engine_peak_gb": torch.cuda.max_memory_allocated(dev) / 2**30}
        return {}

    def abort(self, request_ids) -> None:
        self.engine.abort(request_ids)

    def has_pending(self) -> bool:
        return self.engine.has_unfinished()

    def poll(self):
        out = self.engine.step()
        for c in out:
            c.server = "embedded"
        now = time.monotonic()
        if out:
            self._last_progress = now
        elif now - self._last_progress > self.timeout_s:
            from ..inference.engine import EngineTimeout

            raise EngineTimeout(f"the inference engine finished no request for {self.timeout_s} s")
        return out

    def update_weights(self, version: int, transport: FileTransport) -> None:
        if self.receiver is not None:  # the marker is written once the broadcast is complete
            self.engine.load_weights(self.receiver.take(version), version, assign=True)  # fresh tensors: a swap
        else:
            self.engine.load_weights(transport.load_weights(version), version)


__all__ = ["Orchestrator", "EmbeddedClient", "EnvError", "TransportTimeout", "ProducerDied"]
