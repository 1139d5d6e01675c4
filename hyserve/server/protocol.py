"""OpenAI-shaped request and response models (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``).

Requests are validated strictly (``"max_tokens": "16"`` or ``"temperature": true`` are 400s, not coerced); fields that
accept several shapes (``prompt``, ``messages``, ``stop``) are checked by hand so that the error names the field and
says what is accepted (their OpenAPI schema still spells the shapes out). Besides OpenAI's fields the requests take
vLLM's extra sampling fields (``top_k``, ``min_p``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``,
``repetition_penalty``, ``bad_words``, ``allowed_token_ids``, ...), which the
``openai`` client sends through ``extra_body``.

Nothing is accepted and silently ignored. A field this server does not implement is a 400 naming it, unless it is
set to its no-op value: an unknown field (``guided_decoding_backend``,
``reasoning_effort``, ...) is accepted only as ``null``; declared but unimplemented ones only at their neutral
value. Structured output (``response_format``, ``structured_outputs``, ``guided_*``) is read by
``hyserve.server.structured``.
Tools (``hyserve.server.tools``): ``tools`` reach the chat template; ``tool_choice`` (``"auto"`` when absent with
tools) says whether the answer's calls are parsed (with the server's ``--tool-call-parser``) or, for ``"required"``
and a named function, constrained by the grammar engine (``hyserve.server.tool_choice``), and without tools is a
400. An assistant message's ``tool_calls`` (arguments as a JSON string, as OpenAI sends them, are parsed
to objects as chat templates expect), a tool message's ``tool_call_id`` and ``name`` reach the template. Text with
lone UTF-16 surrogates (JSON ``"\\ud800"``) is a 400 naming the field; the stop list is bounded
(``MAX_STOP_STRINGS`` strings of at most ``MAX_STOP_STRING_CHARS`` characters).

Chat content is a string or a list of ``text`` and ``image_url`` parts (``hyserve.multimodal.chat``: the shapes are
checked here, no image is read); any other part type is a 400 naming the part and the supported types.

Every refusal raises ``APIError`` (HTTP status, message, the offending field as ``param``); the app turns it into
``{"error": {"message", "type", "param", "code"}}``.

The OpenAPI schema of the requests forbids what the checks refuse field by field (an empty prompt, a seed outside
[0, 2**63 - 1], ``n`` outside [1, ``MAX_N``], a null ``content`` outside assistant messages, an unsupported field set to
anything but its neutral value, ...); the runtime checks stay in the request methods and ``SamplingParams`` (their
messages name the field). Rules across fields (``min_tokens <= max_tokens``, ``stream_options`` only with
``stream``, ``top_logprobs`` only with ``logprobs``, ``tools`` with ``tool_choice``, ``best_of`` equal to ``n``,
``max_tokens`` 0 only with ``echo``) and the checkpoint's limits
(vocabulary size, ``max_model_len``) are not in the schema.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    WithJsonSchema,
    model_serializer,
    model_validator,
)

from hyserve.multimodal.chat import SERVER_PART_TYPES, ContentPartError, ImageRef, ParsedChat, parse_content
from hyserve.sampling_params import MAX_SEED, SamplingParams
from hyserve.server.structured import StructuredOutputError, StructuredOutputFields

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_N = 128  # completions per prompt (n): each is a request of its own
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Stop strings are matched against the tail of the output after every token and held back while streaming, so
# their number and length cost on every step: bounded (OpenAI allows 4; these leave room for vLLM-style use).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
ECHO_LIMIT = 80  # characters of a client's value quoted back in an error message
# Message keys passed to the chat template besides role and content; any other key must be null.
MESSAGE_KEYS = ("name", "tool_calls", "tool_call_id", "reasoning_content")


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


def short_repr(x: Any, limit: int = ECHO_LIMIT) -> str:
    """``repr(x)`` cut to ``limit`` characters: what an error message may quote of a client's value.

    ``repr`` escapes what JSON cannot carry (lone surrogates) and the cut keeps a 100 MB value out of the answer;
    huge containers are cut before ``repr`` walks them whole.
    """
    if isinstance(x, (list, tuple)) and len(x) > limit:
        x = type(x)(x[:limit])
    elif isinstance(x, dict) and len(x) > limit:
        x = dict(list(x.items())[:limit])
    elif isinstance(x, str) and len(x) > limit:
        x = x[:limit]
    r = repr(x)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def find_bad_text(value: Any, path: str = "") -> str | None:
    """The path (``messages[0].content``) of the first string (key or value) holding a lone UTF-16 surrogate.

    JSON ``"\\ud800"`` (and CESU-8 bytes, which ``json.loads`` decodes with ``surrogatepass``) parse into such
    strings; they are not text, cannot be tokenized or encoded as UTF-8, and are refused at the door.
    """
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            if _has_surrogate(v):
                return where or "body"
        elif isinstance(v, dict):
            items = list(v.items())
            for k, x in reversed(items):
                key = str(k)
                if _has_surrogate(key):
                    return where or "body"
                stack.append((f"{where}.{key}" if where else key, x))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", x) for i, x in reversed(list(enumerate(v))))
    return None


# ---------------------------------------------------------------------------------------------------- requests


class _StrictModel(BaseModel):
    """No coercion; an unknown field is accepted only as ``null`` (its no-op value) and is a 400 otherwise."""

    # The schema says what _drop_null_unknowns does: any other key only as null.
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra={"additionalProperties": {"type": "null"}})

    @model_validator(mode="before")
    @classmethod
    def _drop_null_unknowns(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(v is None and k not in cls.model_fields for k, v in data.items()):
            return {k: v for k, v in data.items() if v is not None or k in cls.model_fields}
        return data


class _RequestModel(_StrictModel):
    """A whole request body: text holding lone surrogates is refused first, naming the field."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_bad_text(cls, data: Any) -> Any:
        where = find_bad_text(data)
        if where is not None:
            raise APIError(f"{where} is not valid Unicode text: it holds a lone UTF-16 surrogate (e.g. \\ud800)",
                           param=None if where == "body" else where)
        return data


class StreamOptions(_StrictModel):
    include_usage: bool = False
    # Every chunk carries the usage so far (hyserve.server.responses.StreamUsage).
    continuous_usage_stats: bool = False


# OpenAPI schemas of the fields validated by hand (the validation itself stays in the request methods, whose errors
# name the field and say what is accepted).
_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS}
_STOP_SCHEMA = {"anyOf": [_STOP_STRING, {"type": "array", "items": _STOP_STRING, "maxItems": MAX_STOP_STRINGS},
                          {"type": "null"}],
                "description": "a stop string or a list of them"}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS,
                            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                            {"type": "array", "items": _TOKEN_IDS, "minItems": 1}],
                  "description": "a non-empty string, a non-empty list of token ids, or a list of those (one "
                                 "completion per prompt and n)"}
_TEXT_PART_SCHEMA = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                     "required": ["type", "text"]}
_IMAGE_PART_SCHEMA = {"type": "object", "properties": {
    "type": {"const": "image_url"},
    "image_url": {"anyOf": [{"type": "string"}, {"type": "object", "properties": {
        "url": {"type": "string", "description": "data:image/{png,jpeg,webp};base64,..., or an http(s):// or "
                                                 "file:// URL the server allows"},
        "detail": {"const": "auto"}}, "required": ["url"]}]}}, "required": ["type", "image_url"]}
_TOOL_CALL_SCHEMA = {"type": "object", "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "properties": {"name": {"type": "string"},
                                                  "arguments": {"anyOf": [{"type": "string"}, {"type": "object"}]}},
                 "required": ["name"]}}, "required": ["function"]}
_CONTENT = [{"type": "string"}, {"type": "array", "items": {"anyOf": [_TEXT_PART_SCHEMA, _IMAGE_PART_SCHEMA]}}]
_NULL = {"type": "null"}
_OPTIONAL_STRING = {"anyOf": [{"type": "string"}, _NULL]}
# Only an assistant message may have a null content (a tool call's turn) or tool_calls; any key besides these is
# accepted only as null.
_MESSAGE_SCHEMAS = [
    {"type": "object", "properties": {
        "role": {"enum": [r for r in CHAT_ROLES if r != "assistant"]}, "content": {"anyOf": _CONTENT},
        **{key: _OPTIONAL_STRING for key in MESSAGE_KEYS if key != "tool_calls"}, "tool_calls": _NULL},
     "required": ["role", "content"], "additionalProperties": _NULL},
    {"type": "object", "properties": {
        "role": {"const": "assistant"}, "content": {"anyOf": [*_CONTENT, _NULL]},
        **{key: _OPTIONAL_STRING for key in MESSAGE_KEYS if key != "tool_calls"},
        "tool_calls": {"anyOf": [{"type": "array", "items": _TOOL_CALL_SCHEMA}, _NULL]}},
     "required": ["role", "content"], "additionalProperties": _NULL},
]
_MESSAGES_SCHEMA = {"type": "array", "minItems": 1, "items": {"anyOf": _MESSAGE_SCHEMAS},
                    "description": "a non-empty list of {'role': ..., 'content': ...}"}
StopField = Annotated[Any, WithJsonSchema(_STOP_SCHEMA)]
PromptField = Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)]
MessagesField = Annotated[Any, WithJsonSchema(_MESSAGES_SCHEMA)]


def _schema(nullable: bool = True, **schema: Any) -> WithJsonSchema:
    """The OpenAPI schema of a field checked by hand or by ``SamplingParams``: what those checks accept."""
    return WithJsonSchema({"anyOf": [schema, _NULL]} if nullable else schema)


class _SamplingRequest(_RequestModel, StructuredOutputFields):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: Annotated[int | None, _schema(type="integer", minimum=1)] = None
    temperature: Annotated[float | None, _schema(type="number", minimum=0)] = None
    top_p: Annotated[float | None, _schema(type="number", exclusiveMinimum=0, maximum=1)] = None
    top_k: Annotated[int | None, _schema(type="integer", minimum=-1)] = None
    min_p: Annotated[float | None, _schema(type="number", minimum=0, maximum=1)] = None
    # exclusiveMaximum: the OpenAPI document holds bounds as floats, and 2**63 - 1 is no float (2**63 is).
    seed: Annotated[int | None, _schema(type="integer", minimum=0, exclusiveMaximum=MAX_SEED + 1)] = None
    stop: StopField = None  # str | list[str] | None: checked by hand and by SamplingParams, naming the field
    stop_token_ids: Annotated[list[int] | None, _schema(type="array", items={"type": "integer", "minimum": 0},
                                                        maxItems=MAX_STOP_TOKEN_IDS)] = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, _schema(False, type="integer", minimum=0)] = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: Annotated[int, _schema(False, type="integer", minimum=1, maximum=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Penalties and logit masks (vLLM's ranges; token ids outside the vocabulary are the engine's 400).
    frequency_penalty: Annotated[float | None, _schema(type="number", minimum=-2, maximum=2)] = None
    presence_penalty: Annotated[float | None, _schema(type="number", minimum=-2, maximum=2)] = None
    repetition_penalty: Annotated[float | None, _schema(type="number", exclusiveMinimum=0)] = None
    logit_bias: Annotated[dict[str, float] | None, _schema(type="object", additionalProperties={"type": "number"},
                                                           propertyNames={"pattern": "^[0-9]+$"})] = None
    allowed_token_ids: Annotated[list[int] | None, _schema(type="array", minItems=1,
                                                           items={"type": "integer", "minimum": 0})] = None
    bad_words: Annotated[list[str] | None, _schema(type="array", items={"type": "string", "minLength": 1})] = None
    best_of: Annotated[int | None, _schema(type="integer", minimum=1, maximum=MAX_N)] = None
    user: str | None = None
    # vLLM's extras for clients that work in token ids: the output (and prompt) token ids in every choice, and
    # logprob tokens written as "token_id:N" instead of their text.
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False

    def _check_unsupported(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise APIError(f"n must be in [1, {MAX_N}] (got {self.n})", param="n")
        if self.best_of is not None and self.best_of != self.n:
            # vLLM's engine dropped best_of > n (sampling more completions than it returns) too.
            raise APIError(f"best_of={self.best_of} is not supported: only best_of equal to n ({self.n}) is accepted, "
                           "every completion sampled is returned", param="best_of")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")
        self._check_stop()

    def _check_stop(self) -> None:
        """Shape and bounds of ``stop`` and ``stop_token_ids`` (their values are checked by ``SamplingParams``)."""
        stop = self.stop
        if stop is not None and not isinstance(stop, str):
            if not isinstance(stop, list):
                raise APIError(f"stop must be a string or a list of strings (got {short_repr(stop)})", param="stop")
            if len(stop) > MAX_STOP_STRINGS:
                raise APIError(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are accepted",
                               param="stop")
            for i, x in enumerate(stop):
                if not isinstance(x, str):
                    raise APIError(f"stop[{i}] must be a string (got {short_repr(x)})", param="stop")
        for i, x in enumerate([stop] if isinstance(stop, str) else stop or []):
            if not x:
                raise APIError("stop must not contain empty strings", param="stop")
            if len(x) > MAX_STOP_STRING_CHARS:
                raise APIError(f"stop[{i}] has {len(x)} characters; at most {MAX_STOP_STRING_CHARS} are accepted",
                               param="stop")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise APIError(f"stop_token_ids holds {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are "
                           "accepted", param="stop_token_ids")

    # Sampling fields a checkpoint's generation_config.json may default (``LLMEngine.default_sampling_params``)
    # and the value used when neither the request nor the checkpoint sets one (vLLM's defaults).
    _DEFAULTABLE: ClassVar[dict[str, Any]] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                              "repetition_penalty": 1.0}

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, names: dict[str, str],
                         defaults: dict[str, Any] | None = None) -> SamplingParams:
        """``defaults`` (the checkpoint's generation config) fill the sampling fields the request did not set;
        a field the request set, even to ``null``, keeps the request's choice."""
        defaults = defaults or {}
        kwargs: dict[str, Any] = {
            "n": self.n,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "logprobs": logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "logit_bias": self.logit_bias,
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words,
        }
        try:
            kwargs["structured_outputs"] = self.structured_outputs_params()
        except StructuredOutputError as e:
            raise APIError(str(e), param=e.param) from e
        for name, fallback in self._DEFAULTABLE.items():
            value = getattr(self, name)
            if value is None and name not in self.model_fields_set:
                value = defaults.get(name)
            kwargs[name] = fallback if value is None else value
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            message = str(e)
            if len(message) > 4 * ECHO_LIMIT:
                message = message[: 4 * ECHO_LIMIT] + "..."
            raise APIError(message, param=sampling_error_param(message, names)) from e

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

    prompt: PromptField = Field(description="a non-empty string, a non-empty list of token ids, or a list of "
                                            "those")
    logprobs: Annotated[int | None, _schema(type="integer", minimum=0, maximum=MAX_LOGPROBS)] = None
    echo: bool = False  # the prompt before the completion (and its logprobs with logprobs)
    # vLLM's: the top-N logprobs of every prompt token (the request then computes its whole prompt: no prefix hit).
    prompt_logprobs: Annotated[int | None, _schema(type="integer", minimum=0, maximum=MAX_LOGPROBS)] = None
    suffix: Annotated[str | None, _schema(type="string", maxLength=0)] = None

    def parse_prompts(self) -> list[str | list[int]]:
        """The prompts: one (a string or a list of token ids) or a list of them (strings or token-id lists)."""
        p = self.prompt
        shapes = "a string, a list of token ids, or a list of strings or of token-id lists"
        if isinstance(p, str):
            if not p:
                raise APIError("prompt must not be empty", param="prompt")
            return [p]
        if not isinstance(p, list):
            raise APIError(f"prompt must be {shapes} (got {type(p).__name__})", param="prompt")
        if not p:
            raise APIError("prompt must not be empty", param="prompt")
        if all(_is_int(t) for t in p):
            return [list(p)]
        out: list[str | list[int]] = []
        for i, inner in enumerate(p):
            where = "prompt" if len(p) == 1 else f"prompt[{i}]"
            if not isinstance(inner, (str, list)) or (isinstance(inner, list) and not all(_is_int(t) for t in inner)):
                raise APIError(f"prompt must be {shapes}", param="prompt")
            if not inner:
                raise APIError(f"{where} must not be empty", param=where)
            out.append(inner if isinstance(inner, str) else list(inner))
        if len({type(x) for x in out}) > 1:
            raise APIError("prompt mixes strings and token-id lists: send a list of one kind", param="prompt")
        return out

    def check(self) -> None:
        """Refuse what this server does not implement (before the prompt is tokenized)."""
        self._check_unsupported()
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(f"logprobs must be in [0, {MAX_LOGPROBS}] (got {self.logprobs})", param="logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise APIError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] (got {self.prompt_logprobs})",
                           param="prompt_logprobs")

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0`` (vLLM's echo without generation: lm-eval's loglikelihood): the prompt
        alone is returned (one token is generated and dropped)."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, max_tokens: int | None, defaults: dict[str, Any] | None = None) -> SamplingParams:
        self.check()
        params = self._sampling_params(max_tokens, self.logprobs, {}, defaults)
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs  # echo with logprobs: the prompt's tokens get them too
        return dataclasses.replace(params, prompt_logprobs=prompt_logprobs)


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``. ``max_tokens`` (or ``max_completion_tokens``) defaults to the room left in the
    context after the prompt."""

    messages: MessagesField = Field(description="a non-empty list of {'role': ..., 'content': ...}")
    max_completion_tokens: Annotated[int | None, _schema(type="integer", minimum=1)] = None
    logprobs: bool = False
    top_logprobs: Annotated[int | None, _schema(type="integer", minimum=0, maximum=MAX_LOGPROBS)] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted only when the server runs with --trust-request-chat-template (vLLM's rule).
    chat_template: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Annotated[str | dict[str, Any] | None,
                           _schema(anyOf=[{"enum": ["none", "auto", "required"]}, {"type": "object"}])] = None
    parallel_tool_calls: bool | None = None  # false: at most the first call is returned
    include_reasoning: bool = True  # vLLM's: false drops the reasoning (--reasoning-parser) from the answer

    def parse_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (see ``parse_chat``)."""
        return self.parse_chat().messages

    def parse_chat(self) -> ParsedChat:
        """The messages for the chat template and their image parts, in order (none is read here).

        Text-only content renders as before (text parts joined with ``"\\n"``); a message with ``image_url`` parts
        keeps its parts, each image as ``{"type": "image"}`` (``hyserve.multimodal.chat``).
        """
        raw = self.messages
        if not isinstance(raw, list):
            raise APIError(f"messages must be a list of {{'role': ..., 'content': ...}} objects "
                           f"(got {type(raw).__name__})", param="messages")
        if not raw:
            raise APIError("messages must not be empty", param="messages")
        out: list[dict[str, Any]] = []
        images: list[ImageRef] = []
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
            content, found = _message_content(m["content"], role, f"{where}.content")
            images += found
            msg: dict[str, Any] = {"role": role, "content": content}
            for key, value in m.items():
                if key in ("role", "content") or value is None:
                    continue  # null is every optional key's no-op value (clients echo e.g. "refusal": null back)
                if key not in MESSAGE_KEYS:
                    raise APIError(f"{where}.{short_repr(key)[1:-1]} is not supported (only role, content, "
                                   f"{', '.join(MESSAGE_KEYS)} are)", param=f"{where}.{key}")
                if key == "tool_calls":
                    if role != "assistant":
                        raise APIError(f"{where}.tool_calls is only allowed in assistant messages",
                                       param=f"{where}.tool_calls")
                    msg[key] = _tool_calls(value, f"{where}.tool_calls")
                elif not isinstance(value, str):
                    raise APIError(f"{where}.{key} must be a string (got {short_repr(value)})",
                                   param=f"{where}.{key}")
                else:
                    msg[key] = value
            out.append(msg)
        return ParsedChat(out, images)

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the asked maximum, the field it came from): ``max_completion_tokens`` wins over ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def check(self) -> None:
        """Refuse what this server does not implement (before the messages are rendered)."""
        self._check_unsupported()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError("top_logprobs needs logprobs to be true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}] (got {self.top_logprobs})",
                               param="top_logprobs")

    def to_sampling_params(self, max_tokens: int | None, defaults: dict[str, Any] | None = None) -> SamplingParams:
        self.check()
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        _, max_name = self.requested_max_tokens
        return self._sampling_params(max_tokens, logprobs, {"max_tokens": max_name, "logprobs": "top_logprobs"},
                                     defaults)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls as chat templates read them: ``function.arguments`` as an object.

    OpenAI sends arguments as a JSON string; transformers' templates expect a dict (as vLLM converts them).
    """
    if not isinstance(value, list):
        raise APIError(f"{where} must be a list of tool calls (got {short_repr(value)})", param=where)
    out: list[dict[str, Any]] = []
    for j, call in enumerate(value):
        here = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or call.get("type") not in (None, "function"):
            raise APIError(f"{here} must be {{'type': 'function', 'function': {{'name': str, 'arguments': ...}}}}",
                           param=here)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise APIError(f"{here}.function.arguments is not valid JSON: {e}", param=f"{here}.function.arguments"
                               ) from e
        if not isinstance(args, dict):
            raise APIError(f"{here}.function.arguments must be a JSON object (got {short_repr(args)})",
                           param=f"{here}.function.arguments")
        out.append({**call, "type": "function", "function": {**fn, "arguments": args}})
    return out


def _message_content(content: Any, role: str, where: str) -> tuple[str | list[Any], list[ImageRef]]:
    """A message's content for the template, and its image parts (text and ``image_url`` parts are accepted)."""
    if isinstance(content, str):
        return content, []
    if content is None:
        if role == "assistant":
            return "", []
        raise APIError(f"{where} must not be null for role {role!r}", param=where)
    if isinstance(content, list):
        try:
            return parse_content(content, where, part_types=SERVER_PART_TYPES, join_text=True)
        except ContentPartError as e:
            raise APIError(str(e), param=e.param) from e
    raise APIError(f"{where} must be a string or a list of content parts (got {type(content).__name__})", param=where)


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


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_OmitNone):
    _omit_if_none = frozenset({"name", "arguments"})

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OmitNone):
    """A streamed call's piece: the first has its id, type and name; later ones append to ``arguments``."""

    _omit_if_none = frozenset({"id", "type"})

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatMessage(_OmitNone):
    _omit_if_none = frozenset({"reasoning_content", "tool_calls"})

    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


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
    _omit_if_none = frozenset({"role", "content", "reasoning_content", "tool_calls"})

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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
