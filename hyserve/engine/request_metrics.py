"""Per-request latencies and lengths as histograms, measured where they happen (the engine thread), with vLLM's
bucket boundaries so that dashboards built for vLLM read them unchanged (``hyserve.server.metrics_vllm`` exports
them as ``vllm:*`` Prometheus histograms).

The times come from the request's own timestamps (``Request``: ``arrival_time`` when the engine took it,
``first_scheduled_time`` when a step first ran it, ``first_token_time`` / ``last_token_time`` when output tokens
were appended, ``finished_time``):

- time to first token: arrival to the first output token;
- inter-token latency: one observation per output step after the first (a verify step that emits several tokens
  is one observation), the time since the request's previous output step;
- queue time: arrival to first scheduled; prefill time: first scheduled to first token; decode time: first token
  to last token; inference time: first scheduled to last token; end to end: arrival to finished.

A request that finishes before it was scheduled (aborted while waiting, refused) observes end to end only.
Everything here is host-side numbers (the scheduler side of the seam).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Protocol

# vLLM's boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
# The finish reasons vLLM labels ``vllm:request_success`` with (every one present from the start, at 0).
FINISH_REASONS = ("stop", "length", "abort", "error")


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(buckets)
            buckets.append(float(m * scale))
        scale *= 10


@dataclass(slots=True)
class Histogram:
    """Observations counted per bucket (``counts[i]``: values ``<= buckets[i]`` and above the previous bound; the
    last entry counts those above every bound), with their sum."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= it)`` for every bound and ``+Inf``, as Prometheus writes ``_bucket``."""
        out: list[tuple[float, int]] = []
        total = 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out

    def copy(self) -> Histogram:
        return Histogram(self.buckets, list(self.counts), self.sum)


class TimedRequest(Protocol):
    """What the latencies read from a request (``hyserve.request.Request`` has it)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None

    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...


@dataclass(slots=True)
class RequestMetrics:
    """The histograms and the finish-reason counts; the engine calls ``on_output_step`` and ``on_finished``."""

    max_model_len: int = 1 << 20
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    inter_token: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    prefill: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    decode: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    inference: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    prompt_tokens: Histogram = field(default_factory=lambda: Histogram(()))
    generation_tokens: Histogram = field(default_factory=lambda: Histogram(()))
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))

    def __post_init__(self) -> None:
        if not self.prompt_tokens.buckets:
            self.prompt_tokens = Histogram(build_1_2_5_buckets(self.max_model_len))
            self.generation_tokens = Histogram(build_1_2_5_buckets(self.max_model_len))

    def on_output_step(self, previous_token_time: float | None, req: TimedRequest) -> None:
        """``req`` took output tokens this step; ``previous_token_time`` is its ``last_token_time`` before them."""
        now = req.last_token_time
        if now is None or now == previous_token_time:
            return
        if previous_token_time is None:
            self.ttft.observe(max(0.0, now - req.arrival_time))
        else:
            self.inter_token.observe(max(0.0, now - previous_token_time))

    def on_finished(self, req: TimedRequest, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
        end = req.finished_time if req.finished_time is not None else req.arrival_time
        self.e2e.observe(max(0.0, end - req.arrival_time))
        self.prompt_tokens.observe(req.num_prompt_tokens)
        self.generation_tokens.observe(req.num_output_tokens)
        scheduled = req.first_scheduled_time
        if scheduled is None:
            return
        self.queue.observe(max(0.0, scheduled - req.arrival_time))
        first, last = req.first_token_time, req.last_token_time
        if first is None or last is None:
            return
        self.prefill.observe(max(0.0, first - scheduled))
        self.decode.observe(max(0.0, last - first))
        self.inference.observe(max(0.0, last - scheduled))

    def copy(self) -> RequestMetrics:
        """A consistent copy for another thread (the server's ``/metrics``)."""
        return RequestMetrics(self.max_model_len, self.ttft.copy(), self.inter_token.copy(), self.e2e.copy(),
                              self.queue.copy(), self.prefill.copy(), self.decode.copy(), self.inference.copy(),
                              self.prompt_tokens.copy(), self.generation_tokens.copy(), dict(self.finished))
