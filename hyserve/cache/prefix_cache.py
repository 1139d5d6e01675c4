"""Prefix caching for hybrid models: attention KV blocks and recurrent-state snapshots in one key space.

Keys. Block ``i`` of a token sequence (tokens ``[i*B, (i+1)*B)``, B = block size) has the key
``h_i = H(h_{i-1}, tokens of block i)``: the key names the whole prefix ``[0, (i+1)*B)``. The attention KV of that
block is cached under ``h_i`` (``BlockPool``), and so is a recurrent snapshot, the state of every recurrent layer after
consuming exactly that prefix (docs/design.md invariant 4). The block size stays small (16); where snapshots are
taken is a policy:

    prompt:   |=========================== P ===========|xxx|
    points:   ^interval        ^branch point    ^end of prompt (aligned down)   ^every block boundary while
                                                                                 decoding (latest one kept)

A branch point is where a request's prefix leaves the cached KV of another (the sibling that comes next will hit
there), or where a waiting request shares the prefix that this one is computing (the scheduler's prefix sharing);
both are the request's ``share_points``. A prompt with images also has a point before each image (``image_points``):
a GUI agent's next prompt replaces the oldest screenshot of its sliding window by text, and resumes there.

A hit of length L needs KV for [0, L) *and* a snapshot at exactly L, with L <= num_tokens - 1 (the last known token
is always computed, so the step produces logits). Lookup takes the deepest such L.

Lookahead (speculative decoding with the MTP head). A block's storage also holds the MTP layer's KV, and the MTP
entry at position i depends on token i + 1 (invariant 5): the entry at a block's last position depends on the first
token of the *next* block. So with MTP the key of block ``i`` also covers that one token,
``h_i = H(h_{i-1}, tokens [i*B, (i+1)*B + 1))``, and every entry a block holds is a function of its key: any chain of
cached blocks (whoever published each of them, and however the branches they came from split) holds exactly the MTP
entries a from-scratch computation of the hitting request would, with nothing to recompute and no private copy. The
price: a block is keyed, published and snapshotted only once the token after it is known and the MTP entry before
it is written (position ``num_tokens - 1`` is never a snapshot point), and two requests that split exactly at a block
boundary share one block less.

Correctness rests on three rules, each enforced in one place here:
* A snapshot is copied out of a request's slot (or verified candidate) only right after the forward of the step that
  brought the state to the snapshot's position, or written by the recurrent layers during that forward at a point
  inside a prefill row (``snapshot_points``: a chunk need not end there where the layers can), into an entry
  reserved when that step was scheduled; it is
  published only when that step's result is in (``commit_snapshot``), so any step that copies it in runs after the
  copy out; nothing reads a snapshot in the step that writes it.
* Only computed, verified tokens are published (invariant 3): a block when all its tokens are computed, a snapshot
  at a position the request has reached. (With speculative decoding, rows publish only up to the accepted length.)
* Published KV blocks and snapshots are never written again; a hit copies the snapshot into the request's own slot
  and takes references on the shared blocks, and the request writes only blocks past the hit.

Eviction: KV blocks LRU through ``BlockPool`` (deepest-first); a snapshot whose block is evicted is dropped with it
(its prefix is gone), and snapshots have their own budget with LRU eviction, spare ones first. A snapshot is spare
where no later request is expected to resume: at an interval point, before an image other than the first (a GUI
agent's next prompt turns its oldest screenshot into text, which moves every later image), or at the prompt's end
once the answer has reached a block boundary; it stops being spare when a request resumes there or computes through
it again. The resume points (the answer's latest boundary, or the prompt's end before it has one; a point where
prefixes part; before the first image) go by the chance each is resumed from later, the least likely first
(``KindModel``): per kind, the share of its snapshots resumed from before they were dropped (decayed counts), and
how long after their last use the resumes came (the latest 64 delays, counted in snapshots taken since), so a
fresh answer end keeps its kind's chance while an old one, past the delays its kind is resumed within, has
almost none. A snapshot's life as a kind ends at its first resume; from then on it is learned as that kind
resumed from ("answer+": a chat's answer end, resumed from by the next turn, is rarely resumed from again, a
system prompt's branch point always). A decoding answer's latest boundary is learned only once its request has
ended (the point moves on with the answer), and a lookup that an evicted snapshot would have served deeper turns
its drop into a resume (the dropped are remembered a while), so a kind evicted too eagerly wins its place back.
A hit keeps the point before the request's first image as recently used as itself, and counts as a use of it:
an agent's next step resumes there. Within a kind the least recently used is the least likely, so only each
kind's least recently used is weighed; ties go to the least recently used. A workload teaches the cache which
points pay: GUI agents resume at their first two steps' answer ends, then before their first image; a chat at
the answer's end. A verify row's candidate entry (MTP) takes a free or spare entry only. Snapshots pinned for a
copy-in in the current step are not evicted.

The host tier (``num_host_snapshots`` > 0, ``--snapshot-host-memory-gb``): a resume point the budget evicts is not
dropped but moved to host memory if its chance of being resumed from later is at least ``MOVE_UTILITY``
(``take_offloads``: the worker copies the entry out before the step that reuses it writes it), where it stays,
least recently used first, until the host entries run out or its KV block is evicted (a drop learned then). A
lookup whose deepest snapshot is on the host hits it as one on the device (``PrefixHit.host_snapshot``: the worker
copies it into the request's slot). The copy is the same bytes, so a hit through the host gives what one through the
device does. Spare snapshots go nowhere: they are dropped as before.
"""

from __future__ import annotations

import bisect
import hashlib
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from hyserve.cache.block_pool import BlockPool
from hyserve.cache.state_slots import StateSlots
from hyserve.request import Request

ROOT_HASH = b"hyserve-prefix-root"
# The kinds of resume point (``PrefixCache._point_kind``); a spare snapshot promoted by a hit or a recomputation is
# "recurred".
POINT_KINDS = ("share", "first_image", "prompt_end", "answer", "recurred")
# What the cache learns per kind of resume point, and separately per kind for a snapshot already resumed from once
# ("answer+": whether an answer's end, resumed from, is resumed from again).
LEARNED_KINDS = POINT_KINDS + tuple(f"{kind}+" for kind in POINT_KINDS)


def resumed_kind(kind: str) -> str:
    """The kind a resume point of ``kind`` is learned as once resumed from."""
    return kind if kind.endswith("+") else f"{kind}+"
# The host tier takes an evicted resume point whose chance of being resumed from later is at least this.
MOVE_UTILITY = 0.25
# The latest resume delays kept per kind (``KindModel``).
DELAYS_KEPT = 64


class KindModel:
    """What the cache has learned of one kind of resume point: how many of its snapshots were resumed from and how
    many were dropped unresumed (decayed counts; a snapshot's life ends at its first resume, after which it is
    "recurred"), and how long after their last use (in snapshots taken since) the latest resumes came."""

    __slots__ = ("_delays", "_sorted", "dropped", "resumed")

    def __init__(self) -> None:
        self.resumed = 0.0
        self.dropped = 0.0
        self._delays: deque[int] = deque()
        self._sorted: list[int] = []

    def chance(self) -> float:
        """The chance a snapshot of this kind is resumed from at all: a Laplace estimate (1/2 before any)."""
        return (self.resumed + 1.0) / (self.resumed + self.dropped + 2.0)

    def add_delay(self, delay: int) -> None:
        self._delays.append(delay)
        bisect.insort(self._sorted, delay)
        if len(self._delays) > DELAYS_KEPT:
            del self._sorted[bisect.bisect_left(self._sorted, self._delays.popleft())]

    def still(self, age: int) -> float:
        """The chance a snapshot of this kind unused for ``age`` is resumed from later: of the snapshots resumed
        from, the share resumed later than ``age`` after their last use (S, with one more counted later: 1 before
        any delay is known), against those never resumed: ``p S / (1 - p + p S)``."""
        later = len(self._sorted) - bisect.bisect_right(self._sorted, age)
        survive = (later + 1.0) / (len(self._sorted) + 1.0)
        p = self.chance()
        return p * survive / (1.0 - p + p * survive)

    def decay(self, factor: float) -> None:
        self.resumed *= factor
        self.dropped *= factor


def hash_block(parent: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    h.update(extra)
    return h.digest()


def image_keys(req: Request, start: int, end: int) -> bytes:
    """What a block covering tokens ``[start, end)`` adds to its key for the images whose placeholders it overlaps:
    each one's content hash and offset from ``start``. Equal placeholder ids with different images then never share
    a block, nor anything after it (keys chain), while blocks before the first image still do."""
    out = b""
    for span in req.image_spans:
        if span.offset < end and span.offset + span.length > start:
            out += span.content_hash.encode() + (span.offset - start).to_bytes(8, "little", signed=True)
    return out


def image_points(req: Request, block_size: int) -> list[int]:
    """Snapshot points before each image (its span's start, aligned down to a block): an agent's next prompt that
    drops this screenshot from its sliding window, keeping the text before it, resumes there."""
    return [(span.offset // block_size) * block_size for span in req.image_spans]


def extend_block_hashes(req: Request, block_size: int, upto_tokens: int, lookahead: int = 0) -> None:
    """Extend ``req.block_hashes`` to cover every full block inside the first ``upto_tokens`` tokens whose
    ``lookahead`` following tokens are known too (block ``i``'s key covers tokens [i*B, (i+1)*B + lookahead))."""
    n_full = min(upto_tokens, req.num_tokens - lookahead) // block_size
    hashes = req.block_hashes
    while len(hashes) < n_full:
        i = len(hashes)
        parent = hashes[-1] if hashes else ROOT_HASH
        lo, hi = i * block_size, (i + 1) * block_size + lookahead
        hashes.append(hash_block(parent, req.token_ids(lo, hi), image_keys(req, lo, hi)))


@dataclass(slots=True)
class PrefixHit:
    num_tokens: int  # L: tokens whose KV and state come from the cache
    blocks: list[int]  # KV blocks of [0, L), referenced
    snapshot_entry: int | None  # state-pool entry to copy into the request's slot (pinned for this step)
    branch_point: int | None  # aligned position past L up to which cached KV matched, but no snapshot
    host_snapshot: int | None = None  # or: host entry to copy into the request's slot (pinned for this step)


@dataclass(slots=True)
class SnapshotStats:
    hits: int = 0
    misses: int = 0
    taken: int = 0
    evictions: int = 0
    skipped_full: int = 0
    host_hits: int = 0  # hits whose snapshot came from the host tier (counted in ``hits`` too)
    offloads: int = 0  # resume points the budget moved to the host instead of dropping them
    host_evictions: int = 0  # host entries dropped for others (their KV block evicted: not counted)


class PrefixCache:
    def __init__(self, block_pool: BlockPool, state_slots: StateSlots, block_size: int,
                 snapshot_interval: int, has_recurrent_state: bool = True, lookahead: int = 0,
                 num_host_snapshots: int = 0) -> None:
        if snapshot_interval <= 0 or snapshot_interval % block_size:
            raise ValueError(f"recurrent_snapshot_interval must be a positive multiple of block_size={block_size} "
                             f"(got {snapshot_interval}); set --recurrent-snapshot-interval")
        self.block_pool = block_pool
        self.state_slots = state_slots
        self.block_size = block_size
        self.interval = snapshot_interval
        self.has_recurrent_state = has_recurrent_state
        # 1 with an MTP draft layer: a block's key also covers the token after it (see the module docstring).
        self.lookahead = lookahead
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> snapshot index, LRU first
        # Snapshots evicted before the others (see ``_alloc_snapshot``): taken where no later request is expected to
        # resume, until one does (a hit, or a request computing through the point again).
        self._spare: set[bytes] = set()
        # The resume points' kinds (``_point_kind``; "recurred" once resumed from), when each was last used (the
        # count of snapshots taken then: ``_clock``), and per kind what the cache has learned (``KindModel``; a drop
        # that a later lookup shows too eager is turned into a resume, through ``_ghosts``): the budget evicts the
        # resume point least likely to be resumed from later first (``_alloc_snapshot``).
        self._kind: dict[bytes, str] = {}
        self._used: dict[bytes, int] = {}
        # A decoding request's latest answer boundary -> the request: until it finishes the point moves on, so its
        # eviction is no drop to learn from, nor worth a move to the host.
        self._moving: dict[bytes, Request] = {}
        self._clock = 0
        self._models = {k: KindModel() for k in LEARNED_KINDS}
        # dropped resume points -> (kind, last use), oldest first: remembered over many budgets' worth of snapshots
        # (a GUI agent resumes before its first image three steps after taking it)
        self._ghosts: OrderedDict[bytes, tuple[str, int]] = OrderedDict()
        self._ghost_limit = max(64 * state_slots.num_snapshots, 1024)
        self._decay = 1.0 - 1.0 / (4 * max(state_slots.num_snapshots, 1))
        self._free_snapshots = list(range(state_slots.num_snapshots - 1, -1, -1))
        self._pinned: dict[int, int] = {}
        # The host tier: prefix hash -> host entry, least recently used first; its free entries, pins, kinds, and
        # the moves (device entry, host entry) the next step's workers make before anything else of the step.
        self.num_host_snapshots = num_host_snapshots if has_recurrent_state else 0
        self._host: OrderedDict[bytes, int] = OrderedDict()
        self._free_host = list(range(self.num_host_snapshots - 1, -1, -1))
        self._host_pinned: dict[int, int] = {}
        self._offloads: list[tuple[int, int]] = []
        self.stats = SnapshotStats()
        # Weak: a bound method stored in the pool would close a cycle (pool -> cache -> pool) that keeps the state
        # pool's tensors alive after the engine is dropped, until a gc pass happens to run.
        ref = weakref.WeakMethod(self._on_block_evicted)

        def on_evict(block_hash: bytes) -> None:
            method = ref()
            if method is not None:
                method(block_hash)

        block_pool.on_evict = on_evict

    # ------------------------------------------------------------------ lookup

    def lookup(self, req: Request) -> PrefixHit:
        """Deepest hit for ``req`` (references its blocks, pins its snapshot); ``release_hit`` undoes it."""
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs  # also keyable: the token after block max_blocks - 1 is known
        self._extend_hashes(req, max_blocks * bs)
        kv_depth = best = 0
        for i in range(max_blocks):
            h = req.block_hashes[i]
            if self.block_pool.lookup(h) is None:
                break
            kv_depth = i + 1
            if not self.has_recurrent_state or h in self._snapshots or h in self._host:
                best = i + 1
        branch = kv_depth * bs if kv_depth > best else None
        self._count_ghost_hit(req, best, kv_depth)
        if best == 0:
            if self.has_recurrent_state and kv_depth:
                self.stats.misses += 1
            return PrefixHit(0, [], None, branch)
        blocks = [self.block_pool.lookup(req.block_hashes[j]) for j in range(best)]
        assert all(b is not None for b in blocks)
        kv_blocks = [b for b in blocks if b is not None]
        self.block_pool.touch(kv_blocks)
        entry = None
        if self.has_recurrent_state:
            # The point before the first image, where this request's next step may resume (see _resume_point): kept
            # as recently used as the hit beyond it, so an agent's resume point lives as long as its episode goes on.
            first = self._first_image_point(req)
            resume = req.block_hashes[first // bs - 1] if first is not None and bs <= first < best * bs else None
            if resume is not None:
                self._passed(resume)
            h = req.block_hashes[best - 1]
            self._resumed(h)
            self.stats.hits += 1
            if h not in self._snapshots:  # on the host
                host = self._host[h]
                self._host.move_to_end(h)
                self._host_pinned[host] = self._host_pinned.get(host, 0) + 1
                self.stats.host_hits += 1
                return PrefixHit(best * bs, kv_blocks, None, branch, host)
            idx = self._snapshots[h]
            self._snapshots.move_to_end(h)
            self._promote(h)
            self._pinned[idx] = self._pinned.get(idx, 0) + 1
            entry = self.state_slots.snapshot_entry(idx)
        return PrefixHit(best * bs, kv_blocks, entry, branch)

    def release_hit(self, hit: PrefixHit) -> None:
        """Undo a lookup whose request could not be admitted after all."""
        if hit.blocks:
            self.block_pool.free(hit.blocks)
        self.unpin(hit.snapshot_entry)
        self.unpin_host(hit.host_snapshot)

    def unpin_host(self, host: int | None) -> None:
        if host is None:
            return
        self._host_pinned[host] -= 1
        if self._host_pinned[host] == 0:
            del self._host_pinned[host]

    def take_offloads(self) -> list[tuple[int, int]]:
        """The (device entry, host entry) moves decided since the last call: the step being scheduled carries them,
        and every worker makes them before anything else of that step (the step reuses those device entries)."""
        moves, self._offloads = self._offloads, []
        return moves

    def unpin(self, entry: int | None) -> None:
        if entry is None:
            return
        idx = entry - self.state_slots.snapshot_entry(0)
        self._pinned[idx] -= 1
        if self._pinned[idx] == 0:
            del self._pinned[idx]

    # ------------------------------------------------------------------ policy

    def keyable_tokens(self, req: Request) -> int:
        """How many of ``req``'s tokens can be named by a key: all but the lookahead (see the module docstring)."""
        return req.num_tokens - self.lookahead

    def _extend_hashes(self, req: Request, upto_tokens: int) -> None:
        extend_block_hashes(req, self.block_size, upto_tokens, self.lookahead)

    def _prompt_end_point(self, req: Request) -> int:
        return ((req.num_prompt_tokens - self.lookahead) // self.block_size) * self.block_size

    def next_snapshot_point(self, req: Request, start: int, end: int) -> int | None:
        """The first snapshot position in (start, end] for a chunk of ``req``, or None (only keyable positions)."""
        points = self.snapshot_points(req, start, end)
        return points[0] if points else None

    def snapshot_points(self, req: Request, start: int, end: int) -> list[int]:
        """Every snapshot position in (start, end] for a chunk of ``req``, ascending (only keyable positions): the
        interval points, the end of the prompt, its share points and the points before its images."""
        bs = self.block_size
        limit = min(end, self.keyable_tokens(req))
        points = {(self.keyable_tokens(req) // bs) * bs, *req.share_points, *image_points(req, bs)}
        points.update(range((start // self.interval + 1) * self.interval, limit + 1, self.interval))
        return sorted(p for p in points if start < p <= limit)

    # ------------------------------------------------------------------ publish

    def publish_blocks(self, req: Request, num_computed: int) -> None:
        """Publish the request's full blocks whose tokens are all computed (and verified) and keyable.

        With lookahead the caller guarantees that the MTP entries of positions [0, num_computed) are written.
        """
        bs = self.block_size
        n_full = min(num_computed, self.keyable_tokens(req)) // bs
        if n_full <= req.num_published_blocks:
            return
        self._extend_hashes(req, n_full * bs)
        for i in range(req.num_published_blocks, n_full):
            self.block_pool.publish(req.block_table[i], req.block_hashes[i])
        req.num_published_blocks = n_full

    def reserve_snapshot(self, req: Request, position: int) -> int | None:
        """Reserve an entry for the snapshot of ``req``'s prefix of ``position`` tokens, or None (not a keyable
        block boundary, the prefix already has one, or no entry can be freed).

        Called when a step is scheduled whose forward ends exactly at ``position`` (a chunk's end); the worker fills
        the entry right after that forward, and ``commit_snapshot`` publishes it once the step's result is in, so
        nothing reads it before it is written (a lookup in between does not see it).
        """
        if not self._snapshot_position(req, position):
            return None
        self._extend_hashes(req, position)
        h = req.block_hashes[position // self.block_size - 1]
        if self._touch(h):  # another request computes through this prefix again: it recurs
            return None
        return self.reserve_entry()

    def reserve_entry(self, spare_only: bool = False) -> int | None:
        """Reserve a snapshot entry whose prefix is not known yet (a verify row: the accepted length decides).

        ``spare_only``: take a free or spare entry, never a resume point's. A verify row's candidate is speculative
        (most are released: the accepted length stops short of the boundary), so evicting a published resume point
        for one would trade a point a later request resumes from for a likely nothing; under pressure the row goes
        without, and its request keeps its previous boundary's snapshot."""
        if not self.has_recurrent_state:
            return None
        idx = self._alloc_snapshot(spare_only)
        if idx is None:
            self.stats.skipped_full += 1
            return None
        return self.state_slots.snapshot_entry(idx)

    def release_entry(self, entry: int | None) -> None:
        """Give back a reserved entry that will not be published."""
        if entry is not None:
            self._free_snapshots.append(entry - self.state_slots.snapshot_entry(0))

    def commit_snapshot(self, req: Request, position: int, entry: int) -> bool:
        """Publish reserved ``entry`` (filled by the worker from ``req``'s state after ``position`` tokens) as the
        snapshot of that prefix; release it instead if the position is not (or no longer) keyable, or the prefix
        got a snapshot meanwhile. True if published."""
        if not self._snapshot_position(req, position):
            self.release_entry(entry)
            return False
        self._extend_hashes(req, position)
        h = req.block_hashes[position // self.block_size - 1]
        if self._touch(h):
            self.release_entry(entry)
            return False
        self._snapshots[h] = entry - self.state_slots.snapshot_entry(0)
        self._clock += 1
        if self._resume_point(req, position):
            self._kind[h] = self._point_kind(req, position) or "recurred"
            self._used[h] = self._clock
        else:
            self._spare.add(h)
        end = self._prompt_end_point(req)
        if position > end >= self.block_size and req.rolling_snapshot_hash is None \
                and not self._resume_point(req, end, answered=True):
            # the answer's first boundary: the next turn resumes there or later, no longer at the prompt's end
            prompt_end = req.block_hashes[end // self.block_size - 1]
            if prompt_end in self._snapshots:  # the same resume point moved on: no drop learned
                self._spare.add(prompt_end)
                self._forget(prompt_end)
        self.stats.taken += 1
        self._retire_rolling(req, h, position)
        return True

    def _snapshot_position(self, req: Request, position: int) -> bool:
        return self.has_recurrent_state and 0 < position <= self.keyable_tokens(req) \
            and position % self.block_size == 0

    def _retire_rolling(self, req: Request, new_hash: bytes, position: int) -> None:
        """While decoding, keep only the latest boundary snapshot of a request unless a policy point needs it."""
        is_policy_point = position % self.interval == 0 or position in req.share_points \
            or position == self._prompt_end_point(req) or position in image_points(req, self.block_size)
        old = req.rolling_snapshot_hash
        req.rolling_snapshot_hash = None if is_policy_point else new_hash
        if not is_policy_point and new_hash in self._kind:
            self._moving[new_hash] = req
        if old is None:
            return
        idx = self._snapshots.get(old)  # (never on the host: a decoding answer's boundary does not move there)
        if idx is not None and idx not in self._pinned:  # the answer's resume point moved on: no drop learned
            del self._snapshots[old]
            self._spare.discard(old)
            self._forget(old)
            self._free_snapshots.append(idx)

    def _point_kind(self, req: Request, position: int, answered: bool = False) -> str | None:
        """The kind of resume point ``position`` is for ``req`` (see ``_resume_point``), or None where it is spare."""
        end = self._prompt_end_point(req)
        if position in req.share_points:
            return "share"
        if position == self._first_image_point(req):
            return "first_image"
        if position == end and not answered:
            return "prompt_end"
        return "answer" if position > end else None

    def _resume_point(self, req: Request, position: int, answered: bool = False) -> bool:
        """Whether a later request is expected to resume at ``req``'s ``position``: the prompt's end or a block
        boundary of its answer (the latest one is kept: a conversation's next turn resumes there; the prompt's end
        turns spare when the answer reaches its first boundary), a point where its prefix parts from another's, or
        the point before its first image (a GUI agent's next prompt turns the oldest screenshot of its window into
        text and resumes there; every later image moves with it, so the points before them are not resumed from). The
        other points (every ``interval`` tokens, before later images) are spare: evicted first, until a request
        resumes or computes through one again. ``answered``: the answer has reached a block boundary."""
        return self._point_kind(req, position, answered) is not None

    def _first_image_point(self, req: Request) -> int | None:
        images = image_points(req, self.block_size)
        return min(images) if images else None

    def _alloc_snapshot(self, spare_only: bool = False) -> int | None:
        """A free entry, else an unpinned snapshot's: the least recently used spare one, else the resume point least
        likely to be resumed from later (``_chance_later``; ``spare_only``: a spare one or none). Within a kind
        that is its least recently used one, so only those are weighed; ties go to the least recently used. An
        evicted resume point worth it moves to the host tier; one dropped is remembered (``_ghosts``)."""
        if self._free_snapshots:
            return self._free_snapshots.pop()
        victim = next((h for h, idx in self._snapshots.items() if h in self._spare and idx not in self._pinned), None)
        chance: float | None = None
        if victim is None and not spare_only:
            oldest: dict[str, bytes] = {}  # each kind's least recently used unpinned snapshot, in LRU order
            for h, idx in self._snapshots.items():
                kind = self._kind.get(h, "recurred")
                if kind not in oldest and idx not in self._pinned:
                    oldest[kind] = h
                    if len(oldest) == len(LEARNED_KINDS):
                        break
            if oldest:
                chances = {h: self._chance_later(h) for h in oldest.values()}  # LRU order kept
                victim = min(chances, key=chances.__getitem__)  # min keeps the first (least recent) of ties
                chance = chances[victim]
        if victim is None:
            return None
        self._spare.discard(victim)
        idx = self._snapshots.pop(victim)
        self.stats.evictions += 1
        if victim in self._kind and not self._still_moving(victim):
            if chance is None:  # a spare one
                chance = self._chance_later(victim)
            if chance >= MOVE_UTILITY and self._offload(victim, idx):
                return idx
        self._dropped(victim)
        return idx

    def _chance_later(self, h: bytes) -> float:
        """The chance resume point ``h`` is resumed from later, by its kind's model and how long it has been unused."""
        kind = self._kind.get(h, "recurred")
        return self._models[kind].still(self._clock - self._used.get(h, self._clock))

    def _resumed(self, h: bytes) -> None:
        """A lookup resumes from ``h``: its kind learns a resume and its delay; from now on it is learned as its kind
        resumed from (``resumed_kind``; a spare snapshot: "recurred")."""
        kind = self._kind.get(h)
        if kind is not None:
            self._learn(kind, resumed=True, delay=self._clock - self._used.get(h, self._clock))
        self._spare.discard(h)
        self._kind[h] = resumed_kind(kind) if kind is not None else "recurred"
        self._used[h] = self._clock
        self._moving.pop(h, None)

    def _passed(self, h: bytes) -> None:
        """A hit deeper than resume point ``h`` keeps it (the point before the request's first image: its next step
        resumes there): used now, and its kind learns a use as a resume (a GUI agent's first-image point is passed
        at its next two steps and resumed from at the third)."""
        kind = self._kind.get(h)
        if kind is not None and not kind.endswith("+") and (h in self._snapshots or h in self._host):
            self._learn(kind, resumed=True, delay=self._clock - self._used.get(h, self._clock))
        self._touch(h)

    def _still_moving(self, h: bytes) -> bool:
        """Whether ``h`` is the latest answer boundary of a request still decoding."""
        req = self._moving.get(h)
        return req is not None and not req.is_finished

    def _dropped(self, h: bytes) -> None:
        """Resume point ``h`` (device or host) is gone unresumed: its kind learns a drop, and it is remembered a while
        (``_ghosts``: a lookup it would have served turns the drop into a resume). Not while it is a decoding
        answer's latest boundary (the point moves on)."""
        kind = self._kind.get(h)
        if kind is not None and not self._still_moving(h):
            self._learn(kind, resumed=False)
            self._ghosts[h] = (kind, self._used.get(h, self._clock))
            if len(self._ghosts) > self._ghost_limit:
                self._ghosts.popitem(last=False)
        self._forget(h)

    def _forget(self, h: bytes) -> None:
        self._kind.pop(h, None)
        self._used.pop(h, None)
        self._moving.pop(h, None)

    def _learn(self, kind: str, resumed: bool, delay: int = 0) -> None:
        for model in self._models.values():
            model.decay(self._decay)
        model = self._models[kind]
        if resumed:
            model.resumed += 1
            model.add_delay(delay)
        else:
            model.dropped += 1

    def _offload(self, h: bytes, idx: int) -> bool:
        """Move resume point ``h`` (device snapshot ``idx``, just evicted) to a host entry: a free one, else the
        least recently used unpinned one's (which is dropped). False if the host tier has none to give."""
        if not self.num_host_snapshots:
            return False
        if self._free_host:
            host = self._free_host.pop()
        else:
            old = next((k for k, e in self._host.items() if e not in self._host_pinned), None)
            if old is None:
                return False
            host = self._host.pop(old)
            self.stats.host_evictions += 1
            self._dropped(old)
        self._host[h] = host
        self._offloads.append((self.state_slots.snapshot_entry(idx), host))
        self.stats.offloads += 1
        return True

    def _touch(self, h: bytes) -> bool:
        """Whether prefix ``h`` has a snapshot, on the device or the host; if so it is used now (most recently used;
        a spare one promoted)."""
        if h in self._snapshots:
            self._snapshots.move_to_end(h)
            self._promote(h)
            return True
        if h in self._host:
            self._host.move_to_end(h)
            self._used[h] = self._clock
            return True
        return False

    def _promote(self, h: bytes) -> None:
        """A snapshot used again (its age starts over); a spare one resumed from or computed through again is a
        resume point from now on ("recurred")."""
        if h in self._spare:
            self._spare.discard(h)
            self._kind[h] = "recurred"
        if h in self._kind:
            self._used[h] = self._clock

    def _count_ghost_hit(self, req: Request, best: int, kv_depth: int) -> None:
        """A lookup whose KV reaches past its hit (``best`` blocks) to an evicted resume point's prefix: that kind
        would have served it deeper."""
        for j in range(kv_depth - 1, best - 1, -1):
            h = req.block_hashes[j]
            if h in self._ghosts:  # a drop that was too eager: learned as the resume it would have been
                kind, used = self._ghosts.pop(h)
                model = self._models[kind]
                model.dropped = max(model.dropped - 1.0, 0.0)
                model.resumed += 1.0
                model.add_delay(self._clock - used)
                return

    def _on_block_evicted(self, block_hash: bytes) -> None:
        idx = self._snapshots.get(block_hash)
        if idx is not None and idx not in self._pinned:
            del self._snapshots[block_hash]
            self._spare.discard(block_hash)
            self._dropped(block_hash)
            self._free_snapshots.append(idx)
            self.stats.evictions += 1
        host = self._host.get(block_hash)
        if host is not None and host not in self._host_pinned:
            del self._host[block_hash]
            self._dropped(block_hash)
            self._free_host.append(host)

    # ------------------------------------------------------------------ introspection

    def leaks(self) -> str | None:
        """What an idle cache still holds for steps that have ended: pinned entries or moves never sent (None)."""
        held = [f"{len(pins)} {what} pinned" for what, pins in (("device snapshots", self._pinned),
                                                                 ("host snapshots", self._host_pinned)) if pins]
        if self._offloads:
            held.append(f"{len(self._offloads)} moves to the host never sent")
        return "; ".join(held) or None

    def kind_utilities(self) -> dict[str, float]:
        """Each kind of resume point's estimate of the chance a snapshot of it is resumed from at all
        (``KindModel.chance``)."""
        return {kind: model.chance() for kind, model in self._models.items()}

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    @property
    def num_host_snapshots_held(self) -> int:
        return len(self._host)

    @property
    def snapshot_bytes(self) -> int:
        return len(self._snapshots) * self.state_slots.bytes_per_entry

    def has_snapshot(self, block_hash: bytes) -> bool:
        return block_hash in self._snapshots

    def has_host_snapshot(self, block_hash: bytes) -> bool:
        return block_hash in self._host
