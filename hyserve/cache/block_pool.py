"""Paged KV memory for the full-attention layers: a pool of fixed-size blocks handed out to requests.

A request owns the blocks listed in its ``block_table``; token ``i`` of the request lives in block
``block_table[i // block_size]`` at offset ``i % block_size``. Block 0 is never handed out: padded rows of a captured
graph point at it.

With prefix caching, a full block whose tokens are computed is *published* under its prefix hash (see
``prefix_cache.py``) and may be shared by several requests (``ref_count``). A published block is never written again.
When its last user lets go it stays cached but *evictable*; eviction is least-recently-used, and users free their
blocks deepest-first so that a prefix's deeper blocks always go before its shallower ones.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    NULL_BLOCK = 0

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (got {num_blocks})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))
        self._ref_count = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # published block -> its prefix hash
        self._cached: dict[bytes, int] = {}  # prefix hash -> published block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # published, unreferenced, LRU first
        self.on_evict: Callable[[bytes], None] | None = None  # told which prefix hash lost its KV
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never-used ones plus cached blocks nobody references."""
        return len(self._free) + len(self._evictable)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_needed(self, num_tokens: int, num_held: int) -> int:
        """Blocks to add so that a request holding ``num_held`` blocks can store ``num_tokens`` tokens."""
        return max(0, cdiv(num_tokens, self.block_size) - num_held)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"KV cache out of blocks: asked for {n}, {self.num_free_blocks} free")
        blocks = [self._take_one() for _ in range(n)]
        for b in blocks:
            self._ref_count[b] = 1
        return blocks

    def _take_one(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)
        h = self._hash_of.pop(block)
        del self._cached[h]
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(h)
        return block

    def free(self, blocks: list[int]) -> None:
        """Let go of ``blocks`` (a block table): deepest first, so a prefix's tail is evicted before its head."""
        for b in reversed(blocks):
            if self._ref_count[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self._ref_count[b] -= 1
            if self._ref_count[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # ------------------------------------------------------------------ prefix caching

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached ``blocks`` (a prefix hit)."""
        for b in blocks:
            if self._ref_count[b] == 0:
                self._evictable.pop(b, None)
            self._ref_count[b] += 1

    def publish(self, block: int, block_hash: bytes) -> bool:
        """Make a full, computed block findable under ``block_hash``. False if that prefix is already cached."""
        if block_hash in self._cached or block in self._hash_of:
            return False
        self._cached[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def ref_count(self, block: int) -> int:
        return self._ref_count[block]
