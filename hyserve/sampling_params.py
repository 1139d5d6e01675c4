"""``SamplingParams``: how to pick each output token and when to stop, with vLLM's names and defaults.

Invariants (established by ``__post_init__``; every constructor path, including ``clone()``, goes through it):

- ``n`` is an int >= 1: the number of completions of the prompt (each is a child request of its own, the engine's
  ``hyserve.engine.parallel_sampling``; with a seed, child i draws with ``seed + i``).
- ``temperature`` is a finite float >= 0; ``top_p`` a float in (0, 1]; ``top_k`` an int >= 0, where 0 means off
  (vLLM's ``-1`` is accepted and normalized to 0); ``min_p`` a float in [0, 1].
- Greedy requests (``temperature < _SAMPLING_EPS``, as vLLM) have ``top_p == 1``, ``top_k == 0`` and
  ``min_p == 0``: the truncation knobs mean nothing for an argmax and are reset, as vLLM does.
- ``stop`` is a list of non-empty strings and ``stop_token_ids`` a list of ints >= 0 (``None``/a single string
  are normalized); both lists are fresh copies owned by this object.
- ``max_tokens`` is ``None`` (bounded only by the model length) or >= 1; ``0 <= min_tokens <= max_tokens``.
- ``logprobs`` is ``None`` (no logprobs) or the number N >= 0 of top logprobs to return per output token (the
  sampled token's own logprob is returned whenever ``logprobs`` is not ``None``, as in vLLM).
- ``prompt_logprobs`` is ``None`` or the number N >= 0 of top logprobs to return per prompt position besides the
  prompt token's own (vLLM's; ``RequestOutput.prompt_logprobs``). Such a request takes no prefix-cache hit: the
  positions it needs logits for are computed again.
- ``seed`` is ``None`` or an int in [0, 2**63 - 1] (``MAX_SEED``): every seed in that range gives its own stream of
  draws. Beyond it, seeds would alias others (the sampler's per-token seeds are computed modulo 2**64, and a CPU
  generator keeps only the low 32 bits of them, which makes ``s`` and ``s + 2**63`` draw alike), and a negative
  seed such as -1 (a "random seed" to some clients) would be one more fixed seed; both are refused.
- Penalties (vLLM's ranges): ``presence_penalty`` and ``frequency_penalty`` are floats in [-2, 2] (0 = off),
  ``repetition_penalty`` a float > 0 (1 = off).
- ``logit_bias`` is ``None`` or a fresh dict token id (int >= 0) -> bias, each bias clamped to [-100, 100] (as
  vLLM does for the OpenAI API; string keys such as JSON's ``"42"`` are read as ints); an empty dict is ``None``.
- ``allowed_token_ids`` is ``None`` or a non-empty list of ints >= 0; ``bad_words`` is ``None`` or a list of
  non-empty strings; ``bad_words_token_ids`` is what the engine makes of ``bad_words`` with the model's tokenizer
  (``with_bad_words_token_ids``): per word, its ids without and with a leading space (vLLM's rule), each a
  non-empty list of ints >= 0. Whether ids are inside the vocabulary is the engine's check (it knows the model).
- ``output_kind`` is a ``RequestOutputKind`` (vLLM's): CUMULATIVE (the default) outputs hold everything generated so
  far, DELTA outputs only what is new since the request's previous output, FINAL_ONLY gives one cumulative output
  when the request finishes.

Every violation raises ``ValueError`` whose message names the field and the offending value (wrong types
included, so an API layer can turn any of them into a 400). The object is mutable like vLLM's, but mutation
bypasses validation: build a new one (or ``dataclasses.replace``) instead of assigning fields.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hyserve.structured_output.params import StructuredOutputsParams

# vLLM's threshold: a temperature below this is greedy (argmax) decoding.
_SAMPLING_EPS = 1e-5
# The largest request seed: seeds are non-negative 64-bit signed ints (see the module docstring).
MAX_SEED = 2**63 - 1


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds (vLLM's enum)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingType(enum.IntEnum):
    """How a request's tokens are drawn (vLLM's enum)."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _wrong_type(name: str, expected: str, value: Any) -> ValueError:
    # ValueError, not TypeError: a wrong type is a bad request value like any other (vLLM does the same).
    return ValueError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")


def _as_int(name: str, value: Any) -> int:
    # bool is an int subclass, but ``top_k=True`` is a bug, not a number.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _wrong_type(name, "an int", value)
    return int(value)


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _wrong_type(name, "a number", value)
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return out


def _token_id(name: str, value: Any) -> int:
    """A token id >= 0; a string of digits (a JSON object key) is read as one."""
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"{name} keys must be token ids (integers), got {value!r}") from None
    token = _as_int(f"{name} token id", value)
    if token < 0:
        raise ValueError(f"{name} token ids must be >= 0, got {token}")
    return token


def _as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _wrong_type(name, "a bool", value)
    return value


@dataclass(slots=True)
class SamplingParams:
    """Sampling and stopping parameters of one request; see the module docstring for the invariants."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    # Annotated with their normalized types, so that readers need no None checks; the constructor also
    # accepts vLLM's ``stop: str | list[str] | None`` and ``stop_token_ids: list[int] | None`` (and tuples).
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # What the output must match (a JSON schema, regex, choice, grammar, any JSON object); a dict of its fields is
    # accepted too. Applied as an allowed-token mask at every sampled position (hyserve.structured_output).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.n = _as_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")

        self.temperature = _as_float("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _as_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _as_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disable) or at least 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _as_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

        if self.seed is not None:
            self.seed = _as_int("seed", self.seed)
            if not 0 <= self.seed <= MAX_SEED:
                raise ValueError(f"seed must be in [0, {MAX_SEED}] (0 to 2**63 - 1), got {self.seed}")

        self.stop = self._normalize_stop(self.stop)
        self.stop_token_ids = self._normalize_stop_token_ids(self.stop_token_ids)
        self.ignore_eos = _as_bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _as_bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _as_bool("include_stop_str_in_output", self.include_stop_str_in_output)

        if not isinstance(self.output_kind, RequestOutputKind):
            raise _wrong_type("output_kind", "a RequestOutputKind", self.output_kind)

        if self.max_tokens is not None:
            self.max_tokens = _as_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        self.min_tokens = _as_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")

        if self.logprobs is not None:
            self.logprobs = _as_int("logprobs", self.logprobs)
            if self.logprobs < 0:
                raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _as_int("prompt_logprobs", self.prompt_logprobs)
            if self.prompt_logprobs < 0:
                raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")

        self._check_logits_processing()

        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                    StructuredOutputsParams):
            raise _wrong_type("structured_outputs", "a StructuredOutputsParams or a dict", self.structured_outputs)

        if self.temperature < _SAMPLING_EPS:
            # Greedy: truncation cannot change an argmax; reset so that downstream code sees "off".
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    def _check_logits_processing(self) -> None:
        """Penalties, logit_bias, allowed_token_ids and bad words (vLLM's ranges and messages)."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise _wrong_type("logit_bias", "a dict of token id -> bias", self.logit_bias)
            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                token = _token_id("logit_bias", key)
                bias[token] = min(100.0, max(-100.0, _as_float(f"logit_bias[{key!r}]", value)))
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)):
                raise _wrong_type("allowed_token_ids", "a list of ints", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (null allows every token)")
            self.allowed_token_ids = [_token_id("allowed_token_ids", t) for t in self.allowed_token_ids]
        if self.bad_words is not None:
            items = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
            if not isinstance(items, (list, tuple)) or not all(isinstance(w, str) and w for w in items):
                raise _wrong_type("bad_words", "a list of non-empty strings", self.bad_words)
            self.bad_words = list(items)
        if self.bad_words_token_ids is not None:
            words = self.bad_words_token_ids
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, (list, tuple)) and w for w in words):
                raise _wrong_type("bad_words_token_ids", "a list of non-empty lists of ints", words)
            self.bad_words_token_ids = [[_token_id("bad_words_token_ids", t) for t in w] for w in words]

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the request's tokens so far: penalties or bad words."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.bad_words_token_ids))

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before sampling: penalties, logit_bias, allowed_token_ids, bad words."""
        return self.needs_history or self.logit_bias is not None or self.allowed_token_ids is not None

    def out_of_vocab(self, vocab_size: int) -> str | None:
        """A message naming the field whose token ids reach outside ``[0, vocab_size)``, or None."""
        fields = (("logit_bias", list(self.logit_bias or ())), ("allowed_token_ids", self.allowed_token_ids or []),
                  ("bad_words", [t for w in self.bad_words_token_ids or [] for t in w]))
        for name, ids in fields:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                return f"{name} contains token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
        return None

    def with_bad_words_token_ids(self, encode: Callable[[str], list[int]]) -> SamplingParams:
        """A copy with ``bad_words_token_ids`` from ``bad_words`` (``encode``: text -> ids without special tokens),
        vLLM's rule: each word (leading spaces stripped) as it is and after a space; the spaced form only where it
        is as many tokens as the plain one and starts with another token (a separate word token)."""
        if not self.bad_words:
            return self
        out: list[list[int]] = []
        for word in self.bad_words:
            plain = encode(word.lstrip())
            if plain:
                out.append(plain)
            spaced = encode(" " + word.lstrip())
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                out.append(spaced)
        return dataclasses.replace(self, bad_words_token_ids=out or None)

    @staticmethod
    def _normalize_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)):
            raise _wrong_type("stop", "a string or a list of strings", stop)
        out: list[str] = []
        for s in items:
            if not isinstance(s, str):
                raise _wrong_type("stop", "a list of strings", stop)
            if not s:
                raise ValueError(f"stop must not contain empty strings, got {stop!r}")
            out.append(s)
        return out

    @staticmethod
    def _normalize_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise _wrong_type("stop_token_ids", "a list of ints", ids)
        out = [_as_int(f"stop_token_ids[{i}]", t) for i, t in enumerate(ids)]
        for t in out:
            if t < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t} in {list(ids)!r}")
        return out

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def clone(self) -> SamplingParams:
        """An independent copy (the stop lists are copied, not shared)."""
        return dataclasses.replace(self)
