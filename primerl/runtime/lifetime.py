"""Child processes that do not outlive the ``primerl rl`` launcher.

The launcher starts the trainer and the orchestrator in their own sessions (so it can stop each
process group), which also means a killed launcher leaves them running under PID 1. Two guards:

- :func:`die_with_parent` (a ``Popen`` ``preexec_fn``): on Linux, ``prctl(PR_SET_PDEATHSIG,
  SIGTERM)`` makes the kernel send SIGTERM to the child the moment its parent dies (torchrun,
  the trainer's direct child, then stops its workers).
- :func:`watch_launcher`: a daemon thread in every trainer/orchestrator process (torchrun workers
  included, which are grandchildren) that terminates the process within ``interval_s`` of the
  launcher's pid disappearing; also covers systems without ``prctl``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

LAUNCHER_PID_ENV = "PRIMERL_LAUNCHER_PID"
JOB_RESTARTS_ENV = "PRIMERL_JOB_RESTARTS"  # how many times the launcher restarted the job (launcher.run_job)
# set by a node agent's watch (launch.node_watch) once this process is ending on purpose (SIGTERM, another
# node's end): the exit code that a failure following from it reports instead of its own
ENDING = {"exit_code": None}
_PR_SET_PDEATHSIG = 1

log = logging.getLogger("primerl")

__all__ = ["ENDING", "JOB_RESTARTS_ENV", "LAUNCHER_PID_ENV", "die_with_parent", "watch_launcher", "pid_alive",
           "peer_alive"]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def peer_alive(pid: int | None):
    """A liveness check of the peer process ``pid`` (``PRIMERL_PEER_PID``), or None when unknown."""
    return (lambda: pid_alive(pid)) if pid else None


def die_with_parent(parent_pid: int):
    """A ``preexec_fn`` that ties the child to ``parent_pid`` (runs in the child before exec)."""
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: no dlopen in the forked child

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def watch_launcher(interval_s: float = 0.5) -> threading.Thread | None:
    """Start the watchdog when this process was started by a launcher (``PRIMERL_LAUNCHER_PID``)."""
    pid = int(os.environ.get(LAUNCHER_PID_ENV, "0"))
    if not pid:
        return None

    def watch() -> None:
        while pid_alive(pid):
            time.sleep(interval_s)
        log.error("the primerl launcher (pid %d) is gone; exiting", pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # a SIGTERM handler that does not exit gets 5 s
        os._exit(143)

    th = threading.Thread(target=watch, name="launcher-watchdog", daemon=True)
    th.start()
    return th


def setup_logging(name: str) -> None:
    """A process's log lines: time, its name (trainer / orchestrator / ...), level, message."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s", stream=sys.stderr)


def log_tail(path, n: int = 15) -> str:
    """The last ``n`` lines of a process's log, for the message naming it when it failed."""
    from pathlib import Path

    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"
