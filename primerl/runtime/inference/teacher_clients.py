"""The distillation teacher's clients: ``score(sequences) -> per-token log-probs`` (``teacher.score_logprobs``'
convention: entry t scores token t, entry 0 is 0.0), whatever serves the teacher.

- :class:`InProcessTeacher`: the teacher's model in the orchestrator's process (the default).
- :class:`ServerTeacher`: ``POST /v1/score`` of ``primerl inference --role teacher`` (the embedded backend).
- :class:`VLLMTeacher`: vLLM's ``/v1/completions`` with ``prompt_logprobs = 0`` and ``max_tokens = 1``
  (the vllm backend): vLLM returns the log-prob of every prompt token after the first.

Each also has ``score_topk(sequences, k)`` (``distill.topk``): per sequence ``(logprobs [L], topk_ids
[L][k], topk_logprobs [L][k])``, entry t the teacher's k most likely tokens where token t was drawn
(entry 0: zeros). The server gets ``top_k`` in the same request; vLLM is asked for
``prompt_logprobs = k`` (vLLM caps it at its ``--max-logprobs``, 20 by default).

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

    def score_topk(self, sequences: list[list[int]], k: int) -> list:
        from .teacher import score_topk

        return score_topk(self.model, sequences, k, temperature=self.temperature)


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

    def score_topk(self, sequences: list[list[int]], k: int) -> list:
        body = _post(f"{self.url}/v1/score", {"sequences": sequences, "temperature": self.temperature, "top_k": k},
                     self.timeout_s, self.name)
        name = f"{self.name} at {self.url}"
        lps = _check(body.get("logprobs"), sequences, name)
        ids, tops = body.get("top_ids"), body.get("top_logprobs")
        if not (isinstance(ids, list) and isinstance(tops, list) and len(ids) == len(tops) == len(sequences)):
            raise TeacherError(f"{name}: expected top_ids and top_logprobs of {len(sequences)} sequences")
        return [_topk_rows(lp, i_rows, t_rows, len(s), k, name, n)
                for n, (lp, i_rows, t_rows, s) in enumerate(zip(lps, ids, tops, sequences))]


class VLLMTeacher:
    """A vLLM server of the teacher at ``url`` (model name ``model``): one completion request per
    sequence, ``prompt_logprobs = 0`` (each prompt token's own log-prob; entry 0 is null)."""

    def __init__(self, url: str, model: str, *, temperature: float = 1.0, timeout_s: float = 300.0,
                 name: str = "teacher"):
        self.url, self.model, self.temperature = url.rstrip("/"), model, temperature
        self.timeout_s, self.name = timeout_s, name

    def _prompt_logprobs(self, s: list[int], k: int) -> list:
        """vLLM's ``prompt_logprobs`` of sequence ``s`` (asked for ``k``: each entry holds the top-k
        and the prompt's own token; entry 0 is null)."""
        body = _post(f"{self.url}/v1/completions",
                     {"model": self.model, "prompt": s, "max_tokens": 1, "prompt_logprobs": k,
                      "temperature": self.temperature}, self.timeout_s, self.name)
        pl = body.get("choices", [{}])[0].get("prompt_logprobs") if isinstance(body, dict) else None
        if not isinstance(pl, list) or len(pl) != len(s):
            raise TeacherError(f"{self.name} at {self.url}: no prompt_logprobs in the answer: {str(body)[:200]}")
        return pl

    def _read(self, s: list[int], k: int, read):
        try:
            return read(self._prompt_logprobs(s, k)[1:])
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
            raise TeacherError(f"{self.name} at {self.url}: unreadable prompt_logprobs ({e!r})") from None

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        out = [[None] + self._read(s, 0, lambda pl, s=s: [_vllm_entry(d, t) for d, t in zip(pl, s[1:])])
               for s in sequences]
        return _check(out, sequences, f"{self.name} at {self.url}")

    def score_topk(self, sequences: list[list[int]], k: int) -> list:
        name = f"{self.name} at {self.url}"
        out = []
        for n, s in enumerate(sequences):
            lp, tops = self._read(s, k, lambda pl, s=s: ([_vllm_entry(d, t) for d, t in zip(pl, s[1:])],
                                                         [_vllm_topk(d, k) for d in pl]))
            (lp,) = _check([[None] + lp], [s], name)
            out.append(_topk_rows(lp, [None] + [i for i, _ in tops], [None] + [x for _, x in tops], len(s), k,
                                  name, n))
        return out


def _topk_rows(lp, id_rows, lp_rows, L: int, k: int, name: str, n: int):
    """One sequence's (logprobs, topk_ids, topk_logprobs) from the wire (entry 0 null), checked."""
    if not isinstance(id_rows, list) or not isinstance(lp_rows, list) or len(id_rows) != L or len(lp_rows) != L:
        raise TeacherError(f"{name}: sequence {n} has {L} tokens but its top-k rows do not match")
    ids, lps = [[0] * k], [[0.0] * k]
    for a, b in zip(id_rows[1:], lp_rows[1:]):
        if not isinstance(a, list) or not isinstance(b, list) or len(a) != k or len(b) != k:
            raise TeacherError(f"{name}: sequence {n}: a top-k row is not {k} ids and {k} log-probs")
        row = [float(x) for x in b]
        if not all(math.isfinite(x) for x in row):
            raise TeacherError(f"{name}: non-finite top-k log-probs for sequence {n}")
        ids.append([int(x) for x in a])
        lps.append(row)
    return lp, ids, lps


def _vllm_topk(d: dict, k: int) -> tuple[list[int], list[float]]:
    """vLLM's prompt_logprobs entry (the k most likely tokens, each with its ``rank``, plus the
    prompt's own token when it is not among them) -> the k most likely ids and log-probs."""
    items = [(int(t), float(v["logprob"] if isinstance(v, dict) else v)) for t, v in d.items()]
    items.sort(key=lambda x: -x[1])
    if len(items) < k:
        raise KeyError(f"{len(items)} entries where the top-{k} was asked for: {str(d)[:80]}")
    return [t for t, _ in items[:k]], [x for _, x in items[:k]]


def _vllm_entry(d: dict, token: int) -> float:
    """vLLM's prompt_logprobs entry ``{"<token id>": {"logprob": x, ...}, ...}`` -> x of ``token``."""
    v = d.get(str(token), d.get(token)) if isinstance(d, dict) else None
    if v is None:
        raise KeyError(f"token {token} missing from {str(d)[:80]}")
    return float(v["logprob"] if isinstance(v, dict) else v)
