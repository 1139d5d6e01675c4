"""OpenAI-shaped request and response models (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``).

Requests are validated strictly (``"max_tokens": "16"`` or ``"temperature": true`` are 400s, not coerced); fields that
accept several shapes (``prompt``, ``messages``, ``stop``) are checked by hand so that the error names the field and
says what is accepted. Unknown fields are ignored, as vLLM and OpenAI do. Besides OpenAI's fields the requests take
vLLM's extra sampling fields (``top_k``, ``min_p``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``, ...), which the
``openai`` client sends through ``extra_body``.

Every refusal raises ``APIError`` (HTTP status, message, the offending field as ``param``); the app turns it into
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from hyserve.sampling_params import SamplingParams

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """A refused request: becomes an OpenAI-style error body with this HTTP status."""

    def __init__(self, message: str, *, param: str | None = None, status_code: int = 400,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.type = type
        self.code = code


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------------------------------- requests


class _StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_StrictModel):
    include_usage: bool = False


class _SamplingRequest(_StrictModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Any = None  # str | list[str] | None: checked by SamplingParams, whose errors name the field
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted at their neutral values only (anything else is a 400 naming the field).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    user: str | None = None
    # vLLM's extras for clients that work in token ids: the output (and prompt) token ids in every choice, and
    # logprob tokens written as "token_id:N" instead of their text.
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False

    def _check_unsupported(self) -> None:
        for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise APIError(f"{name} is not supported yet (got {value}; only {neutral} is accepted)", param=name)
        if self.logit_bias:
            raise APIError("logit_bias is not supported yet", param="logit_bias")
        if self.best_of is not None and self.best_of != 1:
            raise APIError(f"best_of must be 1 (got {self.best_of}): only one completion per request is supported",
                           param="best_of")
        if self.n != 1:
            raise APIError(f"n must be 1 (got {self.n}): only one completion per request is supported", param="n")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, names: dict[str, str]
                         ) -> SamplingParams:
        kwargs: dict[str, Any] = {
            "n": self.n,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": 0 if self.top_k is None else self.top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "logprobs": logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise APIError(str(e), param=sampling_error_param(str(e), names)) from e

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


_PARAM_RE = re.compile(r"^([a-z_]+)")
_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)


def sampling_error_param(message: str, names: dict[str, str] | None = None) -> str | None:
    """The request field a ``SamplingParams`` error is about: its messages start with the field's name."""
    m = _PARAM_RE.match(message)
    if m is None or m.group(1) not in _SAMPLING_FIELDS:
        return None
    return (names or {}).get(m.group(1), m.group(1))


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``max_tokens`` defaults to 16 (OpenAI's default)."""

    prompt: Any = Field(description="a string, a list of token ids, or a list holding one of those")
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def parse_prompt(self) -> str | list[int]:
        p = self.prompt
        shapes = "a string, a list of token ids, or a list holding one string or one list of token ids"
        if isinstance(p, str):
            if not p:
                raise APIError("prompt must not be empty", param="prompt")
            return p
        if not isinstance(p, list):
            raise APIError(f"prompt must be {shapes} (got {type(p).__name__})", param="prompt")
        if not p:
            raise APIError("prompt must not be empty", param="prompt")
        if all(_is_int(t) for t in p):
            return list(p)
        if all(isinstance(x, (str, list)) for x in p):
            if len(p) != 1:
                raise APIError(f"a list of {len(p)} prompts is not supported: send one prompt per request",
                               param="prompt")
            inner = p[0]
            if isinstance(inner, str):
                if not inner:
                    raise APIError("prompt must not be empty", param="prompt")
                return inner
            if inner and all(_is_int(t) for t in inner):
                return list(inner)
            if not inner:
                raise APIError("prompt must not be empty", param="prompt")
        raise APIError(f"prompt must be {shapes}", param="prompt")

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        self._check_unsupported()
        if self.echo:
            raise APIError("echo is not supported yet", param="echo")
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(f"logprobs must be in [0, {MAX_LOGPROBS}] (got {self.logprobs})", param="logprobs")
        return self._sampling_params(max_tokens, self.logprobs, {})


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``. ``max_tokens`` (or ``max_completion_tokens``) defaults to the room left in the
    context after the prompt."""

    messages: Any = Field(description="a non-empty list of {'role': ..., 'content': ...}")
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def parse_messages(self) -> list[dict[str, Any]]:
        raw = self.messages
        if not isinstance(raw, list):
            raise APIError(f"messages must be a list of {{'role': ..., 'content': ...}} objects "
                           f"(got {type(raw).__name__})", param="messages")
        if not raw:
            raise APIError("messages must not be empty", param="messages")
        out: list[dict[str, Any]] = []
        for i, m in enumerate(raw):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise APIError(f"{where} must be an object with 'role' and 'content' (got {type(m).__name__})",
                               param=where)
            role = m.get("role")
            if not isinstance(role, str) or role not in CHAT_ROLES:
                raise APIError(f"{where}.role must be one of {', '.join(CHAT_ROLES)} (got {role!r})",
                               param=f"{where}.role")
            if "content" not in m:
                raise APIError(f"{where}.content is missing", param=f"{where}.content")
            out.append({"role": role, "content": _message_text(m["content"], role, f"{where}.content")})
        return out

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the asked maximum, the field it came from): ``max_completion_tokens`` wins over ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        self._check_unsupported()
        if self.tools:
            raise APIError("tools are not supported yet", param="tools")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise APIError("response_format other than {'type': 'text'} is not supported yet",
                           param="response_format")
        logprobs: int | None = None
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError("top_logprobs needs logprobs to be true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}] (got {self.top_logprobs})",
                               param="top_logprobs")
        if self.logprobs:
            logprobs = self.top_logprobs or 0
        _, max_name = self.requested_max_tokens
        return self._sampling_params(max_tokens, logprobs, {"max_tokens": max_name, "logprobs": "top_logprobs"})


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _message_text(content: Any, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant":
            return ""
        raise APIError(f"{where} must not be null for role {role!r}", param=where)
    if isinstance(content, list):
        parts: list[str] = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(f"{where}[{j}] must be {{'type': 'text', 'text': str}} (only text content is "
                               "supported)", param=f"{where}[{j}]")
            parts.append(part["text"])
        return "\n".join(parts)
    raise APIError(f"{where} must be a string or a list of text parts (got {type(content).__name__})", param=where)


# ---------------------------------------------------------------------------------------------------- responses


class _OmitNone(BaseModel):
    """Fields listed in ``_omit_if_none`` are left out of the JSON when they are None (vLLM's optional extras)."""

    _omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None or k not in self._omit_if_none}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_OmitNone):
    _omit_if_none = frozenset({"token_ids", "prompt_token_ids"})

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(_OmitNone):
    _omit_if_none = frozenset({"token_ids"})

    index: int = 0
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_OmitNone):
    _omit_if_none = frozenset({"prompt_token_ids"})

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(_OmitNone):
    # A delta carries only what changed: ``{"content": "x"}``, not ``{"role": null, "content": "x"}``.
    _omit_if_none = frozenset({"role", "content"})

    role: str | None = None
    content: str | None = None


class ChatStreamChoice(_OmitNone):
    _omit_if_none = frozenset({"token_ids"})

    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_OmitNone):
    _omit_if_none = frozenset({"prompt_token_ids"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "hyserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
