"""Engine counters, named as the Prometheus metrics the server exports (``hyserve:*``), and the periodic stats log
line (``StatsLogger``: prompt and generation throughput, running and waiting requests, KV cache and state-slot usage,
as vLLM's "Avg prompt throughput" line)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from hyserve.engine.request_metrics import RequestMetrics, TimedRequest

if TYPE_CHECKING:
    from collections.abc import Sized

    from hyserve.cache.prefix_cache import SnapshotStats

logger = logging.getLogger("hyserve")


# What the counters read from the engine, as Protocols: ``LLMEngine`` satisfies ``MetricsSource`` and this module does
# not import the engine (which imports this module).
class BlockUsage(Protocol):
    @property
    def num_usable_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_cached_blocks(self) -> int: ...
    @property
    def num_evictions(self) -> int: ...


class SlotUsage(Protocol):
    @property
    def num_slots(self) -> int: ...
    @property
    def num_free_slots(self) -> int: ...


class QueueCounts(Protocol):
    @property
    def running(self) -> Sized: ...
    @property
    def waiting(self) -> Sized: ...
    @property
    def prefix_cache_queries(self) -> int: ...
    @property
    def prefix_cache_hits(self) -> int: ...


class SnapshotCounts(Protocol):
    @property
    def stats(self) -> SnapshotStats: ...
    @property
    def num_snapshots(self) -> int: ...
    @property
    def snapshot_bytes(self) -> int: ...
    @property
    def num_host_snapshots_held(self) -> int: ...


class ItemCacheCounts(Protocol):
    @property
    def queries(self) -> int: ...
    @property
    def hits(self) -> int: ...


class MetricsSource(Protocol):
    @property
    def metrics(self) -> EngineMetrics: ...
    @property
    def scheduler(self) -> QueueCounts: ...
    @property
    def block_pool(self) -> BlockUsage: ...
    @property
    def state_slots(self) -> SlotUsage: ...
    @property
    def prefix_cache(self) -> SnapshotCounts | None: ...
    @property
    def processor_cache(self) -> ItemCacheCounts | None: ...


@dataclass(slots=True)
class EngineMetrics:
    num_requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    scheduled_tokens: int = 0
    num_steps: int = 0
    step_time_s: float = 0.0
    request_success: int = 0
    request_aborted: int = 0
    request_errors: int = 0
    num_preemptions: int = 0
    # Prompt positions computed (prefill chunks; a preempted request's recompute counts again), vLLM's "prompt
    # throughput" numerator.
    prompt_tokens_computed: int = 0

    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    spec_steps_per_k: list[int] = field(default_factory=list)  # steps with verify rows, by their k_step
    # Per-request latencies and lengths (histograms) and finish reasons: hyserve.engine.request_metrics.
    requests: RequestMetrics = field(default_factory=RequestMetrics)

    def on_verify(self, num_drafts: list[int], accepted: list[int]) -> None:
        """One verify step: draft counts per row and accepted counts (-1 for error rows)."""
        for k, a in zip(num_drafts, accepted, strict=True):
            if k == 0 or a < 0:
                continue
            self.spec_num_drafts += 1
            self.spec_num_draft_tokens += k
            self.spec_num_accepted_tokens += a
            if len(self.spec_accepted_per_pos) < k:
                self.spec_accepted_per_pos.extend([0] * (k - len(self.spec_accepted_per_pos)))
            for j in range(a):
                self.spec_accepted_per_pos[j] += 1

    def on_spec_step(self, k_step: int) -> None:
        """A step with verify rows at speculation length ``k_step`` (hyserve.speculative.adaptive)."""
        if len(self.spec_steps_per_k) <= k_step:
            self.spec_steps_per_k.extend([0] * (k_step + 1 - len(self.spec_steps_per_k)))
        self.spec_steps_per_k[k_step] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step: accepted drafts + the one token every step emits."""
        return 1.0 + self.spec_num_accepted_tokens / max(self.spec_num_drafts, 1)

    def on_request_added(self, num_prompt_tokens: int) -> None:
        self.num_requests += 1
        self.prompt_tokens += num_prompt_tokens

    def on_request_finished(self, reason: str, req: TimedRequest | None = None) -> None:
        if req is not None:
            self.requests.on_finished(req, reason)
        if reason == "abort":
            self.request_aborted += 1
        elif reason == "error":
            self.request_errors += 1
        else:
            self.request_success += 1

    def on_preemptions(self, n: int) -> None:
        self.num_preemptions += n

    def on_step(self, num_tokens: int, num_sampled: int, seconds: float) -> None:
        self.num_steps += 1
        self.scheduled_tokens += num_tokens
        self.generation_tokens += num_sampled
        self.step_time_s += seconds

    def snapshot(self, engine: MetricsSource) -> dict[str, float | list[float]]:
        pool = engine.block_pool
        pc = engine.prefix_cache
        used = pool.num_usable_blocks - pool.num_free_blocks
        states = engine.state_slots
        mm = engine.processor_cache
        return {
            "hyserve:num_requests": self.num_requests,
            "hyserve:prompt_tokens": self.prompt_tokens,
            "hyserve:generation_tokens": self.generation_tokens,
            "hyserve:scheduled_tokens": self.scheduled_tokens,
            "hyserve:num_steps": self.num_steps,
            "hyserve:step_time_seconds": self.step_time_s,
            "hyserve:request_success": self.request_success,
            "hyserve:request_aborted": self.request_aborted,
            "hyserve:request_errors": self.request_errors,
            "hyserve:num_preemptions": self.num_preemptions,
            "hyserve:num_requests_running": len(engine.scheduler.running),
            "hyserve:num_requests_waiting": len(engine.scheduler.waiting),
            "hyserve:kv_cache_usage_perc": used / max(pool.num_usable_blocks, 1),
            "hyserve:state_slots_usage_perc": (states.num_slots - states.num_free_slots) / max(states.num_slots, 1),
            "hyserve:prefix_cache_queries": engine.scheduler.prefix_cache_queries,
            "hyserve:prefix_cache_hits": engine.scheduler.prefix_cache_hits,
            "hyserve:prefix_cache_snapshot_hits": pc.stats.hits if pc else 0,
            "hyserve:prefix_cache_snapshot_misses": pc.stats.misses if pc else 0,
            "hyserve:prefix_cache_snapshots_taken": pc.stats.taken if pc else 0,
            "hyserve:prefix_cache_snapshot_evictions": pc.stats.evictions if pc else 0,
            "hyserve:prefix_cache_snapshots": pc.num_snapshots if pc else 0,
            "hyserve:prefix_cache_snapshot_bytes": pc.snapshot_bytes if pc else 0,
            "hyserve:prefix_cache_snapshot_host_hits": pc.stats.host_hits if pc else 0,
            "hyserve:prefix_cache_snapshot_offloads": pc.stats.offloads if pc else 0,
            "hyserve:prefix_cache_host_snapshots": pc.num_host_snapshots_held if pc else 0,
            "hyserve:prefix_cache_kv_blocks": pool.num_cached_blocks,
            "hyserve:prefix_cache_kv_evictions": pool.num_evictions,
            "hyserve:mm_cache_queries": mm.queries if mm else 0,
            "hyserve:mm_cache_hits": mm.hits if mm else 0,
            "hyserve:spec_decode_num_drafts": self.spec_num_drafts,
            "hyserve:spec_decode_num_draft_tokens": self.spec_num_draft_tokens,
            "hyserve:spec_decode_num_accepted_tokens": self.spec_num_accepted_tokens,
            "hyserve:spec_decode_num_accepted_tokens_per_pos": [float(x) for x in self.spec_accepted_per_pos],
            "hyserve:spec_decode_steps_per_k": [float(x) for x in self.spec_steps_per_k],
        }


class StatsLogger:
    """Logs one line every ``interval_s`` seconds while the engine has work (vLLM's periodic stats line):

        Avg prompt throughput: X tokens/s, Avg generation throughput: Y tokens/s, Running: N reqs, Waiting: M reqs,
        KV cache usage: P%, state slots usage: Q%

    Throughputs are averages over the interval since the previous line. Idle intervals (no tokens, nothing running
    or waiting) log nothing. ``clock`` is injectable for tests.
    """

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] | None = None) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.log = log or logger.info
        self._last_time = clock()
        self._last_prompt = 0
        self._last_generation = 0

    def maybe_log(self, engine: MetricsSource) -> str | None:
        """Log (and return) the stats line if an interval has passed and there was activity; else None."""
        now = self.clock()
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return None
        m = engine.metrics
        prompt = m.prompt_tokens_computed - self._last_prompt
        generation = m.generation_tokens - self._last_generation
        self._last_time, self._last_prompt, self._last_generation = now, m.prompt_tokens_computed, m.generation_tokens
        running, waiting = len(engine.scheduler.running), len(engine.scheduler.waiting)
        if not (prompt or generation or running or waiting):
            return None
        pool, states = engine.block_pool, engine.state_slots
        kv = (pool.num_usable_blocks - pool.num_free_blocks) / max(pool.num_usable_blocks, 1)
        slots = (states.num_slots - states.num_free_slots) / max(states.num_slots, 1)
        line = (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, Avg generation throughput: "
                f"{generation / elapsed:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {100 * kv:.1f}%, state slots usage: {100 * slots:.1f}%")
        self.log(line)
        return line
