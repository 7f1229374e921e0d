"""What an inference server reports to a cluster operator: ``GET /metrics`` in Prometheus text
format (``prometheus-client``, the ``primerl[serve]`` extra) and ``GET /health`` as JSON, from one
snapshot the engine thread refreshes after every step (the HTTP threads never touch the engine).

Prometheus names (one server per process; a scraper labels them by target):

  primerl_inference_requests_running      gauge    requests holding a batch slot
  primerl_inference_requests_waiting      gauge    requests queued for a slot
  primerl_inference_kv_cache_usage        gauge    cache positions held / allocated (0..1)
  primerl_inference_kv_cache_bytes        gauge    KV cache allocated
  primerl_inference_weights_version       gauge    policy version of the loaded weights
  primerl_inference_paused                gauge    1 while /pause holds generation
  primerl_inference_generated_tokens_total counter tokens sampled since start
  primerl_inference_requests_total{outcome} counter  finished / bad_request / aborted / error
"""

from __future__ import annotations

import threading
import uuid

__all__ = ["ServerStats", "TextBody", "render_prometheus"]

OUTCOMES = ("finished", "bad_request", "aborted", "error")


class TextBody:
    """A non-JSON response body (``/metrics``)."""

    def __init__(self, text: str, content_type: str):
        self.data, self.content_type = text.encode(), content_type


# this process's id in /health: a pool client tells a restarted server (fresh weights) from one it loaded
INSTANCE = uuid.uuid4().hex


class ServerStats:
    """Counters and the engine snapshot of one server; every method is thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.instance = INSTANCE  # the process's (read when the server starts)
        self.snapshot = {"requests_running": 0, "requests_waiting": 0, "kv_cache_usage": 0.0, "kv_cache_bytes": 0,
                         "weights_version": 0, "generated_tokens": 0, "paused": False,
                         "instance": self.instance}
        self.requests = dict.fromkeys(OUTCOMES, 0)

    def refresh(self, engine, *, waiting_extra: int = 0, paused: bool = False) -> None:
        """Called on the engine thread only."""
        snap = {"requests_running": len(engine.running), "requests_waiting": len(engine.waiting) + waiting_extra,
                "kv_cache_usage": engine.kv_cache_usage(), "kv_cache_bytes": engine.kv_cache_bytes,
                "weights_version": engine.policy_version, "generated_tokens": engine.tokens_generated, "paused": paused,
                "instance": self.instance}
        with self._lock:
            self.snapshot = snap

    def count(self, outcome: str, n: int = 1) -> None:
        with self._lock:
            self.requests[outcome] += n

    def read(self) -> dict:
        with self._lock:
            return {**self.snapshot, "requests": dict(self.requests)}


def render_prometheus(stats: dict) -> TextBody:
    """``ServerStats.read()`` -> the Prometheus text exposition."""
    try:
        from prometheus_client import CollectorRegistry, generate_latest
    except ImportError:
        raise ImportError("GET /metrics needs prometheus-client: pip install 'primerl[serve]'") from None
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Snapshot:
        def collect(self):
            p = "primerl_inference_"
            for key, doc in (("requests_running", "requests holding a batch slot"),
                             ("requests_waiting", "requests queued for a batch slot"),
                             ("kv_cache_usage", "KV-cache positions held by running requests / allocated"),
                             ("kv_cache_bytes", "KV cache allocated, bytes"),
                             ("weights_version", "policy version of the loaded weights"),
                             ("paused", "1 while generation is paused (/pause)")):
                yield GaugeMetricFamily(p + key, doc, value=float(stats[key]))
            yield CounterMetricFamily(p + "generated_tokens", "tokens sampled since the server started",
                                      value=float(stats["generated_tokens"]))
            c = CounterMetricFamily(p + "requests", "generation requests by outcome", labels=["outcome"])
            for outcome, n in stats["requests"].items():
                c.add_metric([outcome], float(n))
            yield c

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Snapshot())
    from prometheus_client import CONTENT_TYPE_LATEST

    return TextBody(generate_latest(registry).decode(), CONTENT_TYPE_LATEST)
