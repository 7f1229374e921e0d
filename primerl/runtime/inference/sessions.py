"""What an inference front door sampled for each rollout, keyed by the ``X-Session-ID`` header.

verifiers sends the rollout's trace id as ``X-Session-ID`` on every ``POST /inference/v1/generate``;
the server that answers (the embedded ``server.EngineServer``, or ``generate_proxy.GenerateProxy``
in front of vLLM) records each request here, and the orchestrator pops the record to join it to
its sample (verifiers' train client drops response fields it does not know). ``SessionStore`` is
that record, one class for both servers.
"""

from __future__ import annotations

import collections
import threading
from typing import Sequence

SESSION_HEADER = "X-Session-ID"
MAX_SESSIONS = 100_000  # recorded sessions kept (oldest dropped first) when nobody pops them


class SessionRecord:
    """What was sampled for one session: the policy versions and every request's
    ``(prompt ids [P], completion ids [T], log-probs [T])`` in arrival order."""

    __slots__ = ("first", "last", "requests")

    def __init__(self):
        self.first: int | None = None  # oldest policy version any of its tokens came from
        self.last: int | None = None  # newest
        self.requests: list[tuple[list[int], list[int], list[float]]] = []


class SessionStore:
    """Thread-safe ``session id -> SessionRecord``, oldest-touched dropped first past ``max_sessions``
    (a session nobody pops does not grow the server without bound)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS):
        self.max_sessions = max_sessions
        self._records: collections.OrderedDict[str, SessionRecord] = collections.OrderedDict()
        self._lock = threading.Lock()

    def record(self, session_id: str, prompt: Sequence[int], tokens: Sequence[int], logprobs: Sequence[float],
               first: int, last: int) -> None:
        """Append one request (``prompt`` [P] ids, ``tokens`` [T] ids, ``logprobs`` [T]) whose tokens
        came from policy versions ``first`` .. ``last`` to ``session_id``'s record."""
        with self._lock:
            rec = self._records.pop(session_id, None) or SessionRecord()
            rec.first = first if rec.first is None else min(rec.first, first)
            rec.last = last if rec.last is None else max(rec.last, last)
            rec.requests.append((list(prompt), list(tokens), list(logprobs)))
            self._records[session_id] = rec
            while len(self._records) > self.max_sessions:
                self._records.popitem(last=False)

    def pop(self, session_id: str) -> SessionRecord | None:
        """The session's record (and forget it), or None if it made no recorded request."""
        with self._lock:
            return self._records.pop(session_id, None)

    def versions(self, session_id: str, *, pop: bool = True) -> tuple[int, int, int] | None:
        """(oldest policy version, newest, recorded requests) of a session, or None if it made none."""
        with self._lock:
            rec = self._records.pop(session_id, None) if pop else self._records.get(session_id)
        return None if rec is None else (rec.first, rec.last, len(rec.requests))

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)


__all__ = ["MAX_SESSIONS", "SESSION_HEADER", "SessionRecord", "SessionStore"]
