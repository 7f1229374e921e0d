"""Ports without races: a port primerl picks stays bound until its listener has it.

Picking a port by binding 0, closing the socket and letting another process bind the number
seconds later is a race: in between, the kernel may hand the same number to anyone (an outgoing
connection of gloo, ZeroMQ or an HTTP client draws its local port from the same ephemeral range;
another job's ``bind(0)``), and the listener fails with ``EADDRINUSE``.

:func:`reserve_port` binds port 0 with ``SO_REUSEADDR`` and keeps the socket bound (never
listening) for as long as the :class:`PortReservation` lives. While it is bound, Linux gives that
port to no ``connect()`` and no ``bind(0)``, and a plain ``bind`` of it fails; the listener it is
meant for binds it with ``SO_REUSEADDR`` (the job's listeners all do: aiohttp / http.server,
torch's ``TCPStore``, ZeroMQ, vllm-router) and listens, since a bound socket that does not listen
is no conflict for a reusable listener. The reservation is published before anyone connects: it
is the port in the listener's command line / config / ``processes.json`` row. So the launcher
reserves the ports of its server pool (servers, router, router metrics) for the job's life, and
tests reserve the ports they pass in a config with :func:`held_port` (held until the test
process exits).

:func:`check_ports_free` is the ``--dry-run`` check of a fixed port from the config (e.g.
``orchestrator.metrics_port``): one ``ConfigError`` naming the key when something listens there.
"""

from __future__ import annotations

import errno
import socket
import threading

__all__ = ["PortReservation", "check_ports_free", "held_port", "port_in_use", "reserve_block", "reserve_port"]


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class PortReservation:
    """Port ``port`` on ``host``, bound (not listening) by this process until :meth:`close`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host = host
        self._sock = socket.socket(_family(host), socket.SOCK_STREAM)
        try:  # a given port: bound exclusively first (fails on any holder, another reservation too), then reusable
            if not port:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        except OSError:
            self._sock.close()
            raise
        self.port: int = self._sock.getsockname()[1]

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "PortReservation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PortReservation({self.host}:{self.port})"


def reserve_port(host: str = "127.0.0.1") -> PortReservation:
    """A free port of ``host``, held (see the module docstring) until the reservation is closed."""
    return PortReservation(host)


def reserve_block(n: int, host: str = "127.0.0.1", low: int = 20000, high: int = 29000, tries: int = 200
                  ) -> list[PortReservation]:
    """``n`` consecutive ports of ``host`` in ``[low, high)`` (below Linux's ephemeral range and the
    config's default ports 29400-29630, which a ``--dry-run`` of a config without overrides checks), each
    reserved like :func:`reserve_port`: for a config that takes a base port and counts up from it
    (``inference.pd.base_port``). Each port is bound without ``SO_REUSEADDR`` first, so one that
    anything holds (a listener, another reservation, a TIME_WAIT) moves the block on."""
    import random

    rng = random.Random()
    for _ in range(tries):
        start, got = rng.randrange(low, high - n), []
        try:
            for p in range(start, start + n):
                got.append(PortReservation(host, p))
            return got
        except OSError:
            for r in got:
                r.close()
    raise OSError(errno.EADDRINUSE, f"no {n} consecutive free ports in [{low}, {high}) on {host}")


_HELD: list[PortReservation] = []
_HELD_LOCK = threading.Lock()


def held_port(host: str = "127.0.0.1") -> int:
    """A free port of ``host`` reserved for the rest of this process's life (tests, one-shot tools)."""
    r = reserve_port(host)
    with _HELD_LOCK:
        _HELD.append(r)
    return r.port


def port_in_use(host: str, port: int) -> bool:
    """True when something listens on ``host:port`` (or holds it without ``SO_REUSEADDR``): a
    listener of ours could not bind it. A reservation or a closed socket's TIME_WAIT is no conflict."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def check_ports_free(ports: list[tuple[str, str, int]]) -> None:
    """``ports``: ``[(config key, host, port)]`` that a process of this job will bind on this
    machine; ``ConfigError`` naming the first key whose port is in use (or cannot be bound here)."""
    from .config import ConfigError

    for key, host, port in ports:
        try:
            busy = port_in_use(host, port)
        except OSError as e:
            raise ConfigError(f"{key}: cannot bind {host}:{port} on this machine ({e}), got {port!r}") from None
        if busy:
            raise ConfigError(f"{key}: port {port} on {host} is in use (another job or a leftover process); choose "
                              f"another port, got {port!r}")
