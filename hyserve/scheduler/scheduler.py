"""Continuous batching with chunked prefill, FCFS admission and preemption by recompute; both ends of every step.

``schedule()`` decides a step and returns it as plain data (``SchedulerOutput``); ``update_from_output(so, ro)``
takes that step's result. Between them the scheduler is the only writer of a request's computed count, block
table, state slot and drafts (docs/design.md invariant 13): the worker only reads the ids and ints it is sent.

Each step spends a token budget (``max_num_batched_tokens``). Running requests come first, in admission order: a
decoding request takes one token (or, speculating, one verify row [last token + drafts]), a request in the middle of
its prompt takes the next chunk that fits. Waiting requests are then admitted in arrival order while the budget,
``max_num_seqs``, KV blocks and state slots allow; a request that does not fit blocks the queue behind it (FCFS).
When a running request needs a KV block and none is free, the most recently admitted running request is preempted:
its blocks and slot are freed at once and it goes back to the front of the queue, to be recomputed from its prompt
and the output it had produced. KV blocks are allocated here and freed here (finish, preemption, and the rollback
of blocks that only held rejected drafts), nowhere else.

With prefix caching, admission first looks the request up (``PrefixCache.lookup``): a hit of L tokens gives it the
cached KV blocks of [0, L) and a snapshot to copy into its slot, and it starts computing at L. Where every recurrent
layer can take a snapshot inside a prefill row (``snapshots_inside_rows``: the GDN and Mamba2 families), a chunk runs
past the snapshot points it crosses and each gets an entry that the layers fill from the state their prefill computes
there (``ScheduledRow.interior_snapshots``); otherwise chunks are split so that every snapshot point of a request
falls on the end of a chunk. Either way the snapshot's entry is reserved when the step is scheduled and published
when its result is in.

Prefix sharing among requests that arrive together. A waiting request whose prefix a running request is still
computing (the first turns of conversations that share one system prompt) is not admitted alongside it to compute
the same tokens again: it waits while the running one computes the shared part and leaves a snapshot at its end,
and is admitted with a hit there (``_wait_for_sharer``). The requests behind it are admitted as usual meanwhile, and
the wait ends when the sharer passes that point, finishes or is preempted, whatever the snapshot pool did.

Steps in flight (async scheduling). A step may be scheduled before the previous step's result is in. A request's
tokens then run ahead of what is computed: ``num_inflight_tokens`` are scheduled and not yet reported, and a plain
decoding request whose sampled token is not known yet feeds ``PREVIOUS_SAMPLED`` (the worker has that token on the
device). A speculating request's next verify row is scheduled behind the one in flight where nothing in it but its
position depends on that row's accepted count (``_can_verify_behind``): it feeds the last token and the drafts that
row's acceptance and drafting leave on the device, its blocks are reserved for the latest start it can have, and
its start is set when the count comes in (``_place``; ScheduledRow.start_on_device). Otherwise it waits for the
count. A result is read only through the rows of its own step: each row names its request by id, and a request that
was preempted or finished after the step was scheduled takes none of the step's effects on memory.

Liveness: admission never waits for memory that cannot be freed. A request's first chunk needs the blocks of
[0, end) and nothing else (a hit's blocks are shared as they are, see ``prefix_cache``), and every admitted prompt is
shorter than max_model_len, which fits the pool; so with nothing running the FCFS head always fits. Should it not
(a bug, or a pool smaller than its request), the head is failed (``SchedulerOutput.failed``, finished with an error
that names both numbers) instead of blocking every request behind it forever.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from hyserve.cache.block_pool import BlockPool, cdiv
from hyserve.cache.prefix_cache import PrefixCache, PrefixHit, extend_block_hashes
from hyserve.cache.state_slots import StateSlots
from hyserve.request import Request, RequestStatus
from hyserve.scheduler.output import (
    PREVIOUS_DRAFT,
    PREVIOUS_SAMPLED,
    NewRequestData,
    RunnerOutput,
    ScheduledRow,
    SchedulerOutput,
    candidate_point,
)

if TYPE_CHECKING:
    from hyserve.speculative.drafts import DraftManager

# A waiting request waits for a running one that computes its prefix (see _wait_for_sharer) only when that saves it
# at least this many tokens: the wait costs it at least a step, which a few blocks of prefill do not repay.
SHARE_MIN_TOKENS = 256


class StepSink(Protocol):
    """What the scheduler hands a step's tokens to (the engine: detokenization, stop checks, finish reasons)."""

    def append_tokens(self, req: Request, ro: RunnerOutput, row: int) -> str | None:
        """Append row ``row``'s tokens to ``req``; the finish reason if the request ends there."""

    def request_finished(self, req: Request, reason: str, error: str | None = None) -> None:
        """``req`` ends with ``reason`` (its memory is freed by the scheduler right after)."""


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, block_pool: BlockPool,
                 state_slots: StateSlots, max_model_len: int, prefix_cache: PrefixCache | None = None,
                 drafts: DraftManager | None = None,
                 banned_token_ids: Callable[[Request], list[int]] | None = None,
                 pipeline_parallel_size: int = 1, async_verify: bool = False,
                 snapshots_inside_rows: bool = False) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_pool = block_pool
        self.state_slots = state_slots
        self.max_model_len = max_model_len
        self.prefix_cache = prefix_cache
        self.drafts = drafts
        self.banned_token_ids = banned_token_ids or (lambda req: [])
        # Chunks of known tokens run past snapshot points (the worker writes those snapshots inside the row).
        self.snapshots_inside_rows = snapshots_inside_rows and prefix_cache is not None
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._next_step_id = 0
        self._known_to_worker: set[str] = set()
        self._finished_ids: list[str] = []
        # step id -> each row's request epoch (its preemption count when the step was scheduled)
        self._epochs: dict[int, list[int]] = {}
        # Pipeline parallelism: a request's next step waits for its sampled token (the first stage does not have
        # it), and the stages before the last learn each verify step's accepted counts from a later step.
        self.pipeline_parallel_size = pipeline_parallel_size
        self._verify_commits: list[tuple[int, list[int]]] = []
        # Verify rows behind verify rows in flight (async scheduling, one rank, MTP drafts on the device): each
        # request's newest verify row in flight, and its row whose start waits for that row's accepted count.
        self.async_verify = async_verify
        self._verify_in_flight: dict[str, ScheduledRow] = {}
        self._behind: dict[str, ScheduledRow] = {}
        self.num_rows_behind = 0  # verify rows scheduled behind one in flight, in all
        # The speculation length of the step being scheduled (hyserve.speculative.adaptive): its verify rows take at
        # most this many drafts.
        self._k_step = drafts.k if drafts is not None else 0
        self._drafting = self._k_step  # the drafts this step's MTP head proposes (DraftManager.drafting_length)
        # Per request with a verify row in flight: the drafts its step's drafting leaves (DraftManager.
        # drafting_length), the most a row behind it can take.
        self._drafts_after: dict[str, int] = {}

    @property
    def speculative(self) -> bool:
        return self.drafts is not None

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_pending_commits(self) -> bool:
        """Verify commits not sent to the pipeline stages yet (the next step carries them)."""
        return bool(self._verify_commits)

    @property
    def has_pending_finished(self) -> bool:
        """Finished requests the workers have not been told of yet (the next step carries them, even an empty one)."""
        return bool(self._finished_ids)

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._epochs)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(step_id=self._next_step_id)
        self._next_step_id += 1
        budget = self.max_num_batched_tokens
        if self.drafts is not None:
            b = self._num_decoding()
            out.num_spec_tokens = self._k_step = self.drafts.policy.choose(b) if b else self.drafts.k
            out.num_drafting = self._drafting = self.drafts.drafting_length(b, self._k_step)
        preempted: list[Request] = []
        chunks: list[tuple[Request, ScheduledRow, int | None]] = []  # (request, row, the snapshot point it ends on)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if not self._can_schedule(req, budget):
                i += 1
                continue
            row, point = self._chunk(req, req.num_computed_tokens + req.num_inflight_tokens, budget)
            if not self._grow_or_preempt(req, row, preempted):
                break  # req itself was preempted; it was the last running request
            chunks.append((req, row, point))
            budget -= row.num_new_tokens
            i += 1
        out.preempted_req_ids = [r.request_id for r in preempted]
        if not preempted:  # memory is short: admit nobody new this step
            self._admit(out, budget, chunks)
        for req, row, point in chunks:  # after admission: its lookups pin snapshots before any reservation evicts
            self._on_scheduled(req, row, point, out)
        if self.prefix_cache is not None:
            out.snapshot_offloads = self.prefix_cache.take_offloads()
        out.rows.sort(key=lambda r: not r.is_verify)  # stable: verify rows first, as the worker lays them out
        out.finished_req_ids, self._finished_ids = self._finished_ids, []
        if out.rows:
            self._epochs[out.step_id] = [self.requests[r.req_id].num_preemptions for r in out.rows]
        # An empty step is not run, so the commits wait for one that is, or for the pipeline to drain (then the step
        # carries only them, and every stage is up to date while the engine is idle).
        if out.rows or not self._epochs:
            out.verify_commits, self._verify_commits = self._verify_commits, []
        return out

    def _num_decoding(self) -> int:
        """The requests past their prompt: the batch size the step's speculation length is chosen for
        (``hyserve.speculative.adaptive``; the configured k when there are none: no row verifies)."""
        return sum(1 for r in self.running if r.num_output_tokens or r.num_inflight_samples)

    def _can_schedule(self, req: Request, budget: int) -> bool:
        """Whether ``req`` can take part in the next step while its earlier steps are in flight."""
        if not req.num_inflight_samples:
            return True
        if req.grammar is not None:  # its next position's mask needs the token in flight, on the host
            return False
        if self.speculative:
            return self._can_verify_behind(req, budget)
        if self.pipeline_parallel_size > 1:
            return False  # the sampled token is on the last stage; the first stage needs it as input
        p = req.sampling_params
        pending = req.num_output_tokens + req.num_inflight_samples
        max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len
        # The pending token may end the request at max_tokens / max_model_len: do not run a step past it.
        return pending < max_tokens and req.num_tokens + req.num_inflight_samples < self.max_model_len

    def _can_verify_behind(self, req: Request, budget: int) -> bool:
        """Whether ``req``'s next verify row can go behind its verify row in flight: only where nothing in it but
        its start depends on that row's accepted count. The row behind takes ``_behind_drafts`` drafts (the step's
        k_step, at most what the row in flight's step drafts), and the request is far enough from max_tokens and
        max_model_len for the row in flight to leave that many whatever its count; no token position has a seed or
        a min_tokens ban, no logprobs are asked (they are read from logits the drafting overwrites), the prompt has
        no images (their positions are the host's), and the row in flight is not behind one itself with its start
        unknown."""
        if not self.async_verify or req.num_inflight_samples != 1 or req.request_id in self._behind:
            return False
        prev = self._verify_in_flight.get(req.request_id)
        if prev is None:
            return False
        assert self.drafts is not None
        k = self._behind_drafts(req)
        p = req.sampling_params
        if budget < k + 1 or p.seed is not None or p.logprobs is not None or req.mm is not None:
            return False
        if req.num_output_tokens + 1 < p.min_tokens:  # the row's first output index is at least that
            return False
        latest = prev.start + prev.num_new_tokens  # the start if every draft in flight is accepted
        # (The draft limit is at most max_model_len, so this row fits the model's length too.)
        return latest + 1 + k <= self.drafts.draft_limit(req, self.max_model_len)

    def _behind_drafts(self, req: Request) -> int:
        """The drafts a row behind ``req``'s verify row in flight takes: the step's k_step, at most what the row in
        flight's drafting leaves."""
        return min(self._k_step, self._drafts_after.get(req.request_id, self._k_step))

    def _admit(self, out: SchedulerOutput, budget: int,
               chunks: list[tuple[Request, ScheduledRow, int | None]]) -> None:
        """Admit waiting requests in arrival order while the budget, the slots and the memory last.

        A request whose prefix a running request is about to compute waits for it (``_wait_for_sharer``): it is
        skipped, and the requests behind it are considered as usual.
        """
        if not self.waiting:
            return
        pc = self.prefix_cache
        sharers = _Sharers(pc) if pc is not None else None
        if sharers is not None:
            # Every running request still computing its prompt, scheduled in this step or not: one whose chunk
            # through the shared part is in flight (a chunk need not end at a snapshot point) shares it too.
            for req in self.running:
                sharers.add(req)
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[i]
            if self.state_slots.num_free_slots == 0:
                break
            # A request asking prompt logprobs needs logits at every prompt position: no hit, all computed.
            cached = pc is not None and req.sampling_params.prompt_logprobs is None
            hit = pc.lookup(req) if pc is not None and cached else PrefixHit(0, [], None, None)
            if pc is not None and sharers is not None and cached:
                back = self._wait_for_sharer(req, hit.num_tokens, sharers, chunks)
                if back is not None:
                    pc.release_hit(hit)
                    budget += back
                    i += 1
                    continue
            req.share_points = [hit.branch_point] if hit.branch_point is not None else []
            row, point = self._chunk(req, hit.num_tokens, budget)
            need = self.block_pool.blocks_needed(self._blocks_end(req, row), len(hit.blocks))
            if need > self.block_pool.num_free_blocks:
                if self.prefix_cache:
                    self.prefix_cache.release_hit(hit)
                if not self.running:
                    # Nothing holds memory that could be freed for it: waiting would hang every request behind it.
                    del self.waiting[i]
                    out.failed.append((req.request_id, f"its first chunk needs {need + len(hit.blocks)} KV blocks "
                                                       f"but the cache has {self.block_pool.num_usable_blocks}"))
                    continue
                break
            del self.waiting[i]
            req.state_slot = self.state_slots.allocate()
            req.block_table = hit.blocks + self.block_pool.allocate(need)
            req.num_computed_tokens = req.num_cached_tokens = hit.num_tokens
            req.num_published_blocks = len(hit.blocks)
            req.status = RequestStatus.RUNNING
            row.block_table = req.block_table
            row.state_slot = req.state_slot
            row.load_snapshot = hit.snapshot_entry
            row.load_host_snapshot = hit.host_snapshot
            row.reset_state = hit.snapshot_entry is None and hit.host_snapshot is None
            if self.prefix_cache:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += hit.num_tokens
            self.running.append(req)
            chunks.append((req, row, point))
            if sharers is not None:
                sharers.add(req)
            budget -= row.num_new_tokens

    def _wait_for_sharer(self, req: Request, cached: int, sharers: _Sharers,
                         chunks: list[tuple[Request, ScheduledRow, int | None]]) -> int | None:
        """Whether waiting ``req`` should wait for a running request that computes more of its prefix.

        ``req`` shares the prefix ``[0, p)`` with a running request (the sharer) that has not computed it yet, and
        the cache holds only ``cached`` tokens of it: admitted now, ``req`` would compute ``p - cached`` tokens the
        sharer is computing too (the first turns of conversations that start with one system prompt, arriving
        together). If that is at least ``SHARE_MIN_TOKENS`` and the sharer can leave a snapshot at ``p`` (nothing it
        has in flight crosses ``p``), the sharer gets ``p`` as a snapshot point, its chunk in this step is cut there
        if it crosses it (with snapshots inside rows: takes it inside instead), and ``req`` waits: the lookup of a
        later step hits at ``p``. Returns the budget tokens the cut gave back (0 without a cut), or None when ``req``
        should not wait.
        """
        found = sharers.deepest(req, cached)
        if found is None:
            return None
        sharer, p = found
        if p - cached < SHARE_MIN_TOKENS or sharer.num_computed_tokens >= p:
            return None
        if p in sharer.share_points:
            return 0
        if sharer.num_computed_tokens + sharer.num_inflight_tokens >= p:
            return None  # a step in flight reaches p without a snapshot point there
        back = 0
        for k, (r, row, point) in enumerate(chunks):
            if r is sharer:
                if row.end == p:
                    point = p
                elif row.end > p and not self.snapshots_inside_rows:
                    back = self._cut_chunk(row, p)
                    point = p
                # (Inside rows, p is taken where the row crosses it: _on_scheduled reads the share points.)
                chunks[k] = (r, row, point)
                break
        sharer.share_points.append(p)
        return back

    @staticmethod
    def _cut_chunk(row: ScheduledRow, p: int) -> int:
        """End ``row`` (a chunk of prompt tokens: its request has not computed its prefix) at position ``p``, which
        becomes its snapshot point; returns the tokens taken off."""
        back = row.end - p
        row.token_ids = row.token_ids[: p - row.start]
        row.samples = False
        return back

    def _chunk(self, req: Request, start: int, budget: int) -> tuple[ScheduledRow, int | None]:
        """The next chunk of ``req`` from ``start``: as much as the budget allows, cut at its next snapshot point
        (returned too: the chunk's end, or None); with snapshots inside rows not cut, the point returned only where
        the chunk ends on one (the points inside get their entries in ``_on_scheduled``).

        A decoding request under speculative decoding is one verify row: its last token and the drafts that fit the
        budget and the step's speculation length (``_k_step``; 0: its last token alone); it is never cut (its
        snapshot comes from the verified candidate, see ``update_from_output``).
        """
        slot = req.state_slot if req.state_slot is not None else -1
        if req.num_inflight_samples and self.speculative:  # behind the verify row in flight (_can_verify_behind)
            assert self.drafts is not None
            prev = self._verify_in_flight[req.request_id]
            return ScheduledRow(req.request_id, prev.start + 1,
                                [PREVIOUS_SAMPLED] + [PREVIOUS_DRAFT] * self._behind_drafts(req),
                                req.block_table, slot, samples=True, is_verify=True, start_on_device=True,
                                max_start=prev.start + prev.num_new_tokens), None
        if req.num_inflight_samples:  # async: the token this row feeds is still on the device
            assert start == req.num_tokens + req.num_inflight_samples - 1
            return ScheduledRow(req.request_id, start, [PREVIOUS_SAMPLED], req.block_table, slot, samples=True), None
        if self.speculative and start == req.num_tokens - 1 and req.num_output_tokens > 0:
            drafts = req.draft_token_ids[: min(budget - 1, self._k_step)]
            if req.grammar is not None and PREVIOUS_DRAFT in drafts:
                drafts = []  # the masks of a verify row's positions need its drafts on the host
            return ScheduledRow(req.request_id, start, [req.output_token_ids[-1], *drafts], req.block_table, slot,
                                samples=True, is_verify=True), None
        end = start + min(req.num_tokens - start, budget)
        points = self.prefix_cache.snapshot_points(req, start, end) if self.prefix_cache else []
        point = None
        if points and self.snapshots_inside_rows:
            point = end if points[-1] == end else None  # the points before it are taken inside (_on_scheduled)
        elif points:
            point = end = points[0]
        return ScheduledRow(req.request_id, start, req.token_ids(start, end), req.block_table, slot,
                            samples=end == req.num_tokens), point

    def _blocks_end(self, req: Request, row: ScheduledRow) -> int:
        """Tokens the request's blocks must hold for ``row``: its end (at its latest start), plus the MTP head's
        drafting positions."""
        end = row.latest_start + row.num_new_tokens
        if self.drafts is not None and row.samples:
            end = min(end + self.drafts.lookahead_tokens, self.max_model_len)
        return end

    def _grow_or_preempt(self, req: Request, row: ScheduledRow, preempted: list[Request]) -> bool:
        """Give ``req`` the blocks ``row`` needs, preempting from the back. False if req was preempted."""
        need = self.block_pool.blocks_needed(self._blocks_end(req, row), len(req.block_table))
        while need > self.block_pool.num_free_blocks:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        req.block_table.extend(self.block_pool.allocate(need))
        return True

    def _on_scheduled(self, req: Request, row: ScheduledRow, point: int | None, out: SchedulerOutput) -> None:
        """Add ``row`` to the step with what the worker needs beyond the tokens: sampling data, snapshot entries
        (``point``: the snapshot point the chunk ends on), the in-flight count."""
        out.rows.append(row)
        row.block_table = list(req.block_table)  # the step's own copy: the request's table changes after it
        if req.request_id not in self._known_to_worker:
            self._known_to_worker.add(req.request_id)
            prompt = list(req.prompt_token_ids) if req.sampling_params.needs_history else None
            out.new_requests.append(NewRequestData(req.request_id, req.sampling_params, req.mm, prompt))
        pc = self.prefix_cache
        if pc is not None:
            # Snapshot entries are reserved now and filled by the worker during (points inside a chunk) or right
            # after this step's forward. A chunk of known tokens ends at its snapshot point or takes the points it
            # crosses inside; a verify row or a row of a token still on the device may cross a block boundary whose
            # prefix is known only from the result.
            if row.is_verify and row.start_on_device:
                # The point is known with the start: an entry if the latest start's row reaches a boundary.
                reach = row.latest_start + row.num_new_tokens
                if candidate_point(row.start, reach - row.start, pc.block_size) is not None:
                    entry = pc.reserve_entry(spare_only=True)
                    if entry is not None:
                        row.candidate_snapshot = (-1, entry)
            elif row.is_verify:
                boundary = candidate_point(row.start, row.num_new_tokens, pc.block_size)
                if boundary is not None:
                    entry = pc.reserve_entry(spare_only=True)
                    if entry is not None:
                        row.candidate_snapshot = (boundary, entry)
            elif row.token_ids[0] == PREVIOUS_SAMPLED:
                if row.end % pc.block_size == 0:
                    row.snapshot_entry = pc.reserve_entry()
            else:
                if self.snapshots_inside_rows and row.num_new_tokens > 1:  # (a decode row has no inside)
                    for p in pc.snapshot_points(req, row.start, row.end - 1):
                        entry = pc.reserve_snapshot(req, p)
                        if entry is not None:
                            row.interior_snapshots.append((p, entry))
                if point is not None:
                    row.snapshot_entry = pc.reserve_snapshot(req, point)
        if row.samples:
            row.output_index = req.num_output_tokens + req.num_inflight_samples
            if row.output_index < req.sampling_params.min_tokens:
                row.banned_token_ids = self.banned_token_ids(req)
            if req.grammar is not None:
                row.grammar_bitmask = req.grammar.masks(row.token_ids[1:] if row.is_verify else [])
            if self.drafts is not None:
                row.draft_limit = self.drafts.draft_limit(req, self.max_model_len)
            req.num_inflight_samples += 1
            if row.is_verify:
                self._verify_in_flight[req.request_id] = row
                assert self.drafts is not None
                self._drafts_after[req.request_id] = self._drafting
                if row.start_on_device:
                    self._behind[req.request_id] = row
                    self.num_rows_behind += 1
        elif row.end < req.num_tokens:
            row.next_token_id = req.token_ids(row.end, row.end + 1)[0]
        if req.sampling_params.prompt_logprobs is not None and not row.is_verify \
                and row.start < req.num_prompt_tokens - 1 and row.token_ids[0] != PREVIOUS_SAMPLED:
            row.prompt_logprob_targets = req.token_ids(row.start + 1, min(row.end, req.num_prompt_tokens - 1) + 1)
        req.num_inflight_tokens += row.num_new_tokens

    def _preempt(self, req: Request) -> None:
        self._release(req)
        self._forget_in_flight(req)
        req.num_computed_tokens = 0
        req.num_inflight_tokens = 0
        req.num_inflight_samples = 0
        req.num_published_blocks = 0
        req.share_points = []
        req.rolling_snapshot_hash = None  # stays cached as an ordinary snapshot
        req.draft_token_ids = []
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _forget_in_flight(self, req: Request) -> None:
        """Its rows in flight are no longer its (their results are discarded by the epochs)."""
        self._verify_in_flight.pop(req.request_id, None)
        self._behind.pop(req.request_id, None)
        self._drafts_after.pop(req.request_id, None)

    def _release(self, req: Request) -> None:
        if req.block_table:
            self.block_pool.free(req.block_table)
            req.block_table = []
        if req.state_slot is not None:
            self.state_slots.free(req.state_slot)
            req.state_slot = None

    def finish(self, req: Request) -> None:
        """Remove a finished (or aborted) request and free its memory at once; the worker forgets it next step.

        A step of it still in flight keeps writing the memory it was given; whoever gets that memory next writes it
        in a later step, which every stage runs after (stream order), and reads only what it wrote itself. The one
        late write, a verify step's commit on the stages before the last, is cancelled for its rows when the result
        comes in (``_queue_verify_commits``, invariant 14).
        """
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        self._forget_in_flight(req)
        req.status = RequestStatus.FINISHED
        if self.requests.pop(req.request_id, None) is not None and req.request_id in self._known_to_worker:
            self._known_to_worker.discard(req.request_id)
            self._finished_ids.append(req.request_id)

    # ------------------------------------------------------------------ update

    def update_from_output(self, so: SchedulerOutput, ro: RunnerOutput, sink: StepSink) -> list[Request]:
        """Apply step ``so``'s result ``ro``: computed counts, tokens (through ``sink``), the prefix cache, the
        rollback of rejected drafts' blocks and the next drafts. Returns, in row order, the requests the step ran and
        those it ended.

        Every row is matched to its request by the id in ``so`` and to its result by its index in ``ro``; a request
        finished or preempted since ``so`` was scheduled takes no effect of the step on memory (its tokens, which
        are right, are kept if it is only preempted).
        """
        if ro.step_id != so.step_id:
            raise RuntimeError(f"result of step {ro.step_id} applied to step {so.step_id}")
        epochs = self._epochs.pop(so.step_id, [])
        if self.pipeline_parallel_size > 1:
            self._queue_verify_commits(so, ro, epochs)
        pc = self.prefix_cache
        ran: list[tuple[int, ScheduledRow, Request]] = []
        ended: list[Request] = []
        touched: list[Request] = []
        for i, row in enumerate(so.rows):
            req = self.requests.get(row.req_id)
            if req is None or req.is_finished:
                self._release_row(row)
                continue
            live = self._holds_row(req, epochs[i])
            if live:
                req.num_inflight_tokens -= row.num_new_tokens
                if row.samples:
                    req.num_inflight_samples -= 1
                a = ro.num_accepted[i]
                if row.is_verify:
                    self._verified(req, row, a)
                req.num_computed_tokens = row.start + max(a, 0) + 1 if row.is_verify else row.end
            reason = None
            if i in ro.errors:
                req.error = ro.errors[i]
                reason = "error"
            elif ro.token_ids[i] and (row.start + 1 if row.is_verify else row.end) == req.num_tokens:
                # Only tokens that continue the request: a step from before a preemption whose result comes in after
                # the readmitted request ran past it (steps in flight) would put a second token at one position.
                reason = sink.append_tokens(req, ro, i)
            if reason is not None:
                sink.request_finished(req, reason, req.error if reason == "error" else None)
                req.status = RequestStatus.FINISHED  # freed below, once its verified state is published
                ended.append(req)
            if live or reason is not None:
                touched.append(req)
            if live:
                ran.append((i, row, req))
            else:
                self._release_row(row)
        for i, row, req in ran:
            if pc is not None:
                self._publish(row, req, ro.num_accepted[i])
            elif row.snapshot_entry is not None or row.candidate_snapshot is not None:
                raise AssertionError("snapshot entries without a prefix cache")
        if self.drafts is not None:
            for i, _row, req in ran:
                if not req.is_finished and not req.num_inflight_tokens:
                    self._rollback(req)
                    req.draft_token_ids = []
                    if req.is_decoding:
                        proposal = ro.next_draft_token_ids[i] if ro.next_draft_token_ids else []
                        req.draft_token_ids = self.drafts.propose(req, proposal, self.max_model_len)
        for req in ended:
            self.finish(req)
        return touched

    @staticmethod
    def _holds_row(req: Request, epoch: int) -> bool:
        """Whether ``req`` still holds what its row of a step scheduled in ``epoch`` (its preemption count then)
        was given: it is running and has not been preempted since."""
        return req.status == RequestStatus.RUNNING and req.num_preemptions == epoch

    def _queue_verify_commits(self, so: SchedulerOutput, ro: RunnerOutput, epochs: list[int]) -> None:
        """The accepted counts the stages before the last apply to step ``so``'s verify rows (invariant 14).

        A row whose request finished, was aborted or was preempted since ``so`` was scheduled gets -1 (its slot is
        left untouched, its candidate snapshot not copied): its slot and snapshot entry went back to the pools when
        it ended, and a step scheduled since may have given them to another request, whose state the late commit
        would overwrite on those stages. A row still live keeps its count: its slot is its own until this result is
        in, and the commit reaches the stages with the next step, before any step that could reuse the slot."""
        counts: list[int] = []
        for i, row in enumerate(so.rows):
            if not row.is_verify:
                break  # verify rows come first
            req = self.requests.get(row.req_id)
            live = req is not None and not req.is_finished and self._holds_row(req, epochs[i])
            counts.append(ro.num_accepted[i] if live else -1)
        if counts:
            self._verify_commits.append((so.step_id, counts))

    def _verified(self, req: Request, row: ScheduledRow, accepted: int) -> None:
        """Verify row ``row`` of ``req`` is in with ``accepted`` drafts: the row behind it, if any, starts after
        them."""
        rid = req.request_id
        if self._verify_in_flight.get(rid) is row:
            del self._verify_in_flight[rid]
        nxt = self._behind.pop(rid, None)
        if nxt is not None:
            assert nxt is not row, "a row behind another had its result first"
            self._place(nxt, row.start + max(accepted, 0) + 1)

    def _place(self, row: ScheduledRow, start: int) -> None:
        """Set the start of ``row``, scheduled behind a verify row whose count is now known, as the worker found it
        on the device; and its candidate snapshot's point, the last block boundary it reaches, as the worker
        computed it (where it reaches none, the worker copied into the pad slot and the entry goes back)."""
        assert row.start <= start <= row.max_start, (row.start, start, row.max_start)
        row.start = row.max_start = start
        if row.candidate_snapshot is not None:
            pc = self.prefix_cache
            assert pc is not None
            entry = row.candidate_snapshot[1]
            point = candidate_point(start, row.num_new_tokens, pc.block_size)
            if point is not None:
                row.candidate_snapshot = (point, entry)
            else:
                pc.release_entry(entry)
                row.candidate_snapshot = None

    def _publish(self, row: ScheduledRow, req: Request, accepted: int) -> None:
        """Publish what the step computed and verified: full blocks, and the snapshot the row's worker filled.

        Only tokens the request has count (a stop inside accepted drafts drops the ones after it); with MTP only
        positions whose MTP entry is written (``keyable_tokens``), which the step wrote before the request's last
        known token.
        """
        pc = self.prefix_cache
        assert pc is not None
        computed = min(req.num_computed_tokens, pc.keyable_tokens(req))
        pc.publish_blocks(req, computed)
        for point, entry in row.interior_snapshots:  # ascending, before the row's end
            if point <= computed:
                pc.commit_snapshot(req, point, entry)
            else:
                pc.release_entry(entry)
        if row.snapshot_entry is not None:
            pc.commit_snapshot(req, row.end, row.snapshot_entry)
        if row.candidate_snapshot is not None:
            point, entry = row.candidate_snapshot
            if accepted >= point - row.start - 1 and point <= computed:
                pc.commit_snapshot(req, point, entry)
            else:
                pc.release_entry(entry)
        pc.unpin(row.load_snapshot)
        pc.unpin_host(row.load_host_snapshot)

    def _release_row(self, row: ScheduledRow) -> None:
        """A row whose result is not used: give back what it reserved in the prefix cache."""
        if self.prefix_cache is None:
            return
        self.prefix_cache.release_entry(row.snapshot_entry)
        for _, entry in row.interior_snapshots:
            self.prefix_cache.release_entry(entry)
        if row.candidate_snapshot is not None:
            self.prefix_cache.release_entry(row.candidate_snapshot[1])
        self.prefix_cache.unpin(row.load_snapshot)
        self.prefix_cache.unpin_host(row.load_host_snapshot)

    def _rollback(self, req: Request) -> None:
        """Free KV blocks that hold only rejected drafts or drafting positions (published blocks stay)."""
        keep = max(cdiv(req.num_tokens, self.block_pool.block_size), req.num_published_blocks)
        if len(req.block_table) > keep:
            self.block_pool.free(req.block_table[keep:])
            del req.block_table[keep:]


class _Sharers:
    """The running requests still computing their prompts, by the keys of their prompts' blocks: for a waiting
    request, which of them computes (or has computed) the deepest part of its prefix."""

    def __init__(self, prefix_cache: PrefixCache) -> None:
        self.prefix_cache = prefix_cache
        self.by_key: dict[bytes, tuple[Request, int]] = {}

    def add(self, req: Request) -> None:
        pc = self.prefix_cache
        bs = pc.block_size
        end = min(req.num_prompt_tokens, pc.keyable_tokens(req)) // bs
        if req.num_computed_tokens >= end * bs:
            return
        extend_block_hashes(req, bs, end * bs, pc.lookahead)
        for i in range(end):
            self.by_key.setdefault(req.block_hashes[i], (req, (i + 1) * bs))

    def deepest(self, req: Request, cached: int) -> tuple[Request, int] | None:
        """The sharer and the end ``p`` of the deepest block past ``cached`` that ``req`` shares with it (``req``'s
        block keys are those its lookup extended)."""
        found = None
        for i in range(cached // self.prefix_cache.block_size, len(req.block_hashes)):
            hit = self.by_key.get(req.block_hashes[i])
            if hit is None:
                break
            found = hit
        return found
