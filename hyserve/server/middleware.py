"""The ASGI middleware in front of the routes: the API key of ``/v1/*`` (``APIKeyMiddleware``) and the bounded read
of a request body (``BodyLimitMiddleware``). Both answer their refusals themselves, as OpenAI-style errors."""

from __future__ import annotations

import asyncio
import hmac
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hyserve.server.errors import send_error


class APIKeyMiddleware:
    """``/v1/*`` needs ``Authorization: Bearer <key>``; the key is compared in constant time (``hmac``)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path == "/v1" or path.startswith("/v1/"):
            given = b""
            for name, value in scope.get("headers", []):
                if name.lower() == b"authorization":
                    given = value
                    break
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                await send_error(send, 401, "invalid or missing API key: send Authorization: Bearer <key>",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads a request body up to ``max_bytes`` within ``timeout_s`` and replays it to the app.

    Invariants: at most ``max_bytes`` body bytes are ever read (twice that held while they are joined); a declared
    Content-Length over the bound is refused before anything is read; a body that passes the bound is a 413, one
    that does not arrive in time a 408; the app sees the same messages as without this middleware, and after the
    body the real ``receive`` (so that disconnects are still seen).
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = None
        for name, value in scope.get("headers", []):
            if name.lower() == b"content-length":
                declared = value
        if declared is not None and (not declared.strip().isdigit() or int(declared) > self.max_bytes):
            await send_error(send, 413, f"the request body is larger than this server accepts "
                                        f"({self.max_bytes} bytes; --max-request-body-bytes)", code="body_too_large")
            return
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                await send_error(send, 408, f"the request body did not arrive within {self.timeout_s:g} s",
                                 code="request_timeout")
                return
            if message["type"] == "http.disconnect":
                return  # the client left before its request was complete: nothing to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await send_error(send, 413, f"the request body is larger than this server accepts "
                                            f"({self.max_bytes} bytes; --max-request-body-bytes)",
                                 code="body_too_large")
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
