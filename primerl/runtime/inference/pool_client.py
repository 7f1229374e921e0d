"""The orchestrator's client for a pool of inference servers behind vllm-router.

Data plane through the router: every completion goes to the router URL (``X-Session-ID`` set, for
``consistent_hash``). A request that fails with a 5xx or a broken / refused connection (its server
was killed, or the router itself is being restarted) is sent again through the router until
``timeout_s`` has passed, and counted once (``inference/redispatched``: requests that needed
more than one send); a 4xx is the caller's error and
is not retried.

Control plane straight to every server (vllm-router 0.1.17 forwards an unknown route to ONE worker,
so ``/pause``, ``/resume``, ``/collective_rpc`` never go through it): a weight update is pause /
load / resume on each server in parallel (``VLLMClient.update_weights``); a server that fails it is
taken out of the router. A maintenance thread, every ``interval_s``:

- asks each server's ``/health`` (``health_timeout_s``); one that does not answer is taken out;
- a server that answers but does not hold the pool's current version (a restarted server: its
  ``/health`` ``instance`` changed, so it holds the seeded initial weights) loads it first;
- makes the router's worker list (``/list_workers``) equal to the servers that answered and hold
  the current version (``/add_worker`` / ``/remove_worker``): a restarted router starts empty and
  gets them back here.

Weights by broadcast (``broadcast=True``: ``inference.weight_update = "broadcast"``, trainer rank 0
sends every version to every server at once, ``pool_broadcast``): the client loads nothing itself.
``update_weights(v)`` asks every server which version it holds and routes only to those holding
``v`` (or newer); a server that lacks it (replaced, so it holds the seeded weights, and rejoins
the trainer's group at the next version) stays out of the router until the maintenance pass sees
it holding the pool's version. ``server_versions()`` is the newest version a server holds (the
orchestrator's ``weight_sync.ServerWeightVersions`` waits on it: no file is shared with the
trainer).

``metrics()`` (per step): ``inference/redispatched`` (since the previous call),
``inference/restarts`` (processes restarted by the launcher, from ``processes.json``; on inference
nodes only this node's router, each node's servers are in its own ``processes-node<i>.json``),
``inference/servers_replaced`` (servers seen answering as a new process, on any node).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..config import VLLMConfig
from .engine import Completion, Request
from .vllm_client import InferenceServerError, VLLMClient, _Aborted, http_json

log = logging.getLogger("primerl.pool")

_CLIENT_ERROR = re.compile(r": HTTP 4\d\d: ")

__all__ = ["PoolClient"]


class PoolClient(VLLMClient):
    """``servers``: every server's URL (control plane); ``router``: the router's (data plane)."""

    def __init__(self, cfg: VLLMConfig, servers: list[str], router: str, *, timeout_s: float = 300.0,
                 output_dir: str | None = None, processes_json: str | None = None, health_timeout_s: float = 10.0,
                 interval_s: float = 1.0, broadcast: bool = False, **kw):
        concurrency = kw.pop("concurrency", 64)  # requests in flight through the router
        super().__init__(dataclasses.replace(cfg, url=router), timeout_s=timeout_s, output_dir=output_dir,
                         concurrency=concurrency, **kw)
        self.members = {u.rstrip("/"): VLLMClient(dataclasses.replace(cfg, url=u), timeout_s=timeout_s,
                                                  output_dir=output_dir, concurrency=1, **kw) for u in servers}
        self.health_timeout_s, self.interval_s = health_timeout_s, interval_s
        self.broadcast = broadcast  # the trainer sends every server each version; the client only verifies
        self.processes_json = processes_json
        self.redispatched = 0
        self.replaced = 0  # servers seen coming back as a new process (their /health instance changed)
        self._instances: dict[str, str | None] = {}
        self._redispatched_reported = 0
        self._loaded: dict[str, tuple] = {}  # url -> (instance, version) it holds by our load
        self._healthy: set[str] = set()
        self._holders: set[str] = set()  # by broadcast: the servers holding the pool's version
        self._seen: set[str] = set()  # asked at least once
        self._transport = None
        self._lock = threading.RLock()  # one control-plane action at a time (an update, a re-sync)
        self._count_lock = threading.Lock()
        self._stop = threading.Event()
        self._fan = ThreadPoolExecutor(max(len(self.members), 1), thread_name_prefix="pool-ctl")
        self._thread = threading.Thread(target=self._maintain, name="pool-maintain", daemon=True)
        self._thread.start()

    # -- health
    def _state(self, url: str) -> tuple[bool, str | None, int | None]:
        """(answers /health, its instance id or None, the version it reports or None)."""
        try:
            h = http_json(url + "/health", None, timeout=self.health_timeout_s)
        except InferenceServerError:
            return False, None, None
        if "weights_version" in h:  # primerl inference
            inst = h.get("instance")
            with self._count_lock:
                if self._instances.setdefault(url, inst) != inst:  # a new process on that URL
                    self._instances[url] = inst
                    self.replaced += 1
            return True, inst, int(h["weights_version"])
        try:  # vLLM: ask the workers
            got = self.members[url].server_versions()
            return True, None, (None if not got or any(v is None for v in got) else min(got))
        except InferenceServerError:
            return False, None, None

    def servers_healthy(self) -> int:
        return len(self._healthy)

    def wait_healthy(self, timeout: float) -> None:
        """Until every server answers and the router lists them all."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                listed = set(http_json(self.url + "/list_workers", None, timeout=5).get("urls") or [])
            except InferenceServerError:
                listed = set()
            if listed >= set(self.members):
                return
            if time.monotonic() > deadline:
                raise InferenceServerError(f"the inference pool: {sorted(set(self.members) - listed)} not in the "
                                           f"router {self.url} within {timeout} s")
            time.sleep(0.5)

    def _current(self, url: str, instance: str | None, version: int | None) -> bool:
        if self.version < 0:  # no update yet: every server holds the seeded initial weights
            return True
        if self.broadcast:  # what the server says it loaded from the trainer's broadcast
            return version is not None and version >= self.version
        if instance is not None:
            return self._loaded.get(url) == (instance, self.version)
        return version == self.version

    def _maintain(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.maintain_once()
            except Exception:  # noqa: BLE001 - the next pass tries again
                log.exception("inference pool maintenance pass failed")

    def maintain_once(self) -> None:
        states = dict(zip(self.members, self._fan.map(self._state, self.members)))
        with self._lock:
            ready = set()
            for url, (ok, inst, ver) in states.items():
                if not ok:
                    if url in self._healthy:
                        log.warning("%s does not answer /health: out of the router", url)
                    self._loaded.pop(url, None)
                    continue
                if not self._current(url, inst, ver):
                    self._set_router(url, False)
                    # by broadcast the trainer's next version reaches it (it rejoins the group then)
                    if self.broadcast or self._transport is None or not self._resync(url, inst):
                        continue
                ready.add(url)
            self._healthy = {u for u, s in states.items() if s[0]}
            self._holders = set(ready)
            self._seen.update(states)
            try:
                listed = set(http_json(self.url + "/list_workers", None, timeout=5).get("urls") or [])
            except InferenceServerError:
                return  # the router is down (the launcher restarts it): next pass
            for url in ready - listed:
                self._set_router(url, True)
                log.info("%s holds weights version %d: in the router", url, self.version)
            for url in (listed & set(self.members)) - ready:
                self._set_router(url, False)

    def _resync(self, url: str, instance: str | None) -> bool:
        """Load the pool's current version into a server that lacks it (a restarted one)."""
        t0 = time.perf_counter()
        try:
            self.members[url].update_weights(self.version, self._transport)
        except InferenceServerError as e:
            log.warning("%s: loading weights version %d failed (%s); it stays out of the router", url, self.version, e)
            return False
        self._loaded[url] = (instance, self.version)
        log.info("%s loaded weights version %d in %.2f s; back in the router", url, self.version,
                 time.perf_counter() - t0)
        return True

    def _set_router(self, url: str, present: bool) -> None:
        """``/add_worker`` or ``/remove_worker`` (the router answers in plain text)."""
        route = "/add_worker" if present else "/remove_worker"
        req = urllib.request.Request(f"{self.url}{route}?url={urllib.parse.quote(url, safe=':/')}", data=b"",
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                r.read()
        except urllib.error.HTTPError as e:
            if present or e.code != 404:
                log.warning("router %s %s: HTTP %d %s", route, url, e.code, e.read()[:200])
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            log.warning("router %s %s: %s", route, url, e)

    # -- weights: to every server directly
    def server_versions(self) -> list[int]:
        """``[the newest version a server of the pool holds]`` (``[]`` when none answers)."""
        got = [ver for ok, _, ver in self._fan.map(self._state, self.members) if ok and ver is not None]
        return [max(got)] if got else []

    def _verify_broadcast(self, version: int) -> None:
        """Weights by broadcast: route to the servers that hold ``version`` (or newer), no other. The
        servers that held the previous version get ``health_timeout_s`` to finish loading this one
        (the trainer's send returns once every server has the bytes; each loads between two steps)."""
        deadline = time.monotonic() + self.health_timeout_s
        while True:
            states = dict(zip(self.members, self._fan.map(self._state, self.members)))
            held = {u for u, (ok, _, ver) in states.items() if ok and ver is not None and ver >= version}
            expected = {u for u in self._holders if states[u][0]}
            if expected <= held or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self._holders = held
        for url in set(self.members) - held:
            log.warning("%s does not hold weights version %d (%s): out of the router until it does", url, version,
                        "no answer" if not states[url][0] else f"it holds {states[url][2]}")
            self._set_router(url, False)
        self._healthy = {u for u, s in states.items() if s[0]}
        self._seen.update(states)
        self.version = version
        if not held:
            log.warning("no inference server holds weights version %d; generation waits for one", version)

    def update_weights(self, version: int, transport) -> None:
        if self.broadcast:
            with self._lock:
                self._verify_broadcast(version)
            return
        with self._lock:
            self._transport = transport
            # a server known down is left to the maintenance pass (re-synced when it answers again)
            urls = [u for u in self.members if u in self._healthy or u not in self._seen]

            def one(url):
                inst = self._state(url)[1]
                self.members[url].update_weights(version, transport)
                return inst

            futs = {u: self._fan.submit(one, u) for u in urls}
            ok = 0
            for url, fut in futs.items():
                try:
                    self._loaded[url] = (fut.result(), version)
                    ok += 1
                except InferenceServerError as e:
                    self._healthy.discard(url)
                    log.warning("%s missed weights version %d (%s): out of the router until it holds it", url,
                                version, e)
                    self._loaded.pop(url, None)
                    self._set_router(url, False)
            self.version = version
            if not ok:
                log.warning("no inference server took weights version %d; generation waits for a re-synced one",
                            version)

    # -- generation through the router, re-dispatched on a server's death
    def _headers(self, req: Request) -> dict:
        return {"X-Session-ID": str(req.request_id)}

    def complete(self, req: Request) -> Completion:
        deadline = time.monotonic() + self.timeout_s
        wait, first = 0.1, True
        while True:
            try:
                return super().complete(req)
            except _Aborted:
                raise
            except InferenceServerError as e:
                if _CLIENT_ERROR.search(str(e)) or time.monotonic() + wait > deadline:
                    raise
                if first:  # a request counts once, however many sends it took
                    with self._count_lock:
                        self.redispatched += 1
                    first = False
                log.info("request %d re-dispatched after: %s", req.request_id, str(e)[:200])
                time.sleep(wait)
                wait = min(wait * 2, 2.0)

    def metrics(self) -> dict:
        """``inference/redispatched`` since the previous call, ``inference/restarts`` (``processes.json``)."""
        with self._count_lock:
            n, self._redispatched_reported = self.redispatched - self._redispatched_reported, self.redispatched
        restarts = 0
        if self.processes_json:
            try:  # the launcher's table (processes.ProcessTable)
                rows = json.loads(Path(self.processes_json).read_text())
            except (OSError, ValueError):
                rows = []
            restarts = sum(int(r.get("restarts", 0)) for r in rows)
        with self._count_lock:
            replaced = self.replaced
        return {"inference/redispatched": n, "inference/restarts": restarts, "inference/servers_replaced": replaced}

    def close(self) -> None:
        self._stop.set()
