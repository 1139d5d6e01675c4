"""The parts of an OpenAI answer made from the engine's ``RequestOutput``s, shared by the completion routes: usage,
finish reason, logprobs in either API's form, the server-sent events of a stream (``data: {json}\\n\\n``, an error
event, ``data: [DONE]``), and the wait for a whole answer that gives up when the client disconnects."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing, suppress
from typing import Any, TypeVar

from fastapi import Request

from hyserve.outputs import RequestOutput, SampleLogprobs
from hyserve.sampling_params import RequestOutputKind, SamplingParams
from hyserve.server.async_engine import EngineDeadError
from hyserve.server.protocol import (
    ChatLogprobs,
    ChatLogprobToken,
    CompletionLogprobs,
    ErrorInfo,
    ErrorResponse,
    PromptTokensDetails,
    StreamOptions,
    TopLogprob,
    UsageInfo,
)

logger = logging.getLogger("hyserve.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# The 200 of a completion route, as the OpenAPI schema declares it besides the JSON answer.
SSE_SCHEMA = {"text/event-stream": {"schema": {"type": "string", "description": "with stream: true, data: "
                                                                       "{chunk JSON} events, then data: [DONE]"}}}


def usage(out: RequestOutput, n_out: int | None = None) -> UsageInfo:
    """Token counts of a finished request (every completion's, with ``n`` > 1); a stream of DELTA outputs passes
    the ``n_out`` it counted."""
    n_prompt = len(out.prompt_token_ids)
    n_out = sum(len(c.token_ids) for c in out.outputs) if n_out is None else n_out
    return UsageInfo(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens or 0))


@dataclasses.dataclass(slots=True)
class StreamUsage:
    """Usage in a stream (``stream_options``): with ``include_usage`` a last chunk carries the totals; with
    ``continuous_usage_stats`` every chunk carries the counts so far (prompt tokens, completion tokens sent up to and
    including that chunk's, their total), as vLLM sends them. Otherwise chunks leave ``usage`` out."""

    include_usage: bool
    continuous: bool
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0

    @classmethod
    def of(cls, stream_options: StreamOptions | None, num_prompt_tokens: int) -> StreamUsage:
        opts = stream_options or StreamOptions()
        return cls(opts.include_usage, opts.continuous_usage_stats, num_prompt_tokens)

    def add(self, out: RequestOutput) -> None:
        """Count a DELTA output's new tokens (and its prompt, as the engine counts it)."""
        self.prompt_tokens = len(out.prompt_token_ids)
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        self.cached_tokens = out.num_cached_tokens or 0

    def total(self) -> UsageInfo:
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                         total_tokens=self.prompt_tokens + self.completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens))

    def so_far(self) -> UsageInfo | None:
        """What a content chunk carries: the counts so far with ``continuous_usage_stats``, else None."""
        return self.total() if self.continuous else None

    @property
    def exclude(self) -> set[str] | None:
        """Fields a content chunk leaves out: ``usage`` unless usage was asked for (then it is null or counts)."""
        return None if self.include_usage or self.continuous else {"usage"}


def finish_reason(out: RequestOutput) -> str | None:
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
        top: dict[str, float] = {}
        for _, lp, tok in _ranked(entry, as_ids):  # two ids of one text: the likelier one's (the list is sorted)
            top.setdefault(tok, lp)
        res.top_logprobs.append(top)
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


T = TypeVar("T")


async def final_output(outputs: AsyncGenerator[T, None], request: Request) -> T | None:
    """The finished output (the last one), or None if the client disconnected first (then the request is
    aborted)."""

    async def consume() -> T | None:
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


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_error(e: BaseException) -> str:
    """An error event for a stream whose 200 is already sent; a ValueError is a request the engine refused (400)."""
    if isinstance(e, ValueError):
        body = ErrorResponse(error=ErrorInfo(message=f"the request was refused: {e}", type="invalid_request_error",
                                             code="400"))
        return sse(body.model_dump_json())
    status = 503 if isinstance(e, EngineDeadError) else 500
    body = ErrorResponse(error=ErrorInfo(message=str(e), type="server_error", code=str(status)))
    return sse(body.model_dump_json())
