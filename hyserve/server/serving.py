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

Connections (``ReadTimeoutH11Protocol``): a request's head (request line and headers) must arrive within
``request_read_timeout_s`` of the connection opening or of the previous response, else the connection is closed,
so slow-header clients and idle connections that never send a request do not pile up (uvicorn's own
``timeout_keep_alive`` only starts after a response); the body has the same bound in the app
(``BodyLimitMiddleware``). ``limit_concurrency`` makes uvicorn answer 503 beyond that many connections and tasks.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from hyserve.server.async_engine import AsyncEngine

logger = logging.getLogger("hyserve.server")

DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
DEFAULT_REQUEST_READ_TIMEOUT_S = 30.0
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5
DEFAULT_LIMIT_CONCURRENCY = 1024
DEFAULT_MAX_HEADER_BYTES = 64 * 1024  # h11's bound on an incomplete request head


class ReadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request head does not arrive in time.

    The timer is armed when the connection opens and after each response; when it fires, the connection is closed
    only if the peer is still before the end of a request head (h11's ``their_state`` is ``IDLE``): a request being
    answered, or whose body is being read, is left alone.
    """

    read_timeout_s: float = DEFAULT_REQUEST_READ_TIMEOUT_S
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

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
        self.transport.close()


def protocol_class(read_timeout_s: float) -> type[ReadTimeoutH11Protocol]:
    """A ``ReadTimeoutH11Protocol`` with this timeout (uvicorn builds protocols from a class)."""
    return type("ReadTimeoutH11Protocol", (ReadTimeoutH11Protocol,), {"read_timeout_s": float(read_timeout_s)})


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` with the bounded shutdown described in the module docstring."""

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
                limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY) -> GracefulServer:
    """A ``GracefulServer`` for ``app`` with bounded connections; ``server.run(sockets=...)`` serves it."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, http=protocol_class(request_read_timeout_s),
        timeout_keep_alive=timeout_keep_alive_s, limit_concurrency=limit_concurrency,
        h11_max_incomplete_event_size=DEFAULT_MAX_HEADER_BYTES,
        # A backstop only: abort_all ends every request at shutdown_timeout_s, so this never fires in practice.
        timeout_graceful_shutdown=int(shutdown_timeout_s) + 10,
    )
    return GracefulServer(config, async_engine, shutdown_timeout_s)
