"""The OpenAI-compatible HTTP server: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/version`` and ``/metrics``, in front of an ``AsyncEngine``.

Choices worth knowing:

- Bad input is a 4xx with ``{"error": {"message", "type": "invalid_request_error", "param", "code"}}`` naming the
  field: invalid JSON, wrong types or values, a prompt that does not fit ``max_model_len`` (both numbers in the
  message), ``max_tokens`` beyond the room the prompt leaves, malformed messages, sampling values that
  ``SamplingParams`` refuses: 400; an unknown model: 404. A 500 only comes from a genuine bug (logged with its
  traceback); a dead engine loop gives 503.
- A request whose logits turn non-finite ends with ``finish_reason: "error"`` in an ordinary 200 answer (streamed or
  not), and the server logs it: the tokens produced before it are valid and returned, and a streamed answer has
  already sent its 200 when the error happens, so both paths report it the same way. ``hyserve:request_errors``
  counts these requests.
- Streaming (``text/event-stream``): ``data: {json}\\n\\n`` chunks with the engine's DELTA outputs as they come
  (text, token ids and logprobs new since the last chunk), a final chunk with ``finish_reason``, an optional usage
  chunk (``stream_options.include_usage``) and ``data: [DONE]``. The engine's output processor holds back the last
  ``max(len(stop)) - 1`` characters until the request finishes, so a stop string cut from the end is never sent:
  the streamed text equals the non-streamed one.
- A client that disconnects (mid-stream, or while waiting for a non-streamed answer) has its request aborted in the
  engine, which frees its KV blocks and state slot before the next step.
- ``api_key``: every ``/v1/*`` route needs ``Authorization: Bearer <key>`` (compared in constant time), else a 401
  with an OpenAI-style body; ``/health``, ``/version`` and ``/metrics`` stay open (as vLLM's do).
- Bounded work per request, so that one request cannot stall the others: a body over ``max_request_body_bytes`` is
  a 413 (refused from its Content-Length before it is read, or as soon as the bytes read pass the bound; at most
  that many bytes are ever held) and must arrive within ``body_read_timeout_s`` (408); text longer than
  ``4 * max_model_len * (longest token in characters)`` can never fit the context and is refused before it is
  tokenized; tokenizing runs in a worker thread through the tokenizer's GIL-releasing batch call (neither the
  event loop nor the engine thread ever tokenizes text: the engine gets token ids); a chat template renders in a
  worker thread under a deadline (``chat_template_timeout_s``) that the template's own code checks on every line,
  so a runaway loop stops burning CPU when the deadline passes (single huge operations, such as
  ``'x' * 10**10``, are not interrupted: only the checkpoint's template and trusted request templates run).
- Images (``image_url`` content parts in chat messages; ``hyserve.multimodal.chat``): counted against
  ``--limit-mm-per-prompt`` and refused for a text-only checkpoint before any is read, then fetched and decoded in
  a worker thread under ``load_image``'s rules (data URLs; http(s) only on ``--allowed-media-domains`` hosts;
  file:// only under ``--allowed-local-media-path``). Text is tokenized with special tokens recognised, so it can
  spell the image placeholder: a prompt without images that holds one is a 400 (completions too), and the rendered
  prompt of one with images must hold one image placeholder per image, and its length with each image's tokens
  (sized from the image's dimensions, as the processor resizes) is checked against ``max_model_len`` and the room
  for ``max_tokens``. Every refusal is a 400 whose ``param`` names the part
  (``messages[1].content[2]``). The engine processes the pixels when its loop adds the request; should it still
  refuse the request there, the answer is a 400 (streamed: an error event and ``data: [DONE]``).
- A request-supplied ``chat_template`` (or ``chat_template_kwargs.chat_template``) is refused (400) unless the server
  was started with ``trust_request_chat_template`` (vLLM's ``--trust-request-chat-template``).
- The OpenAPI schema declares the refusals as they are answered (400, other 4xx and 503 with the error body, never
  a 422), ``/metrics`` as ``text/plain; version=0.0.4``; the request models' schemas are in ``protocol``.
- Server shutdown (``hyserve.server.serving``) ends every open request through ``AsyncEngine.abort_all()``: a stream
  gets a final chunk with ``finish_reason: "abort"`` and ``data: [DONE]``, a non-streamed answer the text so far with
  the same finish reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager, suppress
from types import FrameType
from typing import Any, TypeVar

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from PIL import Image
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import hyserve
from hyserve.multimodal.chat import ContentPartError, ParsedChat, check_images, image_token_counts, load_images
from hyserve.multimodal.image import ImageProcessorSettings
from hyserve.outputs import RequestOutput, SampleLogprobs
from hyserve.sampling_params import RequestOutputKind, SamplingParams
from hyserve.server.async_engine import AsyncEngine, EngineDeadError, RequestAbortedError
from hyserve.server.metrics import HTTPMetrics, HTTPMetricsMiddleware, render_metrics
from hyserve.server.protocol import (
    APIError,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
    random_id,
    sampling_error_param,
    short_repr,
)
from hyserve.tokenizer import Tokenizer

logger = logging.getLogger("hyserve.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2**20
DEFAULT_BODY_READ_TIMEOUT_S = 30.0
DEFAULT_CHAT_TEMPLATE_TIMEOUT_S = 10.0
MAX_ERROR_MESSAGE_CHARS = 2000
# Unicode normalization (NFC) can merge up to 4 code points into one character, so a text of more than
# 4 * max_model_len * (longest token in characters) characters has more than max_model_len tokens.
_NORMALIZATION_SLACK = 4
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# The error answers the POST routes declare in the OpenAPI schema: every one is an ``ErrorResponse``, and a refused
# body is a 400 (the framework's default declaration, a 422 with its own error model, is not what this server
# answers).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "The request is refused; error.param names the field"},
    "4XX": {"model": ErrorResponse, "description": "401 without the API key, 404 for an unknown model, 408 or 413 "
                                                   "for a body that is too slow or too large"},
    503: {"model": ErrorResponse, "description": "The engine is not running"},
}
_SSE_SCHEMA = {"text/event-stream": {"schema": {"type": "string", "description": "with stream: true, data: "
                                                                        "{chunk JSON} events, then data: [DONE]"}}}
# /metrics is the text exposition format 0.0.4 (hyserve.server.metrics writes it).
METRICS_MEDIA_TYPE = "text/plain; version=0.0.4"
_T = TypeVar("_T")


def served_name_for(model_dir: str) -> str:
    return os.path.basename(os.path.normpath(model_dir)) or model_dir


# ---------------------------------------------------------------------------------------------------- errors


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


async def _send_error(send: Send, status_code: int, message: str, *, code: str | None = None,
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


class MetricsResponse(PlainTextResponse):
    """``/metrics``' answer: ``text/plain; version=0.0.4; charset=utf-8``, also so declared in the OpenAPI schema."""

    media_type = METRICS_MEDIA_TYPE


# ---------------------------------------------------------------------------------------------------- helpers


def _usage(out: RequestOutput, n_out: int | None = None) -> UsageInfo:
    """Token counts of a finished request; a stream of DELTA outputs passes the ``n_out`` it counted."""
    n_prompt = len(out.prompt_token_ids)
    n_out = len(out.outputs[0].token_ids) if n_out is None else n_out
    return UsageInfo(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens or 0))


def _finish_reason(out: RequestOutput) -> str | None:
    reason = out.outputs[0].finish_reason
    if reason == "error":
        logger.error("request %s finished with an error (non-finite logits) after %d tokens; answering "
                     "finish_reason='error'", out.request_id, len(out.outputs[0].token_ids))
    return reason


def _token_str(tid: int, decoded: str | None, as_ids: bool) -> str:
    """A logprob token: its text, or ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``, or no tokenizer)."""
    return decoded if decoded is not None and not as_ids else f"token_id:{tid}"


def _ranked(entry: dict[int, Any], as_ids: bool) -> list[tuple[int, float, str]]:
    items = [(tid, lp.logprob, _token_str(tid, lp.decoded_token, as_ids)) for tid, lp in entry.items()]
    items.sort(key=lambda x: -x[1])
    return items


def completion_logprobs(token_ids: list[int], logprobs: SampleLogprobs | None, text_offset: int,
                        as_ids: bool = False) -> tuple[CompletionLogprobs | None, int]:
    """Legacy completions logprobs of ``token_ids`` (a whole completion or one delta) and the text offset after them.

    ``top_logprobs[i]`` holds the requested top-N and the sampled token (as vLLM returns them).
    """
    if logprobs is None:
        return None, text_offset
    res = CompletionLogprobs()
    for tid, entry in zip(token_ids, logprobs, strict=False):
        own = entry.get(tid)
        token = _token_str(tid, own.decoded_token if own is not None else None, as_ids)
        res.tokens.append(token)
        res.token_logprobs.append(own.logprob if own is not None else None)
        res.top_logprobs.append({tok: lp for _, lp, tok in _ranked(entry, as_ids)})
        res.text_offset.append(text_offset)
        text_offset += len(token)
    return res, text_offset


def chat_logprobs(token_ids: list[int], logprobs: SampleLogprobs | None, top_n: int,
                  as_ids: bool = False) -> ChatLogprobs | None:
    """Chat logprobs of ``token_ids`` (a whole completion or one delta)."""
    if logprobs is None:
        return None
    content: list[ChatLogprobToken] = []
    for tid, entry in zip(token_ids, logprobs, strict=False):
        own = entry.get(tid)
        token = _token_str(tid, own.decoded_token if own is not None else None, as_ids)
        tops = [TopLogprob(token=tok, logprob=lp, bytes=list(tok.encode("utf-8")))
                for _, lp, tok in _ranked(entry, as_ids)[:top_n]]
        content.append(ChatLogprobToken(token=token, logprob=own.logprob if own is not None else float("-inf"),
                                        bytes=list(token.encode("utf-8")), top_logprobs=tops))
    return ChatLogprobs(content=content)


def stream_kind(params: SamplingParams, stream: bool | None) -> SamplingParams:
    """A streamed response reads DELTA outputs (sent as they come); a whole one the cumulative final output."""
    return dataclasses.replace(params, output_kind=RequestOutputKind.DELTA) if stream else params


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _final_output(outputs: AsyncGenerator[RequestOutput, None], request: Request) -> RequestOutput | None:
    """The finished output, or None if the client disconnected first (then the request is aborted)."""

    async def consume() -> RequestOutput | None:
        last = None
        async with aclosing(outputs):
            async for out in outputs:
                last = out
        return last

    task = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        logger.info("client disconnected: aborting its request")
        return None
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
                with suppress(asyncio.CancelledError, Exception):
                    await t


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def _sse_error(e: BaseException) -> str:
    """An error event for a stream whose 200 is already sent; a ValueError is a request the engine refused (400)."""
    if isinstance(e, ValueError):
        body = ErrorResponse(error=ErrorInfo(message=f"the request was refused: {e}", type="invalid_request_error",
                                             code="400"))
        return _sse(body.model_dump_json())
    status = 503 if isinstance(e, EngineDeadError) else 500
    body = ErrorResponse(error=ErrorInfo(message=str(e), type="server_error", code=str(status)))
    return _sse(body.model_dump_json())


# ---------------------------------------------------------------------------------------------------- bounded work


class TemplateTimeoutError(Exception):
    """A chat template ran past its deadline (its rendering was stopped)."""


def run_with_deadline(fn: Callable[[], _T], timeout_s: float) -> _T:
    """Run ``fn()`` in this thread; Jinja template code it runs raises ``TemplateTimeoutError`` past the deadline.

    A trace function (this thread only) checks the deadline on every call, and on every line of compiled template
    code (Jinja compiles templates to Python with the file name ``<template>``), so a template looping for minutes
    stops within one line's work of the deadline instead of burning CPU after its client gave up. Other frames are
    not line-traced, which keeps the cost to one check per Python call.
    """
    deadline = time.monotonic() + timeout_s

    def check() -> None:
        if time.monotonic() > deadline:
            raise TemplateTimeoutError(f"the chat template took longer than {timeout_s:g} s to render")

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        check()
        return local

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        check()
        return local if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return fn()
    finally:
        sys.settrace(previous)


def encode_text(tok: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of ``text``, through the batch call: the tokenizers library releases the GIL there (not in its
    single ``encode``), so tokenizing a long prompt in a worker thread does not stall the event loop."""
    enc = tok.hf_tokenizer.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
    return list(enc[0].ids)


def max_text_chars(tok: Tokenizer | None, max_model_len: int) -> int | None:
    """The most characters a text can have and still fit ``max_model_len`` tokens (None without a tokenizer)."""
    if tok is None:
        return None
    vocab = tok.hf_tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
    longest = max((len(t) for t in vocab), default=1)
    return _NORMALIZATION_SLACK * max_model_len * max(longest, 1)


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
                await _send_error(send, 401, "invalid or missing API key: send Authorization: Bearer <key>",
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
            await _send_error(send, 413, f"the request body is larger than this server accepts "
                                         f"({self.max_bytes} bytes; --max-request-body-bytes)", code="body_too_large")
            return
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                await _send_error(send, 408, f"the request body did not arrive within {self.timeout_s:g} s",
                                  code="request_timeout")
                return
            if message["type"] == "http.disconnect":
                return  # the client left before its request was complete: nothing to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await _send_error(send, 413, f"the request body is larger than this server accepts "
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


# ---------------------------------------------------------------------------------------------------- app


def build_app(async_engine: AsyncEngine, served_model_name: str | None = None, *,
              shutdown_engine_on_exit: bool = True, api_key: str | None = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S,
              trust_request_chat_template: bool = False,
              chat_template_timeout_s: float = DEFAULT_CHAT_TEMPLATE_TIMEOUT_S) -> FastAPI:
    """The FastAPI app serving ``async_engine`` (started on app startup if it is not yet); see the module docstring
    for ``api_key``, the bounds and ``trust_request_chat_template``."""
    engine = async_engine.engine
    model_dir = str(engine.config.model)
    model_name = served_model_name or served_name_for(model_dir)
    http_metrics = HTTPMetrics()
    text_limit = max_text_chars(engine.tokenizer, engine.max_model_len)
    # Image input: None when the checkpoint has no vision tower (or --limit-mm-per-prompt image=0 turned it off).
    mm_config = engine.model_config.multimodal
    image_settings: ImageProcessorSettings | None = None
    if mm_config is not None:
        try:
            image_settings = ImageProcessorSettings.from_checkpoint(model_dir)
        except (ValueError, OSError) as e:
            logger.warning("image requests cannot be sized before they are queued: %s", e)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        logger.info("serving %s as %r (max_model_len %d)", model_dir, model_name, engine.max_model_len)
        try:
            yield
        finally:
            if shutdown_engine_on_exit:
                await asyncio.to_thread(_shutdown_engine, async_engine)

    app = FastAPI(title="hyserve", version=hyserve.__version__, lifespan=lifespan)
    app.state.engine = async_engine
    app.state.served_model_name = model_name
    app.state.http_metrics = http_metrics

    # -------------------------------------------------------------- error handlers

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status_code, exc.message, param=exc.param, type=exc.type, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        resp = error_response(exc.status_code, str(exc.detail), type=kind)
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), type="server_error", code="engine_dead")

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error answering %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}", type="server_error")

    # -------------------------------------------------------------- shared steps

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(f"the model {short_repr(name)} does not exist; this server serves {model_name!r}",
                           param="model", status_code=404, code="model_not_found")

    def check_text_length(text: str, param: str) -> None:
        if text_limit is not None and len(text) > text_limit:
            raise APIError(f"{param} has {len(text)} characters: more than any text of max_model_len="
                           f"{engine.max_model_len} tokens can have ({text_limit})", param=param)

    async def encode(prompt: str | list[int], param: str, add_special_tokens: bool = True
                     ) -> tuple[str | None, list[int]]:
        """Tokenize (a worker thread; see ``encode_text``) and check a prompt; refusals name ``param``."""
        tok = engine.tokenizer
        item: dict[str, Any]
        if isinstance(prompt, str) and tok is not None:
            check_text_length(prompt, param)
            ids = await asyncio.to_thread(encode_text, tok, prompt, add_special_tokens)
            item = {"prompt_token_ids": ids, "prompt": prompt}
        elif isinstance(prompt, str):
            item = {"prompt": prompt}  # refused below: no tokenizer
        else:
            if len(prompt) >= engine.max_model_len:  # before the per-id checks walk a huge list
                raise APIError(f"the prompt has {len(prompt)} tokens, but max_model_len is {engine.max_model_len} "
                               "(the prompt must leave room for at least one output token)", param=param)
            item = {"prompt_token_ids": prompt}
        try:
            return async_engine.encode_prompt(item)  # ids only: O(n) checks, no tokenizing
        except ValueError as e:
            raise APIError(str(e), param=param) from e

    def resolve_max_tokens(asked: int | None, name: str, n_prompt: int, default: int | None) -> int | None:
        """The request's max_tokens (checked against the room the prompt leaves), else the checkpoint's default
        (generation_config.json's max_new_tokens), else ``default``; defaults are capped by the room."""
        room = engine.max_model_len - n_prompt
        if asked is None:
            configured = sampling_defaults().get("max_tokens")
            if configured is not None:
                default = int(configured)
            return None if default is None else min(default, room)
        if asked > room:
            raise APIError(f"{name}={asked} is too large: the prompt has {n_prompt} tokens and max_model_len is "
                           f"{engine.max_model_len}, which leaves room for at most {room} output tokens",
                           param=name)
        return asked

    def check_alive() -> None:
        if not async_engine.is_alive():
            err = async_engine.dead_error
            raise EngineDeadError("the engine loop is not running" + (f": {err!r}" if err else ""))

    def sampling_defaults() -> dict[str, Any]:
        return dict(getattr(engine, "default_sampling_params", None) or {})

    def open_request(request_id: str, prompt: dict[str, Any], params: SamplingParams,
                     names: dict[str, str] | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Queue the request now: what the engine refuses is a 400 before any response starts."""
        check_alive()
        try:
            return async_engine.open(request_id, prompt, params)
        except ValueError as e:
            raise APIError(str(e), param=sampling_error_param(str(e), names)) from e

    async def render_chat(body: ChatCompletionRequest, messages: list[dict[str, Any]]) -> str:
        tok = engine.tokenizer
        if tok is None:
            raise APIError("this checkpoint has no tokenizer, so chat completions are not available; use "
                           "/v1/completions with token ids", param="messages")
        template_kwargs = dict(body.chat_template_kwargs or {})
        for reserved in ("messages", "conversation", "add_generation_prompt", "tokenize", "tools", "chat_template"):
            if reserved in template_kwargs:
                hint = f"; use the request's {reserved} field" if reserved in ("tools", "chat_template") else ""
                raise APIError(f"chat_template_kwargs must not set {reserved!r}{hint}", param="chat_template_kwargs")
        if body.chat_template is not None:
            if not trust_request_chat_template:
                raise APIError("a request-supplied chat_template is refused: this server runs only its checkpoint's "
                               "template unless started with --trust-request-chat-template", param="chat_template")
            template_kwargs["chat_template"] = body.chat_template
        tools = body.template_tools()
        if tools is not None:
            template_kwargs["tools"] = tools

        def render() -> str:
            return run_with_deadline(lambda: tok.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt, **template_kwargs),
                chat_template_timeout_s)

        try:
            text = await asyncio.to_thread(render)
        except TemplateTimeoutError as e:
            raise APIError(f"{e}; its rendering was stopped", param="chat_template"
                           if body.chat_template is not None else "messages") from e
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
            raise APIError(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                           param="messages") from e
        if not isinstance(text, str):
            raise APIError("the chat template did not render to text", param="messages")
        return text

    # -------------------------------------------------------------- endpoints

    @app.post("/v1/completions", response_model=None, responses={
        200: {"model": CompletionResponse, "content": _SSE_SCHEMA}, **ERROR_RESPONSES})
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        check_model(body.model)
        prompt = body.parse_prompt()
        body.check()
        text, ids = await encode(prompt, "prompt")
        check_no_placeholders(ids, "prompt")
        max_tokens = resolve_max_tokens(body.max_tokens, "max_tokens", len(ids), DEFAULT_COMPLETION_MAX_TOKENS)
        params = stream_kind(body.to_sampling_params(max_tokens, sampling_defaults()), body.stream)
        request_id = random_id("cmpl")
        engine_prompt: dict[str, Any] = {"prompt_token_ids": ids, "prompt": text}
        outputs = open_request(request_id, engine_prompt, params)
        if body.stream:
            return StreamingResponse(_stream_completion(outputs, request_id, params, body),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        try:
            final = await _final_output(outputs, raw_request)
        except ValueError as e:  # refused by the engine when its loop added the request
            raise APIError(f"the request was refused: {e}", param="prompt") from e
        if final is None:
            return Response(status_code=499)
        c = final.outputs[0]
        logprobs, _ = completion_logprobs(c.token_ids, c.logprobs, 0, body.return_tokens_as_token_ids)
        choice = CompletionChoice(text=c.text, logprobs=logprobs, finish_reason=_finish_reason(final),
                                  stop_reason=c.stop_reason)
        if body.return_token_ids:
            choice.token_ids = list(c.token_ids)
            choice.prompt_token_ids = list(final.prompt_token_ids)
        resp = CompletionResponse(id=request_id, model=model_name, choices=[choice], usage=_usage(final))
        return JSONResponse(resp.model_dump())

    async def _stream_completion(outputs: AsyncGenerator[RequestOutput, None], request_id: str, params: SamplingParams,
                                 body: CompletionRequest) -> AsyncIterator[str]:
        created = CompletionResponse(id=request_id, model=model_name, choices=[]).created
        include_usage = body.include_usage
        exclude = None if include_usage else {"usage"}
        first = True
        n_sent, offset = 0, 0
        final: RequestOutput | None = None
        try:
            async with aclosing(outputs):  # closed (the request aborted) even if this generator is dropped early
                async for out in outputs:  # DELTA outputs: only what is new (stop-string holdback included)
                    c = out.outputs[0]
                    delta, new_ids = c.text, c.token_ids
                    logprobs, offset = completion_logprobs(new_ids, c.logprobs, offset,
                                                           body.return_tokens_as_token_ids)
                    n_sent += len(new_ids)
                    reason = _finish_reason(out) if out.finished else None
                    if delta or out.finished or (new_ids and (logprobs is not None or body.return_token_ids)):
                        choice = CompletionChoice(text=delta, logprobs=logprobs, finish_reason=reason,
                                                  stop_reason=c.stop_reason if out.finished else None)
                        if body.return_token_ids:
                            choice.token_ids = list(new_ids)
                            if first:
                                choice.prompt_token_ids = list(out.prompt_token_ids)
                        first = False
                        chunk = CompletionChunk(id=request_id, created=created, model=model_name, choices=[choice])
                        yield _sse(chunk.model_dump_json(exclude=exclude))
                    if out.finished:
                        final = out
            if include_usage and final is not None:
                chunk = CompletionChunk(id=request_id, created=created, model=model_name, choices=[],
                                        usage=_usage(final, n_sent))
                yield _sse(chunk.model_dump_json())
        except (EngineDeadError, RequestAbortedError, ValueError) as e:  # ValueError: the engine refused it
            logger.warning("request %s: %s", request_id, e)
            yield _sse_error(e)
        yield _sse("[DONE]")

    def check_no_placeholders(ids: list[int], param: str) -> None:
        """A prompt without images may not hold the image placeholder token: text can spell it (it is a special
        token, and text is tokenized with special tokens recognised), and the engine would take it for an image
        slot with no image. Refused here, before any response starts; the engine refuses it too."""
        if mm_config is None or mm_config.image_token_id not in ids:
            return
        raise APIError(f"{param} holds {ids.count(mm_config.image_token_id)} image placeholder tokens (id "
                       f"{mm_config.image_token_id}, <|image_pad|>) but no image: text may not contain the image "
                       "placeholder; send images as image_url parts of a chat message", param=param)

    def check_chat_images(parsed: ParsedChat) -> None:
        """Refuse images for a text-only model and over ``--limit-mm-per-prompt``, before any is read."""
        try:
            check_images(parsed.images, limit=engine.config.image_limit, accepts_images=mm_config is not None)
        except ContentPartError as e:
            raise APIError(str(e), param=e.param) from e

    async def load_chat_images(parsed: ParsedChat) -> list[Image.Image]:
        """Fetch and decode the (already counted) images in a worker thread; a refusal names the part."""
        if not parsed.images:
            return []
        try:
            return await asyncio.to_thread(load_images, parsed.images,
                                           allowed_domains=engine.config.allowed_media_domains,
                                           allowed_local_path=engine.config.allowed_local_media_path)
        except ContentPartError as e:
            raise APIError(str(e), param=e.param) from e

    def expanded_length(ids: list[int], parsed: ParsedChat, images: list[Image.Image]) -> int:
        """The prompt's length once each image placeholder is widened to its image's tokens (as the engine will);
        refuses a rendering whose placeholders do not match the images."""
        assert mm_config is not None
        placeholders = ids.count(mm_config.image_token_id)
        if placeholders != len(images):
            raise APIError(f"the chat template rendered {placeholders} image placeholders for {len(images)} images "
                           "(one <|vision_start|><|image_pad|><|vision_end|> per image is needed; text may not "
                           "contain <|image_pad|>)", param="messages")
        if image_settings is None:
            return len(ids)  # no preprocessor_config.json: the engine refuses the images when it adds the request
        try:
            counts = image_token_counts(images, parsed.images, image_settings)
        except ContentPartError as e:
            raise APIError(str(e), param=e.param) from e
        n = len(ids) - len(images) + sum(counts)
        if n >= engine.max_model_len:
            raise APIError(f"the prompt has {n} tokens ({sum(counts)} of them for {len(images)} images), but "
                           f"max_model_len is {engine.max_model_len} (the prompt must leave room for at least one "
                           "output token)", param="messages")
        return n

    @app.post("/v1/chat/completions", response_model=None, responses={
        200: {"model": ChatCompletionResponse, "content": _SSE_SCHEMA}, **ERROR_RESPONSES})
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        check_model(body.model)
        parsed = body.parse_chat()
        body.check()
        check_chat_images(parsed)
        text = await render_chat(body, parsed.messages)
        _, ids = await encode(text, "messages", add_special_tokens=False)
        if not parsed.images:
            check_no_placeholders(ids, "messages")  # with images: expanded_length counts them once they are loaded
        images = await load_chat_images(parsed)  # after the cheap refusals: a refused request fetches nothing
        engine_prompt: dict[str, Any] = {"prompt_token_ids": ids, "prompt": text}
        n_prompt = len(ids)
        if images:
            n_prompt = expanded_length(ids, parsed, images)
            try:  # the pixel work in a worker thread, not on the engine's
                ids, inputs = await asyncio.to_thread(engine.prepare_images, ids, images)
            except ValueError as e:
                raise APIError(str(e), param="messages") from e
            engine_prompt = {"prompt_token_ids": ids, "prompt": text, "multi_modal_inputs": inputs}
            n_prompt = len(ids)
        asked, name = body.requested_max_tokens
        max_tokens = resolve_max_tokens(asked, name, n_prompt, None)
        params = stream_kind(body.to_sampling_params(max_tokens, sampling_defaults()), body.stream)
        request_id = random_id("chatcmpl")
        top_n = body.top_logprobs or 0
        outputs = open_request(request_id, engine_prompt, params, {"max_tokens": name, "logprobs": "top_logprobs"})
        if body.stream:
            return StreamingResponse(_stream_chat(outputs, request_id, params, body, top_n),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        try:
            final = await _final_output(outputs, raw_request)
        except ValueError as e:  # refused by the engine when its loop added the request (an image it cannot use)
            raise APIError(f"the request was refused: {e}", param="messages") from e
        if final is None:
            return Response(status_code=499)
        c = final.outputs[0]
        choice = ChatChoice(message=ChatMessage(role="assistant", content=c.text),
                            logprobs=chat_logprobs(c.token_ids, c.logprobs, top_n, body.return_tokens_as_token_ids),
                            finish_reason=_finish_reason(final), stop_reason=c.stop_reason)
        resp = ChatCompletionResponse(id=request_id, model=model_name, choices=[choice], usage=_usage(final))
        if body.return_token_ids:
            choice.token_ids = list(c.token_ids)
            resp.prompt_token_ids = list(final.prompt_token_ids)
        return JSONResponse(resp.model_dump())

    async def _stream_chat(outputs: AsyncGenerator[RequestOutput, None], request_id: str, params: SamplingParams,
                           body: ChatCompletionRequest, top_n: int) -> AsyncIterator[str]:
        created = ChatCompletionResponse(id=request_id, model=model_name, choices=[]).created
        include_usage = body.include_usage
        exclude = None if include_usage else {"usage"}

        def chunk(choices: list[ChatStreamChoice], prompt_token_ids: list[int] | None = None) -> str:
            msg = ChatCompletionChunk(id=request_id, created=created, model=model_name, choices=choices,
                                      prompt_token_ids=prompt_token_ids)
            return _sse(msg.model_dump_json(exclude=exclude))

        n_sent = 0
        first = True
        final: RequestOutput | None = None
        try:
            yield chunk([ChatStreamChoice(delta=DeltaMessage(role="assistant", content=""))])
            async with aclosing(outputs):  # closed (the request aborted) even if this generator is dropped early
                async for out in outputs:  # DELTA outputs: only what is new (stop-string holdback included)
                    c = out.outputs[0]
                    delta, new_ids = c.text, c.token_ids
                    logprobs = chat_logprobs(new_ids, c.logprobs, top_n, body.return_tokens_as_token_ids)
                    n_sent += len(new_ids)
                    if delta or (new_ids and (logprobs is not None or body.return_token_ids)):
                        choice = ChatStreamChoice(delta=DeltaMessage(content=delta), logprobs=logprobs)
                        if body.return_token_ids:
                            choice.token_ids = list(new_ids)
                        prompt_ids = list(out.prompt_token_ids) if body.return_token_ids and first else None
                        first = False
                        yield chunk([choice], prompt_ids)
                    if out.finished:
                        final = out
                        yield chunk([ChatStreamChoice(delta=DeltaMessage(), finish_reason=_finish_reason(out),
                                                      stop_reason=c.stop_reason)])
            if include_usage and final is not None:
                msg = ChatCompletionChunk(id=request_id, created=created, model=model_name, choices=[],
                                          usage=_usage(final, n_sent))
                yield _sse(msg.model_dump_json())
        except (EngineDeadError, RequestAbortedError, ValueError) as e:  # ValueError: the engine refused it
            logger.warning("request %s: %s", request_id, e)
            yield _sse_error(e)
        yield _sse("[DONE]")

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        # root is the served name, as vLLM's: the checkpoint's path on this machine is not the client's business.
        return ModelList(data=[ModelCard(id=model_name, root=model_name, max_model_len=engine.max_model_len)])

    @app.get("/health", response_model=None)
    async def health() -> Response:
        if async_engine.is_alive():
            return JSONResponse({"status": "ok"})
        err = async_engine.dead_error
        return error_response(503, "the engine loop is not running" + (f": {err!r}" if err else ""),
                              type="server_error", code="engine_dead")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": hyserve.__version__}

    @app.get("/metrics", response_model=None, response_class=MetricsResponse)
    def metrics() -> Response:  # sync: FastAPI runs it in a worker thread, so waiting for a step blocks no one
        return MetricsResponse(render_metrics(async_engine.get_metrics(), http_metrics))

    known_paths = frozenset(getattr(r, "path", "") for r in app.routes)
    # Starlette runs the last added outermost: metrics see every answer (401s and 413s included), the key is
    # checked before any body byte is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes, timeout_s=body_read_timeout_s)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(HTTPMetricsMiddleware, metrics=http_metrics, known_paths=known_paths)
    return app


def _shutdown_engine(async_engine: AsyncEngine) -> None:
    """Stop the loop thread and say whether every KV block and state slot came back."""
    open_requests = async_engine.num_open_requests()
    async_engine.shutdown()
    if async_engine.dead_error is not None:  # its requests were failed; the workers may be gone: nothing to check
        logger.info("engine stopped after its loop failed (its open requests were failed); no leak check")
        return
    try:
        async_engine.assert_no_leaks()
    except AssertionError as e:
        logger.error("after shutdown: %s", e)
    else:
        logger.info("engine stopped (%d requests were still open); every KV block and state slot is back in its "
                    "pool", open_requests)
