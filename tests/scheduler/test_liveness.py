"""Liveness: every workload drains, whatever the memory budget, features and aborts.

Random workloads (shared prefixes, repeats, follow-ups that reach max_model_len, staggered arrivals, aborts) run on a
tiny checkpoint under tiny KV budgets, with prefix caching on or off and MTP, n-gram or no speculation. Each run is
bounded in steps, so a hang (admission waiting for memory that cannot be freed) fails instead of hanging. At the end
every request has finished the way its parameters say and every block and slot is free.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyserve import SamplingParams
from hyserve.testing.engine import drive, make_llm
from hyserve.testing.families import CheckpointCache
from hyserve.worker import cuda_graphs

SPECS: dict[str, dict[str, object] | None] = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
    "mtp1": {"method": "mtp", "num_speculative_tokens": 1},
    "mtp2": {"method": "mtp", "num_speculative_tokens": 2},
}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=st.sampled_from(list(SPECS)), caching=st.booleans(), num_kv_blocks=st.integers(3, 9),
       slots=st.integers(1, 3), budget=st.sampled_from([7, 16, 40]), seed=st.integers(0, 2**16),
       n_requests=st.integers(1, 6), async_scheduling=st.booleans(), graphs=st.booleans())
def test_random_workloads_under_tiny_budgets_always_drain(ckpts: CheckpointCache, spec: str, caching: bool,
                                                          num_kv_blocks: int, slots: int, budget: int, seed: int,
                                                          n_requests: int, async_scheduling: bool,
                                                          graphs: bool) -> None:
    """Under async scheduling with MTP, verify rows go behind rows in flight (unseeded requests far enough from
    their end), with their blocks reserved for the latest start. ``graphs``: the CUDA graphs emulated (the whole
    verify step enqueued at once: acceptance, moves of rows behind, snapshots and drafting in graphs)."""
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    emulate = cuda_graphs.EMULATE
    cuda_graphs.EMULATE = graphs
    try:
        _drain_random_workload(path, spec, caching, num_kv_blocks, slots, budget, seed, n_requests, async_scheduling)
    finally:
        cuda_graphs.EMULATE = emulate


def _drain_random_workload(path: str, spec: str, caching: bool, num_kv_blocks: int, slots: int, budget: int,
                           seed: int, n_requests: int, async_scheduling: bool) -> None:
    llm = make_llm(path, enable_prefix_caching=caching, speculative_config=SPECS[spec], num_kv_blocks=num_kv_blocks,
                   num_state_slots=slots, max_num_seqs=slots, max_num_batched_tokens=budget,
                   recurrent_snapshot_interval=16, num_snapshot_slots=8, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    max_len = engine.max_model_len  # (num_kv_blocks - 1) * 16: every request fits the pool alone, barely
    rng = random.Random(seed)
    base = [rng.randrange(400) for _ in range(max_len)]
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
    aborts: dict[int, list[str]] = {}
    expect: dict[str, tuple[int, int]] = {}
    for i in range(n_requests):
        # Prefixes of one sequence (repeats and follow-ups hit each other's blocks), or a fresh branch of it.
        n = rng.choice([rng.randrange(1, max_len), max_len - 1 - rng.randrange(16)])  # often near the limit
        cut = n if rng.random() < 0.7 else rng.randrange(n)
        prompt = base[:cut] + [rng.randrange(400) for _ in range(n - cut)]
        max_tokens = rng.choice([1, 3, max_len])  # max_len: runs into max_model_len
        rid = f"r{i}"
        arrivals.setdefault(rng.randrange(0, 12), []).append((rid, prompt, SamplingParams(
            temperature=rng.choice([0.0, 0.8]), seed=rng.choice([None, rng.randrange(100)]), max_tokens=max_tokens,
            ignore_eos=True)))
        expect[rid] = (len(prompt), max_tokens)
        if rng.random() < 0.2:
            aborts.setdefault(rng.randrange(0, 20), []).append(rid)
    final = drive(engine, arrivals, aborts, max_steps=600)
    aborted = {rid for rids in aborts.values() for rid in rids}
    for rid, (n_prompt, max_tokens) in expect.items():
        if rid in aborted and rid not in final:
            continue  # aborted before it finished (an aborted request gives no final output)
        out = final[rid].outputs[0]
        want = min(max_tokens, max_len - n_prompt)
        assert out.finish_reason == "length" and len(out.token_ids) == want, (rid, out.finish_reason,
                                                                               len(out.token_ids), want)
    engine.assert_no_leaks()


def test_mtp_prefix_hit_when_the_first_chunk_needs_every_block(ckpts: CheckpointCache) -> None:
    """The minimal hang: MTP, prefix caching, 4 usable blocks, one slot; a 60-token prompt sent twice. The second
    one hits 48 tokens and needs all 4 blocks for its first chunk: it must run, and give the first one's output."""
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    llm = make_llm(path, speculative_config=SPECS["mtp1"], num_kv_blocks=5, num_state_slots=1, max_num_seqs=1)
    prompt = [random.Random(3).randrange(400) for _ in range(60)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = []
    for rid in ("first", "second"):
        outs.append(drive(llm.llm_engine, {0: [(rid, prompt, params)]}, max_steps=50)[rid])
    assert outs[1].num_cached_tokens > 0, "the second request must hit the cache"
    assert outs[1].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert outs[0].outputs[0].finish_reason == outs[1].outputs[0].finish_reason == "length"
    llm.llm_engine.assert_no_leaks()
