"""``POST /v1/completions``: prompts (text or token ids, one or a list) in, ``n`` completions of each out, whole or
streamed; ``echo`` and ``prompt_logprobs`` (``hyserve.server.completion_choices``)."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hyserve.outputs import RequestOutput
from hyserve.server.async_engine import EngineDeadError, RequestAbortedError
from hyserve.server.completion_choices import Echo, choice_piece, final_outputs, make_echo, merge_outputs
from hyserve.server.context import Context, ServerContext
from hyserve.server.errors import ERROR_RESPONSES
from hyserve.server.protocol import (
    APIError,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    UsageInfo,
    random_id,
)
from hyserve.server.responses import (
    SSE_HEADERS,
    SSE_SCHEMA,
    StreamUsage,
    final_output,
    finish_reason,
    sse,
    sse_error,
    stream_kind,
)

logger = logging.getLogger("hyserve.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

router = APIRouter()


@dataclass(slots=True)
class _Prompt:
    text: str | None
    ids: list[int]


@router.post("/v1/completions", response_model=None, responses={
    200: {"model": CompletionResponse, "content": SSE_SCHEMA}, **ERROR_RESPONSES})
async def create_completion(body: CompletionRequest, raw_request: Request, ctx: Context) -> Response:
    ctx.check_model(body.model)
    raw = body.parse_prompts()
    body.check()
    prompts: list[_Prompt] = []
    for k, item in enumerate(raw):
        param = "prompt" if len(raw) == 1 else f"prompt[{k}]"
        text, ids = await ctx.encode(item, param)
        ctx.check_no_placeholders(ids, param)
        prompts.append(_Prompt(text, ids))
    # echo with max_tokens 0: one token is generated (and dropped), as vLLM does.
    asked = 1 if body.echo_only else body.max_tokens
    request_id = random_id("cmpl")
    streams: list[AsyncGenerator[RequestOutput, None]] = []
    try:
        for k, p in enumerate(prompts):
            max_tokens = ctx.resolve_max_tokens(asked, "max_tokens", len(p.ids), DEFAULT_COMPLETION_MAX_TOKENS)
            params = stream_kind(body.to_sampling_params(max_tokens, ctx.sampling_defaults()), body.stream)
            engine_prompt: dict[str, Any] = {"prompt_token_ids": p.ids, "prompt": p.text}
            streams.append(ctx.open_request(request_id if len(prompts) == 1 else f"{request_id}-{k}", engine_prompt,
                                            params))
    except BaseException:
        for s in streams:
            await s.aclose()  # never iterated: aclose does not run its body, so abort the request explicitly
        for k in range(len(streams)):
            ctx.async_engine.abort(request_id if len(prompts) == 1 else f"{request_id}-{k}")
        raise
    if body.stream:
        stream_usage = StreamUsage.of(body.stream_options, sum(len(p.ids) for p in prompts))
        return StreamingResponse(_stream_completion(streams, request_id, ctx, body, prompts, stream_usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        finals = await final_output(final_outputs(streams), raw_request)
    except ValueError as e:  # refused by the engine when its loop added the request
        raise APIError(f"the request was refused: {e}", param="prompt") from e
    if finals is None:
        return Response(status_code=499)
    choices: list[CompletionChoice] = []
    n_out = 0
    for k, final in enumerate(finals):
        echo = make_echo(body, final, prompts[k].text, *_decoders(ctx))
        for c in final.outputs:
            piece = choice_piece(body, c, 0, echo)
            n_out += piece.counted
            if c.finish_reason == "error":
                finish_reason(final)  # logs it
            choice = CompletionChoice(index=k * body.n + c.index, text=piece.text, logprobs=piece.logprobs,
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            if body.return_token_ids:
                choice.token_ids = piece.token_ids
                choice.prompt_token_ids = list(final.prompt_token_ids)
            choices.append(choice)
    n_prompt = sum(len(f.prompt_token_ids) for f in finals)
    usage = UsageInfo(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                      prompt_tokens_details=PromptTokensDetails(
                          cached_tokens=sum(f.num_cached_tokens or 0 for f in finals)))
    resp = CompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=usage)
    return JSONResponse(resp.model_dump())


def _decoders(ctx: ServerContext) -> tuple[Callable[[int], str | None], Callable[[list[int]], str]]:
    """One token's text (None without a tokenizer), and a prompt's (empty without one)."""
    tok = ctx.engine.tokenizer

    def one(tid: int) -> str | None:
        return None if tok is None else tok.decode([tid], skip_special_tokens=False)

    def whole(ids: list[int]) -> str:
        return "" if tok is None else tok.decode(ids, skip_special_tokens=False)

    return one, whole


@dataclass(slots=True)
class _ChoiceState:
    """A streamed choice: the text offset of its logprobs so far, whether its echo has gone out."""

    offset: int = 0
    started: bool = False
    finished: bool = False
    prompt_ids_sent: bool = False


@dataclass(slots=True)
class _PromptState:
    echo: Echo | None = None
    choices: dict[int, _ChoiceState] = field(default_factory=dict)


async def _stream_completion(streams: list[AsyncGenerator[RequestOutput, None]], request_id: str, ctx: ServerContext,
                             body: CompletionRequest, prompts: list[_Prompt], stream_usage: StreamUsage
                             ) -> AsyncIterator[str]:
    model_name = ctx.model_name
    created = CompletionResponse(id=request_id, model=model_name, choices=[]).created
    states = [_PromptState() for _ in prompts]
    decoders = _decoders(ctx)
    try:
        async with aclosing(merge_outputs(streams)) as merged:
            async for k, out in merged:  # DELTA outputs: only what is new (stop-string holdback included)
                st = states[k]
                if body.echo and st.echo is None:
                    # The prompt's logprobs come with its first sampled token (the whole prompt computed).
                    if body.logprobs is not None and out.prompt_logprobs is None and not out.finished:
                        continue
                    st.echo = make_echo(body, out, prompts[k].text, *decoders)
                stream_usage.cached_tokens = out.num_cached_tokens or 0
                for c in out.outputs:
                    cs = st.choices.setdefault(c.index, _ChoiceState())
                    choice = _chunk(body, out, c, cs, st.echo, stream_usage, k * body.n + c.index)
                    if choice is not None:
                        yield sse(CompletionChunk(id=request_id, created=created, model=model_name, choices=[choice],
                                                  usage=stream_usage.so_far()
                                                  ).model_dump_json(exclude=stream_usage.exclude))
        if stream_usage.include_usage:
            last = CompletionChunk(id=request_id, created=created, model=model_name, choices=[],
                                   usage=stream_usage.total())
            yield sse(last.model_dump_json())
    except (EngineDeadError, RequestAbortedError, ValueError) as e:  # ValueError: the engine refused it
        logger.warning("request %s: %s", request_id, e)
        yield sse_error(e)
    yield sse("[DONE]")


def _chunk(body: CompletionRequest, out: RequestOutput, c: Any, cs: _ChoiceState, echo: Echo | None,
           stream_usage: StreamUsage, index: int) -> CompletionChoice | None:
    """Choice ``index``'s piece of one DELTA output (its echo first), or None when it has nothing to send."""
    piece = choice_piece(body, c, cs.offset, None if cs.started else echo)
    cs.offset = piece.offset
    done = c.finish_reason is not None
    stream_usage.completion_tokens += piece.counted
    new_ids = piece.token_ids
    if not (piece.text or done or (new_ids and (piece.logprobs is not None or body.return_token_ids))
            or (not cs.started and echo is not None)):
        return None
    cs.started = True
    choice = CompletionChoice(index=index, text=piece.text, logprobs=piece.logprobs,
                              finish_reason=c.finish_reason if done else None,
                              stop_reason=c.stop_reason if done else None)
    if done and c.finish_reason == "error":
        finish_reason(out)  # logs it
    if body.return_token_ids:
        choice.token_ids = list(new_ids)
        if not cs.prompt_ids_sent:
            choice.prompt_token_ids = list(out.prompt_token_ids)
            cs.prompt_ids_sent = True
    return choice
