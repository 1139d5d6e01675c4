"""``/v1/completions``' choices from the engine's outputs: several prompts with ``n`` completions each, and ``echo``.

- Choice ``prompt_index * n + index`` is completion ``index`` of prompt ``prompt_index`` (vLLM's order); each prompt
  is a request of its own (``n`` > 1: its children, ``hyserve.engine.parallel_sampling``), and ``merge_outputs``
  streams their outputs as one, tagged with the prompt's index. Closing it closes (aborts) every request.
- ``echo``: the prompt's text before the completion's. With ``logprobs`` the prompt's tokens come first in
  ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` (the first token's logprob and top logprobs
  are null: nothing precedes it), from the request's prompt logprobs. With ``max_tokens: 0`` (``echo_only``) the
  prompt alone is returned: the one token generated is dropped and not counted.
- Usage: the prompt tokens of every prompt once, the completion tokens of every completion returned.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from hyserve.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from hyserve.server.protocol import CompletionLogprobs, CompletionRequest
from hyserve.server.responses import completion_logprobs

_DONE = object()


async def merge_outputs(streams: list[AsyncGenerator[RequestOutput, None]]
                        ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """The outputs of several requests as they come, each with the index of its stream; an error of one ends all."""
    if len(streams) == 1:  # no tasks for the common case
        async with aclosing(streams[0]) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(k: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async with aclosing(stream):
                async for out in stream:
                    queue.put_nowait((k, out))
        except Exception as e:
            queue.put_nowait((k, e))
        else:
            queue.put_nowait((k, _DONE))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            k, item = await queue.get()
            if item is _DONE:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                assert isinstance(item, RequestOutput)
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def final_outputs(streams: list[AsyncGenerator[RequestOutput, None]]
                        ) -> AsyncGenerator[list[RequestOutput], None]:
    """One item: every request's finished output, in prompt order."""
    finals: dict[int, RequestOutput] = {}
    async with aclosing(merge_outputs(streams)) as merged:
        async for k, out in merged:
            finals[k] = out
    yield [finals[k] for k in range(len(streams))]


def _token_text(tid: int, decoded: str | None, as_ids: bool) -> str:
    return decoded if decoded is not None and not as_ids else f"token_id:{tid}"


def prompt_logprobs_part(prompt_ids: list[int], prompt_logprobs: PromptLogprobs,
                         decode: Callable[[int], str | None], as_ids: bool) -> tuple[CompletionLogprobs, int]:
    """The legacy logprobs of the prompt's tokens (the first has none) and the text offset after them."""
    res = CompletionLogprobs()
    offset = 0
    for tid, entry in zip(prompt_ids, prompt_logprobs, strict=True):
        own = entry.get(tid) if entry is not None else None
        token = _token_text(tid, own.decoded_token if own is not None else decode(tid), as_ids)
        res.tokens.append(token)
        res.token_logprobs.append(own.logprob if own is not None else None)
        top: dict[str, float] | None = None
        if entry is not None:
            top = {}
            for t, lp in sorted(entry.items(), key=lambda x: -x[1].logprob):
                top.setdefault(_token_text(t, lp.decoded_token, as_ids), lp.logprob)  # two ids may read alike
        res.top_logprobs.append(top)
        res.text_offset.append(offset)
        offset += len(token)
    return res, offset


@dataclass(slots=True)
class Echo:
    """What ``echo`` puts before each completion of one prompt (its text, and its logprobs when asked)."""

    text: str
    logprobs: CompletionLogprobs | None = None
    offset: int = 0


def make_echo(body: CompletionRequest, out: RequestOutput, prompt_text: str | None,
              decode: Callable[[int], str | None], decode_all: Callable[[list[int]], str]) -> Echo | None:
    """The echo of ``out``'s prompt (a prompt given as token ids is echoed as their text)."""
    if not body.echo:
        return None
    echo = Echo(prompt_text if prompt_text is not None else decode_all(out.prompt_token_ids))
    if body.logprobs is not None and out.prompt_logprobs is not None:
        echo.logprobs, echo.offset = prompt_logprobs_part(out.prompt_token_ids, out.prompt_logprobs, decode,
                                                          body.return_tokens_as_token_ids)
    return echo


@dataclass(slots=True)
class ChoicePiece:
    """A choice's text and logprobs (a whole completion or one streamed delta), echo included where it goes."""

    text: str
    token_ids: list[int]
    logprobs: CompletionLogprobs | None
    offset: int = 0
    counted: int = 0  # completion tokens it returns (usage)


def choice_piece(body: CompletionRequest, c: CompletionOutput, offset: int, echo: Echo | None) -> ChoicePiece:
    """Completion ``c`` (or its delta) as a choice's text and logprobs from text offset ``offset``; ``echo`` (the
    first piece of a choice) goes before it. With ``echo_only`` the completion's own tokens are dropped."""
    ids, text, sample_logprobs = c.token_ids, c.text, c.logprobs
    if body.echo_only:
        ids, text, sample_logprobs = [], "", [] if c.logprobs is not None else None
    as_ids = body.return_tokens_as_token_ids
    if echo is None:
        logprobs, offset = completion_logprobs(ids, sample_logprobs, offset, as_ids)
        return ChoicePiece(text, list(ids), logprobs, offset, len(ids))
    own, end = completion_logprobs(ids, sample_logprobs, echo.offset, as_ids)
    logprobs = None
    if echo.logprobs is not None or own is not None:
        logprobs = CompletionLogprobs()
        for part in (echo.logprobs, own):
            if part is not None:
                logprobs.tokens += part.tokens
                logprobs.token_logprobs += part.token_logprobs
                logprobs.top_logprobs += part.top_logprobs
                logprobs.text_offset += part.text_offset
    return ChoicePiece(echo.text + text, list(ids), logprobs, end, len(ids))
