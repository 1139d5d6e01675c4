"""``POST /v1/completions``: a prompt (text or token ids) in, its completion out, whole or streamed."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hyserve.outputs import RequestOutput
from hyserve.server.async_engine import EngineDeadError, RequestAbortedError
from hyserve.server.context import Context
from hyserve.server.errors import ERROR_RESPONSES
from hyserve.server.protocol import (
    APIError,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from hyserve.server.responses import (
    SSE_HEADERS,
    SSE_SCHEMA,
    StreamUsage,
    completion_logprobs,
    final_output,
    finish_reason,
    sse,
    sse_error,
    stream_kind,
    usage,
)

logger = logging.getLogger("hyserve.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

router = APIRouter()


@router.post("/v1/completions", response_model=None, responses={
    200: {"model": CompletionResponse, "content": SSE_SCHEMA}, **ERROR_RESPONSES})
async def create_completion(body: CompletionRequest, raw_request: Request, ctx: Context) -> Response:
    ctx.check_model(body.model)
    prompt = body.parse_prompt()
    body.check()
    text, ids = await ctx.encode(prompt, "prompt")
    ctx.check_no_placeholders(ids, "prompt")
    max_tokens = ctx.resolve_max_tokens(body.max_tokens, "max_tokens", len(ids), DEFAULT_COMPLETION_MAX_TOKENS)
    params = stream_kind(body.to_sampling_params(max_tokens, ctx.sampling_defaults()), body.stream)
    request_id = random_id("cmpl")
    engine_prompt: dict[str, Any] = {"prompt_token_ids": ids, "prompt": text}
    outputs = ctx.open_request(request_id, engine_prompt, params)
    if body.stream:
        stream_usage = StreamUsage.of(body.stream_options, len(ids))
        return StreamingResponse(_stream_completion(outputs, request_id, ctx.model_name, body, stream_usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        final = await final_output(outputs, raw_request)
    except ValueError as e:  # refused by the engine when its loop added the request
        raise APIError(f"the request was refused: {e}", param="prompt") from e
    if final is None:
        return Response(status_code=499)
    c = final.outputs[0]
    logprobs, _ = completion_logprobs(c.token_ids, c.logprobs, 0, body.return_tokens_as_token_ids)
    choice = CompletionChoice(text=c.text, logprobs=logprobs, finish_reason=finish_reason(final),
                              stop_reason=c.stop_reason)
    if body.return_token_ids:
        choice.token_ids = list(c.token_ids)
        choice.prompt_token_ids = list(final.prompt_token_ids)
    resp = CompletionResponse(id=request_id, model=ctx.model_name, choices=[choice], usage=usage(final))
    return JSONResponse(resp.model_dump())


async def _stream_completion(outputs: AsyncGenerator[RequestOutput, None], request_id: str, model_name: str,
                             body: CompletionRequest, stream_usage: StreamUsage) -> AsyncIterator[str]:
    created = CompletionResponse(id=request_id, model=model_name, choices=[]).created
    first = True
    offset = 0
    final: RequestOutput | None = None
    try:
        async with aclosing(outputs):  # closed (the request aborted) even if this generator is dropped early
            async for out in outputs:  # DELTA outputs: only what is new (stop-string holdback included)
                c = out.outputs[0]
                delta, new_ids = c.text, c.token_ids
                logprobs, offset = completion_logprobs(new_ids, c.logprobs, offset, body.return_tokens_as_token_ids)
                stream_usage.add(out)
                reason = finish_reason(out) if out.finished else None
                if delta or out.finished or (new_ids and (logprobs is not None or body.return_token_ids)):
                    choice = CompletionChoice(text=delta, logprobs=logprobs, finish_reason=reason,
                                              stop_reason=c.stop_reason if out.finished else None)
                    if body.return_token_ids:
                        choice.token_ids = list(new_ids)
                        if first:
                            choice.prompt_token_ids = list(out.prompt_token_ids)
                    first = False
                    chunk = CompletionChunk(id=request_id, created=created, model=model_name, choices=[choice],
                                            usage=stream_usage.so_far())
                    yield sse(chunk.model_dump_json(exclude=stream_usage.exclude))
                if out.finished:
                    final = out
        if stream_usage.include_usage and final is not None:
            chunk = CompletionChunk(id=request_id, created=created, model=model_name, choices=[],
                                    usage=stream_usage.total())
            yield sse(chunk.model_dump_json())
    except (EngineDeadError, RequestAbortedError, ValueError) as e:  # ValueError: the engine refused it
        logger.warning("request %s: %s", request_id, e)
        yield sse_error(e)
    yield sse("[DONE]")
