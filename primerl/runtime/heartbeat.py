"""Progress heartbeats and stack dumps of the job's processes (issue 45's stall watchdog).

A process of the job shows progress with :func:`beat` (``beat("step 12")``): called where its
work advances (a trainer rank's finished step, the orchestrator's batch handed over or request
finished, a server's request answered), never from a timer, so a deadlocked or stopped process
stops beating. When the launcher sets ``PRIMERL_HEARTBEAT_DIR``, each beat rewrites
``<dir>/<name>.json`` (``{"name", "pid", "host", "progress", "what", "time"}``; at most every
``MIN_INTERVAL_S``, atomically); ``name`` is ``PRIMERL_HEARTBEAT_NAME`` or the role given to
:func:`install` (``-rank<R>`` added under torchrun). Without the variable a beat costs a counter.

:func:`install` also registers ``faulthandler`` on SIGUSR1 (every thread's Python stack to the
process's stderr, i.e. its log): how a running process is asked for its stacks. A stopped
(SIGSTOP) process cannot run a handler: :func:`dump_stacks` reads it from outside with
``py-spy dump --nonblocking`` when py-spy is installed, and falls back to SIGUSR1.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HEARTBEAT_DIR_ENV = "PRIMERL_HEARTBEAT_DIR"
HEARTBEAT_NAME_ENV = "PRIMERL_HEARTBEAT_NAME"
MIN_INTERVAL_S = 0.25
STACK_SIGNAL = signal.SIGUSR1

__all__ = ["HEARTBEAT_DIR_ENV", "HEARTBEAT_NAME_ENV", "STACK_SIGNAL", "beat", "dump_stacks", "install",
           "read_heartbeats"]

_state = {"name": None, "dir": None, "progress": 0, "written": 0.0, "installed": False}


def install(role: str) -> None:
    """Name this process's heartbeat (``role``, ``-rank<R>`` under torchrun) and register the
    faulthandler stack dump on SIGUSR1. Call once, early, in the process's main thread."""
    rank = os.environ.get("RANK") if os.environ.get("TORCHELASTIC_RUN_ID") else None
    _state["name"] = os.environ.get(HEARTBEAT_NAME_ENV) or (f"{role}-rank{rank}" if rank is not None else role)
    d = os.environ.get(HEARTBEAT_DIR_ENV)
    _state["dir"] = Path(d) if d else None
    if not _state["installed"]:
        faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
        _state["installed"] = True
    beat("started")


def beat(what: str) -> None:
    """This process's work advanced (``what``: e.g. ``"step 12"``)."""
    _state["progress"] += 1
    d = _state["dir"]
    if d is None:
        return
    now = time.time()
    if now - _state["written"] < MIN_INTERVAL_S and what != "started":
        return
    _state["written"] = now
    row = {"name": _state["name"], "pid": os.getpid(), "host": socket.gethostname(), "progress": _state["progress"],
           "what": what, "time": now}
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{_state['name']}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(row))
        os.replace(tmp, d / f"{_state['name']}.json")
    except OSError:  # a full or gone disk must not stop the work; the watchdog sees a stale beat
        pass


def read_heartbeats(directory: str | Path) -> list[dict]:
    """Every heartbeat row under ``directory`` (a row being replaced is skipped)."""
    rows = []
    for p in sorted(Path(directory).glob("*.json")) if Path(directory).is_dir() else []:
        try:
            rows.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return rows


def _py_spy() -> str | None:
    near = Path(sys.executable).parent / "py-spy"
    return str(near) if near.exists() else shutil.which("py-spy")


def dump_stacks(pid: int, *, timeout_s: float = 30.0) -> tuple[str, str]:
    """Every thread's Python stack of process ``pid``: ``(how, text)``. ``py-spy dump --nonblocking``
    (works on a stopped process); without py-spy, or when it fails, SIGUSR1 (the process's
    faulthandler writes to its own log; a stopped process writes it once continued)."""
    exe = _py_spy()
    if exe is not None:
        try:
            r = subprocess.run([exe, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True,
                               timeout=timeout_s)
            if r.returncode == 0 and r.stdout.strip():
                return "py-spy dump", r.stdout
            why = (r.stderr.strip().splitlines() or ["no output"])[0]
        except (OSError, subprocess.TimeoutExpired) as e:
            why = str(e)
    else:
        why = "py-spy is not installed (pip install 'primerl[watchdog]')"
    try:
        os.kill(pid, STACK_SIGNAL)
    except ProcessLookupError:
        return "none", f"(process {pid} is gone; py-spy: {why})"
    return "faulthandler", (f"(py-spy: {why}; sent SIGUSR1: the process's faulthandler writes every thread's stack "
                            "to its own log)")
