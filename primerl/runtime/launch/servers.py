"""A pool of inference server processes behind vllm-router, kept alive for the job's life.

The pieces, reusable for any role (``"inference"`` here; prefill / decode servers the same way):

- ``processes.ProcessTable`` (``<output_dir>/processes.json``, a row per process, rewritten
  atomically whenever one is (re)started) and ``processes.ManagedProcess`` (one child process: own
  session, log file, dies with the launcher; restarted on the same command line, so the same port).
- :func:`server_process` / :func:`router_process`: the command lines of ``primerl inference`` on a
  port and of ``vllm-router`` (normal mode with a policy, or P/D mode with ``prefill`` / ``decode``
  URLs). The router starts with NO workers: the pool client adds each one (``/add_worker``) only
  once it holds the current weights (``inference.pool_client``); except under a policy vllm-router
  refuses to start without workers (``power_of_two``: ``config.inference.ROUTER_MIN_WORKERS``), whose
  router starts with the pool's servers (the pool client takes out one lacking the current version).
- :class:`ServerPool`: starts N servers of a role and, when asked, a router in front; a supervisor
  thread restarts a server that exited or stopped answering ``/health`` within
  ``health_timeout_s`` (killed first: a hung, e.g. SIGSTOPped, process; a hung server's stacks go
  to its log first, ``heartbeat.dump_stacks``), and the router when it exits or stops answering
  ``/health`` the same way, each at most ``max_restarts`` times; past that ``failure`` names it and the launcher fails
  the job. ``endpoints()`` is what the orchestrator's pool client needs (server URLs, router URL,
  processes.json), passed to a child process as JSON in ``POOL_ENV``.

Ports: the pool reserves every port it hands out (``ports.reserve_port``: bound by the launcher,
never listening, until the pool stops), so no other process can take one between the pick and the
server's or router's own bind, and a restarted process binds the same port again.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..config.inference import ROUTER_MIN_WORKERS  # policies that need workers at the router's start
from ..heartbeat import dump_stacks
from ..lifetime import log_tail
from ..ports import held_port, reserve_port
from ..processes import ManagedProcess, ProcessTable
from ..transport import INFERENCE_POOL_ENV

log = logging.getLogger("primerl.launch")

POOL_ENV = INFERENCE_POOL_ENV  # JSON of ServerPool.endpoints() for the orchestrator and trainer processes
ROUTER_POLICIES = ("consistent_hash", "round_robin", "power_of_two", "cache_aware", "random")

__all__ = ["POOL_ENV", "ROUTER_POLICIES", "ServerPool", "free_port", "pool_for_job", "router_executable",
           "router_process", "server_process"]


def free_port(host: str = "127.0.0.1") -> int:
    """A free port of ``host``, reserved for the rest of this process's life (``ports.held_port``;
    a job's pool reserves its own ports and frees them when it stops)."""
    return held_port(host)


def router_executable() -> Path:
    """``vllm-router``'s launcher next to this interpreter (the ``router`` extra installs it)."""
    return Path(sys.executable).parent / "vllm-router"


def server_process(i: int, cfg_path: str, port: int, log_dir: Path, *, role: str = "inference",
                   host: str = "127.0.0.1", env: dict | None = None, table: ProcessTable | None = None,
                   extra_args: list[str] = ()) -> ManagedProcess:
    """``primerl inference --config cfg_path --port port`` as server ``i`` of ``role``."""
    args = [sys.executable, "-m", "primerl.runtime.cli", "inference", "--config", cfg_path, "--host", host,
            "--port", str(port), *extra_args]
    env = dict(os.environ if env is None else env, PRIMERL_SERVER_INDEX=str(i),  # its GPU: server.server_device
               PRIMERL_HEARTBEAT_NAME=f"{role}-{i}")  # its heartbeat, named like its log (heartbeat.py)
    return ManagedProcess(f"{role}-{i}", role, args, Path(log_dir) / f"{role}-{i}.log", url=f"http://{host}:{port}",
                          env=env, table=table)


def router_process(port: int, log_dir: Path, *, policy: str = "consistent_hash", workers: list[str] = (),
                   prefill: list[str] = (), decode: list[str] = (), request_timeout_s: float = 300.0,
                   host: str = "127.0.0.1", env: dict | None = None, table: ProcessTable | None = None,
                   extra_args: list[str] = (), metrics_port: int | None = None,
                   startup_timeout_s: float = 600.0) -> ManagedProcess:
    """vllm-router on ``port``, its Prometheus exporter on ``metrics_port`` (None: a held free port).
    Normal mode: ``workers`` (may be empty: added later with ``/add_worker``, except under a policy of
    ``ROUTER_MIN_WORKERS``) under ``policy``; P/D mode when ``prefill`` and ``decode`` are given
    (``--vllm-pd-disaggregation``). Its own retries are off: the client retries and counts
    re-dispatches (a dead worker's in-flight request comes back 5xx). With ``workers``, the router
    listens once they all answer ``/health`` (checked every second, for at most ``startup_timeout_s``)."""
    need = ROUTER_MIN_WORKERS.get(policy, 0)
    if prefill or decode:
        if need and (len(prefill) < need or len(decode) < need):
            raise ValueError(f"vllm-router policy {policy!r} needs at least {need} prefill and {need} decode "
                             f"servers, got {len(prefill)} and {len(decode)}")
    elif need and len(workers) < need:
        raise ValueError(f"vllm-router policy {policy!r} needs at least {need} workers at its start, "
                         f"got {len(workers)}")
    exe = router_executable()
    if not exe.exists():
        raise FileNotFoundError(f"vllm-router is not installed next to {sys.executable} "
                                "(pip install 'primerl[router]'); needed for inference.num_servers > 1")
    args = [str(exe), "--host", host, "--port", str(port), "--prometheus-port",
            str(held_port(host) if metrics_port is None else metrics_port),
            "--request-timeout-secs", str(int(request_timeout_s)), "--disable-retries"]
    if prefill or decode:
        args += ["--vllm-pd-disaggregation"]
        for u in prefill:
            args += ["--prefill", u]
        for u in decode:
            args += ["--decode", u]
        args += ["--prefill-policy", policy, "--decode-policy", policy]
    else:
        args += ["--policy", policy]
        if workers:
            args += ["--worker-urls", *workers, "--worker-startup-check-interval", "1",
                     "--worker-startup-timeout-secs", str(max(int(startup_timeout_s), 1))]
    return ManagedProcess("router", "router", args + list(extra_args), Path(log_dir) / "router.log",
                          url=f"http://{host}:{port}", env=env, table=table)


def _healthy(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError):
        return False


class ServerPool:
    """N ``primerl inference`` servers of one ``role`` (and optionally a router), supervised.

    ``with ServerPool(...) as pool:`` starts them (returns at once: servers load their model in
    the background; the pool client waits for their health) and stops everything at exit.
    ``urls``: the servers' URLs; ``router_url``: the router's (None without one); ``failure``: a
    message once a process died more than ``max_restarts`` times (the job must stop)."""

    def __init__(self, cfg_path: str, n: int, log_dir: Path, table: ProcessTable, *, role: str = "inference",
                 router: bool = True, policy: str = "consistent_hash", external_urls: list[str] = (),
                 max_restarts: int = 3, health_timeout_s: float = 10.0, health_interval_s: float = 1.0,
                 startup_timeout_s: float = 600.0, request_timeout_s: float = 300.0, env: dict | None = None,
                 host: str = "127.0.0.1", ports: list[int] | None = None, first_index: int = 0,
                 extra_args: list[str] = ()):
        self.table, self.role = table, role
        self.max_restarts, self.health_timeout_s = max_restarts, health_timeout_s
        self.health_interval_s = health_interval_s
        self.startup_timeout_s = startup_timeout_s
        if ports is not None and len(ports) != n:
            raise ValueError(f"ServerPool: {n} servers but {len(ports)} ports {ports}")
        # held until stop(): the servers' (unless given) and the router's two
        self._ports = [reserve_port(host) for _ in range((n if ports is None else 0) + 2 * bool(router))]
        server_ports = list(ports) if ports is not None else [h.port for h in self._ports[:n]]
        router_ports = self._ports[len(self._ports) - 2:] if router else []
        # server k is the pool's server first_index + k (its name, log); on GPUs it takes this node's k-th
        self.servers = []
        for k in range(n):
            p = server_process(first_index + k, cfg_path, server_ports[k], log_dir,
                               role=role, host=host, env=env, table=table, extra_args=extra_args)
            p.env["PRIMERL_SERVER_INDEX"] = str(k)
            self.servers.append(p)
        self.urls = [s.url for s in self.servers] + list(external_urls)
        # a policy that cannot start empty gets the initial servers (they hold the seeded initial weights,
        # the pool's version before any update; a restarted router gets them again and the pool client
        # takes out any that lacks the current version on its next pass)
        initial = self.urls if policy in ROUTER_MIN_WORKERS else []
        self.router = router_process(router_ports[0].port if router else 0, log_dir, policy=policy,
                                     request_timeout_s=request_timeout_s,
                                     host=host, env=env, table=table, workers=initial,
                                     metrics_port=router_ports[1].port if router else None,
                                     startup_timeout_s=startup_timeout_s) if router else None
        self.router_url = self.router.url if self.router else None
        self.failure: str | None = None
        self._up: dict[str, bool] = {}  # server name -> answered /health since its last start
        self._misses: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def endpoints(self, processes_json: Path | None = None) -> dict:
        return {"servers": self.urls, "router": self.router_url,
                "processes": str(processes_json or self.table.path)}

    def start(self) -> "ServerPool":
        for p in ([self.router] if self.router else []) + self.servers:
            p.start()
        self._thread = threading.Thread(target=self._supervise, name=f"{self.role}-pool", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.health_timeout_s + 5)
        for p in self.servers + ([self.router] if self.router else []):
            p.stop()
        for r in self._ports:
            r.close()

    def __enter__(self) -> "ServerPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def restarts(self) -> int:
        return sum(p.restarts for p in self.servers + ([self.router] if self.router else []))

    # -- supervision
    def _restart(self, p: ManagedProcess, why: str, *, hung: bool = False) -> None:
        if hung and p.role != "router":  # a Python server: every thread's stack to its log before it is killed
            how, text = dump_stacks(p.pid)
            with open(p.log_path, "a") as f:
                f.write(f"\n==== primerl pool: {p.name} (pid {p.pid}) {why}; every thread's stack ({how}):\n"
                        f"{text.rstrip()}\n====\n")
        if p.restarts >= self.max_restarts:
            self.failure = (f"the {p.name} process ({p.url}) {why} after {p.restarts} restart(s) "
                            f"(inference.max_restarts = {self.max_restarts}); end of {p.log_path}:\n"
                            + log_tail(p.log_path, 10))
            return
        log.warning("%s (%s) %s: restarting it (restart %d of at most %d)", p.name, p.url, why, p.restarts + 1,
                    self.max_restarts)
        p.kill()
        p.start()
        self._up[p.name], self._misses[p.name] = False, 0

    def check_once(self) -> None:
        """One supervision pass (the thread calls it every ``health_interval_s``)."""
        for p in ([self.router] if self.router else []) + self.servers:
            if self.failure or self._stop.is_set():
                return
            if not p.alive():
                self._restart(p, f"exited with code {p.proc.returncode}")
                continue
            healthy = _healthy(p.url, self.health_timeout_s)
            if not healthy and not p.alive():  # it died while /health was asked: its exit, not a hang
                self._restart(p, f"exited with code {p.proc.returncode}")
                continue
            if healthy:
                self._up[p.name], self._misses[p.name] = True, 0
            elif self._up.get(p.name):
                self._misses[p.name] = self._misses.get(p.name, 0) + 1
                if self._misses[p.name] >= 2:  # two health timeouts in a row: hung (e.g. SIGSTOP)
                    self._restart(p, f"did not answer /health within {self.health_timeout_s} s twice", hung=True)
            elif time.monotonic() - p.started_at > self.startup_timeout_s:
                self._restart(p, f"did not answer /health within {self.startup_timeout_s} s of its start")

    def _supervise(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            try:
                self.check_once()
            except Exception:  # noqa: BLE001 - keep supervising; a real failure shows as self.failure
                log.exception("inference pool supervision pass failed")
            if self.failure:
                return


def pool_for_job(cfg, cfg_path: str, out: Path, table: ProcessTable, env: dict | None = None) -> ServerPool | None:
    """The job's server pool, not started: ``inference.num_servers`` > 1 ``primerl inference``
    servers, or the external ``inference.vllm.urls``, behind a router; None for one in-process engine."""
    i = cfg.inference
    if i.num_servers <= 1 and not i.vllm.urls:
        return None
    from ..inference.backend import get_backend

    n = i.num_servers if get_backend(cfg).capabilities.server_pool else 0  # servers primerl starts (else: external)
    return ServerPool(cfg_path, n, Path(out) / "logs", table, policy=i.router_policy, external_urls=i.vllm.urls,
                      max_restarts=i.max_restarts, health_timeout_s=i.health_timeout_s,
                      request_timeout_s=i.timeout_s, env=env)
