"""Request outputs, shaped like vLLM's (``vllm.outputs``) so that its users read them the same way.

Invariants:

- ``CompletionOutput.token_ids``, ``text`` and ``logprobs`` are cumulative (everything generated so far), vLLM's
  default output kind; with ``SamplingParams.output_kind`` DELTA they hold only what is new since the request's
  previous output (``cumulative_logprob`` stays cumulative); ``finish_reason`` is ``None`` while the completion
  is still running and one of ``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` once it has finished.
- ``stop_reason`` is the stop string or stop token id that ended the completion, ``None`` for EOS, length,
  abort or error.
- ``logprobs``, when requested, has one dict per entry of ``token_ids``; each dict maps token id -> ``Logprob``
  and contains the sampled token plus the requested top-N.
- ``RequestOutput.finished`` is true iff every one of the request's ``n`` completions has finished; ``outputs`` holds
  them by ``index`` (a DELTA output with ``n`` > 1: those with something new).
- ``RequestOutput.prompt_logprobs`` (``SamplingParams.prompt_logprobs``) has one entry per prompt token, the first
  ``None``; a DELTA output carries it once.
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
    """One completion of a request: ``index`` is its place among the request's ``n`` completions (0 to n - 1)."""

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


def merge_delta(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive DELTA outputs of one request as one: texts, token ids and logprobs of each completion (by
    ``index``: with ``n`` > 1 each output holds the completions that had something new) concatenated, the rest
    (finish state, cumulative logprob, metrics) from ``later``. A consumer that falls behind merges what it missed
    instead of dropping it, so the deltas it reads still add up to the whole completion."""
    merged = {c.index: c for c in earlier.outputs}
    for b in later.outputs:
        a = merged.get(b.index)
        if a is None:
            merged[b.index] = b
            continue
        logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
        merged[b.index] = CompletionOutput(index=b.index, text=a.text + b.text, token_ids=a.token_ids + b.token_ids,
                                           cumulative_logprob=b.cumulative_logprob, logprobs=logprobs,
                                           finish_reason=b.finish_reason, stop_reason=b.stop_reason)
    return RequestOutput(request_id=later.request_id, prompt=later.prompt, prompt_token_ids=later.prompt_token_ids,
                         outputs=[merged[i] for i in sorted(merged)], finished=later.finished, metrics=later.metrics,
                         prompt_logprobs=earlier.prompt_logprobs if later.prompt_logprobs is None
                         else later.prompt_logprobs, num_cached_tokens=later.num_cached_tokens)
