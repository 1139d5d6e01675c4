"""How the cache budget is split: KV blocks, recurrent state slots (+ verify scratch) and prefix-cache snapshots.

Pure arithmetic over what the layers declare (``specs``) and what the worker measured (``determine_available_memory``
of the executor): the engine plans, the worker allocates what the plan says.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from hyserve.cache.block_pool import cdiv
from hyserve.config import EngineConfig, snapshot_host_memory_bytes

logger = logging.getLogger("hyserve")

# Share of the cache budget the recurrent state pool may take before max_num_seqs is lowered to fit.
MAX_STATE_SHARE = 0.5
# Share of the cache budget for prefix-cache snapshots (--snapshot-memory-fraction unset), and how far it is raised
# to hold the snapshots that a max_num_seqs the user set can hold at once while decoding (``snapshots_wanted``).
DEFAULT_SNAPSHOT_MEMORY_FRACTION = 0.2
MAX_SNAPSHOT_MEMORY_FRACTION = 0.4


@dataclass(slots=True)
class CacheLayout:
    num_kv_blocks: int
    num_state_slots: int
    kv_bytes_per_block: int
    state_bytes_per_slot: int
    num_snapshots: int = 0
    max_num_seqs: int = 1
    num_host_snapshots: int = 0  # the prefix cache's host tier (entries of state_bytes_per_slot)


@dataclass(slots=True)
class CacheInfo:
    """What a worker's model needs per KV block and per state slot (every layer's declared specs)."""

    kv_bytes_per_block: int
    state_bytes_per_slot: int
    has_recurrent_state: bool
    # Sets of verify scratch (k + 1 candidate states per sequence) the worker keeps: more than one on a pipeline
    # stage that commits a verify step only when its accepted counts come back (hyserve.worker.pipeline_stage).
    verify_scratch_sets: int = 1
    # Every recurrent layer takes prefix-cache snapshots inside prefill rows (RecurrentLayer.supports_row_snapshots).
    row_snapshots: bool = False
    # Bytes of one verify position of one sequence in a scratch set (CacheSpecs.scratch_bytes_per_position); None:
    # a candidate state (state_bytes_per_slot).
    scratch_bytes_per_position: int | None = None


def cache_memory_flag(device_type: str) -> str:
    """The flag that sizes the cache on a device of ``device_type`` (for error messages)."""
    return "--gpu-memory-utilization" if device_type == "cuda" else "--cpu-cache-memory (cpu_cache_memory_bytes)"


def host_memory_available() -> int | None:
    """Bytes of host memory available to new allocations (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def plan_host_snapshots(config: EngineConfig, per_slot: int, caching: bool, device_type: str,
                        workers_here: int = 1) -> int:
    """Entries of the prefix cache's host tier (``--snapshot-host-memory-gb``, or ``num_host_snapshot_slots``):
    what the asked memory holds. The default is lowered to a quarter of the host's available memory shared by the
    ``workers_here`` workers of this host; an explicit size that does not fit is an error."""
    if not caching or not per_slot:
        return 0
    if config.num_host_snapshot_slots is not None:
        return config.num_host_snapshot_slots
    want = snapshot_host_memory_bytes(config.snapshot_host_memory_gb, device_type)
    available = host_memory_available()
    if want and available is not None:
        if config.snapshot_host_memory_gb is None:
            want = min(want, available // (4 * workers_here))
        elif want * workers_here > available:
            raise ValueError(f"--snapshot-host-memory-gb {config.snapshot_host_memory_gb:g} for each of {workers_here} "
                             f"workers needs {want * workers_here / 2**30:.1f} GiB of host memory, but "
                             f"{available / 2**30:.1f} GiB is available; lower it (0 turns the host tier off)")
    return want // per_slot


def snapshots_held_while_decoding(max_num_seqs: int, steps_in_flight: int) -> int:
    """Snapshot entries ``max_num_seqs`` decoding requests can hold at once: each keeps the snapshot at its latest
    block boundary (the request end's, once it finishes) and reserves one for the boundary a step may cross, for
    every step scheduled and not yet applied."""
    return max_num_seqs * (2 + steps_in_flight)


def snapshot_entries(config: EngineConfig, budget: int, per_slot: int, snapshots_wanted: int) -> int:
    """Snapshot entries of ``per_slot`` bytes out of ``budget`` bytes: ``--snapshot-memory-fraction`` of it, or by
    default DEFAULT_SNAPSHOT_MEMORY_FRACTION of it raised to hold ``snapshots_wanted`` entries, up to
    MAX_SNAPSHOT_MEMORY_FRACTION. A budget below what the running requests hold at once loses each published
    snapshot within a few steps (on the seed's agents, 32 of them: 57 entries against 96, docs/features.md)."""
    per_slot = max(per_slot, 1)
    if config.snapshot_memory_fraction is not None:
        return int(budget * config.snapshot_memory_fraction) // per_slot
    default = int(budget * DEFAULT_SNAPSHOT_MEMORY_FRACTION) // per_slot
    return max(default, min(snapshots_wanted, int(budget * MAX_SNAPSHOT_MEMORY_FRACTION) // per_slot))


def plan_caches(config: EngineConfig, info: CacheInfo, max_num_seqs: int, num_speculative_tokens: int,
                budget_fn: Callable[[], int], device_type: str, snapshots_wanted: int = 0) -> CacheLayout:
    """The layout for ``config``: its explicit sizes, or a split of ``budget_fn()`` bytes (called only if needed).
    ``snapshots_wanted``: the snapshot entries the running requests hold at once, where the user set their number
    (``snapshot_entries``)."""
    per_block, per_slot = info.kv_bytes_per_block, info.state_bytes_per_slot
    caching = config.enable_prefix_caching and info.has_recurrent_state
    host = plan_host_snapshots(config, per_slot, caching, device_type, config.world_size)
    if config.num_kv_blocks is not None and config.num_state_slots is not None:
        snaps = (config.num_snapshot_slots if config.num_snapshot_slots is not None else 64) if caching else 0
        return CacheLayout(config.num_kv_blocks, config.num_state_slots, per_block, per_slot, snaps,
                           min(max_num_seqs, config.num_state_slots), host)
    budget = budget_fn()
    snaps = 0
    if caching:
        snaps = config.num_snapshot_slots if config.num_snapshot_slots is not None else \
            snapshot_entries(config, budget, per_slot, snapshots_wanted)
        budget -= snaps * per_slot
    # A sequence's recurrent state costs one slot, plus k + 1 positions of verify scratch when speculating; the pad
    # slot is one more. Together they may take MAX_STATE_SHARE of the budget.
    k = num_speculative_tokens
    per_position = per_slot if info.scratch_bytes_per_position is None else info.scratch_bytes_per_position
    scratch_per_seq = (k + 1) * per_position * info.verify_scratch_sets if k else 0

    def state_bytes(n: int) -> int:
        return (n + 1) * per_slot + min(n, max_num_seqs) * scratch_per_seq

    slots = config.num_state_slots or max_num_seqs
    if per_slot and state_bytes(slots) > MAX_STATE_SHARE * budget:
        fit = (int(MAX_STATE_SHARE * budget) - per_slot) // (per_slot + scratch_per_seq)
        what = f"recurrent state and verify scratch ({k + 1} positions)" if k else "recurrent state"
        if fit < 1:
            raise ValueError(f"the cache budget cannot hold one request's {what}; raise "
                             f"{cache_memory_flag(device_type)}" + (", or lower num_speculative_tokens" if k else ""))
        # Only a max_num_seqs the user asked for deserves a warning; the default is sized to what fits.
        log = logger.warning if config.max_num_seqs is not None else logger.info
        log("%s for %d sequences does not fit the budget; max_num_seqs lowered to %d", what, slots, fit)
        slots = fit
    blocks = config.num_kv_blocks
    if blocks is None:
        blocks = max(2, (budget - state_bytes(slots)) // max(per_block, 1))
        if per_block == 0:  # a model without attention layers needs no KV; keep a token pool for bookkeeping
            blocks = max(2, cdiv(256 * 1024, config.block_size))
    return CacheLayout(int(blocks), int(slots), per_block, per_slot, int(snaps), min(max_num_seqs, int(slots)), host)


def plan_caches_for_ranks(config: EngineConfig, infos: list[CacheInfo], max_num_seqs: int,
                          num_speculative_tokens: int, budgets_fn: Callable[[], list[int]],
                          device_type: str, snapshots_wanted: int = 0) -> CacheLayout:
    """One layout that every rank can hold: each rank's plan from its own needs (a pipeline stage caches only its
    layers) and budget, then the smallest count of each kind (block ids, slot ids and snapshot entries are the same
    on every rank). A rank without recurrent state does not limit the snapshots; the layout's byte sizes are the
    largest rank's."""
    budgets: list[int] | None = None

    def budget(rank: int) -> int:
        nonlocal budgets
        if budgets is None:
            budgets = budgets_fn()
        return budgets[rank]

    if all(info == infos[0] for info in infos):
        return plan_caches(config, infos[0], max_num_seqs, num_speculative_tokens, lambda: min(budgets_fn()),
                           device_type, snapshots_wanted)
    plans = [plan_caches(config, info, max_num_seqs, num_speculative_tokens, functools.partial(budget, r),
                         device_type, snapshots_wanted) for r, info in enumerate(infos)]
    with_state = [p for p, info in zip(plans, infos, strict=True) if info.has_recurrent_state] or plans
    layout = CacheLayout(min(p.num_kv_blocks for p in plans), min(p.num_state_slots for p in plans),
                         max(p.kv_bytes_per_block for p in plans), max(p.state_bytes_per_slot for p in plans),
                         min(p.num_snapshots for p in with_state), min(p.max_num_seqs for p in plans),
                         min(p.num_host_snapshots for p in with_state))
    for r, (info, p) in enumerate(zip(infos, plans, strict=True)):
        logger.info("rank %d: %.1f KiB per KV block, %.1f KiB per state slot: fits %d blocks, %d slots, %d snapshots",
                    r, info.kv_bytes_per_block / 1024, info.state_bytes_per_slot / 1024, p.num_kv_blocks,
                    p.num_state_slots, p.num_snapshots)
    return layout
