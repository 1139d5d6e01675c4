"""Property tests of the scheduler and its pools, without a model: random arrivals, lengths, budgets and aborts.

After every step: the token budget and max_num_seqs hold, each scheduled request owns enough KV blocks for the tokens
it will hold, no block or slot is owned twice, and FCFS holds (nobody is admitted past an earlier waiting request).
At the end every block and slot is free.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyserve.cache.block_pool import BlockPool, cdiv
from hyserve.cache.state_pool import StatePool
from hyserve.config import ModelConfig
from hyserve.engine.request import Request
from hyserve.engine.scheduler import Scheduler
from hyserve.model.registry import cache_specs_for
from hyserve.sampling_params import SamplingParams

TINY = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                   num_key_value_heads=1, head_dim=8, layer_types=["linear_attention"], linear_key_head_dim=4,
                   linear_value_head_dim=4, linear_num_key_heads=1, linear_num_value_heads=1)


def _check_invariants(s: Scheduler, out, budget: int, max_seqs: int, block_size: int) -> None:
    assert out.num_tokens <= budget
    assert len(s.running) <= max_seqs
    owned_blocks: list[int] = []
    owned_slots: list[int] = []
    for r in s.running:
        owned_blocks += r.block_table
        assert r.state_slot is not None
        owned_slots.append(r.state_slot)
    assert len(owned_blocks) == len(set(owned_blocks)), "a KV block is owned twice"
    assert len(owned_slots) == len(set(owned_slots)), "a state slot is owned twice"
    assert 0 not in owned_blocks, "the null block was handed out"
    for row in out.rows:
        assert row.num_new_tokens > 0
        assert row.request in s.running
        assert len(row.request.block_table) >= cdiv(row.end, block_size)
        assert row.start == row.request.num_computed_tokens
    for r in s.waiting:
        assert not r.block_table and r.state_slot is None and r.num_computed_tokens == 0


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 20), st.integers(0, 6)), min_size=1, max_size=12),
    budget=st.integers(1, 48),
    max_seqs=st.integers(1, 6),
    block_size=st.sampled_from([1, 2, 4, 16]),
    abort_every=st.integers(0, 7),
)
def test_scheduler_invariants(lengths: list[tuple[int, int, int]], budget: int, max_seqs: int, block_size: int,
                              abort_every: int) -> None:
    max_len = max(p + o for p, o, _ in lengths)
    num_blocks = cdiv(max_len, block_size) + 2  # room for the longest request alone: forces preemption often
    pool = BlockPool(num_blocks, block_size)
    states = StatePool(cache_specs_for(TINY, torch.float32).recurrent, max_seqs, torch.device("cpu"))
    s = Scheduler(max_seqs, budget, pool, states)
    pending = sorted(lengths, key=lambda x: x[2])
    arrivals: dict[int, list[Request]] = {}
    for i, (p, o, at) in enumerate(pending):
        req = Request(f"r{i}", None, list(range(p)), SamplingParams(max_tokens=o), i)
        arrivals.setdefault(at, []).append(req)
    done: set[str] = set()
    step = 0
    while step <= max(arrivals) or s.has_unfinished_requests():
        for r in arrivals.get(step, []):
            s.add_request(r)
        if abort_every and step % abort_every == abort_every - 1 and s.running:
            victim = s.running[len(s.running) // 2]
            s.finish(victim)
            done.add(victim.request_id)
        waiting_before = list(s.waiting)
        out = s.schedule()
        _check_invariants(s, out, budget, max_seqs, block_size)
        admitted = [r.request for r in out.rows if r.start == 0 and r.request in waiting_before]
        assert admitted == waiting_before[: len(admitted)], "admission is not first-come first-served"
        for row in out.rows:
            req = row.request
            req.num_computed_tokens = row.end
            if row.samples:
                req.output_token_ids.append(0)
                if req.num_output_tokens >= (req.sampling_params.max_tokens or 0):
                    s.finish(req)
                    done.add(req.request_id)
        step += 1
        assert step < 5000, "scheduler made no progress"
    assert len(done) == len(lengths)
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert states.num_free_slots == states.num_slots
