"""Continuous batching with chunked prefill, FCFS admission and preemption by recompute.

Each step spends a token budget (``max_num_batched_tokens``). Running requests come first, in admission order: a
decoding request takes one token, a request in the middle of its prompt takes the next chunk that fits. Waiting
requests are then admitted in arrival order while the budget, ``max_num_seqs``, KV blocks and state slots allow; a
request that does not fit blocks the queue behind it (FCFS). When a running request needs a KV block and none is free,
the most recently admitted running request is preempted: its blocks and slot are freed at once and it goes back to the
front of the queue, to be recomputed from its prompt and the output it had produced.

With prefix caching, admission first looks the request up (``PrefixCache.lookup``): a hit of L tokens gives it the
cached KV blocks of [0, L) and a snapshot to copy into its slot, and it starts computing at L. Chunks are split so
that every snapshot point of a request falls on the end of a chunk.

Liveness: admission never waits for memory that cannot be freed. A request's first chunk needs the blocks of
[0, end) and nothing else (a hit's blocks are shared as they are, see ``prefix_cache``), and every admitted prompt is
shorter than max_model_len, which fits the pool; so with nothing running the FCFS head always fits. Should it not
(a bug, or a pool smaller than its request), the head is failed (``SchedulerOutput.failed``, finished with an error
that names both numbers) instead of blocking every request behind it forever.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hyserve.cache.block_pool import BlockPool
from hyserve.cache.prefix_cache import PrefixCache, PrefixHit
from hyserve.cache.state_pool import StatePool
from hyserve.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRow:
    request: Request
    start: int  # num_computed_tokens when scheduled: first position of this chunk
    num_new_tokens: int
    load_snapshot: int | None = None  # state-pool entry copied into the slot before the step (prefix hit)
    snapshot_at: int | None = None  # == end when the step ends on a snapshot point of the request
    # Speculative decoding: a verify row feeds [last token + drafts]; its GDN state goes to scratch until accepted.
    draft_token_ids: list[int] = field(default_factory=list)
    is_verify: bool = False

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the request's known tokens, so the step samples its next token(s)."""
        return self.is_verify or self.end == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    rows: list[ScheduledRow] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that can never be admitted (with the reason): the engine finishes them with an error.
    failed: list[tuple[Request, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.rows


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, block_pool: BlockPool,
                 state_pool: StatePool, prefix_cache: PrefixCache | None = None, speculative: bool = False) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_pool = block_pool
        self.state_pool = state_pool
        self.prefix_cache = prefix_cache
        self.speculative = speculative
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            row = self._chunk(req, req.num_computed_tokens, budget)
            if not self._grow_or_preempt(req, row.num_new_tokens, out):
                break  # req itself was preempted; it was the last running request
            out.rows.append(row)
            budget -= row.num_new_tokens
            i += 1
        if out.preempted:
            return out  # memory is short: admit nobody new this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if self.state_pool.num_free_slots == 0:
                break
            hit = self.prefix_cache.lookup(req) if self.prefix_cache else PrefixHit(0, [], None, None)
            req.branch_point = hit.branch_point
            row = self._chunk(req, hit.num_tokens, budget)
            need = self.block_pool.blocks_needed(row.end, len(hit.blocks))
            if need > self.block_pool.num_free_blocks:
                if self.prefix_cache:
                    self.prefix_cache.release_hit(hit)
                if not self.running:
                    # Nothing holds memory that could be freed for it: waiting would hang every request behind it.
                    self.waiting.popleft()
                    out.failed.append((req, f"its first chunk needs {need + len(hit.blocks)} KV blocks but the "
                                            f"cache has {self.block_pool.num_usable_blocks}"))
                    continue
                break
            self.waiting.popleft()
            req.state_slot = self.state_pool.allocate()
            req.block_table = hit.blocks + self.block_pool.allocate(need)
            req.num_computed_tokens = req.num_cached_tokens = hit.num_tokens
            req.num_published_blocks = len(hit.blocks)
            req.status = RequestStatus.RUNNING
            row.load_snapshot = hit.snapshot_entry
            if self.prefix_cache:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += hit.num_tokens
            self.running.append(req)
            out.rows.append(row)
            budget -= row.num_new_tokens
        return out

    def _chunk(self, req: Request, start: int, budget: int) -> ScheduledRow:
        """The next chunk of ``req`` from ``start``: as much as the budget allows, cut at its next snapshot point.

        A decoding request under speculative decoding is one verify row: its last token and the drafts that fit the
        budget; it is never cut (its snapshots come from the verified candidates, see the engine).
        """
        if self.speculative and start == req.num_tokens - 1 and req.num_output_tokens > 0:
            drafts = req.draft_token_ids[: budget - 1]
            return ScheduledRow(req, start, 1 + len(drafts), draft_token_ids=drafts, is_verify=True)
        end = start + min(req.num_tokens - start, budget)
        point = self.prefix_cache.next_snapshot_point(req, start, end) if self.prefix_cache else None
        if point is not None:
            end = point
        return ScheduledRow(req, start, end - start, snapshot_at=point)

    def _grow_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Give ``req`` the blocks for ``n`` more tokens, preempting from the back. False if req was preempted."""
        need = self.block_pool.blocks_needed(req.num_computed_tokens + n, len(req.block_table))
        while need > self.block_pool.num_free_blocks:
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        req.block_table.extend(self.block_pool.allocate(need))
        return True

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_computed_tokens = 0
        req.num_published_blocks = 0
        req.branch_point = None
        req.rolling_snapshot_hash = None  # stays cached as an ordinary snapshot
        req.draft_token_ids = []
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        if req.block_table:
            self.block_pool.free(req.block_table)
            req.block_table = []
        if req.state_slot is not None:
            self.state_pool.free(req.state_slot)
            req.state_slot = None

    def finish(self, req: Request) -> None:
        """Remove a finished request from the running set and free its memory at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
