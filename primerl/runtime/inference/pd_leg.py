"""The engine server's side of prefill/decode disaggregation (the protocol and the KV record
format are ``pd``'s): which leg a generation request is, by its ``kv_transfer_params``, and the
one-shot ``GET /kv_transfer/<id>`` pull of a prefilled cache.

- no ``kv_transfer_params``: a plain request;
- ``do_remote_decode`` (a prefill leg; refused by a decode server): run the prompt with
  ``max_tokens = 1`` and the cache exported, keep the record (KV [L, P, H_kv, D] k and v, first
  token, its log-prob, the prompt's routed experts [P, L, k]) under a transfer id, and answer the
  ``kv_transfer_params`` the decode server pulls it by;
- ``do_remote_prefill`` (a decode leg; refused by a prefill server): pull the record, check it
  against this request and model, and continue generation from it.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Callable

from .engine import Prefilled, Request, SamplingParams
from .engine_thread import EngineThread
from .pd import KV_ROUTE, PDState, encode_prefilled, prefill_params
from .server_metrics import TextBody

Extra = Callable[[object], dict]  # Completion -> response fields a leg adds (the prefill leg's kv_transfer_params)


class BytesBody(TextBody):
    """A binary response body (a KV hand-off)."""

    def __init__(self, data: bytes):
        self.data, self.content_type = data, "application/octet-stream"


class PDLeg:
    """Submits a generation request as its P/D leg and serves the KV pulls. ``state`` (``pd.PDState``)
    holds the role, the prefill store and the counters ``GET /health`` shows under ``pd``;
    ``host:port`` is where a decode server pulls this server's prefilled caches."""

    def __init__(self, state: PDState, engine_thread: EngineThread, host: str, port: int):
        self.state = state
        self.engine_thread = engine_thread
        self.host, self.port = host, port

    @property
    def role(self) -> str:
        return self.state.role

    def submit(self, body: dict, rid: int, prompt: list[int], params: SamplingParams) -> tuple[Future, Extra | None]:
        """-> (engine future of the Completion, extra response fields or None) for a request, by its
        ``kv_transfer_params``: a prefill leg (do_remote_decode), a decode leg (do_remote_prefill),
        or a plain request (none). ValueError for a leg this server's role does not run."""
        ktp = body.get("kv_transfer_params")
        if ktp is None:
            return self.engine_thread.submit(Request(rid, prompt, params)), None
        if not isinstance(ktp, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {type(ktp).__name__}")
        if ktp.get("do_remote_decode"):
            if self.role == "decode":
                raise ValueError("kv_transfer_params.do_remote_decode: this server's role is decode, not prefill")
            return self._prefill(rid, prompt, params)
        if ktp.get("do_remote_prefill"):
            if self.role == "prefill":
                raise ValueError("kv_transfer_params.do_remote_prefill: this server's role is prefill, not decode")
            return self._decode(ktp, rid, prompt, params), None
        return self.engine_thread.submit(Request(rid, prompt, params)), None

    def _prefill(self, rid: int, prompt: list[int], params: SamplingParams) -> tuple[Future, Extra]:
        self.state.count("prefills")
        fut = self.engine_thread.submit(Request(rid, prompt, dataclasses.replace(params, max_new_tokens=1),
                                                export_kv=True))

        def extra(c) -> dict:
            k, v = c.kv
            routing = None if c.routing is None else c.routing[:len(prompt)]
            pf = Prefilled(k.cpu(), v.cpu(), c.tokens[0], c.logprobs[0], routing, c.policy_version,
                           c.token_times[0] if c.token_times else 0.0)
            tid = self.state.store.put(encode_prefilled(pf, seed=params.seed, prompt=prompt))
            return {"kv_transfer_params": prefill_params(self.host, self.port, self.state.engine_id, tid)}

        return fut, extra

    def _decode(self, ktp: dict, rid: int, prompt: list[int], params: SamplingParams) -> Future:
        engine = self.engine_thread.engine

        def check(pf, header):
            if header.get("prompt_len") != len(prompt):
                raise ValueError(f"the prefilled prompt has {header.get('prompt_len')} tokens, this request's "
                                 f"prompt {len(prompt)}")
            engine.check_prefilled(rid, len(prompt), pf)

        def submit(pf, header):
            return self.engine_thread.submit(Request(rid, prompt, dataclasses.replace(params, seed=int(header["seed"])),
                                                     prefilled=pf))

        self.engine_thread.check_alive()
        return self.state.start_decode(ktp, check, submit)

    def serve_pull(self, path: str) -> tuple[int, dict | BytesBody]:
        """``GET /kv_transfer/<id>`` -> (200, the record's bytes), once; 404 naming why otherwise."""
        tid = path[len(KV_ROUTE):]
        data = self.state.serve_pull(tid)
        if data is None:
            return 404, {"error": f"unknown KV transfer {tid!r}: never prefilled here, already pulled, "
                                  f"or expired after {self.state.store.ttl_s:g} s"}
        return 200, BytesBody(data)

    def health(self) -> dict | None:
        """The ``pd`` part of ``GET /health`` (None for a colocated server, role "both")."""
        return None if self.role == "both" else self.state.read()


__all__ = ["BytesBody", "PDLeg"]
