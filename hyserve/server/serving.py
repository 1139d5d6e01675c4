"""Running the app under uvicorn with bounded shutdown and bounded connections (``hyserve serve``).

Shutdown (``GracefulServer``): the first SIGTERM or SIGINT makes uvicorn stop accepting and close idle
connections; requests still running get ``shutdown_timeout_s`` to finish, then ``AsyncEngine.abort_all()`` ends
them all, so every open stream gets a final chunk with ``finish_reason: "abort"`` and ``data: [DONE]`` (a
non-streamed answer: the text so far, same finish reason). A second signal aborts at once instead of cutting the
streams, and a third forces uvicorn out. The engine loop is stopped by the app's lifespan, which checks that every
KV block and state slot came back. The signals are not re-raised after a graceful exit (uvicorn re-raises the ones
its own ``handle_exit`` records, which turns SIGINT into a ``KeyboardInterrupt`` traceback and SIGTERM into exit
status 143; ``GracefulServer.handle_exit`` records none): the process exits 0. Signal handlers only set flags or
post to the event loop (``call_soon_threadsafe``): the code they interrupt may hold the locks that aborting takes.

Connections (``BoundedH11Protocol``, uvicorn's h11 protocol with three additions):

- Read timeout: a request's head (request line and headers) must arrive within ``request_read_timeout_s`` of the
  connection opening or of the previous response, else the connection is closed, so slow-header clients and idle
  connections that never send a request do not pile up (uvicorn's own ``timeout_keep_alive`` only starts after a
  response); the body has the same bound in the app (``BodyLimitMiddleware``).
- Two separate bounds. ``limit_concurrency`` (``--limit-concurrency``) bounds requests in flight: a request that
  arrives while that many are running is answered 503 (an OpenAI-style error) at once, its connection kept alive;
  idle connections do not count, and neither does ``/health`` (``UNLIMITED_PATHS``), which is always answered.
  ``limit_connections`` (``--limit-connections``) bounds open connections: a connection that would exceed it
  closes the connection that has been idle longest (no request in flight: never used, kept alive after a response,
  or still sending a request head), so a flood of idle or slow-header connections cannot lock new clients, the
  health probe included, out; only when every open connection has a request in flight is the new one closed
  instead. Keep ``limit_connections`` above ``limit_concurrency`` (the defaults, 4096 and 1024, are), so that
  requests in flight alone can never hold every connection. ``make_server`` lowers ``limit_connections`` to what
  the process's open-file limit allows (``hyserve serve`` first raises that limit to its hard maximum).
- TCP_NODELAY on every accepted connection, whatever socket it came from (asyncio sets it only on sockets created
  with protocol ``IPPROTO_TCP``): without it, Nagle's algorithm holds a response's last segment back until the
  client's delayed ACK, about 40 ms on every request of a kept-alive connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import OrderedDict
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from hyserve.server.async_engine import AsyncEngine
from hyserve.server.errors import error_response

logger = logging.getLogger("hyserve.server")

DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
DEFAULT_REQUEST_READ_TIMEOUT_S = 30.0
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5
DEFAULT_LIMIT_CONCURRENCY = 1024  # requests in flight
DEFAULT_LIMIT_CONNECTIONS = 4096  # open connections
OPEN_FILES_RESERVE = 128  # file descriptors kept for everything but connections (checkpoint files, pipes, workers)
UNLIMITED_PATHS = frozenset({"/health"})  # answered beyond limit_concurrency: a busy server is a healthy one
DEFAULT_MAX_HEADER_BYTES = 64 * 1024  # h11's bound on an incomplete request head


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    """Turn Nagle's algorithm off on a TCP connection (no-op on other sockets)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):  # the peer may already be gone
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class ConnectionLimits:
    """What the connections of one server share: the two bounds, the open connections, the idle ones oldest
    first, and the number of requests in flight that count against ``max_requests``."""

    def __init__(self, max_connections: int | None, max_requests: int | None) -> None:
        self.max_connections = max_connections
        self.max_requests = max_requests
        self.open: set[BoundedH11Protocol] = set()
        self.idle: OrderedDict[BoundedH11Protocol, None] = OrderedDict()  # oldest idle first
        self.requests = 0
        self.refused_requests = 0  # answered 503 (limit_concurrency)
        self.closed_idle = 0  # idle connections closed for a new one (limit_connections)
        self.refused_connections = 0  # new connections closed: every open one had a request in flight
        self._warned_at = -float("inf")

    def warn(self, message: str) -> None:
        """Log a refusal at most every 10 s (a flood would otherwise flood the log too)."""
        now = time.monotonic()
        if now - self._warned_at >= 10.0:
            self._warned_at = now
            logger.warning("%s (so far: %d requests answered 503, %d idle connections closed, %d new connections "
                           "refused)", message, self.refused_requests, self.closed_idle, self.refused_connections)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head timeout, separate bounds on connections and on requests in
    flight, and TCP_NODELAY (the module docstring says how each works).

    The head timer is armed when the connection opens and after each response; when it fires, the connection is
    closed only if the peer is still before the end of a request head (h11's ``their_state`` is ``IDLE``): a request
    being answered, or whose body is being read, is left alone. ``protocol_class`` gives each server its own
    subclass, with its timeout and its own ``ConnectionLimits``.
    """

    read_timeout_s: float = DEFAULT_REQUEST_READ_TIMEOUT_S
    limits: ConnectionLimits = ConnectionLimits(None, None)
    _head_timer: asyncio.TimerHandle | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's own check counts every open connection, idle ones included, as a request: off; requests in
        # flight are bounded by _bounded_app instead.
        self.limit_concurrency = None
        self._app = self.app
        self.app = self._bounded_app

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        set_nodelay(transport)
        limits = self.limits
        limits.open.add(self)
        if limits.max_connections is not None and len(limits.open) > limits.max_connections:
            oldest = next(iter(limits.idle), None)
            if oldest is None:  # every open connection has a request in flight: this one goes
                limits.refused_connections += 1
                limits.warn(f"{len(limits.open) - 1} open connections, each with a request in flight "
                            f"(--limit-connections {limits.max_connections}): a new connection was closed")
                self._close()
                return
            limits.closed_idle += 1
            logger.debug("at --limit-connections %d: closing the connection idle longest", limits.max_connections)
            oldest._close()
        self._update_idle()
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._update_idle()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update_idle()
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        self._cancel_head_timer()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._forget()  # the connection is handed to another protocol, whose end this one never hears of
        self._cancel_head_timer()
        super().handle_websocket_upgrade(event)

    def _update_idle(self) -> None:
        """Keep ``limits.idle`` (no request in flight on this connection) up to date; a connection that turns idle
        goes last. Bytes of a request head do not move it: a slow-header client stays as old as it was."""
        if self.transport.is_closing():
            self._forget()
        elif self.cycle is None or self.cycle.response_complete:
            if self not in self.limits.idle:
                self.limits.idle[self] = None
        else:
            self.limits.idle.pop(self, None)

    def _forget(self) -> None:
        self.limits.open.discard(self)
        self.limits.idle.pop(self, None)

    def _close(self) -> None:
        self._forget()
        self._cancel_head_timer()
        self.transport.close()

    async def _bounded_app(self, scope: Any, receive: Any, send: Any) -> None:
        limits = self.limits
        if scope["type"] != "http" or limits.max_requests is None or scope["path"] in UNLIMITED_PATHS:
            await self._app(scope, receive, send)
            return
        if limits.requests >= limits.max_requests:
            limits.refused_requests += 1
            message = (f"the server is at --limit-concurrency: {limits.max_requests} requests in flight; "
                       "retry later")
            limits.warn(message)
            await error_response(503, message, type="server_error", code="too_many_requests_in_flight")(
                scope, receive, send)
            return
        limits.requests += 1
        try:
            await self._app(scope, receive, send)
        finally:
            limits.requests -= 1

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        if not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.read_timeout_s, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # still answering a request (h11 went back to IDLE only after its response)
        logger.debug("closing a connection whose request head did not arrive within %.0f s", self.read_timeout_s)
        self._close()


def protocol_class(read_timeout_s: float, limits: ConnectionLimits | None = None) -> type[BoundedH11Protocol]:
    """A ``BoundedH11Protocol`` with this timeout and these limits, shared by the connections of one server
    (uvicorn builds protocols from a class)."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,),
                {"read_timeout_s": float(read_timeout_s), "limits": limits or ConnectionLimits(None, None)})


def raise_open_files_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit (every connection takes one)."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            logger.debug("could not raise the open-files limit from %d to %d: %s", soft, hard, e)


def _fit_open_files(limit_connections: int | None) -> int | None:
    """``limit_connections``, lowered so that the connections fit under the open-files limit: beyond it new
    connections would not be accepted at all, so the oldest idle one could not be closed for them."""
    try:
        import resource
    except ImportError:
        return limit_connections
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return limit_connections
    room = max(16, soft - OPEN_FILES_RESERVE)
    if limit_connections is not None and limit_connections > room:
        logger.warning("--limit-connections %d lowered to %d: this process may open %d files (ulimit -n)",
                       limit_connections, room, soft)
        return room
    return limit_connections


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` with the bounded shutdown described in the module docstring."""

    connection_limits: ConnectionLimits | None = None  # make_server's bounds on connections and requests

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self._aborted = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: only flags and a post to the loop (the interrupted code may hold the engine's locks).
        # Not appended to uvicorn's _captured_signals, so that nothing is re-raised after the graceful exit.
        self._signals += 1
        if self._signals == 1:
            self.should_exit = True
        elif self._signals == 2 and self._loop is not None:
            self._loop.call_soon_threadsafe(self._abort_all, "a second signal")
        else:
            self.should_exit = True
            self.force_exit = True

    def _abort_all(self, why: str) -> None:
        if self._aborted:
            return
        self._aborted = True
        n = self.async_engine.abort_all("the server is shutting down")
        if n:
            logger.info("shutdown: aborted %d open request%s (%s)", n, "" if n == 1 else "s", why)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        n = self.async_engine.num_open_requests()
        if n:
            logger.info("shutdown: %d open request%s %.0f s to finish before being aborted", n,
                        " gets" if n == 1 else "s get", self.shutdown_timeout_s)
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout_s, self._abort_all,
                                                      f"--shutdown-timeout {self.shutdown_timeout_s:g} s passed")
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def make_server(app: Any, async_engine: AsyncEngine, *, host: str = "127.0.0.1", port: int = 8000,
                log_level: str = "info", shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
                request_read_timeout_s: float = DEFAULT_REQUEST_READ_TIMEOUT_S,
                timeout_keep_alive_s: int = DEFAULT_TIMEOUT_KEEP_ALIVE_S,
                limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY,
                limit_connections: int | None = DEFAULT_LIMIT_CONNECTIONS) -> GracefulServer:
    """A ``GracefulServer`` for ``app`` with bounded connections; ``server.run(sockets=...)`` serves it.
    ``limit_concurrency`` bounds requests in flight and ``limit_connections`` open connections (``None``: no
    bound); the module docstring says how."""
    limit_connections = _fit_open_files(limit_connections)
    if limit_connections is not None and (limit_concurrency is None or limit_connections <= limit_concurrency):
        logger.warning("--limit-connections %d is not above --limit-concurrency %s: requests in flight may hold "
                       "every connection, and a new one (a /health probe) is then refused", limit_connections,
                       limit_concurrency or "0 (no limit)")
    limits = ConnectionLimits(limit_connections, limit_concurrency)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, http=protocol_class(request_read_timeout_s, limits),
        # uvicorn's own limit_concurrency is switched off in BoundedH11Protocol (it counts idle connections too);
        # kept in the config as the record of the bound on requests in flight.
        timeout_keep_alive=timeout_keep_alive_s, limit_concurrency=limit_concurrency,
        h11_max_incomplete_event_size=DEFAULT_MAX_HEADER_BYTES,
        # A backstop only: abort_all ends every request at shutdown_timeout_s, so this never fires in practice.
        timeout_graceful_shutdown=int(shutdown_timeout_s) + 10,
    )
    server = GracefulServer(config, async_engine, shutdown_timeout_s)
    server.connection_limits = limits
    return server
