"""``POST /v1/chat/completions``: messages (text and ``image_url`` parts) rendered with the chat template, then
completed, whole or streamed.

The template renders in a worker thread under a deadline (``chat_template_timeout_s``) that the template's own code
checks on every line (``run_with_deadline``). Images are counted against ``--limit-mm-per-prompt`` and refused for a
text-only checkpoint before any is read, then fetched and decoded in a worker thread; the prompt's length with each
image's tokens is checked before the request is queued.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from types import FrameType
from typing import Any, TypeVar

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from PIL import Image

from hyserve.multimodal.chat import ContentPartError, ParsedChat, check_images, image_token_counts, load_images
from hyserve.outputs import RequestOutput
from hyserve.server.async_engine import EngineDeadError, RequestAbortedError
from hyserve.server.chat_output import ChatDeltaStream, ChatOutputParser
from hyserve.server.context import Context, ServerContext
from hyserve.server.errors import ERROR_RESPONSES
from hyserve.server.protocol import (
    APIError,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    random_id,
)
from hyserve.server.reasoning import prompt_ends_reasoning, reasoning_parser_class
from hyserve.server.responses import (
    SSE_HEADERS,
    SSE_SCHEMA,
    StreamUsage,
    chat_logprobs,
    final_output,
    finish_reason,
    sse,
    sse_error,
    stream_kind,
    usage,
)
from hyserve.server.tools import ToolPlan, check_forced_reasoning, check_template_kwargs, plan_tools

logger = logging.getLogger("hyserve.server")
_T = TypeVar("_T")

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None, responses={
    200: {"model": ChatCompletionResponse, "content": SSE_SCHEMA}, **ERROR_RESPONSES})
async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request, ctx: Context) -> Response:
    ctx.check_model(body.model)
    parsed = body.parse_chat()
    body.check()
    plan = plan_tools(body, ctx.tool_settings)
    check_template_kwargs(body.chat_template_kwargs)
    check_chat_images(ctx, parsed)
    text = await render_chat(ctx, body, parsed.messages, plan.template_tools)
    output_parser = answer_parser(ctx, body, plan, text)
    _, ids = await ctx.encode(text, "messages", add_special_tokens=False)
    if not parsed.images:
        ctx.check_no_placeholders(ids, "messages")  # with images: expanded_length counts them once they are loaded
    images = await load_chat_images(ctx, parsed)  # after the cheap refusals: a refused request fetches nothing
    engine_prompt: dict[str, Any] = {"prompt_token_ids": ids, "prompt": text}
    n_prompt = len(ids)
    if images:
        n_prompt = expanded_length(ctx, ids, parsed, images)
        try:  # the pixel work in a worker thread, not on the engine's
            ids, inputs = await asyncio.to_thread(ctx.engine.prepare_images, ids, images)
        except ValueError as e:
            raise APIError(str(e), param="messages") from e
        engine_prompt = {"prompt_token_ids": ids, "prompt": text, "multi_modal_inputs": inputs}
        n_prompt = len(ids)
    asked, name = body.requested_max_tokens
    max_tokens = ctx.resolve_max_tokens(asked, name, n_prompt, None)
    params = stream_kind(body.to_sampling_params(max_tokens, ctx.sampling_defaults()), body.stream)
    if plan.constraint is not None:  # tool_choice "required" or a named function (no other constraint: refused)
        params = dataclasses.replace(params, structured_outputs=plan.constraint)
    request_id = random_id("chatcmpl")
    top_n = body.top_logprobs or 0
    outputs = ctx.open_request(request_id, engine_prompt, params, {"max_tokens": name, "logprobs": "top_logprobs"})
    if body.stream:
        stream_usage = StreamUsage.of(body.stream_options, n_prompt)
        return StreamingResponse(_stream_chat(outputs, request_id, ctx.model_name, body, top_n, stream_usage,
                                              output_parser),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        final = await final_output(outputs, raw_request)
    except ValueError as e:  # refused by the engine when its loop added the request (an image it cannot use)
        raise APIError(f"the request was refused: {e}", param="messages") from e
    if final is None:
        return Response(status_code=499)
    finish_reason(final)  # logs an error finish
    choices: list[ChatChoice] = []
    for c in final.outputs:  # n completions, by index
        message = whole_message(c.text, output_parser)
        choice = ChatChoice(index=c.index, message=message,
                            logprobs=chat_logprobs(c.token_ids, c.logprobs, top_n, body.return_tokens_as_token_ids),
                            finish_reason=answer_finish_reason(c.finish_reason, bool(message.tool_calls),
                                                               output_parser),
                            stop_reason=c.stop_reason)
        if body.return_token_ids:
            choice.token_ids = list(c.token_ids)
        choices.append(choice)
    resp = ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=usage(final))
    if body.return_token_ids:
        resp.prompt_token_ids = list(final.prompt_token_ids)
    return JSONResponse(resp.model_dump())


def answer_parser(ctx: ServerContext, body: ChatCompletionRequest, plan: ToolPlan, prompt: str
                  ) -> ChatOutputParser | None:
    """The parser of this request's answer, or None when the answer is plain text (no reasoning parser, no tool
    calls to parse)."""
    reasoning = None
    if ctx.reasoning_parser is not None:
        thinking = (body.chat_template_kwargs or {}).get("enable_thinking", True) is not False \
            and not prompt_ends_reasoning(prompt)
        check_forced_reasoning(plan, thinking)
        reasoning = reasoning_parser_class(ctx.reasoning_parser)(thinking)
    if reasoning is None and plan.parser is None:
        return None
    return ChatOutputParser(reasoning, plan.parser, parallel=plan.parallel, include_reasoning=body.include_reasoning)


def whole_message(text: str, parser: ChatOutputParser | None) -> ChatMessage:
    if parser is None:
        return ChatMessage(role="assistant", content=text)
    parsed = parser.parse(text)
    calls = parser.tool_calls(parsed.calls)
    plain = not (parsed.reasoning or calls)
    return ChatMessage(role="assistant", content=parsed.content if plain or parsed.content else None,
                       reasoning_content=parsed.reasoning or None, tool_calls=calls or None)


def answer_finish_reason(reason: str | None, called: bool, parser: ChatOutputParser | None = None) -> str | None:
    """``tool_calls`` for an answer that ended normally with calls (a cut-short one keeps ``length``; a named
    function's call keeps ``stop``, as OpenAI answers)."""
    if parser is not None and parser.tools is not None and not parser.tools.finish_on_calls:
        return reason
    return "tool_calls" if called and reason == "stop" else reason


async def _stream_chat(outputs: AsyncGenerator[RequestOutput, None], request_id: str, model_name: str,
                       body: ChatCompletionRequest, top_n: int, stream_usage: StreamUsage,
                       output_parser: ChatOutputParser | None = None) -> AsyncIterator[str]:
    created = ChatCompletionResponse(id=request_id, model=model_name, choices=[]).created

    def chunk(choices: list[ChatStreamChoice], prompt_token_ids: list[int] | None = None) -> str:
        msg = ChatCompletionChunk(id=request_id, created=created, model=model_name, choices=choices,
                                  prompt_token_ids=prompt_token_ids, usage=stream_usage.so_far())
        return sse(msg.model_dump_json(exclude=stream_usage.exclude))

    first = True
    final: RequestOutput | None = None
    # One parse per choice (n > 1: each completion its own, by index).
    parses = [ChatDeltaStream(output_parser) if output_parser is not None else None for _ in range(body.n)]
    try:
        for i in range(body.n):
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        async with aclosing(outputs):  # closed (the request aborted) even if this generator is dropped early
            async for out in outputs:  # DELTA outputs: only what is new (stop-string holdback included)
                stream_usage.add(out)
                for c in out.outputs:
                    parsed = parses[c.index]
                    done = c.finish_reason is not None
                    delta, new_ids = c.text, c.token_ids
                    logprobs = chat_logprobs(new_ids, c.logprobs, top_n, body.return_tokens_as_token_ids)
                    if parsed is None:
                        message = DeltaMessage(content=delta) if delta else None
                    else:  # reasoning and tool calls split out of the text so far
                        message = parsed.feed(delta, done)
                    if message is not None or (new_ids and (logprobs is not None or body.return_token_ids)):
                        choice = ChatStreamChoice(index=c.index, delta=message or DeltaMessage(), logprobs=logprobs)
                        if body.return_token_ids:
                            choice.token_ids = list(new_ids)
                        prompt_ids = list(out.prompt_token_ids) if body.return_token_ids and first else None
                        first = False
                        yield chunk([choice], prompt_ids)
                    if done:
                        if c.finish_reason == "error":
                            finish_reason(out)  # logs it
                        reason = answer_finish_reason(c.finish_reason, parsed is not None and parsed.called,
                                                      output_parser)
                        yield chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(), finish_reason=reason,
                                                      stop_reason=c.stop_reason)])
                if out.finished:
                    final = out
        if stream_usage.include_usage and final is not None:
            msg = ChatCompletionChunk(id=request_id, created=created, model=model_name, choices=[],
                                      usage=stream_usage.total())
            yield sse(msg.model_dump_json())
    except (EngineDeadError, RequestAbortedError, ValueError) as e:  # ValueError: the engine refused it
        logger.warning("request %s: %s", request_id, e)
        yield sse_error(e)
    yield sse("[DONE]")


# ---------------------------------------------------------------------------------------------------- template


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


async def render_chat(ctx: ServerContext, body: ChatCompletionRequest, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]] | None = None) -> str:
    tok = ctx.engine.tokenizer
    if tok is None:
        raise APIError("this checkpoint has no tokenizer, so chat completions are not available; use "
                       "/v1/completions with token ids", param="messages")
    template_kwargs = dict(body.chat_template_kwargs or {})
    for reserved in ("messages", "conversation", "add_generation_prompt", "tokenize", "tools", "chat_template"):
        if reserved in template_kwargs:
            hint = f"; use the request's {reserved} field" if reserved in ("tools", "chat_template") else ""
            raise APIError(f"chat_template_kwargs must not set {reserved!r}{hint}", param="chat_template_kwargs")
    if body.chat_template is not None:
        if not ctx.trust_request_chat_template:
            raise APIError("a request-supplied chat_template is refused: this server runs only its checkpoint's "
                           "template unless started with --trust-request-chat-template", param="chat_template")
        template_kwargs["chat_template"] = body.chat_template
    if tools is not None:
        template_kwargs["tools"] = tools
    timeout_s = ctx.chat_template_timeout_s

    def render() -> str:
        return run_with_deadline(lambda: tok.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, **template_kwargs), timeout_s)

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


# ---------------------------------------------------------------------------------------------------- images


def check_chat_images(ctx: ServerContext, parsed: ParsedChat) -> None:
    """Refuse images for a text-only model and over ``--limit-mm-per-prompt``, before any is read."""
    try:
        check_images(parsed.images, limit=ctx.engine.config.image_limit, accepts_images=ctx.mm_config is not None,
                     refusal=ctx.engine.model_config.image_refusal)
    except ContentPartError as e:
        raise APIError(str(e), param=e.param) from e


async def load_chat_images(ctx: ServerContext, parsed: ParsedChat) -> list[Image.Image]:
    """Fetch and decode the (already counted) images in a worker thread; a refusal names the part."""
    if not parsed.images:
        return []
    config = ctx.engine.config
    try:
        return await asyncio.to_thread(load_images, parsed.images, allowed_domains=config.allowed_media_domains,
                                       allowed_local_path=config.allowed_local_media_path)
    except ContentPartError as e:
        raise APIError(str(e), param=e.param) from e


def expanded_length(ctx: ServerContext, ids: list[int], parsed: ParsedChat, images: list[Image.Image]) -> int:
    """The prompt's length once each image placeholder is widened to its image's tokens (as the engine will);
    refuses a rendering whose placeholders do not match the images."""
    mm_config = ctx.mm_config
    assert mm_config is not None
    placeholders = ids.count(mm_config.image_token_id)
    if placeholders != len(images):
        raise APIError(f"the chat template rendered {placeholders} image placeholders for {len(images)} images "
                       "(one <|vision_start|><|image_pad|><|vision_end|> per image is needed; text may not "
                       "contain <|image_pad|>)", param="messages")
    if ctx.image_settings is None:
        return len(ids)  # no preprocessor_config.json: the engine refuses the images when it adds the request
    try:
        counts = image_token_counts(images, parsed.images, ctx.image_settings)
    except ContentPartError as e:
        raise APIError(str(e), param=e.param) from e
    n = len(ids) - len(images) + sum(counts)
    max_model_len = ctx.engine.max_model_len
    if n >= max_model_len:
        raise APIError(f"the prompt has {n} tokens ({sum(counts)} of them for {len(images)} images), but "
                       f"max_model_len is {max_model_len} (the prompt must leave room for at least one "
                       "output token)", param="messages")
    return n
