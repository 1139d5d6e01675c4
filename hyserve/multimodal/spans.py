"""Where a prompt's images sit among its tokens: plain data that both the scheduler and the workers read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """An image's placeholder tokens in the prompt, ``[offset, offset + length)``, and the image's content hash.
    Its placeholder ids are the same for every image, so the prefix cache keys any block that overlaps the span by
    the hash too (``cache/prefix_cache.py``)."""

    offset: int
    length: int
    content_hash: str
