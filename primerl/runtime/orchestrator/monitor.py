"""The orchestrator's monitoring endpoint (``orchestrator.metrics_port`` > 0): ``GET /health``
(JSON) and ``GET /metrics`` (Prometheus text, ``prometheus-client``) on a standard-library HTTP
server thread. The orchestrator publishes one snapshot per loop turn and one per finished step;
the HTTP thread reads only that snapshot.

Prometheus names:

  primerl_orchestrator_step                 gauge  the next step to hand to the trainer
  primerl_orchestrator_policy_version       gauge  the policy version the sampler holds
  primerl_orchestrator_requests_in_flight   gauge  generation requests submitted, not yet answered
  primerl_orchestrator_servers_healthy      gauge  inference servers answering /health
  primerl_orchestrator_step_metric{name}    gauge  the last step's metrics.jsonl values (reward/mean, ...)
"""

from __future__ import annotations

import json
import logging
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("primerl.orchestrator")

__all__ = ["OrchestratorMonitor"]


class OrchestratorMonitor:
    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self._lock = threading.Lock()
        self._state = {"step": 0, "policy_version": -1, "requests_in_flight": 0, "servers_healthy": 0}
        self._last_step: dict = {}
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.httpd.daemon_threads = True
        self.host, self.port = self.httpd.server_address[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._thread: threading.Thread | None = None

    def update(self, **state) -> None:
        with self._lock:
            self._state.update(state)

    def step_done(self, step: int, metrics: dict) -> None:
        with self._lock:
            self._last_step = {"step": step, **metrics}

    def read(self) -> dict:
        with self._lock:
            return {"status": "ok", **self._state, "last_step": dict(self._last_step)}

    def prometheus(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import GaugeMetricFamily

        snap = self.read()

        class Snapshot:
            def collect(self):
                p = "primerl_orchestrator_"
                for key in ("step", "policy_version", "requests_in_flight", "servers_healthy"):
                    yield GaugeMetricFamily(p + key, key.replace("_", " "), value=float(snap[key]))
                g = GaugeMetricFamily(p + "step_metric", "the last finished step's metrics.jsonl values",
                                      labels=["name"])
                for name, v in snap["last_step"].items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                        g.add_metric([name], float(v))
                yield g

        registry = CollectorRegistry(auto_describe=False)
        registry.register(Snapshot())
        return generate_latest(registry)

    def _handler(self):
        mon = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt, *args):
                log.debug(fmt, *args)

            def do_GET(self):
                path = self.path.split("?")[0]
                if path == "/health":
                    body, ctype, code = json.dumps(mon.read()).encode(), "application/json", 200
                elif path == "/metrics":
                    from prometheus_client import CONTENT_TYPE_LATEST

                    body, ctype, code = mon.prometheus(), CONTENT_TYPE_LATEST, 200
                else:
                    body, ctype, code = json.dumps({"error": f"no route GET {path}"}).encode(), "application/json", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler

    def start(self) -> "OrchestratorMonitor":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="orchestrator-monitor", daemon=True)
        self._thread.start()
        log.info("orchestrator metrics on %s/metrics and /health", self.url)
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
