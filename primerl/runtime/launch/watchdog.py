"""The launcher's stall watchdog (issue 45): a job none of whose processes made progress for
``deployment.stall_timeout_s`` is stalled.

The job's processes beat (``heartbeat.beat``) into ``<output_dir>/heartbeats`` when their work
advances. A process that waits on a peer (a trainer rank for its batch, the orchestrator for new
weights) does not beat, so one process alone going quiet is no stall; the job is stalled when the
newest beat of every live process is older than the timeout; while a process of the job has not
yet made progress past its start (its first beat, ``"started"``), the timeout is
``max(stall_timeout_s, deployment.stall_startup_s)`` (a slow start-up is no stall). The process named is the one
stopped by a signal (state ``T`` in ``/proc``: SIGSTOP) if any, else the one whose progress
stopped first. Every stalled process's threads' Python stacks go to its log first
(``heartbeat.dump_stacks``: ``py-spy dump --nonblocking``, which also reads a stopped process, or
faulthandler on SIGUSR1), and the failure line names the process, its host, its last progress and
where the stacks are; then the launcher applies the restart policy (``launcher.run_job``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

from ..heartbeat import dump_stacks, read_heartbeats

__all__ = ["StallWatchdog", "process_state", "started_up"]


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` in ``/proc`` (``R``, ``S``, ``T`` stopped, ``Z``...); None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class StallWatchdog:
    """``check()``: None while the job progresses, else the failure line (stacks already dumped).
    ``log_for(name)``: the log file of the process whose heartbeat is ``name`` (None: this process's
    stderr, a node agent's log)."""

    def __init__(self, directory: str | Path, timeout_s: float, log_for: Callable[[str], Path], startup_s: float = 0.0):
        self.directory, self.timeout_s, self.log_for = Path(directory), timeout_s, log_for
        self.startup_s = startup_s  # deployment.stall_startup_s

    def limit(self, rows: list[dict]) -> float:
        """The stall timeout for the live processes ``rows``: longer (``startup_s``) while one is starting."""
        return self.timeout_s if started_up(rows) else max(self.timeout_s, self.startup_s)

    def end_leftovers(self, grace_s: float = 3.0) -> list[str]:
        """After the launcher stopped its process groups: end every job process that still beats
        here (torchrun's workers run in sessions of their own, and a stopped one ignores the SIGTERM
        torchrun forwards): SIGCONT + SIGTERM, SIGKILL after ``grace_s``. Returns their names."""
        import signal

        left = [r for r in self.live() if _is_job_process(r["pid"])]
        for sig in (signal.SIGCONT, signal.SIGTERM):
            for r in left:
                _kill(r["pid"], sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(process_state(r["pid"]) not in (None, "Z", "X") for r in left):
            time.sleep(0.05)
        for r in left:
            if process_state(r["pid"]) not in (None, "Z", "X"):
                _kill(r["pid"], signal.SIGKILL)
        return [r["name"] for r in left]

    def live(self) -> list[dict]:
        return [r for r in read_heartbeats(self.directory) if process_state(r["pid"]) not in (None, "Z", "X")]

    def check(self, now: float | None = None) -> str | None:
        if self.timeout_s <= 0:
            return None
        rows = self.live()
        now = time.time() if now is None else now
        if not rows or now - max(r["time"] for r in rows) < self.limit(rows):
            return None
        return self.report(rows, now)

    def report(self, rows: list[dict], now: float, *, alone: bool = False) -> str:
        """Dump the stacks of the stalled processes ``rows`` (every one's to its log) and return the
        line naming the culprit: the stopped one, else the one whose progress stopped first.
        ``alone``: the culprit stayed stopped for the timeout while the rest of the job went on."""
        stopped = [r for r in rows if process_state(r["pid"]) in ("T", "t")]
        culprit = stopped[0] if stopped else min(rows, key=lambda r: r["time"])
        how_culprit = ""
        for r in [culprit] + [r for r in rows if r is not culprit]:
            how, text = dump_stacks(r["pid"])
            path = self.log_for(r["name"])
            state = process_state(r["pid"])
            head = (f"\n==== primerl watchdog: {r['name']} (pid {r['pid']} on {r['host']}, state {state}) made no "
                    f"progress for {now - r['time']:.0f} s; its last: {r['what']}; every thread's stack ({how}):\n")
            try:
                if path is None:  # the log is this process's stderr (a node agent started by hand)
                    print(head + text.rstrip() + "\n====", file=sys.stderr, flush=True)
                else:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    with open(path, "a") as f:
                        f.write(head + text.rstrip() + "\n====\n")
            except OSError:
                pass
            if r is culprit:
                how_culprit = how
        age = now - culprit["time"]
        when = time.strftime("%H:%M:%S", time.localtime(culprit["time"]))
        why = ", stopped by a signal (SIGSTOP)" if stopped else ""
        others = "" if alone else ", nor did any other process of the job"
        startup = (f", in the job's start-up: deployment.stall_startup_s = {self.startup_s:g}"
                   if not alone and not started_up(rows) and self.startup_s > self.timeout_s else "")
        return (f"the {culprit['name']} process (pid {culprit['pid']} on {culprit['host']}{why}) made no progress for "
                f"{age:.0f} s{others} (deployment.stall_timeout_s = {self.timeout_s:g}{startup});"
                f" its last progress: {culprit['what']} at {when}; every thread's stack ({how_culprit}) is in "
                f"{self.log_for(culprit['name']) or 'the log of this node agent'}")


def started_up(rows: list[dict]) -> bool:
    """Every process of ``rows`` (heartbeat rows, at least one) made progress past its start: beat more than once."""
    return bool(rows) and all(r.get("progress", 0) >= 2 for r in rows)


def _is_job_process(pid: int) -> bool:
    """``pid`` still runs a primerl process (not a reused pid)."""
    try:
        return b"primerl" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _kill(pid: int, sig: int) -> None:
    import os

    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
