"""``POST /tokenize`` and ``POST /detokenize``, with vLLM's request and response shapes.

``/tokenize`` takes a ``prompt`` (text; ``add_special_tokens`` defaults to true) or chat ``messages`` (rendered with
the chat template as ``/v1/chat/completions`` renders them: ``add_generation_prompt``, ``chat_template_kwargs``,
``tools``, a request ``chat_template`` under the same rule; ``add_special_tokens`` defaults to false, the template
writes them) and answers ``{"count", "max_model_len", "tokens"}`` (``token_strs`` too with ``return_token_strs``).
A text longer than the context is counted, not refused; text longer than any context can be is refused before it is
tokenized (``ServerContext.check_text_length``). ``/detokenize`` takes ``tokens`` (ids in the vocabulary) and
answers ``{"prompt"}``. Tokenizing and decoding run in a worker thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, model_validator

from hyserve.server.context import Context, encode_text
from hyserve.server.errors import ERROR_RESPONSES
from hyserve.server.protocol import APIError, ChatCompletionRequest, MessagesField, find_bad_text
from hyserve.server.routes.chat import render_chat

router = APIRouter()
# Outside /v1/ (no API key, as vLLM's) and never waiting on the engine (no 503).
_RESPONSES = {status: answer for status, answer in ERROR_RESPONSES.items() if status not in (401, 503)}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _refuse_bad_text(cls, data: Any) -> Any:
        where = find_bad_text(data)
        if where is not None:
            raise APIError(f"{where} is not valid Unicode text: it holds a lone UTF-16 surrogate", param=where)
        return data


class TokenizeRequest(_Strict):
    """vLLM's ``TokenizeCompletionRequest`` and ``TokenizeChatRequest`` in one: ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: MessagesField = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post("/tokenize", response_model=TokenizeResponse, responses=_RESPONSES)
async def tokenize(body: TokenizeRequest, ctx: Context) -> JSONResponse:
    ctx.check_model(body.model)
    tok = ctx.engine.tokenizer
    if tok is None:
        raise APIError("this checkpoint has no tokenizer", param="prompt")
    if (body.prompt is None) == (body.messages is None):
        raise APIError("give either prompt or messages", param="prompt" if body.prompt is None else "messages")
    if body.prompt is not None:
        text, param, special = body.prompt, "prompt", body.add_special_tokens is not False
    else:
        chat = ChatCompletionRequest.model_validate({
            "messages": body.messages, "add_generation_prompt": body.add_generation_prompt,
            "chat_template": body.chat_template, "chat_template_kwargs": body.chat_template_kwargs})
        text = await render_chat(ctx, chat, chat.parse_messages(), body.tools)
        param, special = "messages", bool(body.add_special_tokens)
    ctx.check_text_length(text, param)
    ids = await asyncio.to_thread(encode_text, tok, text, special)
    resp = TokenizeResponse(count=len(ids), max_model_len=ctx.engine.max_model_len, tokens=ids)
    if body.return_token_strs:
        resp.token_strs = await asyncio.to_thread(tok.hf_tokenizer.convert_ids_to_tokens, ids)
    return JSONResponse(resp.model_dump(exclude_none=True))


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_RESPONSES)
async def detokenize(body: DetokenizeRequest, ctx: Context) -> JSONResponse:
    ctx.check_model(body.model)
    tok = ctx.engine.tokenizer
    if tok is None:
        raise APIError("this checkpoint has no tokenizer", param="tokens")
    vocab = ctx.engine.model_config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(f"tokens holds ids outside the vocabulary [0, {vocab}): {bad[:5]}", param="tokens")
    text = await asyncio.to_thread(tok.decode, body.tokens, False)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())
