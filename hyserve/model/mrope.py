"""Multimodal (3-axis) rotary positions for Qwen3.5 prompts with images.

Mirrors transformers' ``Qwen3_5Model.get_rope_index`` / ``get_vision_position_ids`` and
``Qwen3_5TextRotaryEmbedding`` (``transformers/models/qwen3_5/modeling_qwen3_5.py``, 5.17):

* every token has a (time, height, width) position. A text token's three are equal and advance by 1 per token. An
  image's ``(h / merge) x (w / merge)`` placeholder tokens, in row-major order, sit at ``t = start``,
  ``h = start + row``, ``w = start + column``; the text after it resumes at ``start + max(h, w) / merge``. So a
  prompt's largest position is below its length, and ``rope_delta = max_position + 1 - len(prompt)`` (<= 0) is what
  every later token adds to its index on all three axes (``decode_positions``).
* the rotary's ``rotary_dim / 2`` frequencies are split among the axes *interleaved*: frequency ``i`` turns with the
  height position when ``i % 3 == 1 and i < 3 * mrope_section[1]``, with the width position when
  ``i % 3 == 2 and i < 3 * mrope_section[2]``, and with the time position otherwise (``mrope_section[0]`` is unused,
  as in transformers). For text-only tokens all axes agree, so this reduces to ``RotaryEmbedding``.

Positions depend on the whole prompt (an image shifts everything after it), so they are computed once per prompt and
a chunk ``[a, b)`` of it -- a chunked-prefill step, or the uncached suffix after a prefix-cache hit -- takes columns
``a:b`` (``mrope_slice``). Only images are handled; videos (per-frame timestamps) are not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hyserve.layers.rotary import RotaryEmbedding, apply_rope
from hyserve.model.vision import vision_token_count

if TYPE_CHECKING:
    from hyserve.config import MultimodalConfig
    from hyserve.model.metadata import StepMetadata

DEFAULT_MROPE_SECTION = (11, 11, 10)


def _image_runs(ids: torch.Tensor, image_token_id: int) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of ``image_token_id`` in the 1-D ``ids``, in order."""
    is_image = (ids == image_token_id).to(torch.int8)
    # +1 where a run starts, -1 just past where one ends; padding closes runs at either edge.
    edges = torch.diff(torch.nn.functional.pad(is_image, (1, 1)))
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()
    return list(zip(starts, ends))


def _image_positions(start: int, grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """(3, t * h * w / merge**2): transformers' get_vision_position_ids with temporal merge 1 and time interval 1."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def mrope_positions(token_ids: Sequence[int], image_grids: Sequence[tuple[int, int, int]], image_token_id: int,
                    spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """(3, T) int64 positions of a whole prompt, and its rope_delta.

    Each maximal run of ``image_token_id`` is one image, matched in order with ``image_grids`` (the processor's
    (t, h, w) patch grids); its length must be ``t * h * w / merge**2``. Two images' placeholders therefore cannot
    touch (Qwen's chat template puts ``<|vision_end|><|vision_start|>`` between them; transformers would fail there
    too). Equal to transformers' ``get_rope_index`` for image-only prompts. Raises ValueError naming the image whose
    run does not fit, or the count mismatch.
    """
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    runs = _image_runs(ids, image_token_id)
    if len(runs) != len(image_grids):
        raise ValueError(f"prompt has {len(runs)} runs of image tokens but {len(image_grids)} images were given")
    grids = [(int(t), int(h), int(w)) for t, h, w in image_grids]
    counts = vision_token_count(grids, spatial_merge_size)
    parts: list[torch.Tensor] = []
    pos = 0  # the next text token's position
    cursor = 0  # index of the first token not yet placed
    for i, ((start, end), grid, count) in enumerate(zip(runs, grids, counts)):
        if end - start != count:
            raise ValueError(f"image {i}: {end - start} image tokens in the prompt, its grid {grid} needs {count}")
        parts.append(torch.arange(start - cursor).expand(3, -1) + pos)
        pos += start - cursor
        parts.append(_image_positions(pos, grid, spatial_merge_size))
        pos += max(grid[1], grid[2]) // spatial_merge_size
        cursor = end
    parts.append(torch.arange(len(ids) - cursor).expand(3, -1) + pos)
    positions = torch.cat(parts, dim=1)
    if positions.shape[1] == 0:
        return positions, 0
    return positions, int(positions.max()) + 1 - positions.shape[1]


def decode_positions(num_computed: int, count: int, rope_delta: int) -> torch.Tensor:
    """(3, count) int64 positions of the ``count`` tokens at indices ``num_computed ...`` past the prompt.

    Index + rope_delta on every axis, as transformers' generation does from its cache length.
    """
    return (torch.arange(num_computed, num_computed + count) + rope_delta).expand(3, -1).contiguous()


def mrope_slice(prompt_positions: torch.Tensor, rope_delta: int, start: int, end: int) -> torch.Tensor:
    """(3, end - start) positions of tokens [start, end) of a sequence whose prompt has ``prompt_positions``.

    Columns of the whole-prompt positions inside the prompt, ``decode_positions`` past it: a prefill chunk, a
    prefix-cache suffix, or a recompute that runs past the prompt all take their positions from here.
    """
    prompt_len = prompt_positions.shape[1]
    inside = prompt_positions[:, start:min(end, prompt_len)]
    if end <= prompt_len:
        return inside
    after = max(start, prompt_len)
    return torch.cat([inside, decode_positions(after, end - after, rope_delta)], dim=1)


def frequency_axes(num_freqs: int, mrope_section: Sequence[int]) -> torch.Tensor:
    """(num_freqs,) long: the axis (0 time, 1 height, 2 width) each rotary frequency turns with (interleaved)."""
    i = torch.arange(num_freqs)
    axes = torch.zeros(num_freqs, dtype=torch.long)
    # transformers' recomposition_frequencies: slice(1, 3 * section[1], 3) from height, slice(2, 3 * section[2], 3)
    # from width, time everywhere else.
    axes[(i % 3 == 1) & (i < 3 * mrope_section[1])] = 1
    axes[(i % 3 == 2) & (i < 3 * mrope_section[2])] = 2
    return axes


def text_rotary(rotary_dim: int, base: float, multimodal: MultimodalConfig | None) -> RotaryEmbedding:
    """The text model's rotary (and the MTP head's): M-RoPE for a checkpoint with a vision tower, which is exactly
    the plain rotary for (T,) positions."""
    if multimodal is None:
        return RotaryEmbedding(rotary_dim, base)
    return MRotaryEmbedding(rotary_dim, base, multimodal.mrope_section)


def with_image_rows(x: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
    """Token embeddings ``x`` (T, hidden) with the step's image rows (``meta.image_embeds``) at their tokens."""
    if meta.image_embeds is None:
        return x
    index, rows = meta.image_embeds
    return x.index_copy(0, index, rows.to(x.dtype))


class MRotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` with (3, T) positions: each frequency's angle comes from its interleaved axis.

    Same ``prepare`` / ``forward`` contract and the same float32 ``(T, rotary_dim / 2)`` cos/sin handed to
    ``apply_rope``; only which position multiplies each frequency differs. A (T,) ``positions`` means text-only
    (equal axes) and gives exactly ``RotaryEmbedding``'s cos/sin.
    """

    multi_axis = True

    def __init__(self, rotary_dim: int, base: float, mrope_section: Sequence[int] = DEFAULT_MROPE_SECTION) -> None:
        super().__init__(rotary_dim, base)
        if len(mrope_section) != 3 or min(mrope_section) < 0:
            raise ValueError(f"mrope_section must be three non-negative sizes, got {list(mrope_section)!r}")
        self.mrope_section = tuple(int(s) for s in mrope_section)
        self._axes: torch.Tensor | None = None

    def axes(self, device: torch.device) -> torch.Tensor:
        if self._axes is None or self._axes.device != device:
            self._axes = frequency_axes(self.rotary_dim // 2, self.mrope_section).to(device)
        return self._axes

    def prepare(self, positions: torch.Tensor) -> None:
        """positions: (3, T) (time, height, width), or (T,) text-only. cos/sin: float32 (T, rotary_dim / 2)."""
        if positions.dim() == 1:
            super().prepare(positions)
            return
        assert positions.dim() == 2 and positions.shape[0] == 3, f"positions must be (3, T), got {positions.shape}"
        # (T, rotary_dim / 2): column i is the position of the axis frequency i turns with. Made contiguous, since
        # the product would keep the transposed strides and the CUDA apply_rope needs unit-stride cos/sin rows.
        per_freq = positions.index_select(0, self.axes(positions.device)).t().contiguous().float()
        freqs = per_freq * self.inv_freq(positions.device).unsqueeze(0)
        self._cos_sin = (freqs.cos(), freqs.sin())

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (T, Hq, D), k: (T, Hk, D); positions as given to this forward's ``prepare``. Rotated copies."""
        cos_sin = self._cos_sin
        assert cos_sin is not None and cos_sin[0].shape[0] == positions.shape[-1], "prepare() not called this step"
        cos, sin = cos_sin
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
