"""The distillation teacher's clients: ``score(sequences) -> per-token log-probs`` (``teacher.score_logprobs``'
convention: entry t scores token t, entry 0 is 0.0), whatever serves the teacher.

- :class:`InProcessTeacher`: the teacher's model in the orchestrator's process (the default).
- :class:`ServerTeacher`: ``POST /v1/score`` of ``primerl inference --role teacher`` (the embedded backend).
- :class:`VLLMTeacher`: vLLM's ``/v1/completions`` with ``prompt_logprobs = 0`` and ``max_tokens = 1``
  (the vllm backend): vLLM returns the log-prob of every prompt token after the first.

An inference backend makes one (``InferenceBackend.make_teacher_client``); the orchestrator runs it
on its scoring thread (``orchestrator.teacher_scoring.TeacherScorer``).
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

__all__ = ["InProcessTeacher", "ServerTeacher", "VLLMTeacher", "TeacherError"]


class TeacherError(RuntimeError):
    """The teacher could not score (a server error, a malformed answer); the message names the teacher."""


class InProcessTeacher:
    def __init__(self, model, *, temperature: float = 1.0, name: str = "teacher"):
        self.model, self.temperature, self.name = model, temperature, name

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        from .teacher import score_logprobs

        return score_logprobs(self.model, sequences, temperature=self.temperature)


def _post(url: str, body: dict, timeout: float, name: str) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise TeacherError(f"{name} at {url}: HTTP {e.code}: {e.read()[:300]!r}") from None
    except (urllib.error.URLError, OSError) as e:
        raise TeacherError(f"{name} at {url}: {e}") from None


def _check(out: list, sequences: list[list[int]], name: str) -> list[list[float]]:
    if not isinstance(out, list) or len(out) != len(sequences):
        raise TeacherError(f"{name}: expected log-probs of {len(sequences)} sequences, got {str(out)[:200]}")
    res = []
    for i, (lp, s) in enumerate(zip(out, sequences)):
        if not isinstance(lp, list) or len(lp) != len(s):
            got = len(lp) if isinstance(lp, list) else repr(lp)
            raise TeacherError(f"{name}: sequence {i} has {len(s)} tokens but {got} log-probs came back")
        row = [0.0] + [float(x) for x in lp[1:]]
        if not all(math.isfinite(x) for x in row):
            raise TeacherError(f"{name}: non-finite log-probs for sequence {i}")
        res.append(row)
    return res


class ServerTeacher:
    """``primerl inference --role teacher`` at ``url``."""

    def __init__(self, url: str, *, temperature: float = 1.0, timeout_s: float = 300.0, name: str = "teacher"):
        self.url, self.temperature, self.timeout_s, self.name = url.rstrip("/"), temperature, timeout_s, name

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        body = _post(f"{self.url}/v1/score", {"sequences": sequences, "temperature": self.temperature},
                     self.timeout_s, self.name)
        return _check(body.get("logprobs"), sequences, f"{self.name} at {self.url}")


class VLLMTeacher:
    """A vLLM server of the teacher at ``url`` (model name ``model``): one completion request per
    sequence, ``prompt_logprobs = 0`` (each prompt token's own log-prob; entry 0 is null)."""

    def __init__(self, url: str, model: str, *, temperature: float = 1.0, timeout_s: float = 300.0,
                 name: str = "teacher"):
        self.url, self.model, self.temperature = url.rstrip("/"), model, temperature
        self.timeout_s, self.name = timeout_s, name

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        out = []
        for s in sequences:
            body = _post(f"{self.url}/v1/completions",
                         {"model": self.model, "prompt": s, "max_tokens": 1, "prompt_logprobs": 0,
                          "temperature": self.temperature}, self.timeout_s, self.name)
            try:
                pl = body["choices"][0]["prompt_logprobs"]
                out.append([None] + [_vllm_entry(d, t) for d, t in zip(pl[1:], s[1:])])
            except (KeyError, IndexError, TypeError) as e:
                raise TeacherError(f"{self.name} at {self.url}: no prompt_logprobs in the answer ({e!r}): "
                                   f"{str(body)[:200]}") from None
        return _check(out, sequences, f"{self.name} at {self.url}")


def _vllm_entry(d: dict, token: int) -> float:
    """vLLM's prompt_logprobs entry ``{"<token id>": {"logprob": x, ...}, ...}`` -> x of ``token``."""
    v = d.get(str(token), d.get(token)) if isinstance(d, dict) else None
    if v is None:
        raise KeyError(f"token {token} missing from {str(d)[:80]}")
    return float(v["logprob"] if isinstance(v, dict) else v)
