"""Ownership of a job's ``output_dir``: one job at a time, and no silent loss of a previous run.

``claim_output_dir(cfg)`` is what the launchers (``run_rl``, ``run_threads``) hold for a job's
whole life:

1. an exclusive ``flock`` on ``<output_dir>/.primerl.lock`` (the file holds the owner's pid and
   host). A second job on the same directory fails at once with :class:`OutputDirBusy` naming the
   holder; the kernel drops the lock when the holder exits, however it dies, so a stale lock
   cannot outlive its job. (``flock`` is local to a host unless the filesystem maps it to its own
   locks, as NFSv4 and Lustre with ``-o flock`` do.)
2. a refusal (:class:`OutputDirNotEmpty`) to start in a directory that already holds files unless
   ``checkpoint.resume = true`` (continue it) or ``overwrite = true`` (its transport, checkpoints
   and metrics are deleted).

The separately launched pieces (``primerl trainer`` / ``primerl orchestrator`` on a cluster) take
no lock: whoever starts them owns the directory.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

LOCK_NAME = ".primerl.lock"

__all__ = ["LOCK_NAME", "OutputDirError", "OutputDirBusy", "OutputDirNotEmpty", "OutputDirUnusable", "OutputDirLock",
           "claim_output_dir"]


class OutputDirError(RuntimeError):
    """The job cannot use its output_dir (message says why and what to do)."""


class OutputDirBusy(OutputDirError):
    pass


class OutputDirNotEmpty(OutputDirError):
    pass


class OutputDirUnusable(OutputDirError):
    """output_dir cannot be created or written (a file in the way, no permission, a kernel
    filesystem): a config error (``primerl rl`` exits 2), found when ``validate.validate``'s look at
    the path could not tell."""


class OutputDirLock:
    """An exclusive, non-blocking ``flock`` on ``<output_dir>/.primerl.lock`` (context manager)."""

    def __init__(self, output_dir: str | Path):
        self.dir = Path(output_dir)
        self.path = self.dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "OutputDirLock":
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise OutputDirUnusable(f"output_dir: cannot create or write {self.dir}: {e.strerror or e} "
                                    f"({type(e).__name__}); choose another --output_dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OutputDirError(f"cannot lock output_dir {self.dir} ({self.path}: {e}); its filesystem may not "
                                     "support flock") from e
            raise OutputDirBusy(f"output_dir {self.dir} is in use by another primerl job (holder: pid {holder}; "
                                f"lock file {self.path}). Wait for it to finish, stop it, or choose another "
                                "--output_dir.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "OutputDirLock":
        return self if self._fd is not None else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# What ``primerl rl`` writes before the trainer's first step (the resolved config, the processes'
# logs, pids and process table, the transport with its initial weights, vLLM's initial policy, the warm start, which
# a new start redoes anyway): a directory holding only these is a start that failed, not a run whose
# work a new start would delete, so it is reused (its logs are appended to: the failure stays readable).
_START_FILES = frozenset({"config.toml", "logs", "pids", "transport", "vllm_init", "warm_start", "processes.json",
                          "heartbeats"})


def _previous_run_files(out: Path) -> list[str]:
    found = sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME) if out.is_dir() else []
    started = set(found) - {"metrics.jsonl"} if (out / "metrics.jsonl").is_file() and \
        (out / "metrics.jsonl").stat().st_size == 0 else set(found)  # opened by the trainer, no step logged
    return [] if started <= _START_FILES else found


def claim_output_dir(cfg) -> OutputDirLock:
    """Lock ``cfg.output_dir`` and check it may be used; the caller releases (or uses ``with``).

    Raises OutputDirBusy (another job holds it) or OutputDirNotEmpty (a previous run's files,
    without ``checkpoint.resume`` or ``overwrite``)."""
    lock = OutputDirLock(cfg.output_dir).acquire()
    try:
        found = _previous_run_files(lock.dir)
        if found and not cfg.checkpoint.resume and not cfg.overwrite:
            shown = ", ".join(found[:8]) + (", ..." if len(found) > 8 else "")
            raise OutputDirNotEmpty(
                f"output_dir {lock.dir} is not empty ({shown}): a new run there would delete the previous run's "
                "checkpoints and metrics. Pass --checkpoint.resume true to continue it, --overwrite true to replace "
                "it, or another --output_dir.")
    except BaseException:
        lock.release()
        raise
    return lock
