"""The orchestrator's client for a P/D deployment: requests through vllm-router in P/D mode, weight
updates to every prefill and decode server, failed hand-offs resampled and counted.

A request whose hand-off fails (the decode server answers ``KVTransferError``: unknown transfer,
cache shape mismatch, vanished prefill peer) or that the router answers 5xx (its prefill leg
failed) is sent again, up to ``resamples`` times; ``counts`` records each by cause and the
orchestrator logs them. After the last attempt the error is raised (the run stops, nothing hangs).

With the deployment it started (``pd_launch.PDDeployment``, supervised): a request that fails
while a process of it is down or restarting (a connection error) is resent too (cause
``server_down``, counted as ``inference/redispatched``); a weight update skips a server that is
restarting, and the server takes the current weights once it answers ``/health`` again (it is
started waiting for them: no request reaches it before, ``_restart_env``); once the
deployment gives up on a process (``inference.max_restarts``), its ``failure``, naming that
process, is the error raised. ``inference/restarts``: the deployment's restarts so far.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

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

    CAUSES = ("peer_unreachable", "unknown_transfer", "bad_cache", "server_error", "server_down")

    def __init__(self, cfg, servers: list[str], *, resamples: int = 3, deployment=None, **kw):
        super().__init__(cfg, **kw)
        self.deployment = deployment  # pd_launch.PDDeployment that started the servers (stopped at exit), or None
        if not servers:
            raise ValueError("PDClient needs the prefill and decode server URLs (weight updates go to each)")
        self.resamples = resamples
        self.servers = [VLLMClient(dataclasses.replace(cfg, url=u), timeout_s=self.timeout_s) for u in servers]
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(self.CAUSES, 0)
        self._redispatched_reported = 0
        self._transport = None  # the last weight update's, for a restarted server
        if deployment is not None:
            deployment.on_up = self._restarted
            deployment.restart_env = self._restart_env

    @property
    def resampled(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def servers_healthy(self) -> int:
        return sum(s.health() for s in self.servers)

    def metrics(self) -> dict:
        """``inference/pd_resampled``: requests resent after a failed KV hand-off (since the start);
        ``inference/redispatched``: requests resent because a process was down, since the previous
        call; ``inference/restarts``: the deployment's restarts."""
        with self._lock:
            down = self.counts["server_error"] + self.counts["server_down"]
            n, self._redispatched_reported = down - self._redispatched_reported, down
        out = {"inference/pd_resampled": self.resampled, "inference/redispatched": n}
        if self.deployment is not None:
            out["inference/restarts"] = self.deployment.restarts
        return out

    def _check_deployment(self) -> None:
        if self.deployment is not None and self.deployment.failure:
            raise InferenceServerError(self.deployment.failure)

    def update_weights(self, version: int, transport) -> None:
        self._check_deployment()
        self._transport = transport
        for s in self.servers:  # prefill and decode servers must sample from the same policy
            try:
                s.update_weights(version, transport)
            except InferenceServerError as e:
                if self.deployment is None:
                    raise
                self.deployment.check_now()  # names (and restarts) the process that died, before this line
                if s.health():
                    raise
                self._check_deployment()  # a server down: the supervisor restarts it, _restarted hands it the weights
                log.info("P/D server %s is down (the deployment restarts it; it takes weights version %d when it "
                         "answers /health): %s", s.url, version, str(e)[:200])
        self.version = version

    def _restart_env(self, proc) -> dict[str, str]:
        """A restarted server answers no sampling request (and its /health 503: the router skips it)
        until it holds the current weights (``http_routes.waiting_for_weights``); ``_restarted`` hands
        them over."""
        from .http_routes import MIN_WEIGHTS_ENV

        return {MIN_WEIGHTS_ENV: str(max(self.version, 0))}

    def _restarted(self, proc) -> None:
        """The supervisor's call once a restarted process answers /health: the current weights."""
        s = next((s for s in self.servers if s.url == proc.url), None)
        if s is not None and self._transport is not None and self.version >= 0:
            log.info("P/D server %s is back: loading weights version %d", s.url, self.version)
            s.update_weights(self.version, self._transport)

    def complete(self, req):
        for attempt in range(self.resamples + 1):
            try:
                return super().complete(req)
            except InferenceServerError as e:
                cause = handoff_cause(e)
                if self.deployment is not None and "HTTP 4" not in str(e):
                    self.deployment.check_now()  # a process that died is named (and restarted) first
                    self._check_deployment()  # one the deployment gave up on: its failure, not this request's
                    if cause is None:
                        cause = "server_down"  # the router or a server is down / restarting
                    if cause in ("server_down", "server_error", "peer_unreachable"):  # wait for it, then resend
                        time.sleep(1.0)
                        self.deployment.wait_up(self.deployment.cfg.inference.pd.launch_timeout_s)
                        self._check_deployment()
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
