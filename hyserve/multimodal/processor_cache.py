"""The multimodal processor cache (vLLM's ``mm_processor_cache_gb``): each image's processor output kept by content
hash, so an image that comes back in a later request is not resized, normalised and cut into patches again.

An agent that shows the last N screenshots sends each screenshot in N requests; the pixel pipeline (transformers'
``Qwen2VLImageProcessorPil``) costs about 45 ms of one CPU core per 1280x720 screenshot, on the path of every
request's first token. The worker's encoder cache already skips the vision tower for a repeated image; this cache
skips the CPU side.

* The key is ``image_hash`` (the RGB pixels and the size): equal exactly when the images are. A cache belongs to one
  engine, so the processor settings are fixed for it.
* Values are ``ProcessedImage``: float32 pixel rows, grid, placeholder count, hash. The pixel arrays are shared by
  every request that holds the image and are never written (the runner copies them to the device).
* Capacity is in bytes of pixel rows, least recently used evicted first; an image larger than the whole capacity is
  processed and not kept. Capacity 0 keeps nothing (``--mm-processor-cache-gb 0``) but still counts queries.
* Thread-safe: the server prepares images off the engine thread, several requests at a time. The pixel work runs
  outside the lock; two threads that miss the same image both process it and the first insert is kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from hyserve.multimodal.image import ImageProcessorSettings, image_hash, process_images

GIB = 1 << 30


@dataclass(frozen=True, slots=True, eq=False)
class ProcessedImage:
    """One image as the processor gives it: ``pixel_values`` (t * h * w, patch_dim) float32 (shared: never
    written), its (t, h, w) patch grid, its placeholder token count and its content hash."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    token_count: int
    digest: str


class ProcessorCache:
    """Processed images by content hash, least recently used evicted first, up to ``capacity_bytes`` of pixel rows.

    ``queries`` and ``hits`` count images looked up and images found (vLLM's ``mm_cache_queries`` /
    ``mm_cache_hits``, in items)."""

    def __init__(self, settings: ImageProcessorSettings | Callable[[], ImageProcessorSettings],
                 capacity_bytes: int) -> None:
        """``settings``, or a function giving them at the first image (a checkpoint's preprocessor_config.json is
        read only when an image comes: a text-only run of a VLM checkpoint needs none)."""
        if capacity_bytes < 0:
            raise ValueError(f"processor cache capacity must be >= 0 bytes (got {capacity_bytes})")
        self._settings = settings
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, ProcessedImage] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.queries = 0
        self.hits = 0
        self.evictions = 0

    @property
    def settings(self) -> ImageProcessorSettings:
        if not isinstance(self._settings, ImageProcessorSettings):
            with self._lock:
                if not isinstance(self._settings, ImageProcessorSettings):
                    self._settings = self._settings()
        return self._settings

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def process(self, images: Sequence[Image.Image]) -> list[ProcessedImage]:
        """Each image's ``ProcessedImage``, in order: from the cache where its hash is there, else processed (an
        image repeated in ``images`` once) and kept. Raises ``MediaError`` for an image the processor refuses, as
        ``process_images`` does."""
        settings = self.settings
        digests = [image_hash(img) for img in images]
        found: dict[str, ProcessedImage] = {}
        with self._lock:
            self.queries += len(digests)
            for d in digests:
                item = self._entries.get(d)
                if item is not None:
                    self._entries.move_to_end(d)
                    found[d] = item
                    self.hits += 1
        missing = {d: img for d, img in zip(digests, images, strict=True) if d not in found}
        for d, img in missing.items():  # one at a time: each entry owns its pixel array (no view of a batch's)
            item = _processed(img, d, settings)
            with self._lock:
                found[d] = self._insert(item)
        return [found[d] for d in digests]

    def _insert(self, item: ProcessedImage) -> ProcessedImage:
        """Keep ``item`` (the lock held); an entry already there for its hash wins. Returns the kept one."""
        kept = self._entries.get(item.digest)
        if kept is not None:
            return kept
        size = item.pixel_values.nbytes
        if size > self.capacity_bytes:
            return item
        self._entries[item.digest] = item
        self._bytes += size
        while self._bytes > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.pixel_values.nbytes
            self.evictions += 1
        return item


def _processed(img: Image.Image, digest: str, settings: ImageProcessorSettings) -> ProcessedImage:
    out = process_images([img], settings=settings, hashes=[digest])
    (t, h, w), = out.grid_thw.tolist()
    # A numpy array of its own, the processor's tensor freed with its temporaries: kept alive in the cache, the
    # tensor's memory made every later image slower to process (benchmarks/processor_cache_bench.py: 0.75 s per turn
    # of 8 requests, against 0.40 s with the copy and 0.66 s with no cache, on a 2-core VM).
    pixels = np.array(out.pixel_values.float().numpy(), dtype=np.float32, copy=True)
    return ProcessedImage(pixels, (int(t), int(h), int(w)), out.token_counts[0], digest)
