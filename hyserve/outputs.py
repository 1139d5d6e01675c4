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
- ``Logprob.rank`` is the 1-based rank of the token in the whole vocabulary under the distribution its logprob is
  reported from: 1 + the number of tokens with a strictly larger logprob (so ties share a rank).
- ``RequestOutput.metrics`` holds the request's timestamps (``time.time()`` seconds, vLLM's ``RequestMetrics``);
  a time the request has not reached yet is ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass


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
class RequestMetrics:
    """When a request reached each stage, as vLLM's ``RequestMetrics`` (wall-clock ``time.time()`` seconds).

    ``first_scheduled_time`` is the start of the first step that ran it; ``time_in_queue`` is
    ``first_scheduled_time - arrival_time``; ``first_token_time`` / ``last_token_time`` are when its first / latest
    output token was produced; ``finished_time`` when it finished (stop, length, abort or error).
    """

    arrival_time: float
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step (or at the end of ``LLM.generate``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int | None = None
