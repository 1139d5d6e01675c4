"""Paged KV memory for the full-attention layers: a pool of fixed-size blocks handed out to requests.

A request owns the blocks listed in its ``block_table``; token ``i`` of the request lives in block
``block_table[i // block_size]`` at offset ``i % block_size``. Blocks are freed at once when the request finishes, is
aborted or is preempted. Block 0 is never handed out: padded rows of a captured graph point at it.
"""

from __future__ import annotations

from collections import deque


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
        self._in_use: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_needed(self, num_tokens: int, num_held: int) -> int:
        """Blocks to add so that a request holding ``num_held`` blocks can store ``num_tokens`` tokens."""
        return max(0, cdiv(num_tokens, self.block_size) - num_held)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV cache out of blocks: asked for {n}, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        self._in_use.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._in_use:
                raise RuntimeError(f"double free of KV block {b}")
            self._in_use.remove(b)
            self._free.append(b)
