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
