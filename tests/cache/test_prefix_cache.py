"""Prefix caching on hybrid models: outputs identical with caching on and off (and equal to transformers), across
multi-turn conversations, shared prefixes, branching siblings, eviction, preemption and aborts; a mutation check that
a corrupted or late snapshot is caught; and the hit rate against an independently counted ideal.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hyserve import SamplingParams
from hyserve.cache import prefix_cache
from hyserve.cache.block_pool import BlockPool
from hyserve.cache.state_slots import StateSlots
from hyserve.engine.llm_engine import LLMEngine
from hyserve.request import ImageSpan, Request
from hyserve.testing.engine import (
    SlotRecorder,
    assert_matches_reference,
    drive,
    make_convs,
    make_llm,
    run_conversations,
    toks,
)
from hyserve.testing.families import CheckpointCache
from hyserve.testing.scenarios import late_snapshots

BS = 16
INTERVAL = 32


def cached_llm(path: str, **kw: object):
    args: dict[str, object] = dict(recurrent_snapshot_interval=INTERVAL, num_snapshot_slots=64,
                                   max_num_batched_tokens=64, num_kv_blocks=512, max_num_seqs=8, num_state_slots=8)
    args.update(kw)
    return make_llm(path, **args)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)








# ---------------------------------------------------------------------------------------------- equivalence


def test_multi_turn_conversations_same_output_with_and_without_caching(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    ref = ckpts.reference(path)
    convs = make_convs(4, 3, toks(50, 1), seed=2)
    on = cached_llm(path)
    rec = SlotRecorder(on.llm_engine)
    got = run_conversations(on.llm_engine, convs, out_len=7)
    off = make_llm(path, enable_prefix_caching=False, max_num_batched_tokens=64)
    want = run_conversations(off.llm_engine, convs, out_len=7)
    assert got == want
    m = on.get_metrics()
    assert m["hyserve:prefix_cache_hits"] > 0 and m["hyserve:prefix_cache_snapshot_hits"] > 0
    assert off.get_metrics()["hyserve:prefix_cache_hits"] == 0
    assert rec.saw_non_identity()
    # Spot-check the last turn of one conversation against transformers (the prompt carries earlier outputs).
    prompt = convs[0][0] + got["c0t0"] + convs[0][1] + got["c0t1"] + convs[0][2]
    out = on.generate({"prompt_token_ids": prompt}, greedy(7), use_tqdm=False)[0]
    assert out.num_cached_tokens and out.num_cached_tokens > 0
    assert out.outputs[0].token_ids == got["c0t2"]
    assert_matches_reference(ref, prompt, out)
    on.llm_engine.assert_no_leaks()


@pytest.mark.parametrize("pattern", ["attn_first", "attn_last_gdn_run"])
def test_shared_system_prompt_siblings_same_step_and_later(ckpts: CheckpointCache, pattern: str) -> None:
    path = ckpts.get("conditional", pattern)
    ref = ckpts.reference(path)
    system = toks(70, 3)
    # a, b arrive together (neither can hit the other); c arrives later and shares the system prompt and part of
    # b's text; d arrives after c and diverges at the same point as c, so it should hit c's branch snapshot.
    b_tail = toks(30, 4)
    prompts = {"a": system + toks(20, 5), "b": system + b_tail, "c": system + b_tail[:20] + toks(9, 6),
               "d": system + b_tail[:20] + toks(11, 7)}
    llm = cached_llm(path, max_num_batched_tokens=256)  # a and b run their prompts in one step
    final = drive(llm.llm_engine, {0: [("a", prompts["a"], greedy(6)), ("b", prompts["b"], greedy(6))],
                                   8: [("c", prompts["c"], greedy(6))], 14: [("d", prompts["d"], greedy(6))]})
    off = make_llm(path, enable_prefix_caching=False)
    for k, p in prompts.items():
        want = off.generate({"prompt_token_ids": p}, greedy(6), use_tqdm=False)[0]
        assert final[k].outputs[0].token_ids == want.outputs[0].token_ids, k
        assert_matches_reference(ref, p, final[k])
    assert final["a"].num_cached_tokens == 0 and final["b"].num_cached_tokens == 0
    # c: KV matches through block 5 (system 70 + 20 shared = 90 tokens -> 5 full blocks) but snapshots exist only at
    # interval points (32, 64): hit 64, branch point 80.
    assert final["c"].num_cached_tokens == 64
    assert final["d"].num_cached_tokens == 80  # c's branch-point snapshot
    llm.llm_engine.assert_no_leaks()


def test_eviction_under_tiny_budgets(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    convs = make_convs(5, 3, toks(40, 8), seed=9)
    tight = cached_llm(path, num_kv_blocks=32, num_snapshot_slots=3, max_model_len=320)
    got = run_conversations(tight.llm_engine, convs, out_len=6)
    off = make_llm(path, enable_prefix_caching=False)
    want = run_conversations(off.llm_engine, convs, out_len=6)
    assert got == want
    m = tight.get_metrics()
    assert m["hyserve:prefix_cache_snapshot_evictions"] > 0
    assert m["hyserve:prefix_cache_kv_evictions"] > 0
    assert m["hyserve:prefix_cache_snapshots"] <= 3
    tight.llm_engine.assert_no_leaks()


@pytest.mark.parametrize("snapshots", [23, 24])
def test_too_few_snapshots_for_the_decoding_requests_are_warned_of(ckpts: CheckpointCache, snapshots: int,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Eight decoding requests can hold 8 x (2 + steps in flight) snapshot entries at once (their latest
    boundaries', and a reservation for each step scheduled and not applied): a budget below that is evicted within
    a few steps, and the engine says so at start, with the flags that raise it."""
    with caplog.at_level("WARNING", logger="hyserve"):
        llm = cached_llm(ckpts.get(), num_snapshot_slots=snapshots, async_scheduling=True)
    demand = llm.llm_engine.snapshot_demand_while_decoding()
    llm.shutdown()
    assert demand == 8 * 3
    warned = [r.getMessage() for r in caplog.records if "recurrent snapshots are fewer" in r.getMessage()]
    assert len(warned) == (snapshots < demand)
    if warned:
        assert "--snapshot-memory-fraction" in warned[0] and "--mamba-ssm-cache-dtype auto" in warned[0]


def test_the_default_concurrency_is_told_of_too_few_snapshots_in_the_debug_log(
        ckpts: CheckpointCache, caplog: pytest.LogCaptureFixture) -> None:
    """max_num_seqs left to the engine (sized to the memory): the same line in the debug log, not a warning."""
    with caplog.at_level("DEBUG", logger="hyserve"):
        llm = make_llm(ckpts.get(), num_snapshot_slots=3, max_num_seqs=None)
    llm.shutdown()
    said = [r for r in caplog.records if "recurrent snapshots are fewer" in r.getMessage()]
    assert [r.levelname for r in said] == ["DEBUG"]


def test_preemption_resumes_from_own_snapshots(ckpts: CheckpointCache) -> None:
    path = ckpts.get("causal", "attn_both_ends")
    prompts = [toks(n, 20 + n) for n in (40, 52, 37, 45)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = make_llm(path, enable_prefix_caching=False).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tight = cached_llm(path, block_size=BS, num_kv_blocks=13, max_model_len=192, max_num_batched_tokens=32)
    got = tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    m = tight.get_metrics()
    assert m["hyserve:num_preemptions"] > 0
    assert m["hyserve:prefix_cache_hits"] > 0  # resumed requests found their own blocks and snapshots
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    tight.llm_engine.assert_no_leaks()


@pytest.mark.parametrize("inside", [True, False])
def test_abort_keeps_completed_snapshots_and_publishes_no_partial(ckpts: CheckpointCache, inside: bool) -> None:
    path = ckpts.get()
    shared = toks(100, 30)
    llm = cached_llm(path, max_num_batched_tokens=40, snapshots_inside_rows=inside)
    eng = llm.llm_engine
    eng.add_request("victim", {"prompt_token_ids": shared + toks(20, 31)}, greedy(5))
    # Inside rows: 40 and 80 tokens, the interval points 32 and 64 taken inside the chunks; else chunks cut there.
    eng.step()
    eng.step()
    assert eng.requests["victim"].num_computed_tokens == (80 if inside else 64)
    eng.abort_request("victim")
    later = shared + toks(15, 32)
    out = llm.generate({"prompt_token_ids": later}, greedy(5), use_tqdm=False)[0]
    assert out.num_cached_tokens == 64  # the completed snapshot survived the abort; nothing past it was published
    want = make_llm(path, enable_prefix_caching=False).generate({"prompt_token_ids": later}, greedy(5),
                                                                use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    eng.assert_no_leaks()


def test_disabled_caching_takes_no_snapshot_memory(ckpts: CheckpointCache) -> None:
    llm = make_llm(ckpts.get(), enable_prefix_caching=False)
    assert llm.llm_engine.prefix_cache is None
    assert llm.llm_engine.runner.state_pool.num_snapshots == 0
    with pytest.raises(ValueError, match="recurrent-snapshot-interval"):
        make_llm(ckpts.get(), recurrent_snapshot_interval=20)


# ---------------------------------------------------------------------------------------------- mutation checks


def _corrupt_snapshots(engine: LLMEngine) -> None:
    """Test-only sabotage: every published snapshot gets its SSM state perturbed."""
    original: Callable = engine.scheduler.update_from_output

    def update(so, ro, sink):  # type: ignore[no-untyped-def]
        ran = original(so, ro, sink)
        pool = engine.runner.state_pool
        for i in range(pool.num_snapshots):
            for ssm in pool.ssm_states:
                ssm[pool.snapshot_entry(i)] += 0.05
        return ran

    engine.scheduler.update_from_output = update  # type: ignore[method-assign]


@pytest.mark.parametrize("sabotage", [_corrupt_snapshots, late_snapshots])
def test_suite_catches_a_bad_snapshot(ckpts: CheckpointCache, sabotage: Callable[[LLMEngine], None]) -> None:
    """The equivalence check above must fail when a published snapshot is wrong."""
    path = ckpts.get()
    convs = make_convs(3, 3, toks(50, 40), seed=41)
    off = make_llm(path, enable_prefix_caching=False)
    want = run_conversations(off.llm_engine, convs, out_len=8)
    bad = cached_llm(path)
    sabotage(bad.llm_engine)
    got = run_conversations(bad.llm_engine, convs, out_len=8)
    assert bad.get_metrics()["hyserve:prefix_cache_snapshot_hits"] > 0
    assert got != want, "a corrupted snapshot went unnoticed"


# ---------------------------------------------------------------------------------------------- hit rate


def ideal_hits(requests: list[tuple[list[int], list[int]]], bs: int, interval: int) -> list[int]:
    """Hit tokens the snapshot policy allows with unlimited memory, counted from the token sequences alone.

    ``requests`` in admission order, each (prompt, output); every earlier request is taken as finished, even one of
    the same round that in fact ran concurrently, so this ideal is generous (the engine cannot hit work that is
    still running). Published per request: its end of prompt, its end (last block boundary its computed tokens
    reach), its interval points and its branch point.
    """
    published: set[tuple[int, ...]] = set()
    computed: list[list[int]] = []
    hits = []
    for prompt, output in requests:
        n = len(prompt)
        hit = max((L for L in range(bs, n, bs) if tuple(prompt[:L]) in published), default=0)
        hits.append(hit)
        lcp = max((_lcp(prompt, c) for c in computed), default=0)
        full = prompt + output
        done = len(full) - 1  # the last sampled token is never computed
        points = {(n // bs) * bs, (done // bs) * bs} | set(range(interval, done + 1, interval))
        branch = (min(lcp, n - 1) // bs) * bs
        if branch > hit:
            points.add(branch)
        published |= {tuple(full[:p]) for p in points if p > 0}
        computed.append(full[:done])
    return hits


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_hit_rate_reaches_ninety_percent_of_the_ideal(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    system = toks(60, 50)
    convs = make_convs(6, 4, system, seed=51)
    llm = cached_llm(path, num_snapshot_slots=256, max_num_seqs=6, max_num_batched_tokens=128)
    eng = llm.llm_engine
    prompts = {c: list(convs[c][0]) for c in range(len(convs))}
    order: list[tuple[list[int], list[int]]] = []
    engine_hits = 0
    for t in range(4):  # rounds: all conversations' turn t together, after round t-1 finished
        for c in range(len(convs)):
            eng.add_request(f"c{c}t{t}", {"prompt_token_ids": prompts[c]}, greedy(6))
        final: dict[str, object] = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    final[out.request_id] = out
        for c in range(len(convs)):
            out = final[f"c{c}t{t}"]
            order.append((prompts[c], out.outputs[0].token_ids))  # type: ignore[attr-defined]
            engine_hits += out.num_cached_tokens  # type: ignore[attr-defined]
            if t + 1 < 4:
                prompts[c] = prompts[c] + out.outputs[0].token_ids + convs[c][t + 1]  # type: ignore[attr-defined]
    ideal = sum(ideal_hits(order, BS, INTERVAL))
    assert ideal > 0
    print(f"hit rate: engine {engine_hits} tokens, ideal {ideal}")
    assert engine_hits >= 0.9 * ideal, f"cached {engine_hits} tokens, ideal {ideal}"
    assert llm.get_metrics()["hyserve:prefix_cache_hits"] == engine_hits


def test_snapshot_policy_points_land_on_chunk_ends(ckpts: CheckpointCache) -> None:
    """Chunks ending at snapshot points (``snapshots_inside_rows=False``, the Mamba2 families' way): every snapshot
    taken is at a block-aligned position equal to a chunk end (checked through the scheduler's reserved entries: the
    worker copies a row's slot into its entry right after that row's forward)."""
    path = ckpts.get()
    llm = cached_llm(path, max_num_batched_tokens=50, snapshots_inside_rows=False)
    eng = llm.llm_engine
    seen: list[tuple[int, int | None]] = []
    original = eng.scheduler.schedule

    def schedule():
        out = original()
        seen.extend((r.end, r.end if r.snapshot_entry is not None else None) for r in out.rows)
        return out

    eng.scheduler.schedule = schedule  # type: ignore[method-assign]
    llm.generate({"prompt_token_ids": toks(150, 60)}, greedy(20), use_tqdm=False)
    points = [at for end, at in seen if at is not None]
    assert all(at % BS == 0 for at in points)
    assert {32, 64, 96, 128, 144} <= set(points)  # intervals, end of prompt (150 -> 144)
    assert 160 in points  # a block boundary reached while decoding
    assert all(end == at for end, at in seen if at is not None)


# ---------------------------------------------------------------------------------------------- prefix sharing

SYSTEM_LEN = 300  # past SHARE_MIN_TOKENS: requests arriving together wait for the one computing the shared prefix
SHARED_POINT = (SYSTEM_LEN // BS) * BS


def sharing_prompts(n: int, seed: int) -> dict[str, list[int]]:
    system = toks(SYSTEM_LEN, seed)
    return {f"s{i}": system + toks(20 + 7 * i, seed + 1 + i) for i in range(n)}


def _cut_nothing(row: object, p: int) -> int:
    """Test-only sabotage: the sharer's chunk in the step is not cut at the sharing point."""
    return 0


@pytest.mark.parametrize("mode", ["plain", "mtp_async"])
def test_requests_arriving_together_share_the_prefix_being_computed(ckpts: CheckpointCache, mode: str) -> None:
    """Four requests with a 300-token system prompt arrive in one step with room for all of them: one computes the
    prompt and leaves a snapshot where the prompts part, the others wait for it and hit there (staggered arrivals,
    a fifth request arriving while the first is mid-way, and MTP with async scheduling in the second mode)."""
    spec = mode == "mtp_async"
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=spec)
    ref = ckpts.reference(path)
    prompts = sharing_prompts(5, 70)
    kw: dict[str, object] = dict(max_num_batched_tokens=256, num_kv_blocks=512, recurrent_snapshot_interval=1024)
    if spec:
        kw.update(speculative_config={"method": "mtp", "num_speculative_tokens": 2}, async_scheduling=True)
    llm = cached_llm(path, **kw)
    ids = list(prompts)
    final = drive(llm.llm_engine, {0: [(r, prompts[r], greedy(8)) for r in ids[:4]], 1: [(ids[4], prompts[ids[4]],
                                                                                             greedy(8))]})
    off = make_llm(path, enable_prefix_caching=False)
    for rid, p in prompts.items():
        want = off.generate({"prompt_token_ids": p}, greedy(8), use_tqdm=False)[0]
        assert final[rid].outputs[0].token_ids == want.outputs[0].token_ids, rid
        assert_matches_reference(ref, p, final[rid])
    # Without the wait, the four that arrive together compute the system prompt four times (interval 1024: no
    # snapshot inside it) and the fifth hits nothing either.
    assert final["s0"].num_cached_tokens == 0
    assert [final[r].num_cached_tokens for r in ids[1:]] == [SHARED_POINT] * 4
    llm.llm_engine.assert_no_leaks()


@pytest.mark.parametrize("sabotage", [False, True])
def test_sharing_check_catches_a_sharer_chunk_left_uncut(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch,
                                                         sabotage: bool) -> None:
    """The sharer's chunk in the step crosses the sharing point (budget 512): it must be cut there. Left uncut, the
    snapshot goes where the chunk really ends (the prefix cache publishes a snapshot at its row's end, never at a
    position the state did not stop at), so the waiters hit nothing: the hit check sees it, the outputs stay right."""
    from hyserve.scheduler.scheduler import Scheduler

    path = ckpts.get("conditional", "gdn3_attn1")
    prompts = sharing_prompts(3, 80)
    off = make_llm(path, enable_prefix_caching=False)
    want = {r: off.generate({"prompt_token_ids": p}, greedy(8), use_tqdm=False)[0].outputs[0].token_ids
            for r, p in prompts.items()}
    if sabotage:
        monkeypatch.setattr(Scheduler, "_cut_chunk", staticmethod(_cut_nothing))
    # Chunks cut at snapshot points (with snapshots inside rows the sharing point is taken inside the chunk).
    llm = cached_llm(path, max_num_batched_tokens=512, recurrent_snapshot_interval=1024, snapshots_inside_rows=False)
    final = drive(llm.llm_engine, {0: [(r, p, greedy(8)) for r, p in prompts.items()]})
    assert all(final[r].outputs[0].token_ids == want[r] for r in prompts)
    hits = [final[r].num_cached_tokens for r in ("s1", "s2")]
    # sabotaged, s1 hits nothing; s2 may still hit at s1's own branch point (where s1's prompt leaves s0's KV)
    assert (hits == [SHARED_POINT] * 2) != sabotage, hits
    llm.llm_engine.assert_no_leaks()


@pytest.mark.parametrize("event", ["abort", "preempt"])
def test_waiters_go_on_when_the_sharer_is_aborted_or_preempted(ckpts: CheckpointCache, event: str) -> None:
    """The sharer is aborted (or preempted for memory) before it reaches the sharing point: the waiting requests
    are admitted anyway, and their outputs are those of a run without caching."""
    path = ckpts.get("causal", "attn_both_ends")
    prompts = sharing_prompts(3, 90)
    kw: dict[str, object] = dict(max_num_batched_tokens=64, recurrent_snapshot_interval=1024)
    aborts: dict[int, list[str]] = {}
    if event == "abort":
        aborts = {2: ["s0"]}  # after two chunks of 64: mid-way through the system prompt
    else:
        kw.update(num_kv_blocks=34, max_model_len=400)  # 34 blocks: the three together outgrow it while decoding
    llm = cached_llm(path, **kw)
    eng = llm.llm_engine
    steps: list[set[str]] = []
    original = eng.scheduler.schedule

    def schedule():  # type: ignore[no-untyped-def]
        out = original()
        steps.append({r.req_id for r in out.rows})
        return out

    eng.scheduler.schedule = schedule  # type: ignore[method-assign]
    final = drive(eng, {0: [(r, p, greedy(24)) for r, p in prompts.items()]}, aborts=aborts)
    assert steps[0] == {"s0"} and steps[1] == {"s0"}  # s1 and s2 waited for s0's system prompt
    off = make_llm(path, enable_prefix_caching=False)
    for rid, p in prompts.items():
        if rid in aborts.get(2, []):
            assert rid not in final or not final[rid].outputs[0].token_ids
            continue
        want = off.generate({"prompt_token_ids": p}, greedy(24), use_tqdm=False)[0]
        assert final[rid].outputs[0].token_ids == want.outputs[0].token_ids, rid
    if event == "preempt":
        assert llm.get_metrics()["hyserve:num_preemptions"] > 0
    eng.assert_no_leaks()


@pytest.mark.parametrize("sabotage", [False, True])
def test_equal_placeholders_with_different_images_share_only_the_blocks_before_them(
        ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch, sabotage: bool) -> None:
    """Three requests with the same token ids, an image's 16 placeholder ids at [40, 56): "b"'s image differs from
    "a"'s, "c"'s is "a"'s. "b" may reuse only what lies before the image (the snapshot at 32; the block [32, 48)
    overlaps it), "c" reuses past it. The sabotaged keys leave the images out, and "b" then hits past its image."""
    if sabotage:
        monkeypatch.setattr(prefix_cache, "image_keys", lambda req, start, end: b"")
    path = ckpts.get("conditional", "attn_first")
    prompt = toks(40, 8) + [7] * 16 + toks(44, 9)
    span = {"a": "img-a", "b": "img-b", "c": "img-a"}
    llm = cached_llm(path)
    engine = llm.llm_engine
    final = {}
    for rid in ("a", "b", "c"):  # one after the other: each finds the earlier ones' blocks published
        engine.add_request(rid, {"prompt_token_ids": prompt}, greedy(4))
        engine.requests[rid].image_spans = (ImageSpan(40, 16, span[rid]),)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
    assert final["a"].num_cached_tokens == 0
    assert final["c"].num_cached_tokens >= 64
    if sabotage:
        assert final["b"].num_cached_tokens == final["c"].num_cached_tokens
    else:
        assert final["b"].num_cached_tokens == INTERVAL
    want = make_llm(path, enable_prefix_caching=False).generate({"prompt_token_ids": prompt}, greedy(4),
                                                                 use_tqdm=False)[0]
    assert all(final[k].outputs[0].token_ids == want.outputs[0].token_ids for k in final)
    engine.assert_no_leaks()


def test_a_block_keys_the_image_of_its_lookahead_token() -> None:
    """With MTP (lookahead 1) block [0, 16)'s MTP entry at position 15 reads token 16: an image starting there is
    in that block's key, so equal text followed by different images does not share it; without lookahead it is not."""
    def keys(content_hash: str, lookahead: int) -> list[bytes]:
        req = Request("r", None, toks(16, 1) + [7] * 8 + toks(8, 2), SamplingParams(), 0)
        req.image_spans = (ImageSpan(16, 8, content_hash),)
        prefix_cache.extend_block_hashes(req, 16, 32, lookahead)
        return req.block_hashes

    assert keys("a", 1)[0] != keys("b", 1)[0]
    assert keys("a", 0)[0] == keys("b", 0)[0] and keys("a", 0)[1] != keys("b", 0)[1]


# ---------------------------------------------------------------------------------------------- eviction order

def _full_cache(monkeypatch: pytest.MonkeyPatch, lru_only: bool,
                entries: int = 3) -> tuple[prefix_cache.PrefixCache, Request]:
    """A cache of ``entries`` entries, holding one request's points taken in this order: 32 (before its first image:
    a resume point), 64 (an interval point, and before its second image: spare) and 96 (its prompt's end: a resume
    point while the answer has no block boundary). ``lru_only``: every snapshot a resume point (plain LRU)."""
    if lru_only:
        monkeypatch.setattr(prefix_cache.PrefixCache, "_resume_point", lambda self, req, position, answered=False: True)
    cache = prefix_cache.PrefixCache(BlockPool(64, 16), StateSlots(2, entries), 16, snapshot_interval=64)
    req = Request("a", None, toks(100, 1), SamplingParams(), 0)
    req.image_spans = (ImageSpan(40, 8, "a"), ImageSpan(70, 8, "b"))
    assert cache.snapshot_points(req, 0, 99) == [32, 64, 96]
    for p in (32, 64, 96):
        entry = cache.reserve_snapshot(req, p)
        assert entry is not None and cache.commit_snapshot(req, p, entry)
    return cache, req


def _kept(cache: prefix_cache.PrefixCache, req: Request) -> list[int]:
    return [p for p in (32, 64, 96, 112) if p <= len(req.block_hashes) * 16
            and cache.has_snapshot(req.block_hashes[p // 16 - 1])]


@pytest.mark.parametrize("lru_only", [False, True])
def test_spare_snapshots_are_evicted_before_resume_points(monkeypatch: pytest.MonkeyPatch, lru_only: bool) -> None:
    """A full budget gives up the oldest spare snapshot (interval point, later image), not the point before the
    first image that is older: a GUI agent's next step resumes there. Plain LRU (the sabotage) evicts the resume
    point first, which the first case would catch."""
    cache, req = _full_cache(monkeypatch, lru_only)
    other = Request("b", None, toks(40, 9), SamplingParams(), 0)
    entry = cache.reserve_snapshot(other, 32)  # the budget is full: one snapshot goes
    assert entry is not None and cache.stats.evictions == 1
    assert _kept(cache, req) == ([64, 96] if lru_only else [32, 96])


def _computed(cache: prefix_cache.PrefixCache, rid: str, tokens: list[int], image: str) -> Request:
    """A request that computed its 100-token prompt (an image at 40, so its first image point is 32) and ended: its
    blocks published and left cached, its snapshots taken (32, before the image; 96, the prompt's end)."""
    req = Request(rid, None, tokens, SamplingParams(), 0)
    req.image_spans = (ImageSpan(40, 8, image),)
    req.block_table = cache.block_pool.allocate(7)
    cache.publish_blocks(req, len(tokens))
    for p in cache.snapshot_points(req, 0, len(tokens) - 1):
        entry = cache.reserve_snapshot(req, p)  # None where the prefix has one already (it is touched)
        assert cache.commit_snapshot(req, p, entry) if entry is not None \
            else cache.has_snapshot(req.block_hashes[p // 16 - 1])
    cache.block_pool.free(req.block_table)
    return req


def _resumes_at(cache: prefix_cache.PrefixCache, tokens: list[int], image: str) -> int:
    """The hit of a request of ``tokens`` with its image at 40 (undone at once)."""
    req = Request("probe", None, tokens, SamplingParams(), 0)
    req.image_spans = (ImageSpan(40, 8, image),)
    hit = cache.lookup(req)
    cache.release_hit(hit)
    return hit.num_tokens


@pytest.mark.parametrize("sabotage", [False, True])
def test_the_budget_evicts_the_kind_of_point_never_resumed_from(monkeypatch: pytest.MonkeyPatch,
                                                                sabotage: bool) -> None:
    """GUI agents' steps leave their points before the first image (each agent's next step, its oldest screenshot
    now text, resumes there) and their prompts' ends (never resumed from: the next prompt differs before them). On
    a budget of four, three agents' steps a, b, c come in turn after three whose next steps resumed: the kind never
    resumed from goes first, so agent a's next step still resumes before its image; under plain LRU (the sabotage:
    every kind alike) the point before a's image goes at c's step. A lookup that an evicted snapshot would have
    served counts for its kind (a kind evicted too eagerly wins its place back)."""
    if sabotage:
        monkeypatch.setattr(prefix_cache.PrefixCache, "_chance_later", lambda self, h: 0.5)
    cache = prefix_cache.PrefixCache(BlockPool(128, 16), StateSlots(2, 4), 16, snapshot_interval=1024)
    for i in range(3):  # earlier steps, each resumed from before its image by the agent's next step
        earlier = toks(100, 11 + i)
        _computed(cache, f"x{i}", earlier, f"x{i}")
        assert _resumes_at(cache, earlier[:40] + toks(60, 21 + i), "next") == 32
    steps = {name: _computed(cache, name, toks(100, seed), name) for name, seed in (("a", 1), ("b", 2), ("c", 3))}
    kept = {(name, p) for name, r in steps.items() for p in (32, 96) if cache.has_snapshot(r.block_hashes[p // 16 - 1])}
    a_next = toks(100, 1)[:40] + toks(60, 4)
    if sabotage:
        assert kept == {("b", 32), ("b", 96), ("c", 32), ("c", 96)}
        assert _resumes_at(cache, a_next, "a2") == 0
        return
    assert kept == {("a", 32), ("b", 32), ("c", 32), ("c", 96)}
    assert _resumes_at(cache, a_next, "a2") == 32
    assert cache.kind_utilities()["prompt_end"] < 0.5 * cache.kind_utilities()["first_image"]
    before = cache.kind_utilities()["prompt_end"]
    assert _resumes_at(cache, toks(100, 2) + toks(20, 5), "b") == 32  # b's prompt again: its end was evicted
    assert cache.kind_utilities()["prompt_end"] > before


def test_a_spare_only_reservation_takes_free_then_spare_entries_and_no_resume_point(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``reserve_entry(spare_only=True)`` (a verify row's candidate) takes the spare snapshot (64), then finds
    nothing (counted as skipped), leaving both resume points; an ordinary reservation then evicts the older one."""
    cache, req = _full_cache(monkeypatch, lru_only=False)
    assert cache.reserve_entry(spare_only=True) is not None
    assert _kept(cache, req) == [32, 96] and cache.stats.evictions == 1
    assert cache.reserve_entry(spare_only=True) is None
    assert _kept(cache, req) == [32, 96] and cache.stats.skipped_full == 1
    assert cache.reserve_entry() is not None
    assert _kept(cache, req) == [96] and cache.stats.evictions == 2


@pytest.mark.parametrize("sabotage", [False, True])
def test_the_prompt_end_turns_spare_at_the_answers_first_boundary(monkeypatch: pytest.MonkeyPatch,
                                                                  sabotage: bool) -> None:
    """A request computing through the interval point again (it recurs) makes it an ordinary snapshot; the answer
    reaching its first block boundary (112) makes the prompt's end spare (the next turn resumes at 112 or later), so
    it goes before the older point before the image. The sabotage (the prompt's end never turned spare) evicts that
    point instead."""
    if sabotage:
        real = prefix_cache.PrefixCache._prompt_end_point
        monkeypatch.setattr(prefix_cache.PrefixCache, "commit_snapshot", _commit_keeping_the_prompt_end(real))
    cache, req = _full_cache(monkeypatch, lru_only=False, entries=4)
    again = Request("c", None, toks(100, 1), SamplingParams(), 0)
    again.image_spans = req.image_spans  # the same prompt, images and all
    assert cache.reserve_snapshot(again, 64) is None  # already there: touched, no longer spare
    req.output_token_ids.extend(toks(20, 5))
    entry = cache.reserve_snapshot(req, 112)  # the fourth entry, free
    assert entry is not None and cache.commit_snapshot(req, 112, entry)
    assert _kept(cache, req) == [32, 64, 96, 112]
    assert cache.reserve_snapshot(Request("o", None, toks(40, 10), SamplingParams(), 0), 32) is not None
    assert _kept(cache, req) == ([64, 96, 112] if sabotage else [32, 64, 112])


def _commit_keeping_the_prompt_end(real: Callable[..., int]) -> Callable[..., bool]:
    """commit_snapshot with the prompt's end hidden while it runs (no snapshot is found there to turn spare)."""
    commit = prefix_cache.PrefixCache.commit_snapshot

    def sabotaged(self: prefix_cache.PrefixCache, req: Request, position: int, entry: int) -> bool:
        if position <= real(self, req):
            return commit(self, req, position, entry)
        self_type = type(self)
        try:
            self_type._prompt_end_point = lambda s, r: 0  # type: ignore[method-assign]
            return commit(self, req, position, entry)
        finally:
            self_type._prompt_end_point = real  # type: ignore[method-assign]

    return sabotaged


def _candidates_evict(real: Callable[..., int | None]) -> Callable[..., int | None]:
    """Test-only sabotage: a verify row's candidate entry may evict any snapshot (plain LRU), not only spare ones."""
    def reserve_entry(self: prefix_cache.PrefixCache, spare_only: bool = False) -> int | None:
        return real(self, False)

    return reserve_entry


@pytest.mark.parametrize("sabotage", [False, True])
def test_verify_candidates_never_evict_a_resume_point(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch,
                                                      sabotage: bool) -> None:
    """MTP with async scheduling and a snapshot budget the decoding requests fill: request ``a`` ends at once,
    leaving its prompt's end (a resume point: its answer has no block boundary); three requests then decode 60
    tokens each, their verify rows reserving candidates for the boundaries they may cross. Those take free and
    spare entries only, so ``a``'s next turn resumes at its prompt's end; the sabotage (candidates evict by LRU)
    loses it. Every output equals the uncached engine's."""
    if sabotage:
        monkeypatch.setattr(prefix_cache.PrefixCache, "reserve_entry",
                            _candidates_evict(prefix_cache.PrefixCache.reserve_entry))
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    llm = cached_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                     async_scheduling=True, num_snapshot_slots=6, recurrent_snapshot_interval=1024)
    first = toks(50, 31)
    decoders = {f"d{i}": toks(40, 40 + i) for i in range(3)}
    final = drive(llm.llm_engine, {0: [("a", first, greedy(1))],
                                   3: [(r, p, greedy(60)) for r, p in decoders.items()]})
    again = first + final["a"].outputs[0].token_ids + toks(20, 39)
    final.update(drive(llm.llm_engine, {0: [("a2", again, greedy(4))]}))
    off = make_llm(path, enable_prefix_caching=False)
    for rid, p in {"a": first, **decoders, "a2": again}.items():
        want = off.generate({"prompt_token_ids": p}, greedy(len(final[rid].outputs[0].token_ids)), use_tqdm=False)
        assert final[rid].outputs[0].token_ids == want[0].outputs[0].token_ids, rid
    m = llm.get_metrics()
    assert m["hyserve:prefix_cache_snapshot_evictions"] > 0 or sabotage
    prompt_end = (len(first) - 1) // BS * BS  # the MTP lookahead: 49 keyable tokens, 48 of them in full blocks
    assert (final["a2"].num_cached_tokens == prompt_end) is not sabotage
    llm.llm_engine.assert_no_leaks()


# ---------------------------------------------------------------------------------------------- the host tier


def _agents_cache(host: int, earlier: int = 3) -> prefix_cache.PrefixCache:
    """A cache of four device entries and ``host`` host entries, in which ``earlier`` agents' steps taught that
    points before the first image are resumed from (and, once the host tier overflows, that prompt ends are
    dropped unresumed)."""
    cache = prefix_cache.PrefixCache(BlockPool(512, 16), StateSlots(2, 4), 16, snapshot_interval=1024,
                                     num_host_snapshots=host)
    for i in range(earlier):
        earlier = toks(100, 11 + i)
        _computed(cache, f"x{i}", earlier, f"x{i}")
        assert _resumes_at(cache, earlier[:40] + toks(60, 21 + i), "next") == 32
    return cache


@pytest.mark.parametrize("host", [0, 16])
def test_an_evicted_resume_point_moves_to_the_host_and_serves_the_next_step(host: int) -> None:
    """Six agents' steps on four device entries: the resume points the budget evicts move to the host tier (each
    move handed to the step once, from the entry it leaves), where agent a's next step finds the point before its
    image, as a host hit (a host entry to copy, no device entry). Without the host tier (the sabotage: 0 entries)
    the same step resumes from nothing."""
    cache = _agents_cache(host)
    earlier = cache.take_offloads()
    steps = {name: _computed(cache, name, toks(100, seed), name) for name, seed in
             (("a", 1), ("b", 2), ("c", 3), ("d", 4))}
    a = steps["a"]
    point = a.block_hashes[32 // 16 - 1]
    assert not cache.has_snapshot(point)
    moves = cache.take_offloads()
    assert cache.take_offloads() == []
    if not host:
        assert moves == earlier == [] and not cache.has_host_snapshot(point) and cache.stats.offloads == 0
        assert _resumes_at(cache, toks(100, 1)[:40] + toks(60, 4), "a2") == 0
        return
    assert cache.has_host_snapshot(point) and len(earlier) + len(moves) == cache.stats.offloads
    assert cache.stats.offloads == cache.num_host_snapshots_held <= host  # a free host entry each: none dropped
    assert len({h for _, h in earlier + moves}) == cache.stats.offloads
    snapshot_entries = range(cache.state_slots.snapshot_entry(0), cache.state_slots.snapshot_entry(4))
    assert all(e in snapshot_entries for e, _ in moves)
    req = Request("a2", None, toks(100, 1)[:40] + toks(60, 4), SamplingParams(), 0)
    req.image_spans = (ImageSpan(40, 8, "a2"),)
    hit = cache.lookup(req)
    assert (hit.num_tokens, hit.snapshot_entry) == (32, None)
    assert hit.host_snapshot == cache._host[point] and cache.stats.host_hits == 1
    # Pinned while the step that copies it is in flight: a full host tier gives up another entry.
    assert hit.host_snapshot in cache._host_pinned
    cache.release_hit(hit)
    assert not cache._host_pinned


@pytest.mark.parametrize("sabotage", [False, True])
def test_a_kind_never_resumed_from_stays_off_the_host(monkeypatch: pytest.MonkeyPatch, sabotage: bool) -> None:
    """The agents' prompt ends are never resumed from: once the cache has learned it (twelve earlier agents' steps
    overflow four host entries: the prompt ends dropped from there unresumed), an evicted prompt end is dropped,
    not moved (a copy over the host link for nothing, and a host entry a point before an image needs), while the
    points before the images are moved. The sabotage (every kind moved) moves the prompt ends too."""
    cache = _agents_cache(4, earlier=12)
    assert cache.kind_utilities()["prompt_end"] < prefix_cache.MOVE_UTILITY <= cache.kind_utilities()["first_image"]
    if sabotage:
        monkeypatch.setattr(prefix_cache, "MOVE_UTILITY", 0.0)
    steps = [_computed(cache, name, toks(100, seed), name) for name, seed in (("a", 1), ("b", 2), ("c", 3),
                                                                              ("d", 4), ("e", 5))]
    on_host = {p: sum(cache.has_host_snapshot(r.block_hashes[p // 16 - 1]) for r in steps) for p in (32, 96)}
    assert on_host[32] > 0
    assert (on_host[96] > 0) is sabotage, on_host


def test_a_full_host_tier_drops_its_least_recently_used_unpinned_entry_and_remembers_it() -> None:
    """One host entry: each move drops the previous entry's snapshot (remembered as a ghost of its kind, so a
    lookup it would have served still counts for the kind), except one pinned by a hit in flight, which stays; a
    spare snapshot never moves; an entry whose KV block is evicted is dropped."""
    cache = _agents_cache(1)
    seeds = {"a": 1, "b": 2, "c": 3, "d": 4}
    steps = [_computed(cache, name, toks(100, seed), name) for name, seed in seeds.items()]
    points = {(r.request_id, p): r.block_hashes[p // 16 - 1] for r in steps for p in (32, 96)}
    on_host = [key for key, h in points.items() if cache.has_host_snapshot(h)]
    assert len(on_host) == cache.num_host_snapshots_held == 1
    assert cache.stats.host_evictions == cache.stats.offloads - 1 > 0
    dropped = [h for h in points.values() if not cache.has_snapshot(h) and not cache.has_host_snapshot(h)]
    assert dropped and all(h in cache._ghosts for h in dropped)
    assert all(cache._kind.get(h) is not None for h in cache._host)  # resume points only: no spare one moved
    # A hit in flight pins the host entry: later moves find none to give, and the points they evict are dropped.
    (rid, p), = on_host
    req = Request("probe", None, toks(100, seeds[rid])[:p] + toks(100 - p, 77), SamplingParams(), 0)
    req.image_spans = (ImageSpan(40, 8, rid if p > 40 else "probe"),)
    hit = cache.lookup(req)
    assert hit.host_snapshot is not None and hit.num_tokens == p
    before = (cache.stats.offloads, cache.stats.evictions)
    _computed(cache, "e", toks(100, 5), "e")
    _computed(cache, "f", toks(100, 6), "f")
    assert cache.stats.offloads == before[0] and cache.stats.evictions > before[1]
    assert cache.has_host_snapshot(points[(rid, p)])
    cache.release_hit(hit)
    # Its prefix's KV evicted, the host entry goes with it.
    cache.block_pool.on_evict(points[(rid, p)])  # type: ignore[misc]
    assert not cache.has_host_snapshot(points[(rid, p)]) and cache._free_host == [0]


def _late_offloads(engine: LLMEngine) -> None:
    """Test-only sabotage: the moves to the host run after their step instead of before it, so the step's new
    snapshot in a reused entry reaches the host under the evicted point's key."""
    runner = engine.runner
    real = runner.execute_model_async

    def execute(so):  # type: ignore[no-untyped-def]
        moves, so.snapshot_offloads = so.snapshot_offloads, []
        handle = real(so)
        handle.result()
        runner.state_ops.offload_snapshots(moves)
        return handle

    runner.execute_model_async = execute  # type: ignore[method-assign]


@pytest.mark.parametrize("mode", ["host", "sabotaged", "no_host"])
def test_conversations_resume_through_the_host_tier_with_the_uncached_outputs(ckpts: CheckpointCache,
                                                                               mode: str) -> None:
    """Six interleaved conversations of four turns on three device snapshot entries, with MTP and async
    scheduling: the resume points the budget evicts move to 32 host entries, and later turns resume from them with
    exactly the outputs of the engine without caching. The host tier serves more prompt tokens than the same budget
    without it; moves made after their step (the sabotage) give wrong outputs."""
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    convs = make_convs(6, 4, toks(40, 8), seed=13)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    off = make_llm(path, enable_prefix_caching=False, speculative_config=spec)
    want = run_conversations(off.llm_engine, convs, out_len=9)
    llm = cached_llm(path, num_snapshot_slots=3, num_host_snapshot_slots=0 if mode == "no_host" else 32,
                     speculative_config=spec, async_scheduling=True)
    if mode == "sabotaged":
        _late_offloads(llm.llm_engine)
    got = run_conversations(llm.llm_engine, convs, out_len=9)
    m = llm.get_metrics()
    if mode == "sabotaged":
        assert m["hyserve:prefix_cache_snapshot_host_hits"] > 0
        assert got != want, "snapshots moved to the host after their entries were reused went unnoticed"
        return
    assert got == want
    pool = llm.llm_engine.runner.state_pool
    assert pool.num_host_snapshots == (32 if mode == "host" else 0)
    if mode == "host":
        assert m["hyserve:prefix_cache_snapshot_offloads"] > 0 and m["hyserve:prefix_cache_snapshot_host_hits"] > 0
        assert 0 < m["hyserve:prefix_cache_host_snapshots"] <= 32
        no_host = cached_llm(path, num_snapshot_slots=3, num_host_snapshot_slots=0, speculative_config=spec,
                             async_scheduling=True)
        assert run_conversations(no_host.llm_engine, convs, out_len=9) == want
        assert m["hyserve:prefix_cache_hits"] > no_host.get_metrics()["hyserve:prefix_cache_hits"]
    else:
        assert m["hyserve:prefix_cache_snapshot_offloads"] == m["hyserve:prefix_cache_snapshot_host_hits"] == 0
    llm.llm_engine.assert_no_leaks()
