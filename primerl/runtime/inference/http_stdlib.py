"""The engine server's standard-library front end (``http="stdlib"``, no dependency): a
``ThreadingHTTPServer``, one thread per connection. Routes and bodies are the server's ``route``
(``http_routes.RouteTable``); a handler waiting on the engine watches its socket and aborts the
request when the client closes it first.

The front end talks to its server through four members: ``route(method, path, body, headers)``,
``abort(pending)``, ``stats`` and ``request_timeout`` (the same as ``http_aiohttp``'s).
"""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
from concurrent.futures import wait
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .engine_thread import Pending
from .server_metrics import TextBody

log = logging.getLogger("primerl.inference")


def _handler(server) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):  # quiet
            log.debug(fmt, *args)

        def _send(self, code: int, obj) -> None:
            if isinstance(obj, TextBody):
                body, ctype = obj.data, obj.content_type
            else:  # compact, as vLLM's: the renderers client splices routed_experts.data out by its prefix
                body, ctype = json.dumps(obj, separators=(",", ":")).encode(), "application/json"
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _serve(self, method: str) -> None:
            try:
                body = None
                if method == "POST":
                    n = int(self.headers.get("Content-Length", 0))
                    body = json.loads(self.rfile.read(n) or b"{}")
                out = server.route(method, self.path, body, self.headers)
                if isinstance(out, Pending):
                    if not self._wait(out):
                        return
                    out = 200, out.finish(out.future.result(0))
                self._send(*out)
            except (ValueError, KeyError, TypeError) as e:
                server.stats.count("bad_request")
                self._send(400, {"error": str(e)})
            except Exception as e:  # noqa: BLE001
                server.stats.count("error")
                self._send(500, {"error": repr(e)})

        def _wait(self, p: Pending) -> bool:
            """Wait for the engine, watching the socket: False (request aborted) if the client
            closed it first. Raises TimeoutError after the server's request timeout."""
            deadline = time.monotonic() + server.request_timeout
            while not wait([p.future], timeout=0.05).done:  # answers as soon as the engine does
                if time.monotonic() > deadline:
                    server.abort(p)
                    raise TimeoutError(f"no result within {server.request_timeout} s")
                readable, _, _ = select.select([self.connection], [], [], 0)
                if readable and not self.connection.recv(1, socket.MSG_PEEK):
                    server.abort(p)
                    self.close_connection = True
                    return False
            return True

        def do_GET(self):
            self._serve("GET")

        def do_POST(self):
            self._serve("POST")

    return Handler


class StdlibFrontend:
    """Binds ``host:port`` (0: any free port) in the constructor; ``start()`` serves on a thread."""

    def __init__(self, server, host: str, port: int):
        self.httpd = ThreadingHTTPServer((host, port), _handler(server))
        self.httpd.daemon_threads = True
        self.host, self.port = self.httpd.server_address[:2]

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


__all__ = ["StdlibFrontend"]
