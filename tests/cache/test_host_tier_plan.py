"""The prefix cache's host tier in the cache plan: ``--snapshot-host-memory-gb`` (or a count) as host entries of a
snapshot's bytes, its default per device, the default lowered to what the host has, an explicit size that does not
fit refused, and the CLI flag reaching the engine's config."""

from __future__ import annotations

import argparse

import pytest

from hyserve.cache import planner
from hyserve.cache.planner import CacheInfo, plan_caches, plan_caches_for_ranks
from hyserve.config import DEFAULT_SNAPSHOT_HOST_MEMORY_GB, EngineConfig
from hyserve.engine_args import engine_args

PER_SLOT = 64 * 2**20  # a snapshot's bytes


def _plan(device: str, **kw: object) -> planner.CacheLayout:
    config = EngineConfig(model="unused", **kw)  # type: ignore[arg-type]
    return plan_caches(config, CacheInfo(2**20, PER_SLOT, True), 8, 0, lambda: 40 * 2**30, device)


def test_the_host_tier_holds_what_its_memory_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planner, "host_memory_available", lambda: 512 * 2**30)
    assert _plan("cuda").num_host_snapshots == int(DEFAULT_SNAPSHOT_HOST_MEMORY_GB * 2**30) // PER_SLOT == 128
    assert _plan("cpu").num_host_snapshots == 0  # the cache is host memory already
    assert _plan("cpu", snapshot_host_memory_gb=1.5).num_host_snapshots == 24
    assert _plan("cuda", snapshot_host_memory_gb=0).num_host_snapshots == 0
    assert _plan("cuda", num_host_snapshot_slots=5).num_host_snapshots == 5
    assert _plan("cuda", enable_prefix_caching=False).num_host_snapshots == 0
    # a model without recurrent state has no snapshots to keep
    config = EngineConfig(model="unused")
    no_state = plan_caches(config, CacheInfo(2**20, 0, False), 8, 0, lambda: 40 * 2**30, "cuda")
    assert no_state.num_host_snapshots == 0
    # pipeline stages: the stage of the largest snapshot bytes sets the count; a stage without state does not
    ranks = [CacheInfo(2**20, PER_SLOT, True), CacheInfo(2**20, 2 * PER_SLOT, True), CacheInfo(2**20, 0, False)]
    layout = plan_caches_for_ranks(EngineConfig(model="unused", pipeline_parallel_size=3,
                                                distributed_executor_backend="mp"), ranks, 8, 0,
                                   lambda: [40 * 2**30] * 3, "cuda")
    assert layout.num_host_snapshots == int(DEFAULT_SNAPSHOT_HOST_MEMORY_GB * 2**30) // (2 * PER_SLOT)


def test_the_default_shrinks_to_the_host_and_an_explicit_size_that_does_not_fit_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planner, "host_memory_available", lambda: 8 * 2**30)
    assert _plan("cuda").num_host_snapshots == 2 * 2**30 // PER_SLOT  # a quarter of what is available
    assert _plan("cuda", snapshot_host_memory_gb=6).num_host_snapshots == 96
    with pytest.raises(ValueError, match=r"--snapshot-host-memory-gb 12 .* 8\.0 GiB is available"):
        _plan("cuda", snapshot_host_memory_gb=12)
    with pytest.raises(ValueError, match="snapshot_host_memory_gb must be a finite number >= 0"):
        EngineConfig(model="unused", snapshot_host_memory_gb=-1).validate()
    monkeypatch.setattr(planner, "host_memory_available", lambda: None)  # unknown: taken as asked
    assert _plan("cuda", snapshot_host_memory_gb=12).num_host_snapshots == 192


def test_the_flag_reaches_the_config() -> None:
    p = argparse.ArgumentParser()
    engine_args(p)
    assert p.parse_args([]).snapshot_host_memory_gb is None
    assert p.parse_args(["--snapshot-host-memory-gb", "2.5"]).snapshot_host_memory_gb == 2.5
