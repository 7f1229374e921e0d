"""The one way the runtime starts a job process: :func:`start_process`.

Every process a launcher starts (trainer, orchestrator, inference servers, router, vLLM, P/D
servers, a node's torchrun, the local nodes) goes through :class:`ManagedProcess`:

- its own session, so its whole process group can be signalled (torchrun's workers, vLLM's engine
  core and workers stop with it);
- ``die_with_parent`` (default on): the kernel sends it SIGTERM when the starting process dies
  (``lifetime.die_with_parent``), so a killed launcher leaves nothing behind;
- stdout and stderr appended to ``log_path`` (``None``: inherited from the starter, as a node's
  torchrun writes to the node's own output);
- a row in ``<output_dir>/processes.json`` through a :class:`ProcessTable` when one is given
  (``{"role", "pid", "url", "restarts"}``, rewritten atomically at every (re)start);
- :meth:`ManagedProcess.stop`: SIGCONT + SIGTERM to the group, ``grace`` seconds, then SIGKILL to
  the group, and the process reaped. :meth:`ManagedProcess.stop_in_signal_handler` does the same
  without ``Popen.wait`` / ``poll``, whose lock a signal handler may find held by the code it
  interrupted (a deadlock: issue 45).

``ManagedProcess`` answers ``poll()``, ``wait(timeout)``, ``pid`` and ``returncode`` like a
``subprocess.Popen``, and ``start()`` again after a death runs the same command line (same port).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from .lifetime import die_with_parent as _die_with_parent

__all__ = ["ManagedProcess", "ProcessTable", "start_process"]


class ProcessTable:
    """``processes.json``: every process the launcher started, by name; rewritten atomically.
    ``merge``: keep the rows another process wrote there (not ours by role and URL), as the
    orchestrator's P/D deployment does beside the launcher's table."""

    def __init__(self, path: str | Path, *, merge: bool = False):
        self.path = Path(path)
        self.merge = merge
        self._rows: dict[str, dict] = {}
        self._lock = threading.Lock()

    def set(self, name: str, role: str, pid: int, url: str | None = None, restarts: int = 0) -> None:
        with self._lock:
            self._rows[name] = {"role": role, "pid": pid, "url": url, "restarts": restarts}
            rows = list(self._rows.values())
            if self.merge:
                ours = {(r["role"], r["url"]) for r in rows}
                try:
                    old = json.loads(self.path.read_text())
                except (OSError, ValueError):
                    old = []
                rows = [r for r in old if (r.get("role"), r.get("url")) not in ours] + rows
            tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(rows, indent=1))
            os.replace(tmp, self.path)


class ManagedProcess:
    """One child process of the job: ``start`` (again after a death: the same command line), ``stop``,
    ``kill``; ``proc`` is the ``subprocess.Popen`` of the current start (None before the first)."""

    def __init__(self, name: str, role: str, argv: list[str], log_path: str | Path | None, *, url: str | None = None,
                 env: dict | None = None, cwd: str | Path | None = None, table: ProcessTable | None = None,
                 die_with_parent: bool = True):
        self.name, self.role, self.url = name, role, url
        self.args = list(argv)
        self.log_path = None if log_path is None else Path(log_path)
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.table = table
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.started_at = 0.0

    # -- Popen's answers
    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        """``Popen.wait``: the exit code; ``subprocess.TimeoutExpired`` after ``timeout`` s."""
        if self.proc is None:
            raise RuntimeError(f"the {self.name} process was never started")
        return self.proc.wait(timeout)

    @property
    def restarts(self) -> int:
        return max(self.starts - 1, 0)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- life
    def start(self) -> "ManagedProcess":
        """Start (or restart) the process; a missing executable raises ``FileNotFoundError``."""
        preexec = _die_with_parent(os.getpid()) if self.die_with_parent else None
        if self.log_path is None:
            self.proc = subprocess.Popen(self.args, env=self.env, cwd=self.cwd, start_new_session=True,
                                         preexec_fn=preexec)
        else:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as f:
                self.proc = subprocess.Popen(self.args, stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
                                             start_new_session=True, preexec_fn=preexec)
        self.starts += 1
        self.started_at = time.monotonic()
        if self.table is not None:
            self.table.set(self.name, self.role, self.proc.pid, self.url, self.restarts)
        return self

    def signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the process group; False when the group is gone."""
        if self.proc is None:
            return False
        try:
            os.killpg(self.proc.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def kill(self) -> None:
        """SIGKILL the process group (a stopped process is killed too) and reap the process."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.signal_group(signal.SIGKILL)
        self.proc.wait()

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the group (SIGCONT first: a stopped process cannot act on it), SIGKILL it after
        ``grace`` s, and reap the process. Nothing to do once the process has exited."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.signal_group(signal.SIGCONT)
        if not self.signal_group(signal.SIGTERM):
            self.proc.wait()
            return
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.kill()

    def stop_in_signal_handler(self, grace: float = 5.0) -> None:
        """``stop`` for a signal handler: reaps with ``os.waitpid`` only, never ``Popen.wait`` / ``poll``
        (whose lock the interrupted code may hold: waiting on it there never returns)."""
        if self.proc is None or self.proc.returncode is not None:
            return
        pid = self.proc.pid
        self.signal_group(signal.SIGCONT)
        self.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        try:
            while os.waitpid(pid, os.WNOHANG)[0] == 0:
                if time.monotonic() >= deadline:
                    self.signal_group(signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.05)
        except ChildProcessError:  # reaped already (by the interrupted wait)
            pass


def start_process(argv: list[str], *, name: str, role: str, log_path: str | Path | None, env: dict | None = None,
                  cwd: str | Path | None = None, table: ProcessTable | None = None, url: str | None = None,
                  die_with_parent: bool = True) -> ManagedProcess:
    """Start ``argv`` as the job process ``name`` (see the module docstring); returns it running."""
    return ManagedProcess(name, role, argv, log_path, url=url, env=env, cwd=cwd, table=table,
                          die_with_parent=die_with_parent).start()
