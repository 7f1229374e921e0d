"""What both orchestrators (built-in environments and verifiers) do the same way with batches:
submit ahead within the async level, hand a finished batch over (finalize, pack, write, report),
count per batch and in total, and the metrics every batch reports.

A subclass sets ``cfg``, ``o`` (``cfg.orchestrator``), ``transport`` and ``client`` (whose
``servers_healthy()`` is reported per step as ``inference/servers_healthy``), calls ``_init_steps``,
and implements ``_submit_batch(step)``, ``_batch_done(step)``, ``_finalize(step)`` (-> ``(samples,
metrics)``, or ``None`` when the batch was sent back for resampling) and ``_in_flight()`` (requests
waiting on inference, for the monitor).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch

from ..heartbeat import beat

HEALTH_EVERY_S = 10.0  # with a monitor: servers' health asked at least this often between steps


class BatchSteps:
    def _init_steps(self, start_step: int, counts: Sequence[str]) -> None:
        self.version = -1  # policy version the sampler holds
        self.next_submit = self.next_write = start_step
        self.batches: dict[int, list] = {}
        self.counters = dict.fromkeys(counts, 0)
        self._batch_counters: dict[int, dict] = {}
        self._t_last_write = time.perf_counter()
        self._tokens_since_write = 0
        self.monitor = None  # monitor.OrchestratorMonitor when orchestrator.metrics_port > 0
        self._servers_healthy = 0
        self._health_checked = -math.inf  # when servers_healthy was last asked (time.monotonic)

    def _check_servers(self) -> None:
        self._servers_healthy = self.client.servers_healthy()
        self._health_checked = time.monotonic()

    def _count(self, step: int, key: str) -> None:
        self.counters[key] += 1
        self._batch_counters[step][key] += 1

    def _submit_due(self, max_steps: int) -> None:
        """Submit every batch the async level allows: batch n once the sampler holds version
        >= n - max_async_level, and at most max_async_level batches ahead of the next hand-over."""
        a = self.o.max_async_level
        while self.next_submit < max_steps and self.next_submit - self.version <= a \
                and self.next_submit <= self.next_write + a:
            self._submit_batch(self.next_submit)
            self.next_submit += 1

    def _hand_over(self, on_batch: Callable[[int, dict], None] | None) -> bool:
        """Hand the next batch to the trainer if it is complete; True if it was complete (written,
        or sent back for resampling)."""
        step = self.next_write
        if self.monitor is not None:
            if time.monotonic() - self._health_checked > HEALTH_EVERY_S:
                self._check_servers()
            self.monitor.update(step=step, policy_version=self.version, requests_in_flight=self._in_flight(),
                                servers_healthy=self._servers_healthy)
        if not self._batch_done(step):
            return False
        out = self._finalize(step)
        if out is not None:
            samples, metrics = out
            self._write(step, samples, metrics)
            if self.monitor is not None:
                self.monitor.step_done(step, metrics)
            if on_batch is not None:
                on_batch(step, metrics)
            beat(f"batch {step} handed over")
            self.next_write += 1
        return True

    def _step_metrics(self, step: int, rewards: list[float], off: list[int], lens: list[int],
                      turns: list[int]) -> dict:
        """The metrics every batch reports (rewards, off-policy steps, lengths, turns, throughput);
        restarts the throughput clock."""
        r = torch.tensor(rewards)
        self._check_servers()
        now = time.perf_counter()
        dt = max(now - self._t_last_write, 1e-9)
        metrics = {
            "reward/mean": float(r.mean()), "reward/std": float(r.std()) if r.numel() > 1 else 0.0,
            "reward/max": float(r.max()), "off_policy/max": max(off), "off_policy/mean": sum(off) / len(off),
            "policy_version": self.version, "samples/discarded_stale": self._batch_counters[step]["discarded_stale"],
            "seq_len/mean": sum(lens) / len(lens), "seq_len/max": max(lens),
            "inference/tokens_per_s": self._tokens_since_write / dt, "turns/mean": sum(turns) / len(turns),
            "inference/servers_healthy": self._servers_healthy,
        }
        metrics.update(self.client.metrics())  # the client's own (a pool's restarts, P/D resamples, engine memory)
        self._t_last_write, self._tokens_since_write = now, 0
        return metrics

    def _write(self, step: int, samples, metrics: dict) -> None:
        from ..config import parallel_dims
        from .batching import put_packed_batch

        put_packed_batch(self.transport, step, samples, metrics, self.o.seq_len, parallel_dims(self.cfg).batch)
        del self.batches[step]
        self._batch_counters.pop(step, None)


__all__ = ["BatchSteps"]
