"""A recording pass-through in front of a vLLM server's generate route (the verifiers path with
``inference.backend = "vllm"``).

verifiers' train client drops response fields it does not know, and vLLM records nothing per
rollout, so the orchestrator points the client at this proxy instead: every request goes to the
upstream server unchanged (bytes in, bytes out; ``/v1/models`` and any other route too), and each
``POST /inference/v1/generate`` with an ``X-Session-ID`` is recorded like the embedded server's
in the same ``sessions.SessionStore`` as the embedded server's (the prompt ids sent, the completion
ids and log-probs returned, and the policy versions ``version()`` reported when the request started
and when it returned — the version the orchestrator has loaded into the server, as the vLLM client
stamps its completions). Same ``sessions`` / ``pop_session`` / ``url`` / ``start`` / ``stop`` as
``server.EngineServer``.

One translation: vLLM 0.32's route (``--enable-scale-out``; ``output_mode = "tokens"``, the only
mode without a server-side tokenizer) writes each log-prob entry as ``{"token_id": N, "logprob":
x}``, while the ``renderers`` client reads ``{"token": "token_id:N", "logprob": x}`` (the text
mode's form); the proxy rewrites the former into the latter, nothing else.
"""

from __future__ import annotations

import json
import logging
from typing import Callable

from aiohttp import ClientSession, ClientTimeout, web

from .aiohttp_thread import AiohttpThread
from .sessions import SESSION_HEADER, SessionRecord, SessionStore

log = logging.getLogger("primerl.inference")

_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


class GenerateProxy:
    def __init__(self, upstream: str, version: Callable[[], int], *, host: str = "127.0.0.1", port: int = 0,
                 request_timeout: float = 300.0):
        self.upstream = upstream.rstrip("/")
        self.version = version
        self.request_timeout = request_timeout
        # handler_cancellation: a harness that gives up on a request cancels the upstream call, whose
        # closed connection makes the server abort it (vLLM's with_cancellation; primerl inference)
        self._http = AiohttpThread(self._handle, host, port, name="generate-proxy", handler_cancellation=True,
                                   on_start=self._open_client, on_stop=self._close_client)
        self.host, self.port = self._http.host, self._http.port
        self.url = f"http://{self.host}:{self.port}"
        self.sessions = SessionStore()
        self._client: ClientSession | None = None

    # ---------------------------------------------------------------- recording
    @staticmethod
    def _normalise(body: bytes) -> bytes:
        """vLLM's tokens-mode log-prob entries in the ``token_id:N`` form (see the module doc)."""
        out = json.loads(body)
        changed = False
        for choice in out.get("choices") or []:
            for e in (choice.get("logprobs") or {}).get("content") or []:
                if "token" not in e and "token_id" in e:
                    e["token"] = f"token_id:{int(e.pop('token_id'))}"
                    e.pop("top_logprobs", None)
                    changed = True
        return json.dumps(out, separators=(",", ":")).encode() if changed else body

    def _record(self, session_id: str, prompt: list[int], body: bytes, first: int, last: int) -> None:
        """Record one upstream generate response ``body`` for ``prompt`` (policy versions ``first`` .. ``last``)."""
        choice = json.loads(body)["choices"][0]
        tokens = [int(t) for t in choice["token_ids"]]
        lps = [float(e["logprob"]) for e in choice["logprobs"]["content"]]
        self.sessions.record(session_id, prompt, tokens, lps, first, last)

    @property
    def engine_error(self) -> BaseException | None:
        """No engine here (vLLM serves the route): nothing of ours can die in between."""
        return None

    def pop_session(self, session_id: str) -> SessionRecord | None:
        """The session's record (and forget it), or None if it made no recorded request."""
        return self.sessions.pop(session_id)

    # ---------------------------------------------------------------- HTTP
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        session_id = request.headers.get(SESSION_HEADER)
        record = request.method == "POST" and request.path == "/inference/v1/generate" and session_id
        first = self.version()
        async with self._client.request(request.method, self.upstream + request.path_qs, data=raw or None,
                                        headers=headers) as up:
            body = await up.read()
            status, ctype = up.status, up.headers.get("Content-Type", "application/json")
        if request.path == "/inference/v1/generate" and status == 200:
            try:
                body = self._normalise(body)
            except (ValueError, TypeError, AttributeError) as e:
                log.warning("generate proxy: unreadable upstream generate response (%s): %.200s", e, body)
        if record and status == 200:
            try:
                self._record(session_id, [int(t) for t in json.loads(raw)["token_ids"]], body, first, self.version())
            except (KeyError, IndexError, TypeError, ValueError) as e:
                # the client would refuse this body too; say why here
                log.warning("generate proxy: unreadable upstream generate response (%s): %.200s", e, body)
        return web.Response(status=status, body=body, headers={"Content-Type": ctype})

    async def _open_client(self) -> None:
        # the client session belongs to the server's event loop, so it is made there
        self._client = ClientSession(timeout=ClientTimeout(total=self.request_timeout))

    async def _close_client(self) -> None:
        await self._client.close()

    def start(self) -> "GenerateProxy":
        self._http.start()
        return self

    def stop(self) -> None:
        self._http.stop()


__all__ = ["GenerateProxy"]
