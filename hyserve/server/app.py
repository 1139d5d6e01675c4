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
- Streaming (``text/event-stream``): ``data: {json}\\n\\n`` chunks with text deltas computed from the engine's
  cumulative text, a final chunk with ``finish_reason``, an optional usage chunk (``stream_options.include_usage``)
  and ``data: [DONE]``. With stop strings, the last ``max(len(stop)) - 1`` characters are held back until the
  request finishes, so a stop string cut from the end is never sent: the streamed text equals the non-streamed one.
- A client that disconnects (mid-stream, or while waiting for a non-streamed answer) has its request aborted in the
  engine, which frees its KV blocks and state slot before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager, suppress
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import hyserve
from hyserve.outputs import RequestOutput, SampleLogprobs
from hyserve.sampling_params import SamplingParams
from hyserve.server.async_engine import AsyncEngine, EngineDeadError, RequestAbortedError
from hyserve.server.metrics import CONTENT_TYPE_LATEST, HTTPMetrics, HTTPMetricsMiddleware, render_metrics
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
)

logger = logging.getLogger("hyserve.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def served_name_for(model_dir: str) -> str:
    return os.path.basename(os.path.normpath(model_dir)) or model_dir


# ---------------------------------------------------------------------------------------------------- errors


def error_response(status_code: int, message: str, *, param: str | None = None,
                   type: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status_code)


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
    r = repr(x)
    return r if len(r) <= limit else r[: limit - 3] + "..."


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
    if param is None:
        if kind == "missing":
            return error_response(400, "the request needs a JSON object body")
        got = first.get("input")
        if isinstance(got, (bytes, bytearray)):
            return error_response(400, "the request body must be a JSON object sent with Content-Type: "
                                       f"application/json (got {_short_repr(bytes(got))})")
        return error_response(400, f"the request body must be a JSON object (got {_short_repr(got)})")
    if kind == "missing":
        message = f"{param} is required"
    else:
        message = f"{param}: {first.get('msg', 'invalid value')} (got {_short_repr(first.get('input'))})"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return error_response(400, message, param=param)


# ---------------------------------------------------------------------------------------------------- helpers


def _usage(out: RequestOutput) -> UsageInfo:
    n_prompt = len(out.prompt_token_ids)
    n_out = len(out.outputs[0].token_ids)
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


def completion_logprobs(token_ids: list[int], logprobs: SampleLogprobs | None, start: int, text_offset: int,
                        as_ids: bool = False) -> tuple[CompletionLogprobs | None, int]:
    """Legacy completions logprobs for positions ``start:`` and the text offset after them.

    ``top_logprobs[i]`` holds the requested top-N and the sampled token (as vLLM returns them).
    """
    if logprobs is None:
        return None, text_offset
    res = CompletionLogprobs()
    for i in range(start, min(len(token_ids), len(logprobs))):
        tid, entry = token_ids[i], logprobs[i]
        own = entry.get(tid)
        token = _token_str(tid, own.decoded_token if own is not None else None, as_ids)
        res.tokens.append(token)
        res.token_logprobs.append(own.logprob if own is not None else None)
        res.top_logprobs.append({tok: lp for _, lp, tok in _ranked(entry, as_ids)})
        res.text_offset.append(text_offset)
        text_offset += len(token)
    return res, text_offset


def chat_logprobs(token_ids: list[int], logprobs: SampleLogprobs | None, start: int, top_n: int,
                  as_ids: bool = False) -> ChatLogprobs | None:
    if logprobs is None:
        return None
    content: list[ChatLogprobToken] = []
    for i in range(start, min(len(token_ids), len(logprobs))):
        tid, entry = token_ids[i], logprobs[i]
        own = entry.get(tid)
        token = _token_str(tid, own.decoded_token if own is not None else None, as_ids)
        tops = [TopLogprob(token=tok, logprob=lp, bytes=list(tok.encode("utf-8")))
                for _, lp, tok in _ranked(entry, as_ids)[:top_n]]
        content.append(ChatLogprobToken(token=token, logprob=own.logprob if own is not None else float("-inf"),
                                        bytes=list(token.encode("utf-8")), top_logprobs=tops))
    return ChatLogprobs(content=content)


def _holdback(params: SamplingParams) -> int:
    """Characters to hold back while streaming, so that a stop string cut from the end is never sent."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1


class _TextDelta:
    """Turns cumulative text into deltas, holding back a possible stop-string prefix until the request ends."""

    def __init__(self, holdback: int) -> None:
        self.holdback = holdback
        self.sent = 0
        self.sent_text = ""

    def __call__(self, text: str, finished: bool) -> str:
        if not text.startswith(self.sent_text):
            # Text already sent is never taken back; this only happens if a detokenizer rewrote its past.
            logger.warning("cumulative text no longer extends the text already streamed")
        end = len(text) if finished else max(self.sent, len(text) - self.holdback)
        delta = text[self.sent:end]
        self.sent = max(self.sent, end)
        self.sent_text = text[: self.sent]
        return delta


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
    status = 503 if isinstance(e, EngineDeadError) else 500
    body = ErrorResponse(error=ErrorInfo(message=str(e), type="server_error", code=str(status)))
    return _sse(body.model_dump_json())


# ---------------------------------------------------------------------------------------------------- app


def build_app(async_engine: AsyncEngine, served_model_name: str | None = None, *,
              shutdown_engine_on_exit: bool = True) -> FastAPI:
    """The FastAPI app serving ``async_engine`` (started on app startup if it is not yet)."""
    engine = async_engine.engine
    model_dir = str(engine.config.model)
    model_name = served_model_name or served_name_for(model_dir)
    http_metrics = HTTPMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        logger.info("serving %s as %r (max_model_len %d)", model_dir, model_name, engine.max_model_len)
        try:
            yield
        finally:
            if shutdown_engine_on_exit:
                await asyncio.to_thread(async_engine.shutdown)

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
            raise APIError(f"the model `{name}` does not exist; this server serves `{model_name}`", param="model",
                           status_code=404, code="model_not_found")

    async def encode(prompt: str | list[int] | dict[str, Any], param: str) -> tuple[str | None, list[int]]:
        try:
            return await asyncio.to_thread(async_engine.encode_prompt, prompt)
        except ValueError as e:
            raise APIError(str(e), param=param) from e

    def resolve_max_tokens(asked: int | None, name: str, n_prompt: int, default: int | None) -> int | None:
        room = engine.max_model_len - n_prompt
        if asked is None:
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

    # -------------------------------------------------------------- endpoints

    @app.post("/v1/completions", response_model=None)
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        check_model(body.model)
        prompt = body.parse_prompt()
        text, ids = await encode(prompt, "prompt")
        max_tokens = resolve_max_tokens(body.max_tokens, "max_tokens", len(ids), DEFAULT_COMPLETION_MAX_TOKENS)
        params = body.to_sampling_params(max_tokens)
        check_alive()
        request_id = random_id("cmpl")
        engine_prompt: dict[str, Any] = {"prompt_token_ids": ids, "prompt": text}
        outputs = async_engine.generate(request_id, engine_prompt, params)
        if body.stream:
            return StreamingResponse(_stream_completion(outputs, request_id, params, body),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        final = await _final_output(outputs, raw_request)
        if final is None:
            return Response(status_code=499)
        c = final.outputs[0]
        logprobs, _ = completion_logprobs(c.token_ids, c.logprobs, 0, 0, body.return_tokens_as_token_ids)
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
        delta_of = _TextDelta(_holdback(params))
        n_sent, offset = 0, 0
        final: RequestOutput | None = None
        try:
            async with aclosing(outputs):  # closed (the request aborted) even if this generator is dropped early
                async for out in outputs:
                    c = out.outputs[0]
                    delta = delta_of(c.text, out.finished)
                    logprobs, offset = completion_logprobs(c.token_ids, c.logprobs, n_sent, offset,
                                                           body.return_tokens_as_token_ids)
                    new_ids = c.token_ids[n_sent:]
                    n_sent = len(c.token_ids)
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
                                        usage=_usage(final))
                yield _sse(chunk.model_dump_json())
        except (EngineDeadError, RequestAbortedError) as e:
            logger.warning("request %s: %s", request_id, e)
            yield _sse_error(e)
        yield _sse("[DONE]")

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        check_model(body.model)
        messages = body.parse_messages()
        tok = engine.tokenizer
        if tok is None:
            raise APIError("this checkpoint has no tokenizer, so chat completions are not available; use "
                           "/v1/completions with token ids", param="messages")
        template_kwargs = dict(body.chat_template_kwargs or {})
        for reserved in ("messages", "conversation", "add_generation_prompt", "tokenize"):
            if reserved in template_kwargs:
                raise APIError(f"chat_template_kwargs must not set {reserved!r}", param="chat_template_kwargs")

        def render() -> dict[str, Any]:
            text = tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                           **template_kwargs)
            return {"prompt_token_ids": tok.encode(text, add_special_tokens=False), "prompt": text}

        try:
            prompt = await asyncio.to_thread(render)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as e:
            raise APIError(f"the chat template cannot render these messages: {e}", param="messages") from e
        _, ids = await encode(prompt, "messages")
        asked, name = body.requested_max_tokens
        max_tokens = resolve_max_tokens(asked, name, len(ids), None)
        params = body.to_sampling_params(max_tokens)
        check_alive()
        request_id = random_id("chatcmpl")
        top_n = body.top_logprobs or 0
        outputs = async_engine.generate(request_id, prompt, params)
        if body.stream:
            return StreamingResponse(_stream_chat(outputs, request_id, params, body, top_n),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        final = await _final_output(outputs, raw_request)
        if final is None:
            return Response(status_code=499)
        c = final.outputs[0]
        choice = ChatChoice(message=ChatMessage(role="assistant", content=c.text),
                            logprobs=chat_logprobs(c.token_ids, c.logprobs, 0, top_n, body.return_tokens_as_token_ids),
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

        delta_of = _TextDelta(_holdback(params))
        n_sent = 0
        first = True
        final: RequestOutput | None = None
        try:
            yield chunk([ChatStreamChoice(delta=DeltaMessage(role="assistant", content=""))])
            async with aclosing(outputs):  # closed (the request aborted) even if this generator is dropped early
                async for out in outputs:
                    c = out.outputs[0]
                    delta = delta_of(c.text, out.finished)
                    logprobs = chat_logprobs(c.token_ids, c.logprobs, n_sent, top_n, body.return_tokens_as_token_ids)
                    new_ids = c.token_ids[n_sent:]
                    n_sent = len(c.token_ids)
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
                                          usage=_usage(final))
                yield _sse(msg.model_dump_json())
        except (EngineDeadError, RequestAbortedError) as e:
            logger.warning("request %s: %s", request_id, e)
            yield _sse_error(e)
        yield _sse("[DONE]")

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, root=model_dir, max_model_len=engine.max_model_len)])

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

    @app.get("/metrics", response_model=None)
    def metrics() -> Response:  # sync: FastAPI runs it in a worker thread, so waiting for a step blocks no one
        text = render_metrics(async_engine.get_metrics(), http_metrics)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    known_paths = frozenset(getattr(r, "path", "") for r in app.routes)
    app.add_middleware(HTTPMetricsMiddleware, metrics=http_metrics, known_paths=known_paths)
    return app
