"""Request outputs, shaped like vLLM's (``vllm.outputs``) so that its users read them the same way.

Invariants:

- ``CompletionOutput.token_ids`` and ``text`` are cumulative (everything generated so far), vLLM's default
  output kind; ``finish_reason`` is ``None`` while the completion is still running and one of ``"stop"``,
  ``"length"``, ``"abort"`` or ``"error"`` once it has finished.
- ``stop_reason`` is the stop string or stop token id that ended the completion, ``None`` for EOS, length,
  abort or error.
- ``logprobs``, when requested, has one dict per entry of ``token_ids``; each dict maps token id -> ``Logprob``
  and contains the sampled token plus the requested top-N.
- ``RequestOutput.finished`` is true iff every one of its ``outputs`` has finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Logprob:
    """The log-probability of one token; ``rank`` is 1-based within the vocabulary (1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob (vLLM's ``SampleLogprobs``).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt position; the first is None (nothing precedes it), as vLLM's ``PromptLogprobs``.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a request (hyserve supports ``n == 1``, so ``index`` is 0)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step (or at the end of ``LLM.generate``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, Any] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int | None = None
