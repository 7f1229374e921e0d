"""An aiohttp server with one catch-all route, on its own thread with its own event loop.

Shared by the engine server's aiohttp front end and the vLLM generate proxy. The socket is bound
in the constructor, so the port is known (and taken) before ``start()``.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AiohttpThread:
    """Serve ``handler`` for every method and path on ``host:port`` (0: any free port).

    ``on_start`` / ``on_stop`` are coroutines run on the server's loop before it accepts and after
    it stops (e.g. to open and close a client session that must live on that loop).
    """

    def __init__(self, handler: Handler, host: str, port: int, *, name: str,
                 on_start: Callable[[], Awaitable[None]] | None = None,
                 on_stop: Callable[[], Awaitable[None]] | None = None, handler_cancellation: bool = False):
        self._handler, self._name = handler, name
        self._handler_cancellation = handler_cancellation  # cancel a handler whose client disconnected
        self._on_start, self._on_stop = on_start, on_stop
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(1024)
        self.host, self.port = self._sock.getsockname()[:2]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    async def _setup(self) -> web.AppRunner:
        if self._on_start is not None:
            await self._on_start()
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handler)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=self._handler_cancellation)
        await runner.setup()
        await web.SockSite(runner, self._sock).start()
        return runner

    async def _teardown(self, runner: web.AppRunner) -> None:
        await runner.cleanup()
        if self._on_stop is not None:
            await self._on_stop()

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            runner = loop.run_until_complete(self._setup())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._teardown(runner))
            loop.close()

    def start(self) -> threading.Thread:
        """Start serving; raises if the server did not come up within 30 s."""
        self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise RuntimeError(f"the {self._name} server did not start: {self._error!r}") from self._error
        return self._thread

    def stop(self) -> None:
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


__all__ = ["AiohttpThread"]
