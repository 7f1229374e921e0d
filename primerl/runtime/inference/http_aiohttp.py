"""The engine server's aiohttp front end: an asyncio HTTP server on its own thread.

Requests that need the engine wait on its future without holding a thread, so any number of
generate calls can be in flight (the engine batches them); the stdlib front end spends a thread
per connection instead. Routes and bodies are ``EngineServer.route``'s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading

from aiohttp import web

log = logging.getLogger("primerl.inference")


class AiohttpFrontend:
    def __init__(self, server, host: str, port: int):
        self.server = server
        # bind now so the port is known (and taken) before start(), as with the stdlib server
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(1024)
        self.host, self.port = self._sock.getsockname()[:2]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._error: BaseException | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        srv = self.server
        try:
            body = None
            if request.method == "POST":
                raw = await request.read()
                body = json.loads(raw or b"{}")
            out = srv.route(request.method, request.path, body, request.headers)
            if not isinstance(out, tuple):
                result = await asyncio.wait_for(asyncio.wrap_future(out.future), srv.request_timeout)
                out = 200, out.finish(result)
            status, obj = out
        except (ValueError, KeyError, TypeError) as e:
            status, obj = 400, {"error": str(e)}
        except Exception as e:  # noqa: BLE001
            status, obj = 500, {"error": repr(e)}
        return web.Response(status=status, body=json.dumps(obj, separators=(",", ":")).encode(), content_type="application/json")

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            app = web.Application(client_max_size=1 << 30)
            app.router.add_route("*", "/{tail:.*}", self._handle)
            self._runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(self._runner.setup())
            loop.run_until_complete(web.SockSite(self._runner, self._sock).start())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

    def start(self) -> threading.Thread:
        th = threading.Thread(target=self._run, name="http", daemon=True)
        th.start()
        self._ready.wait(30)
        if self._error is not None:
            raise RuntimeError(f"the aiohttp server did not start: {self._error!r}") from self._error
        self._thread = th
        return th

    def stop(self) -> None:
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
