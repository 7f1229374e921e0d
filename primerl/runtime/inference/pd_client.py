"""The orchestrator's client for a P/D deployment: requests through vllm-router in P/D mode, weight
updates to every prefill and decode server, failed hand-offs resampled and counted.

A request whose hand-off fails (the decode server answers ``KVTransferError``: unknown transfer,
cache shape mismatch, vanished prefill peer) or that the router answers 5xx (its prefill leg
failed) is sent again, up to ``resamples`` times; ``counts`` records each by cause and the
orchestrator logs them. After the last attempt the error is raised (the run stops, nothing hangs).
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from .vllm_client import InferenceServerError, VLLMClient

log = logging.getLogger("primerl.inference")


def handoff_cause(err: InferenceServerError) -> str | None:
    """The resample cause of a failed P/D request, or None when resending would not help (4xx)."""
    msg = str(err)
    if "KVTransferError" in msg:
        if "unreachable" in msg:
            return "peer_unreachable"
        if "does not hold" in msg:
            return "unknown_transfer"
        return "bad_cache"
    if any(f"HTTP {c}" in msg for c in (500, 502, 503, 504)):
        return "server_error"
    return None


class PDClient(VLLMClient):
    """``VLLMClient`` on the router's URL, whose weight updates go to each of ``servers``."""

    CAUSES = ("peer_unreachable", "unknown_transfer", "bad_cache", "server_error")

    def __init__(self, cfg, servers: list[str], *, resamples: int = 3, deployment=None, **kw):
        super().__init__(cfg, **kw)
        self.deployment = deployment  # pd_launch.PDDeployment that started the servers (stopped at exit), or None
        if not servers:
            raise ValueError("PDClient needs the prefill and decode server URLs (weight updates go to each)")
        self.resamples = resamples
        self.servers = [VLLMClient(dataclasses.replace(cfg, url=u), timeout_s=self.timeout_s) for u in servers]
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(self.CAUSES, 0)

    @property
    def resampled(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def servers_healthy(self) -> int:
        return sum(s.health() for s in self.servers)

    def metrics(self) -> dict:
        """``inference/pd_resampled``: requests resent after a failed KV hand-off (since the start)."""
        return {"inference/pd_resampled": self.resampled}

    def update_weights(self, version: int, transport) -> None:
        for s in self.servers:  # prefill and decode servers must sample from the same policy
            s.update_weights(version, transport)
        self.version = version

    def complete(self, req):
        for attempt in range(self.resamples + 1):
            try:
                return super().complete(req)
            except InferenceServerError as e:
                cause = handoff_cause(e)
                if cause is None or attempt == self.resamples:
                    if cause is not None:
                        raise InferenceServerError(f"request {req.request_id} failed its P/D hand-off "
                                                   f"{attempt + 1} times; last: {e}") from None
                    raise
                with self._lock:
                    self.counts[cause] += 1
                log.warning("request %d: P/D hand-off failed (%s), resampling (attempt %d): %s",
                            req.request_id, cause, attempt + 1, str(e)[:300])
        raise AssertionError("unreachable")
