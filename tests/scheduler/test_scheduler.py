"""Property tests of the scheduler and its pools, without a model: random arrivals, lengths, budgets and aborts.

The scheduler owns both ends of a step: the test only calls ``schedule`` and ``update_from_output`` with a fake
worker's result (one token per sampling row), with zero or one step in flight (async scheduling: step n + 1 is
scheduled before step n's result is applied). After every step: the token budget and max_num_seqs hold, each
scheduled request owns enough KV blocks for the tokens it will hold, no block or slot is owned twice, every row
starts where its request's computed and in-flight tokens end, and FCFS holds. At the end every block and slot is
free, and each request got exactly its max_tokens tokens.
"""

from __future__ import annotations

import pickle
from collections import deque

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hyserve.cache.block_pool import BlockPool, cdiv
from hyserve.cache.state_slots import StateSlots
from hyserve.request import Request
from hyserve.sampling_params import SamplingParams
from hyserve.scheduler.output import PREVIOUS_SAMPLED, RunnerOutput, SchedulerOutput
from hyserve.scheduler.scheduler import Scheduler


class CountingSink:
    """Appends each row's token; ends a request at its max_tokens (what the output processor does)."""

    def __init__(self) -> None:
        self.finished: dict[str, str] = {}

    def append_tokens(self, req: Request, ro: RunnerOutput, row: int) -> str | None:
        req.output_token_ids.extend(ro.token_ids[row])
        return "length" if req.num_output_tokens >= (req.sampling_params.max_tokens or 0) else None

    def request_finished(self, req: Request, reason: str, error: str | None = None) -> None:
        assert req.request_id not in self.finished, "finished twice"
        self.finished[req.request_id] = reason


def fake_result(so: SchedulerOutput) -> RunnerOutput:
    # The sampled token is the row's position: a late result applied to the wrong row shows in the tokens.
    return RunnerOutput(so.step_id, token_ids=[[r.end % 16] if r.samples else [] for r in so.rows],
                        num_accepted=[-1] * len(so.rows))


def _check_invariants(s: Scheduler, out: SchedulerOutput, budget: int, max_seqs: int, block_size: int,
                      shared_blocks: bool = False) -> None:
    """``shared_blocks``: prefix caching, where requests share the cached blocks of their hits."""
    assert out.num_tokens <= budget
    assert len(s.running) <= max_seqs
    owned_blocks: list[int] = []
    owned_slots: list[int] = []
    for r in s.running:
        owned_blocks += r.block_table
        assert r.state_slot is not None
        owned_slots.append(r.state_slot)
    assert shared_blocks or len(owned_blocks) == len(set(owned_blocks)), "a KV block is owned twice"
    assert len(owned_slots) == len(set(owned_slots)), "a state slot is owned twice"
    assert 0 not in owned_blocks, "the null block was handed out"
    for row in out.rows:
        req = s.requests[row.req_id]
        assert row.num_new_tokens > 0
        assert req in s.running
        assert row.block_table == req.block_table and row.state_slot == req.state_slot
        assert len(req.block_table) >= cdiv(row.end, block_size)
        assert row.end == req.num_computed_tokens + req.num_inflight_tokens
        if row.token_ids[0] == PREVIOUS_SAMPLED:
            assert req.num_inflight_samples == 2 and row.start == req.num_tokens
        else:
            assert row.token_ids == req.token_ids(row.start, row.end)
    for r in s.waiting:
        assert not r.block_table and r.state_slot is None and r.num_computed_tokens == 0


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 20), st.integers(0, 6)), min_size=1, max_size=12),
    budget=st.integers(1, 48),
    max_seqs=st.integers(1, 6),
    block_size=st.sampled_from([1, 2, 4, 16]),
    abort_every=st.integers(0, 7),
    pipeline=st.sampled_from([(0, 1), (1, 1), (3, 4)]),
)
@example(lengths=[(1, 1, 1), (1, 1, 2), (1, 1, 2), (2, 2, 0), (1, 1, 0)], budget=3, max_seqs=3, block_size=2,
         abort_every=2, pipeline=(3, 4))  # readmitted after a preemption while its old sampling step is in flight
def test_scheduler_invariants(lengths: list[tuple[int, int, int]], budget: int, max_seqs: int, block_size: int,
                              abort_every: int, pipeline: tuple[int, int]) -> None:
    """``pipeline`` = (steps kept in flight, pipeline stages): 0 or 1 step with one stage (sync / async scheduling),
    three micro-batches with four stages (a request then waits for its own sampled token)."""
    in_flight, stages = pipeline
    max_len = max(p + o for p, o, _ in lengths)
    num_blocks = cdiv(max_len, block_size) + 2  # room for the longest request alone: forces preemption often
    pool = BlockPool(num_blocks, block_size)
    slots = StateSlots(max_seqs)
    s = Scheduler(max_seqs, budget, pool, slots, max_model_len=max_len + 1, pipeline_parallel_size=stages)
    sink = CountingSink()
    pending = sorted(lengths, key=lambda x: x[2])
    arrivals: dict[int, list[Request]] = {}
    for i, (p, o, at) in enumerate(pending):
        req = Request(f"r{i}", None, list(range(p)), SamplingParams(max_tokens=o), i)
        arrivals.setdefault(at, []).append(req)
    aborted: set[str] = set()
    queue: deque[SchedulerOutput] = deque()
    epochs: dict[int, dict[str, int]] = {}  # step id -> each row's request's preemption count when scheduled
    step = 0
    while step <= max(arrivals) or s.has_unfinished_requests() or queue:
        for r in arrivals.get(step, []):
            s.add_request(r)
        if abort_every and step % abort_every == abort_every - 1 and s.running:
            victim = s.running[len(s.running) // 2]
            s.finish(victim)
            aborted.add(victim.request_id)
        waiting_before = list(s.waiting)
        out = pickle.loads(pickle.dumps(s.schedule()))  # plain data
        _check_invariants(s, out, budget, max_seqs, block_size)
        if stages > 1:  # the first stage has no sampled token to feed: a request is in one step until it samples
            assert all(r.token_ids[0] != PREVIOUS_SAMPLED for r in out.rows)
            # (a request preempted since may be readmitted meanwhile: its old rows are stale, their tokens dropped)
            sampling_in_flight = {r.req_id for q in queue for r in q.rows if r.samples and r.req_id in s.requests
                                  and epochs[q.step_id][r.req_id] == s.requests[r.req_id].num_preemptions}
            assert not {r.req_id for r in out.rows} & sampling_in_flight
        admitted = [s.requests[r.req_id] for r in out.rows if s.requests[r.req_id] in waiting_before]
        assert admitted == waiting_before[: len(admitted)], "admission is not first-come first-served"
        if out.rows:
            queue.append(out)
            epochs[out.step_id] = {r.req_id: s.requests[r.req_id].num_preemptions for r in out.rows}
        while len(queue) > in_flight or (queue and not out.rows):
            so = queue.popleft()
            s.update_from_output(so, fake_result(so), sink)
        step += 1
        assert step < 5000, "scheduler made no progress"
    assert set(sink.finished) | aborted == {f"r{i}" for i in range(len(lengths))}
    for reqs in arrivals.values():
        for req in reqs:
            if req.request_id in sink.finished:
                assert sink.finished[req.request_id] == "length"
                assert req.num_output_tokens == req.sampling_params.max_tokens, "a step ran past max_tokens"
                # The fake worker's token is its position: each output token is the one for its own position (a
                # late result of a step before a preemption, applied after the readmitted request ran on, is not).
                n = req.num_prompt_tokens
                assert req.output_token_ids == [(n + j) % 16 for j in range(req.num_output_tokens)], req.request_id
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert slots.num_free_slots == slots.num_slots
    assert s.num_steps_in_flight == 0


def test_a_late_result_is_applied_through_its_own_rows() -> None:
    """Two requests, one step in flight: step n's tokens reach the requests of step n, whatever step n + 1 holds
    (its rows are in another order and hold another request)."""
    pool = BlockPool(64, 4)
    s = Scheduler(4, 64, pool, StateSlots(4), max_model_len=64)
    sink = CountingSink()
    a = Request("a", None, [1, 2, 3], SamplingParams(max_tokens=3), 0)
    b = Request("b", None, [4, 5, 6, 7, 8], SamplingParams(max_tokens=3), 1)
    s.add_request(a)
    s.add_request(b)
    so0 = s.schedule()
    assert [r.req_id for r in so0.rows] == ["a", "b"]
    c = Request("c", None, [9], SamplingParams(max_tokens=1), 2)
    s.finish(a)  # a is aborted while step 0 is in flight: its late token is dropped, b's is not
    s.add_request(c)
    so1 = s.schedule()
    assert [r.req_id for r in so1.rows] == ["b", "c"] and so1.rows[0].token_ids == [PREVIOUS_SAMPLED]
    s.update_from_output(so0, RunnerOutput(0, [[11], [12]], [-1, -1]), sink)
    assert a.output_token_ids == [] and b.output_token_ids == [12]
    s.update_from_output(so1, RunnerOutput(1, [[13], [14]], [-1, -1]), sink)
    assert b.output_token_ids == [12, 13] and c.output_token_ids == [14] and sink.finished == {"c": "length"}
    with pytest.raises(RuntimeError, match="result of step 0 applied to step 2"):
        s.update_from_output(s.schedule(), RunnerOutput(0, [[1]], [-1]), sink)


def test_a_late_token_from_before_a_preemption_is_not_appended_twice() -> None:
    """Pipeline stages keep steps in flight: a request preempted while its sampling step runs may be readmitted and
    sample the same position again before that step's result is in. The first of the two results to arrive gives
    the position its token; the other is dropped, and the next step computes on from there."""
    pool = BlockPool(16, 2)
    s = Scheduler(2, 64, pool, StateSlots(2), max_model_len=32, pipeline_parallel_size=4)
    sink = CountingSink()
    req = Request("a", None, list(range(4)), SamplingParams(max_tokens=3), 0)
    s.add_request(req)
    first = s.schedule()  # the whole prompt; samples position 4
    assert first.rows[0].samples and first.rows[0].end == 4
    s.running.remove(req)
    s._preempt(req)  # as _grow_or_preempt does when another request needs the blocks
    second = s.schedule()  # readmitted: the prompt again, sampling position 4 again
    assert second.rows[0].req_id == "a" and second.rows[0].samples and second.rows[0].end == 4
    s.update_from_output(first, fake_result(first), sink)  # the stale step's token for position 4 is kept
    assert req.output_token_ids == [4]
    s.update_from_output(second, fake_result(second), sink)  # a second token for position 4: dropped
    assert req.output_token_ids == [4] and req.num_computed_tokens == 4
    while s.has_unfinished_requests():
        so = s.schedule()
        s.update_from_output(so, fake_result(so), sink)
    assert req.output_token_ids == [4, 5, 6] and sink.finished == {"a": "length"}
    assert pool.num_free_blocks == pool.num_usable_blocks


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 90), st.integers(1, 6), st.integers(0, 8)),
                     min_size=1, max_size=8),
    budget=st.integers(8, 96),
    interval=st.sampled_from([16, 32, 48]),
    in_flight=st.integers(0, 1),
    abort_every=st.integers(0, 5),
    num_snapshots=st.integers(1, 12),
)
def test_snapshots_inside_rows_invariants(prompts: list[tuple[int, int, int, int]], budget: int, interval: int,
                                          in_flight: int, abort_every: int, num_snapshots: int) -> None:
    """Snapshots inside rows (``snapshots_inside_rows``), prompts sharing prefixes (three bases), aborts, async:
    every snapshot a row takes inside is at a keyable block boundary strictly inside it, entries are never handed
    out twice, a row never ends at a snapshot point only because of one (it ends at the budget or the prompt), a
    snapshot is published only from a row whose request still holds it, at a position it has computed, and at the
    end every entry is free or published (none leaked)."""
    from hyserve.cache.prefix_cache import PrefixCache

    bs = 16
    bases = [list(range(100 + 97 * b, 197 + 97 * b)) for b in range(3)]
    max_len = 100 + 7
    pool = BlockPool(64, bs)
    slots = StateSlots(4, num_snapshots)
    pc = PrefixCache(pool, slots, bs, interval)
    s = Scheduler(4, budget, pool, slots, max_model_len=max_len + 1, prefix_cache=pc, snapshots_inside_rows=True)
    sink = CountingSink()
    arrivals: dict[int, list[Request]] = {}
    for i, (base, n, out_len, at) in enumerate(prompts):
        tokens = [*bases[base][:n], i]  # the last token parts each prompt from the others
        arrivals.setdefault(at, []).append(Request(f"r{i}", None, tokens, SamplingParams(max_tokens=out_len), i))
    owner: dict[int, tuple[Request, int]] = {}  # reserved entry -> (its row's request, that request's epoch)
    commit = pc.commit_snapshot

    def checked_commit(req: Request, position: int, entry: int) -> bool:
        who, epoch = owner[entry]
        # Its request still holds the row (not aborted, not preempted since) and has computed the position.
        assert who is req and s.requests.get(req.request_id) is req and req.num_preemptions == epoch
        assert position <= req.num_computed_tokens, (req.request_id, position)
        return commit(req, position, entry)

    pc.commit_snapshot = checked_commit  # type: ignore[method-assign]
    queue: deque[SchedulerOutput] = deque()
    reserved: set[int] = set()
    step = 0
    while step <= max(arrivals) or s.has_unfinished_requests() or queue:
        for r in arrivals.get(step, []):
            s.add_request(r)
        if abort_every and step % abort_every == abort_every - 1 and s.running:
            s.finish(s.running[len(s.running) // 2])
        out = s.schedule()
        _check_invariants(s, out, budget, 4, bs, shared_blocks=True)
        for row in out.rows:
            req = s.requests[row.req_id]
            entries = [e for _, e in row.interior_snapshots] + ([row.snapshot_entry] if row.snapshot_entry else [])
            assert not set(entries) & reserved, "an entry handed out twice"
            reserved |= set(entries)
            owner.update({e: (req, req.num_preemptions) for e in entries})
            for p, _ in row.interior_snapshots:
                assert row.start < p < row.end and p % bs == 0 and p <= pc.keyable_tokens(req)
            if not row.is_verify and row.token_ids[0] != PREVIOUS_SAMPLED and row.end < req.num_tokens:
                assert row.num_new_tokens == min(budget, req.num_tokens - row.start) or out.num_tokens == budget, \
                    "a chunk ended early"
        if out.rows:
            queue.append(out)
        while len(queue) > in_flight or (queue and not out.rows):
            so = queue.popleft()
            s.update_from_output(so, fake_result(so), sink)
            for row in so.rows:
                reserved -= {e for _, e in row.interior_snapshots} | {row.snapshot_entry}
        step += 1
        assert step < 5000, "scheduler made no progress"
    # Nothing leaked: every entry is free or published, so all of them can be reserved again.
    got = [pc.reserve_entry() for _ in range(num_snapshots + 1)]
    assert sorted(e for e in got if e is not None) == [slots.snapshot_entry(i) for i in range(num_snapshots)]
    assert pool.num_free_blocks == pool.num_usable_blocks and s.num_steps_in_flight == 0
