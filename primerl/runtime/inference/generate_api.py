"""The token-in / token-out routes of vLLM's API, on primerl's embedded engine.

``POST /inference/v1/generate`` (what verifiers' train client and ``renderers.client.generate``
call) and ``GET /v1/models`` (where they read ``max_model_len``). Pure functions from the request
body to engine parameters and from an engine ``Completion`` to the response body; the HTTP server
(``server.EngineServer``) does the transport.

Request::

    {"model": str, "token_ids": [int, ...],
     "sampling_params": {"temperature": float, "max_tokens": int, "top_p": float,
                         "stop_token_ids": [int], "logprobs": 1, "seed": int,
                         "routed_experts_prompt_start": int, ...}}

Unknown sampling keys (``skip_special_tokens``, ``include_stop_str_in_output``, ...) are ignored, as
a client that targets vLLM sends many. vLLM's sampling modifiers the engine does not implement
(``top_k``, ``min_p``, penalties, ``min_tokens``, ``logit_bias``, ``stop`` strings, ``n``) are
accepted at their neutral values and refused otherwise (400 naming the key): ignoring one would
sample from another distribution than the one asked for. ``max_tokens`` absent: up to the context
length.

Response (one choice)::

    {"request_id": str, "prompt_token_ids": [int],
     "choices": [{"index": 0, "token_ids": [int],              # the sampled stop token included
                  "logprobs": {"content": [{"token": "token_id:<id>", "logprob": float}, ...]},
                  "finish_reason": "stop" | "length",
                  "routed_experts": {"data": base64 of raw bytes, "shape": [n, L, k],
                                     "start": s, "dtype": "uint8"}}],   # only with routing
     "usage": {...}}

``routed_experts`` covers sequence positions ``s .. len(prompt) + len(completion) - 2`` (every
position fed through the model; the last sampled token never is), ``s`` being
``routed_experts_prompt_start`` (default 0): a later turn of a conversation asks only for what it
has not seen. The bytes are the C-order ``[n, L, k]`` array (not the ``np.save`` encoding of
``/v1/completions``).
"""

from __future__ import annotations

import base64
import math
import numbers

import torch

from .engine import Completion, SamplingParams

__all__ = ["GenerateRequestError", "parse_generate_request", "parse_completion_request", "parse_score_request",
           "generate_response", "models_response", "encode_routed_experts_raw",
           "decode_routed_experts_raw", "score_response"]


class GenerateRequestError(ValueError):
    """A request the route cannot serve; the message names the field (HTTP 400)."""


def _int(value, name: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise GenerateRequestError(f"{name} must be an integer, got {type(value).__name__} {value!r:.40}")
    if minimum is not None and value < minimum:
        raise GenerateRequestError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _float(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise GenerateRequestError(f"{name} must be a finite number, got {value!r:.40}")
    return float(value)


# vLLM sampling keys the engine does not implement, with the values that leave sampling unchanged
NEUTRAL = {"top_k": (None, -1, 0), "min_p": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
           "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "min_tokens": (None, 0),
           "n": (None, 1), "best_of": (None, 1), "logit_bias": (None, {}), "stop": (None, [], ""),
           "prompt_logprobs": (None, 0)}


def _token_ids(value, name: str, vocab_size: int | None) -> list[int]:
    if not isinstance(value, list) or not value:
        raise GenerateRequestError(f"{name} must be a non-empty list of token ids")
    ids = [_int(t, f"{name}[i]", minimum=0) for t in value]
    if vocab_size is not None:
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise GenerateRequestError(f"{name}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    return ids


def _max_tokens(value, name: str, prompt_len: int, max_model_len: int) -> int:
    room = max_model_len - prompt_len
    if room < 1:
        raise GenerateRequestError(f"the prompt has {prompt_len} tokens; max_model_len is {max_model_len}")
    max_tokens = room if value is None else _int(value, name, minimum=1)
    if max_tokens > room:
        raise GenerateRequestError(f"prompt ({prompt_len} tokens) + {name} ({max_tokens}) exceeds "
                                   f"max_model_len = {max_model_len}")
    return max_tokens


def _sampling(temperature, top_p, prefix: str) -> tuple[float, float]:
    temperature = _float(temperature, f"{prefix}temperature")
    if temperature <= 0:
        raise GenerateRequestError(f"{prefix}temperature must be > 0 (the engine has no greedy mode)")
    top_p = _float(top_p, f"{prefix}top_p")
    if not 0 < top_p <= 1:
        raise GenerateRequestError(f"{prefix}top_p must be in (0, 1], got {top_p}")
    return temperature, top_p


def _stop_ids(value, name: str) -> tuple[int, ...]:
    value = [] if value is None else value
    if not isinstance(value, list):
        raise GenerateRequestError(f"{name} must be a list of token ids")
    return tuple(_int(t, f"{name}[i]", minimum=0) for t in value)


def parse_completion_request(body, *, max_model_len: int, default_seed: int,
                             vocab_size: int | None = None) -> tuple[list[int], SamplingParams]:
    """``POST /v1/completions`` as primerl's vLLM client sends it (``prompt`` = token ids,
    ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop_token_ids``) -> (prompt, params).
    Every field is checked (type, range, vocabulary, context length); the message names it."""
    if not isinstance(body, dict):
        raise GenerateRequestError("the body must be a JSON object")
    prompt = _token_ids(body.get("prompt"), "prompt", vocab_size)
    max_tokens = _max_tokens(body.get("max_tokens", 16), "max_tokens", len(prompt), max_model_len)
    temperature, top_p = _sampling(body.get("temperature", 1.0), body.get("top_p", 1.0), "")
    seed = body.get("seed")
    seed = default_seed if seed is None else _int(seed, "seed")
    return prompt, SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                  stop_token_ids=_stop_ids(body.get("stop_token_ids"), "stop_token_ids"), seed=seed)


def parse_generate_request(body, *, max_model_len: int, default_seed: int,
                           vocab_size: int | None = None) -> tuple[list[int], SamplingParams, int]:
    """-> (prompt token ids, engine sampling params, routed-experts prompt start)."""
    if not isinstance(body, dict):
        raise GenerateRequestError("the body must be a JSON object")
    prompt = _token_ids(body.get("token_ids"), "token_ids", vocab_size)
    sp = body.get("sampling_params")
    sp = {} if sp is None else sp
    if not isinstance(sp, dict):
        raise GenerateRequestError("sampling_params must be an object")
    for key, neutral in NEUTRAL.items():
        if key in sp and not any(sp[key] == v and type(sp[key]) is type(v) or sp[key] is v for v in neutral):
            raise GenerateRequestError(f"sampling_params.{key} = {sp[key]!r:.40} "
                                       "is not supported by the embedded engine "
                                       f"(only {[v for v in neutral if v is not None]})")
    temperature, top_p = _sampling(sp.get("temperature", 1.0), sp.get("top_p", 1.0), "sampling_params.")
    max_tokens = _max_tokens(sp.get("max_tokens"), "sampling_params.max_tokens", len(prompt), max_model_len)
    stops = _stop_ids(sp.get("stop_token_ids"), "sampling_params.stop_token_ids")
    logprobs = sp.get("logprobs")
    if logprobs is not None and _int(logprobs, "sampling_params.logprobs", minimum=0) > 1:
        raise GenerateRequestError("sampling_params.logprobs > 1 (top-n alternatives) is not served; use 0 or 1")
    seed = sp.get("seed")
    seed = default_seed if seed is None else _int(seed, "sampling_params.seed")
    start = sp.get("routed_experts_prompt_start")
    start = 0 if start is None else _int(start, "sampling_params.routed_experts_prompt_start", minimum=0)
    if start > len(prompt):
        raise GenerateRequestError(f"sampling_params.routed_experts_prompt_start = {start} is past the prompt "
                                   f"({len(prompt)} tokens)")
    params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, stop_token_ids=stops,
                            seed=seed)
    return prompt, params, start


def encode_routed_experts_raw(routing: torch.Tensor, start: int) -> dict:
    """``[N, L, k]`` integer expert ids -> ``{data, shape, start, dtype}`` of rows ``start..N-1``."""
    import numpy as np

    arr = routing[start:].contiguous().numpy()
    if arr.dtype not in (np.uint8, np.uint16):
        arr = arr.astype(np.uint8 if arr.size == 0 or int(arr.max()) < 256 else np.uint16)
    return {"data": base64.b64encode(arr.tobytes()).decode("ascii"), "shape": list(arr.shape), "start": int(start),
            "dtype": str(arr.dtype)}


def decode_routed_experts_raw(value: dict) -> tuple[torch.Tensor, int]:
    """``encode_routed_experts_raw``'s ``{data, shape, start, dtype}`` -> (``[n, L, k]`` uint8 or
    int32 expert ids, the sequence position of row 0)."""
    import numpy as np

    dtype = {"uint8": np.uint8, "uint16": np.uint16}.get(value.get("dtype"))
    if dtype is None:
        raise ValueError(f"routed_experts.dtype must be uint8 or uint16, got {value.get('dtype')!r}")
    arr = np.frombuffer(base64.b64decode(value["data"]), dtype=dtype).reshape(value["shape"])
    t = torch.from_numpy(arr.copy())
    return (t if dtype is np.uint8 else t.to(torch.int32)), int(value["start"])


def generate_response(request_id: str, c: Completion, routed_start: int) -> dict:
    bad = [x for x in c.logprobs if not math.isfinite(x)]
    if bad:  # a client checks for this too; the engine must never produce it
        raise RuntimeError(f"request {request_id}: the engine returned non-finite log-probs {bad[:3]}")
    choice = {
        "index": 0,
        "token_ids": list(c.tokens),
        "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": float(lp)}
                                 for t, lp in zip(c.tokens, c.logprobs)]},
        "finish_reason": c.finish_reason,
    }
    if c.routing is not None:
        choice["routed_experts"] = encode_routed_experts_raw(c.routing, routed_start)
    return {"request_id": request_id, "prompt_token_ids": list(c.prompt), "choices": [choice],
            "usage": {"prompt_tokens": len(c.prompt), "completion_tokens": len(c.tokens),
                      "total_tokens": len(c.prompt) + len(c.tokens)}}


def models_response(model_name: str, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "primerl",
                                        "root": model_name, "max_model_len": int(max_model_len)}]}


def parse_score_request(body, *, max_model_len: int,
                        vocab_size: int | None = None) -> tuple[list[list[int]], float, int]:
    """``POST /v1/score`` (prefill only: the log-prob of every given token, the distillation teacher's
    route): ``{"sequences": [[int, ...], ...], "temperature": float, "top_k": int}`` -> (sequences,
    temperature, top_k). Every field is checked (a non-empty list of non-empty token-id lists inside
    the vocabulary and ``max_model_len``, a temperature > 0, ``top_k`` an integer from 0 (the
    default: none) to the vocabulary size); the message names it (HTTP 400)."""
    if not isinstance(body, dict):
        raise GenerateRequestError("the body must be a JSON object")
    seqs = body.get("sequences")
    if not isinstance(seqs, list) or not seqs:
        raise GenerateRequestError("sequences must be a non-empty list of token-id lists")
    out = []
    for i, s in enumerate(seqs):
        ids = _token_ids(s, f"sequences[{i}]", vocab_size)
        if len(ids) > max_model_len:
            raise GenerateRequestError(f"sequences[{i}] has {len(ids)} tokens; max_model_len is {max_model_len}")
        out.append(ids)
    temperature = _float(body.get("temperature", 1.0), "temperature")
    if temperature <= 0:
        raise GenerateRequestError(f"temperature must be > 0, got {temperature}")
    top_k = body.get("top_k", 0)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0 or (vocab_size and top_k > vocab_size):
        raise GenerateRequestError(f"top_k must be an integer from 0 to the vocabulary size ({vocab_size}), got "
                                   f"{top_k!r}")
    unknown = sorted(set(body) - {"sequences", "temperature", "model", "top_k"})
    if unknown:
        raise GenerateRequestError(f"unknown field(s) {unknown} (the score route takes sequences, temperature, top_k, "
                                   "model)")
    return out, temperature, top_k


def score_response(logprobs: list[list[float]], policy_version: int, topk: list | None = None) -> dict:
    """The route's body: entry 0 of every sequence is null (no prediction), as vLLM's ``prompt_logprobs``;
    with ``topk`` (per sequence ``(ids [L][k], log-probs [L][k])``) also ``top_ids`` and
    ``top_logprobs``, entry 0 null too."""
    out = {"object": "score", "policy_version": int(policy_version),
           "logprobs": [[None] + [float(x) for x in lp[1:]] for lp in logprobs]}
    if topk is not None:
        out["top_ids"] = [[None] + ids[1:] for ids, _ in topk]
        out["top_logprobs"] = [[None] + lps[1:] for _, lps in topk]
    return out
