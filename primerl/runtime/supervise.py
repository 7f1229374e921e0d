"""Supervision of a set of HTTP server processes (issue 45): :class:`Supervisor`.

Used for the P/D deployment's prefill and decode servers and their router
(``inference.pd_launch``) the way ``launch.servers.ServerPool`` supervises the pool: a thread
checks every ``interval_s`` that each process (a ``processes.ManagedProcess`` with a ``url``) is
alive and answers ``/health`` within ``health_timeout_s``. One that exited, or that missed two
health checks in a row after having answered (hung, e.g. SIGSTOPped: its stacks go to its log
first, ``heartbeat.dump_stacks``, for a Python process), is killed and started again on the same
command line (the same port), at most ``max_restarts`` times each; the first line about it names
the process (name, role, pid, URL, exit code or signal). Past the budget, ``failure`` says so and
the owner stops the job. ``on_up(process)`` runs once a restarted process answers ``/health``
again (e.g. to hand it the current weights; "waiting for weights" counts as an answer:
``health_state``), and the process counts as up (``wait_up``) only once it returned;
``restart_env(process)`` adds to a restarted process's environment (e.g. the weights version it
must load before it samples, so no request reaches it before: ``http_routes.waiting_for_weights``).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import urllib.error
import urllib.request
from typing import Callable

from .heartbeat import dump_stacks
from .lifetime import log_tail
from .processes import ManagedProcess

log = logging.getLogger("primerl")

__all__ = ["Supervisor", "describe_exit", "health_state", "healthy"]


def healthy(url: str, timeout: float) -> bool:
    """``GET url/health`` answers 200 within ``timeout`` s."""
    return health_state(url, timeout) == "ok"


def health_state(url: str, timeout: float) -> str | None:
    """``GET url/health`` within ``timeout`` s: ``"ok"`` (200), ``"waiting"`` (503 with status
    ``"waiting for weights"``: a restarted server alive, not yet given the job's weights; routers
    skip it), else None."""
    import json

    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return "ok" if r.status == 200 else None
    except urllib.error.HTTPError as e:
        try:
            waiting = e.code == 503 and json.loads(e.read() or b"{}").get("status") == "waiting for weights"
        except (ValueError, OSError, AttributeError):
            waiting = False
        return "waiting" if waiting else None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError):
        return None


def describe_exit(rc: int | None) -> str:
    """``-9`` -> ``"was killed by signal 9 (SIGKILL)"``, ``1`` -> ``"exited with code 1"``."""
    if rc is not None and rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = "?"
        return f"was killed by signal {-rc} ({name})"
    return f"exited with code {rc}"


class Supervisor:
    """``procs`` supervised (module docstring); ``key``: the config key of the budget, for messages."""

    def __init__(self, procs: list[ManagedProcess], *, max_restarts: int, health_timeout_s: float = 10.0,
                 interval_s: float = 1.0, startup_timeout_s: float = 600.0, key: str = "inference.max_restarts",
                 on_up: Callable[[ManagedProcess], None] | None = None, python_roles: tuple[str, ...] = (),
                 restart_env: Callable[[ManagedProcess], dict] | None = None):
        self.procs, self.max_restarts, self.key = procs, max_restarts, key
        self.restart_env = restart_env
        self.health_timeout_s, self.interval_s, self.startup_timeout_s = health_timeout_s, interval_s, startup_timeout_s
        self.on_up, self.python_roles = on_up, python_roles
        self.failure: str | None = None
        self._up: dict[str, bool] = {p.name: True for p in procs}  # started healthy (the owner waited for it)
        self._misses: dict[str, int] = {}
        self._restarted: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one pass at a time: the thread's, or a client's that saw a failure first

    @property
    def restarts(self) -> int:
        return sum(p.restarts for p in self.procs)

    def wait_up(self, timeout: float) -> bool:
        """Wait until every process is alive and answered ``/health`` since its last start (True),
        the supervisor gave up (``failure``) or ``timeout`` s passed (False)."""
        deadline = time.monotonic() + timeout
        while not self.failure and time.monotonic() < deadline:
            if all(self._up.get(p.name) and p.alive() for p in self.procs):
                return True
            time.sleep(0.2)
        return False

    def start(self) -> "Supervisor":
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.health_timeout_s * 2 + 5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check_once()
            except Exception:  # noqa: BLE001 - keep supervising; a real failure shows as self.failure
                log.exception("supervision pass failed")
            if self.failure:
                return

    def _restart(self, p: ManagedProcess, why: str, *, hung: bool = False) -> None:
        what = f"the {p.role} process {p.name} (pid {p.pid}, {p.url}) {why}"
        if hung and p.role in self.python_roles and p.log_path is not None:
            how, text = dump_stacks(p.pid)
            with open(p.log_path, "a") as f:
                f.write(f"\n==== primerl supervisor: {what}; every thread's stack ({how}):\n{text.rstrip()}\n====\n")
        if p.restarts >= self.max_restarts:
            self.failure = (f"{what} after {p.restarts} restart(s) ({self.key} = {self.max_restarts}); end of "
                            f"{p.log_path}:\n" + log_tail(p.log_path, 10))
            log.error("%s", self.failure.splitlines()[0])
            return
        log.error("%s: restarting it (restart %d of at most %d)", what, p.restarts + 1, self.max_restarts)
        p.kill()
        if self.restart_env is not None:  # e.g. the job's weights version, which it must load before it samples
            p.env.update(self.restart_env(p))
        p.start()
        self._up[p.name], self._misses[p.name] = False, 0
        self._restarted.add(p.name)

    def check_once(self) -> None:
        """One supervision pass (the thread's, every ``interval_s``; a client that met a failed
        process may call it at once, so the line naming the process comes first)."""
        with self._lock:
            self._check()

    def _check(self) -> None:
        for p in self.procs:
            if self.failure or self._stop.is_set():
                return
            if not p.alive():
                self._restart(p, describe_exit(p.proc.returncode if p.proc else None))
                continue
            state = health_state(p.url, self.health_timeout_s)
            if state is None and not p.alive():  # it died while /health was asked: its exit, not a hang
                self._restart(p, describe_exit(p.proc.returncode if p.proc else None))
                continue
            if state is not None:
                self._misses[p.name] = 0
                if not self._up.get(p.name) and p.name in self._restarted and self.on_up is not None:
                    try:
                        self.on_up(p)  # its weights: up (wait_up) only once they are loaded
                    except Exception as e:  # noqa: BLE001 - not up yet; the next pass tries again
                        log.warning("the restarted %s process %s (%s) answers /health but taking the current "
                                    "weights failed (tried again): %s", p.role, p.name, p.url, str(e)[:300])
                        if time.monotonic() - p.started_at > self.startup_timeout_s:
                            self._restart(p, f"did not take the current weights within {self.startup_timeout_s:g} "
                                             "s of its start")
                        continue
                self._up[p.name] = True
            elif self._up.get(p.name):
                self._misses[p.name] = self._misses.get(p.name, 0) + 1
                if self._misses[p.name] >= 2:  # two health timeouts in a row: hung (e.g. SIGSTOP)
                    self._restart(p, f"did not answer /health within {self.health_timeout_s:g} s twice", hung=True)
            elif time.monotonic() - p.started_at > self.startup_timeout_s:
                self._restart(p, f"did not answer /health within {self.startup_timeout_s:g} s of its start")
