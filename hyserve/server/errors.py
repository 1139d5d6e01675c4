"""The server's error answers: OpenAI's ``{"error": {"message", "type", "param", "code"}}`` body for every refusal
(``error_response``), the exception handlers that make one of each refusal (``add_error_handlers``), and the error
answers the POST routes declare in the OpenAPI schema (``ERROR_RESPONSES``)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from hyserve.server.async_engine import EngineDeadError
from hyserve.server.protocol import APIError, ErrorInfo, ErrorResponse, short_repr

logger = logging.getLogger("hyserve.server")

MAX_ERROR_MESSAGE_CHARS = 2000
# The error answers the POST routes declare in the OpenAPI schema: every one is an ``ErrorResponse``, and a refused
# body is a 400 (the framework's default declaration, a 422 with its own error model, is not what this server
# answers).
# 401 is answered only with an API key set (and then on every /v1/* route: AUTH_RESPONSES).
AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse, "description": "Without the API key (with --api-key)"},
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "The request is refused; error.param names the field"},
    **AUTH_RESPONSES,
    404: {"model": ErrorResponse, "description": "The model is not the one served"},
    408: {"model": ErrorResponse, "description": "The body did not arrive within --request-read-timeout"},
    413: {"model": ErrorResponse, "description": "The body is larger than --max-request-body-bytes"},
    503: {"model": ErrorResponse, "description": "The engine is not running"},
    # Also what keeps the framework from declaring a 422 this server never answers.
    "default": {"model": ErrorResponse, "description": "Any other failure (a 500 is a bug, logged)"},
}


def _printable(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters and made UTF-8-encodable (a lone surrogate becomes ``\\ud800``)."""
    if len(text) > limit:
        text = text[:limit] + f"... ({len(text) - limit} more characters)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(status_code: int, message: str, *, param: str | None = None,
                   type: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    # Messages and params may quote the client: bounded and encodable, whatever the request held.
    body = ErrorResponse(error=ErrorInfo(message=_printable(message, MAX_ERROR_MESSAGE_CHARS),
                                         type=type, param=None if param is None else _printable(param, 200),
                                         code=code))
    return JSONResponse(body.model_dump(), status_code=status_code)


async def send_error(send: Send, status_code: int, message: str, *, code: str | None = None,
                     headers: dict[str, str] | None = None) -> None:
    """An OpenAI-style error answered straight from ASGI middleware."""
    resp = error_response(status_code, message, code=code)
    if headers:
        resp.headers.update(headers)
    await send({"type": "http.response.start", "status": status_code, "headers": resp.raw_headers})
    await send({"type": "http.response.body", "body": resp.body})


def _loc_to_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += f".{p}" if out else str(p)
    return out or None


def _short_repr(x: Any, limit: int = 80) -> str:
    return short_repr(x, limit)


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    if not errors:
        return error_response(400, "invalid request")
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        ctx = first.get("ctx") or {}
        detail = ctx.get("error", first.get("msg", ""))
        return error_response(400, f"the request body is not valid JSON: {detail}")
    param = _loc_to_param(first.get("loc", ()))
    name = param if param is None or len(param) <= 100 else param[:100] + "..."  # as quoted in the message
    if param is None:
        if kind == "missing":
            return error_response(400, "the request needs a JSON object body")
        got = first.get("input")
        if isinstance(got, (bytes, bytearray)):
            return error_response(400, "the request body must be a JSON object sent with Content-Type: "
                                       f"application/json (got {_short_repr(bytes(got))})")
        return error_response(400, f"the request body must be a JSON object (got {_short_repr(got)})")
    if kind == "missing":
        message = f"{name} is required"
    elif kind == "extra_forbidden":
        message = (f"{name} is not supported by this server (got {_short_repr(first.get('input'))}): remove it "
                   "or send null")
    else:
        message = f"{name}: {first.get('msg', 'invalid value')} (got {_short_repr(first.get('input'))})"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return error_response(400, message, param=param)


# ---------------------------------------------------------------------------------------------------- handlers


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status_code, exc.message, param=exc.param, type=exc.type, code=exc.code)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error_response(exc)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    resp = error_response(exc.status_code, str(exc.detail), type=kind)
    if exc.headers:
        resp.headers.update(exc.headers)
    return resp


async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
    return error_response(503, str(exc), type="server_error", code="engine_dead")


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error answering %s %s", request.method, request.url.path)
    return error_response(500, f"internal server error: {type(exc).__name__}: {exc}", type="server_error")


def add_error_handlers(app: FastAPI) -> None:
    """Every refusal as an OpenAI-style error: ``APIError`` (the routes' own), a body the request models refuse
    (400, never the framework's 422), the framework's HTTP errors (404, 405, ...), a dead engine (503), and any
    other exception (500, logged with its traceback)."""
    app.exception_handler(APIError)(_api_error)
    app.exception_handler(RequestValidationError)(_validation_error)
    app.exception_handler(StarletteHTTPException)(_http_error)
    app.exception_handler(EngineDeadError)(_engine_dead)
    app.exception_handler(Exception)(_internal_error)
