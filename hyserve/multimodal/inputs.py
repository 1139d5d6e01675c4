"""A prompt's images as the engine carries them: placeholder spans, pixels for the vision tower, M-RoPE positions.

``build_multimodal_prompt`` runs at ``add_request``: it processes the images (through the engine's ``ProcessorCache``),
widens each placeholder to its image's token count, and computes the whole prompt's (3, P) positions and
``rope_delta`` once (``hyserve.model.mrope``). The worker reads, per step:

* positions: a chunk ``[a, b)`` with ``a < last_image_end`` takes ``mrope_slice(positions, delta, a, b)`` (three
  axes); every token after the last image has equal axes ``index + rope_delta``, so later chunks, decode, verify and
  the CUDA graphs keep 1-D positions, shifted by the delta (``position_shift``);
* embeddings: the rows of each image's encoder output at the placeholder positions the chunk covers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from hyserve.config import MultimodalConfig
from hyserve.model.mrope import mrope_positions, mrope_slice
from hyserve.multimodal.image import ImageProcessorSettings, expand_image_placeholders
from hyserve.multimodal.processor_cache import ProcessorCache
from hyserve.multimodal.spans import ImageSpan


@dataclass(frozen=True, slots=True, eq=False)
class ImageInput:
    """One image of a prompt: its placeholder span (with the content hash), its processor pixels
    ``(t * h * w, patch_dim)`` float32 and its (t, h, w) patch grid. Arrays, not tensors: what the scheduler sends
    the workers stays plain data (``scheduler/output.py``)."""

    span: ImageSpan
    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]

    @property
    def end(self) -> int:
        return self.span.offset + self.span.length


@dataclass(frozen=True, slots=True, eq=False)
class MultimodalPrompt:
    """The images of a prompt, in order, and its (3, P) int64 positions and ``rope_delta``."""

    images: tuple[ImageInput, ...]
    positions: np.ndarray
    rope_delta: int

    @property
    def last_image_end(self) -> int:
        return self.images[-1].end if self.images else 0

    def needs_axes(self, start: int) -> bool:
        """Whether a chunk starting at ``start`` needs the three-axis positions (it begins before the last image
        ends); later tokens have 1-D positions ``index + rope_delta``."""
        return start < self.last_image_end

    def position_shift(self, start: int) -> int:
        """What a 1-D position adds to the token index from ``start`` on (past the last image)."""
        return self.rope_delta if start >= self.last_image_end else 0

    def axes(self, start: int, end: int) -> torch.Tensor:
        """(3, end - start) positions of tokens [start, end)."""
        return mrope_slice(torch.from_numpy(self.positions), self.rope_delta, start, end)

    def reaches(self, start: int, n: int, lookahead: int = 0) -> bool:
        """Whether a pass over positions [start, start + n) that reads the tokens ``lookahead`` later (the MTP head:
        1) needs three-axis positions or image rows."""
        return self.needs_axes(start) or bool(self.overlapping(start + lookahead, start + n + lookahead))

    def overlapping(self, start: int, end: int) -> list[ImageInput]:
        """The images whose placeholders intersect tokens [start, end)."""
        return [im for im in self.images if im.span.offset < end and im.end > start]


def build_multimodal_prompt(token_ids: list[int], images: Sequence[Image.Image], model_dir: str | os.PathLike[str],
                            config: MultimodalConfig, cache: ProcessorCache | None = None, pinned: bool = False
                            ) -> tuple[list[int], MultimodalPrompt]:
    """The expanded token ids and the ``MultimodalPrompt`` of a rendered prompt holding one image placeholder per
    image, each image processed through ``cache`` (the engine's processor cache; None: model_dir's settings, nothing
    kept). ``pinned``: each image's pixels copied into pinned host memory here (the caller's thread, off the engine's
    loop in a server), so that a worker in this process copies them to the device without a host copy of its own
    (``MMInputs``: 22 MB for a 1280x720 screenshot). Raises ValueError (``MediaError`` for an image the processor
    refuses) naming the problem."""
    if cache is None:
        cache = ProcessorCache(ImageProcessorSettings.from_checkpoint(model_dir), 0)
    processed = cache.process(list(images))
    ids = expand_image_placeholders(token_ids, [p.token_count for p in processed], config.image_token_id)
    grids = [p.grid_thw for p in processed]
    merge = int(config.vision_config.get("spatial_merge_size", 2))
    positions, delta = mrope_positions(ids, grids, config.image_token_id, merge)
    starts = [i for i, t in enumerate(ids) if t == config.image_token_id and (i == 0 or ids[i - 1] != t)]
    inputs = [ImageInput(ImageSpan(start, p.token_count, p.digest),
                         pinned_copy(p.pixel_values) if pinned else p.pixel_values, p.grid_thw)
              for start, p in zip(starts, processed, strict=True)]
    return ids, MultimodalPrompt(tuple(inputs), positions.numpy(), delta)


def pinned_copy(pixels: np.ndarray) -> np.ndarray:
    """``pixels`` copied into pinned host memory, as a numpy array (it keeps its tensor alive): ``torch.from_numpy``
    of it is pinned, so ``host_to_device`` takes it as it is."""
    return torch.from_numpy(pixels).pin_memory().numpy()
