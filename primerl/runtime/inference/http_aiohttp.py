"""The engine server's aiohttp front end: an asyncio HTTP server on its own thread.

Requests that need the engine wait on its future without holding a thread, so any number of
generate calls can be in flight (the engine batches them); the stdlib front end spends a thread
per connection instead. Routes and bodies are ``EngineServer.route``'s. A client that disconnects
cancels its handler (``handler_cancellation``), which aborts its request in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading

from aiohttp import web

from .aiohttp_thread import AiohttpThread
from .server_metrics import TextBody

log = logging.getLogger("primerl.inference")


class AiohttpFrontend:
    def __init__(self, server, host: str, port: int):
        self.server = server
        self._http = AiohttpThread(self._handle, host, port, name="http", handler_cancellation=True)
        self.host, self.port = self._http.host, self._http.port

    async def _handle(self, request: web.Request) -> web.Response:
        srv = self.server
        pending = None
        try:
            body = None
            if request.method == "POST":
                raw = await request.read()
                body = json.loads(raw or b"{}")
            out = srv.route(request.method, request.path, body, request.headers)
            if not isinstance(out, tuple):
                pending = out
                result = await asyncio.wait_for(asyncio.wrap_future(out.future), srv.request_timeout)
                out = 200, out.finish(result)
            status, obj = out
        except asyncio.CancelledError:  # the client disconnected (handler_cancellation): stop its generation
            if pending is not None:
                srv.abort(pending)
            raise
        except (ValueError, KeyError, TypeError) as e:
            srv.stats.count("bad_request")
            status, obj = 400, {"error": str(e)}
        except Exception as e:  # noqa: BLE001
            if pending is not None:  # e.g. the request timeout: the engine need not finish it
                srv.abort(pending)
            srv.stats.count("error")
            status, obj = 500, {"error": repr(e)}
        if isinstance(obj, TextBody):
            return web.Response(status=status, body=obj.data, headers={"Content-Type": obj.content_type})
        return web.Response(status=status, body=json.dumps(obj, separators=(",", ":")).encode(),
                            content_type="application/json")

    def start(self) -> threading.Thread:
        return self._http.start()

    def stop(self) -> None:
        self._http.stop()
