"""The prefix cache's snapshot policy, piece by piece: what a kind of resume point learns (``KindModel``), a resume
point resumed from once learned apart from fresh ones (``answer+``), a decoding answer's superseded boundary freed
on the host tier too, and the snapshot budget's default share raised for a concurrency the user set."""

from __future__ import annotations

import argparse
import random

import pytest

from hyserve import SamplingParams
from hyserve.cache import prefix_cache
from hyserve.cache.block_pool import BlockPool
from hyserve.cache.planner import (
    DEFAULT_SNAPSHOT_MEMORY_FRACTION,
    MAX_SNAPSHOT_MEMORY_FRACTION,
    CacheInfo,
    plan_caches,
    snapshot_entries,
    snapshots_held_while_decoding,
)
from hyserve.cache.state_slots import StateSlots
from hyserve.config import EngineConfig
from hyserve.engine_args import engine_args
from hyserve.request import Request, RequestStatus

BS = 16


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_a_kind_learns_how_often_and_how_soon_its_points_are_resumed_from() -> None:
    model = prefix_cache.KindModel()
    assert model.chance() == 0.5 and model.still(10**6) == 0.5  # nothing known: the prior, whatever the age
    for delay in (1, 2, 3, 10):
        model.resumed += 1
        model.add_delay(delay)
    model.dropped += 2
    p = 5 / 8
    assert model.chance() == pytest.approx(p)
    # S(age): the share of resumes later than ``age`` after the last use, one more counted later
    for age, later in ((0, 4), (2, 2), (5, 1), (10, 0), (500, 0)):
        s = (later + 1) / 5
        assert model.still(age) == pytest.approx(p * s / (1 - p + p * s))
    assert model.still(0) > model.still(5) > model.still(10) == model.still(500) > 0
    for delay in range(prefix_cache.DELAYS_KEPT + 10):  # only the latest delays are kept: the old ones age out
        model.add_delay(1000 + delay)
    assert model.still(999) == pytest.approx(p)  # every kept delay is later than 999: the four short ones are gone
    model.decay(0.5)
    assert (model.resumed, model.dropped) == (2.0, 1.0)


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, None, tokens, SamplingParams(), 0)


def _answered(cache: prefix_cache.PrefixCache, rid: str, prompt: list[int], answer: list[int]) -> Request:
    """A request whose prompt was computed and whose answer decoded to its end, one token a step (no drafts: a
    decode row's boundary takes any entry, as the scheduler's does): a snapshot at the prompt's end and at each
    block boundary the answer reaches (the latest kept); then it finishes."""
    req = _request(rid, prompt)
    hit = cache.lookup(req)
    cache.release_hit(hit)
    req.block_table = cache.block_pool.allocate(-(-(len(prompt) + len(answer)) // BS))
    end = (len(prompt) - 1) // BS * BS
    entry = cache.reserve_snapshot(req, end)
    if entry is not None:
        cache.commit_snapshot(req, end, entry)
    req.num_computed_tokens = len(prompt)
    for t in answer:
        req.output_token_ids.append(t)
        req.num_computed_tokens = req.num_tokens - 1
        p = req.num_computed_tokens
        if p % BS == 0 and p > end:
            entry = cache.reserve_entry()
            if entry is not None:
                cache.commit_snapshot(req, p, entry)
    cache.publish_blocks(req, req.num_computed_tokens)
    req.status = RequestStatus.FINISHED
    cache.block_pool.free(req.block_table)
    return req


@pytest.mark.parametrize("sabotage", [False, True])
def test_a_resume_point_resumed_from_once_is_learned_apart(monkeypatch: pytest.MonkeyPatch, sabotage: bool) -> None:
    """Chats resumed once at their answer's end and never again (each next turn leaves its own): the cache learns
    the answer ends resumed from ("answer+") apart from fresh ones, so on a full budget the answer end resumed from
    a moment ago goes before a fresh one taken earlier. The sabotage (a resumed point learned as its kind, as
    before it was resumed) keeps the recently used one and evicts the fresh answer end."""
    if sabotage:
        monkeypatch.setattr(prefix_cache, "resumed_kind", lambda kind: kind)
    cache = prefix_cache.PrefixCache(BlockPool(1024, BS), StateSlots(2, 6), BS, snapshot_interval=1024)
    for i in range(8):  # conversations of two turns: the first turn's answer end resumed from once, then dropped
        first = _answered(cache, f"t{i}", toks(40, i), toks(40, 100 + i))
        hit = cache.lookup(_request(f"u{i}", first.prompt_token_ids + first.output_token_ids + toks(8, 200 + i)))
        assert hit.num_tokens == 64  # the first answer's latest boundary
        cache.release_hit(hit)
    fresh = _answered(cache, "fresh", toks(40, 50), toks(40, 51))
    old = _answered(cache, "old", toks(40, 60), toks(40, 61))
    resumed = old.prompt_token_ids + old.output_token_ids + toks(8, 62)
    hit = cache.lookup(_request("old2", resumed))  # the old conversation's next turn: resumed from, once
    assert hit.num_tokens == 64
    cache.release_hit(hit)
    if not sabotage:
        assert cache.kind_utilities()["answer+"] < 0.5 < cache.kind_utilities()["answer"]
    for i in range(12):  # more snapshots than room: something goes
        req = _request(f"x{i}", toks(40, 300 + i))
        entry = cache.reserve_snapshot(req, 32)
        assert entry is not None
        cache.commit_snapshot(req, 32, entry)
        fresh_kept = cache.has_snapshot(fresh.block_hashes[64 // BS - 1])
        old_kept = cache.has_snapshot(old.block_hashes[64 // BS - 1])
        if not (fresh_kept and old_kept):
            break
    assert (fresh_kept, old_kept) == ((False, True) if sabotage else (True, False))


@pytest.mark.parametrize("sabotage", [False, True])
def test_a_decoding_answers_boundary_is_no_drop_and_moves_to_the_host_only_once_its_request_ends(
        monkeypatch: pytest.MonkeyPatch, sabotage: bool) -> None:
    """The budget (one device entry) takes a decoding answer's latest boundary: the answer moves on to its next
    boundary, so the evicted one is neither moved to the host tier (a copy for nothing) nor learned as a resume
    point dropped unresumed. Once the request has finished, its answer end is a resume point like any: evicted, it
    moves to the host. The sabotage (every boundary taken as final) moves the first and learns a drop."""
    if sabotage:
        monkeypatch.setattr(prefix_cache.PrefixCache, "_still_moving", lambda self, h: False)
    cache = prefix_cache.PrefixCache(BlockPool(256, BS), StateSlots(2, 1), BS, snapshot_interval=1024,
                                     num_host_snapshots=4)
    req = _request("a", toks(40, 1))
    req.block_table = cache.block_pool.allocate(6)
    req.output_token_ids += toks(9, 2)
    req.num_computed_tokens = 48  # the answer's first boundary past the prompt's end (32)
    entry = cache.reserve_entry()
    assert entry is not None and cache.commit_snapshot(req, 48, entry)
    first = req.block_hashes[48 // BS - 1]

    def evict_with_another(seed: int) -> None:
        other = _request(f"o{seed}", toks(40, seed))  # another request's prompt end takes the one device entry
        entry = cache.reserve_snapshot(other, 32)
        assert entry is not None
        cache.commit_snapshot(other, 32, entry)

    evict_with_another(3)
    assert not cache.has_snapshot(first)
    assert cache.has_host_snapshot(first) is sabotage
    assert cache._models["answer"].dropped == 0.0
    req.output_token_ids += toks(16, 4)
    req.num_computed_tokens = 64
    entry = cache.reserve_entry()
    assert entry is not None and cache.commit_snapshot(req, 64, entry)
    req.status = RequestStatus.FINISHED
    end = req.block_hashes[64 // BS - 1]
    evict_with_another(5)
    assert cache.has_host_snapshot(end)  # a finished request's answer end moves like any resume point


def _plan(budget: int, per_slot: int, wanted: int, **kw: object) -> int:
    config = EngineConfig(model="unused", **kw)  # type: ignore[arg-type]
    return plan_caches(config, CacheInfo(2**20, per_slot, True), 32, 0, lambda: budget, "cpu", wanted).num_snapshots


def test_the_default_snapshot_share_holds_what_a_set_concurrency_holds() -> None:
    """The seed's layout on one H100 (float32 27B snapshots of about 150 MiB, about 42 GiB of cache budget, 32
    agents, async scheduling): 0.2 of the budget held 57 snapshots against the 96 that 32 decoding requests hold at
    once; the default share now rises to hold them, up to 0.4, and an explicit fraction is kept as given."""
    per_slot, budget = 150 * 2**20, 42 * 2**30
    wanted = snapshots_held_while_decoding(32, 1)
    assert wanted == 96
    assert _plan(budget, per_slot, 0) == int(budget * DEFAULT_SNAPSHOT_MEMORY_FRACTION) // per_slot == 57
    assert _plan(budget, per_slot, wanted) == 96
    assert _plan(budget, per_slot, 8) == 57  # fewer wanted: the default share stays
    assert _plan(budget, per_slot, 1000) == int(budget * MAX_SNAPSHOT_MEMORY_FRACTION) // per_slot  # capped
    assert _plan(budget, per_slot, wanted, snapshot_memory_fraction=0.1) == 28  # as given
    assert snapshot_entries(EngineConfig(model="unused"), budget, 0, 0) == int(budget * 0.2)  # no state: no bytes
    with pytest.raises(ValueError, match=r"snapshot_memory_fraction must be a number in \[0, 1\)"):
        EngineConfig(model="unused", snapshot_memory_fraction=1.5).validate()
    p = argparse.ArgumentParser()
    engine_args(p)
    assert p.parse_args([]).snapshot_memory_fraction is None
    assert p.parse_args(["--snapshot-memory-fraction", "0.35"]).snapshot_memory_fraction == 0.35
