"""Image input on the worker: each request's images and M-RoPE positions, and the vision tower's outputs.

A request's images arrive once, with the step that brings the request (``NewRequest.mm``), and are kept until its
id comes back in ``finished_req_ids``. The tower's outputs are kept by image content hash, least recently used
first, up to ``encoder_cache_tokens`` rows on the device; what leaves the device goes to pinned host memory (least
recently used first, up to ``encoder_host_cache_bytes``) and comes back from there, a copy in place of the tower: a
screenshot repeated in later turns' prompts is encoded once, also where the turns of many requests come between
(32 agents, each showing its last screenshots again: the device holds a few steps' worth).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
from torch import nn

from hyserve.model.vision import VisionConfig
from hyserve.multimodal.image import ImageProcessorSettings
from hyserve.multimodal.inputs import ImageInput, MultimodalPrompt
from hyserve.scheduler.output import ScheduledRow
from hyserve.utils import host_to_device

# The encoder cache holds this many steps' token budget of image embeddings on the device, and at least
# ENCODER_CACHE_MIN_TOKENS (8192 rows of a 27B model's 5120-wide bf16 embeddings: 84 MB); the memory plan counts it
# (``worker.memory``). Behind it, ENCODER_HOST_CACHE_BYTES of pinned host memory (a 1280x720 screenshot's rows on
# the 27B: 9 MB, so about 230 of them; a copy back takes about 0.4 ms where the tower takes milliseconds).
ENCODER_CACHE_STEPS = 2
ENCODER_CACHE_MIN_TOKENS = 8192
ENCODER_HOST_CACHE_BYTES = 2 << 30

# (first token index in the step, start, length, prompt) of each row that needs three-axis positions or image rows.
ImageRow = tuple[int, int, int, MultimodalPrompt]


def _largest_side(model_dir: str) -> int:
    """Patches per side of the largest square image the checkpoint's processor makes (its max_pixels)."""
    settings = ImageProcessorSettings.from_checkpoint(model_dir)
    unit = settings.patch_size * settings.merge_size
    return max(1, int(math.isqrt(settings.max_pixels) // unit)) * settings.merge_size


def largest_image_patches(model_dir: str) -> int:
    """The patches of the largest image the memory profile encodes (``largest_image_inputs``): what one tower call
    may take."""
    return _largest_side(model_dir) ** 2


def split_encoded(rows: torch.Tensor, images: list[ImageInput]) -> list[torch.Tensor]:
    """One tower call's output rows, image by image (in ``images``' order: each its span's placeholder count)."""
    lengths = [im.span.length for im in images]
    if rows.shape[0] != sum(lengths):
        raise RuntimeError(f"the vision tower gave {rows.shape[0]} rows for images of {sum(lengths)} placeholder "
                           "tokens")
    return list(rows.split(lengths))


def largest_image_inputs(model_dir: str, cfg: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero pixels and the grid of the largest square image the checkpoint's processor makes (its max_pixels):
    what the memory profile encodes."""
    side = _largest_side(model_dir)
    grid = torch.tensor([[1, side, side]], dtype=torch.long)
    return torch.zeros(side * side, cfg.patch_dim), grid


class MMInputs:
    """The images of the requests this worker holds, and the encoder cache of the vision tower's outputs."""

    def __init__(self, tower: nn.Module | None, device: torch.device, dtype: torch.dtype,
                 max_num_batched_tokens: int, encoder_host_cache_bytes: int = ENCODER_HOST_CACHE_BYTES,
                 model_dir: str | None = None) -> None:
        self.tower = tower  # None on a model without one, or a pipeline stage after the first
        self.model_dir = model_dir
        # The patches one tower call may take (the largest image the memory profile encoded: read from the
        # checkpoint's processor settings when several images first come together; 0: one call an image). A step's
        # new images go through the tower together up to it.
        self.max_encode_patches: int | None = None if model_dir is not None else 0
        self.num_tower_calls = 0
        self.device = device
        self.dtype = dtype
        self.prompts: dict[str, MultimodalPrompt] = {}
        self.encoder_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encoder_cache_tokens = max(ENCODER_CACHE_STEPS * max_num_batched_tokens, ENCODER_CACHE_MIN_TOKENS)
        # The host tier: rows that left the device (pinned on CUDA), and the bytes they take.
        self.host_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encoder_host_cache_bytes = encoder_host_cache_bytes
        self.host_cache_held = 0
        self.num_images_encoded = 0
        self.num_images_from_host = 0

    def encoder_cache_stats(self) -> dict[str, int]:
        """Images encoded by the tower, images brought back from the host tier, and the entries each tier holds."""
        return {"images_encoded": self.num_images_encoded, "images_from_host": self.num_images_from_host,
                "tower_calls": self.num_tower_calls, "device_entries": len(self.encoder_cache),
                "host_entries": len(self.host_cache)}

    def get(self, req_id: str | None) -> MultimodalPrompt | None:
        """Request ``req_id``'s images and positions, if its prompt has images."""
        return self.prompts.get(req_id) if req_id is not None and self.prompts else None

    def position_shift(self, req_id: str, start: int) -> int:
        """What request ``req_id``'s 1-D rotary positions add to the index from ``start`` on (its rope_delta past
        its prompt's last image; 0 for a text prompt)."""
        mm = self.get(req_id)
        return mm.position_shift(start) if mm is not None else 0

    def reaches_image(self, row: ScheduledRow) -> bool:
        """Whether ``row`` starts before its prompt's last image ends (three-axis positions, image embeddings)."""
        mm = self.get(row.req_id)
        return mm is not None and mm.needs_axes(row.start)

    def mtp_reaches_image(self, req_id: str | None, start: int, num_tokens: int) -> bool:
        """Whether an MTP pass row needs three-axis positions or an image row as its input."""
        mm = self.get(req_id)
        return mm is not None and mm.reaches(start, num_tokens, lookahead=1)

    def image_inputs(self, host_positions: torch.Tensor, mm_rows: list[ImageRow], lookahead: int = 0,
                     embed: bool = True) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """A step's (3, T) positions and its image rows, for ``mm_rows`` = (first token index, start, length, prompt).

        Each listed row starting before its prompt's last image takes the prompt's three axes, every other token its
        1-D position (``host_positions``) on each axis. With ``embed``, the token at position p reads the encoder row
        of sequence index p + ``lookahead`` where that is an image placeholder (the target: 0; the MTP head, which
        consumes the next token: 1); a row that cuts an image's span takes the rows of its part."""
        positions = host_positions.clone().expand(3, -1).contiguous()
        index: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        if embed:
            self.encode_together([im for _, start, n, mm in mm_rows
                                  for im in mm.overlapping(start + lookahead, start + n + lookahead)])
        for t0, start, n, mm in mm_rows:
            if mm.needs_axes(start):
                positions[:, t0 : t0 + n] = mm.axes(start, start + n)
            if not embed:
                continue
            lo, hi = start + lookahead, start + n + lookahead
            for im in mm.overlapping(lo, hi):
                a, b = max(lo, im.span.offset), min(hi, im.end)
                embeds.append(self.span_rows(im, a, b))
                index.append(torch.arange(t0 + a - lo, t0 + b - lo))
        mrope = host_to_device(positions, self.device)
        if not embeds:
            return mrope, None
        return mrope, (host_to_device(torch.cat(index), self.device), torch.cat(embeds))

    def span_rows(self, im: ImageInput, a: int, b: int) -> torch.Tensor:
        """The encoder rows of ``im``'s placeholder tokens [a, b) (sequence indices inside its span)."""
        return self.image_embeddings(im)[a - im.span.offset : b - im.span.offset]

    def image_embeddings(self, im: ImageInput) -> torch.Tensor:
        """The vision tower's (placeholder count, hidden) output for ``im``, from the encoder cache or encoded now."""
        key = im.span.content_hash
        cached = self.encoder_cache.get(key)
        if cached is not None:
            self.encoder_cache.move_to_end(key)
            return cached
        kept = self.host_cache.pop(key, None)
        if kept is not None:
            self.host_cache_held -= kept.nbytes
            # Pinned, so the copy is queued behind the one that brought it to the host (the same stream).
            rows = kept.to(self.device, non_blocking=True)
            self.num_images_from_host += 1
        else:
            (rows,) = self._encode([im])
        self._put(key, rows)
        return rows

    def encode_together(self, images: list[ImageInput]) -> None:
        """The images among ``images`` that neither tier holds, through the tower in as few calls as
        ``max_encode_patches`` allows, into the device cache. One call a step in place of one an image: the tower's
        launches are small (a screenshot's 3,600 patches at width 1,152), and one image at a time left the device
        idle between them (the seed's opening burst: about 0.36 s of 7 s on an H100, 2026-12-07)."""
        todo: dict[str, ImageInput] = {}
        for im in images:
            key = im.span.content_hash
            if key not in self.encoder_cache and key not in self.host_cache:
                todo.setdefault(key, im)
        if len(todo) < 2:
            return  # image_embeddings encodes it as it comes
        if self.max_encode_patches is None:
            assert self.model_dir is not None
            self.max_encode_patches = largest_image_patches(self.model_dir)
        if self.max_encode_patches <= 0:
            return
        batch: list[ImageInput] = []
        patches = 0
        for im in todo.values():
            n = math.prod(im.grid_thw)
            if batch and patches + n > self.max_encode_patches:
                self._put_encoded(batch)
                batch, patches = [], 0
            batch.append(im)
            patches += n
        self._put_encoded(batch)

    def _put_encoded(self, images: list[ImageInput]) -> None:
        for im, rows in zip(images, self._encode(images), strict=True):
            self._put(im.span.content_hash, rows)

    def _put(self, key: str, rows: torch.Tensor) -> None:
        """``rows`` into the device cache, its least recently used entries leaving for the host tier."""
        self.encoder_cache[key] = rows
        held = sum(r.shape[0] for r in self.encoder_cache.values())
        while held > self.encoder_cache_tokens and len(self.encoder_cache) > 1:
            old_key, old = self.encoder_cache.popitem(last=False)
            held -= old.shape[0]
            self._keep_on_host(old_key, old)

    def _encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """The tower's rows of ``images``, one call for all (their grids one after another)."""
        tower = self.tower
        assert isinstance(tower, nn.Module), "a stage without the vision tower needs no image rows"
        grid = torch.tensor([im.grid_thw for im in images], dtype=torch.long)
        # Through pinned memory, image by image: a copy from pageable memory would wait for the stream to drain.
        pixels = [host_to_device(torch.from_numpy(im.pixel_values), self.device) for im in images]
        with torch.profiler.record_function("hyserve::vision"):  # the profiler's name (benchmarks/trace_gaps.py)
            rows = tower((pixels[0] if len(pixels) == 1 else torch.cat(pixels)).to(self.dtype), grid)
        self.num_tower_calls += 1
        self.num_images_encoded += len(images)
        return split_encoded(rows, images)

    def _keep_on_host(self, key: str, rows: torch.Tensor) -> None:
        """``rows``, leaving the device cache, into the host tier (its least recently used entries make room)."""
        size = rows.nbytes
        if size > self.encoder_host_cache_bytes:
            return
        if rows.device.type == "cuda":
            # Queued on the stream after the rows' writers; a later use of the freed device memory queues after it.
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
        else:
            host = rows  # the host is the device: the tier keeps the tensor itself
        self.host_cache[key] = host
        self.host_cache_held += size
        while self.host_cache_held > self.encoder_host_cache_bytes:
            _, old = self.host_cache.popitem(last=False)
            self.host_cache_held -= old.nbytes
