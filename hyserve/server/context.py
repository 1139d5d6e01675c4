"""What the routes share: ``ServerContext``, one per app (``app.state.context``, which a route receives through the
``Context`` dependency): the engine, the served model name, the settings ``build_app`` was given, and the steps
every generation route takes (check the model name, tokenize and check a prompt, size ``max_tokens``, queue the
request).

Tokenizing runs in a worker thread through the tokenizer's GIL-releasing batch call (``encode_text``): neither the
event loop nor the engine thread ever tokenizes text, the engine gets token ids. Text longer than
``4 * max_model_len * (longest token in characters)`` can never fit the context and is refused before it is
tokenized (``max_text_chars``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncGenerator
from typing import Annotated, Any

from fastapi import Depends, Request

from hyserve.multimodal.image import ImageProcessorSettings
from hyserve.outputs import RequestOutput
from hyserve.sampling_params import SamplingParams
from hyserve.server.async_engine import AsyncEngine, EngineDeadError
from hyserve.server.metrics import HTTPMetrics
from hyserve.server.protocol import APIError, sampling_error_param, short_repr
from hyserve.server.reasoning import reasoning_parser_class
from hyserve.server.tools import ToolSettings
from hyserve.tokenizer import Tokenizer

logger = logging.getLogger("hyserve.server")

# Unicode normalization (NFC) can merge up to 4 code points into one character, so a text of more than
# 4 * max_model_len * (longest token in characters) characters has more than max_model_len tokens.
_NORMALIZATION_SLACK = 4


def served_name_for(model_dir: str) -> str:
    return os.path.basename(os.path.normpath(model_dir)) or model_dir


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


class ServerContext:
    """The engine a server answers from and what its routes need of it; the shared steps raise ``APIError``
    (a 400 naming the field, unless said otherwise) for what they refuse."""

    def __init__(self, async_engine: AsyncEngine, served_model_name: str | None = None, *,
                 trust_request_chat_template: bool = False, chat_template_timeout_s: float,
                 tool_settings: ToolSettings | None = None, reasoning_parser: str | None = None) -> None:
        self.async_engine = async_engine
        self.engine = engine = async_engine.engine
        self.model_dir = str(engine.config.model)
        self.model_name = served_model_name or served_name_for(self.model_dir)
        self.http_metrics = HTTPMetrics()
        self.text_limit = max_text_chars(engine.tokenizer, engine.max_model_len)
        self.trust_request_chat_template = trust_request_chat_template
        self.chat_template_timeout_s = chat_template_timeout_s
        self.tool_settings = tool_settings or ToolSettings()
        if reasoning_parser is not None:
            reasoning_parser_class(reasoning_parser)  # an unknown name fails at startup, listing the known ones
        self.reasoning_parser = reasoning_parser
        # Image input: None when the checkpoint has no vision tower (or --limit-mm-per-prompt image=0 turned it off).
        self.mm_config = engine.model_config.multimodal
        self.image_settings: ImageProcessorSettings | None = None
        if self.mm_config is not None:
            try:
                self.image_settings = ImageProcessorSettings.from_checkpoint(self.model_dir)
            except (ValueError, OSError) as e:
                logger.warning("image requests cannot be sized before they are queued: %s", e)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(f"the model {short_repr(name)} does not exist; this server serves {self.model_name!r}",
                           param="model", status_code=404, code="model_not_found")

    def check_text_length(self, text: str, param: str) -> None:
        if self.text_limit is not None and len(text) > self.text_limit:
            raise APIError(f"{param} has {len(text)} characters: more than any text of max_model_len="
                           f"{self.engine.max_model_len} tokens can have ({self.text_limit})", param=param)

    async def encode(self, prompt: str | list[int], param: str, add_special_tokens: bool = True
                     ) -> tuple[str | None, list[int]]:
        """Tokenize (a worker thread; see ``encode_text``) and check a prompt; refusals name ``param``."""
        engine = self.engine
        tok = engine.tokenizer
        item: dict[str, Any]
        if isinstance(prompt, str) and tok is not None:
            self.check_text_length(prompt, param)
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
            return self.async_engine.encode_prompt(item)  # ids only: O(n) checks, no tokenizing
        except ValueError as e:
            raise APIError(str(e), param=param) from e

    def check_no_placeholders(self, ids: list[int], param: str) -> None:
        """A prompt without images may not hold the image placeholder token: text can spell it (it is a special
        token, and text is tokenized with special tokens recognised), and the engine would take it for an image
        slot with no image. Refused here, before any response starts; the engine refuses it too."""
        mm_config = self.mm_config
        if mm_config is None or mm_config.image_token_id not in ids:
            return
        raise APIError(f"{param} holds {ids.count(mm_config.image_token_id)} image placeholder tokens (id "
                       f"{mm_config.image_token_id}, <|image_pad|>) but no image: text may not contain the image "
                       "placeholder; send images as image_url parts of a chat message", param=param)

    def sampling_defaults(self) -> dict[str, Any]:
        return dict(getattr(self.engine, "default_sampling_params", None) or {})

    def resolve_max_tokens(self, asked: int | None, name: str, n_prompt: int, default: int | None) -> int | None:
        """The request's max_tokens (checked against the room the prompt leaves), else the checkpoint's default
        (generation_config.json's max_new_tokens), else ``default``; defaults are capped by the room."""
        max_model_len = self.engine.max_model_len
        room = max_model_len - n_prompt
        if asked is None:
            configured = self.sampling_defaults().get("max_tokens")
            if configured is not None:
                default = int(configured)
            return None if default is None else min(default, room)
        if asked > room:
            raise APIError(f"{name}={asked} is too large: the prompt has {n_prompt} tokens and max_model_len is "
                           f"{max_model_len}, which leaves room for at most {room} output tokens", param=name)
        return asked

    def check_alive(self) -> None:
        if not self.async_engine.is_alive():
            err = self.async_engine.dead_error
            raise EngineDeadError("the engine loop is not running" + (f": {err!r}" if err else ""))

    def open_request(self, request_id: str, prompt: dict[str, Any], params: SamplingParams,
                     names: dict[str, str] | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Queue the request now: what the engine refuses is a 400 before any response starts."""
        self.check_alive()
        try:
            return self.async_engine.open(request_id, prompt, params)
        except ValueError as e:
            raise APIError(str(e), param=sampling_error_param(str(e), names)) from e


async def server_context(request: Request) -> ServerContext:
    """The app's ``ServerContext`` (a dependency: async, so that it runs on the event loop, not in a thread)."""
    context: ServerContext = request.app.state.context
    return context


Context = Annotated[ServerContext, Depends(server_context)]
