"""hyserve's 3-axis rotary positions against transformers' Qwen3.5 (get_rope_index, Qwen3_5TextRotaryEmbedding).

Positions and rope deltas must be identical. cos/sin and rotated q/k (float32) are compared with ATOL = 1e-6; both
sides compute the same float32 products and the same rotate-half arithmetic, so the measured difference is 0.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import Qwen3_5Config, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5Model,
    Qwen3_5TextRotaryEmbedding,
    apply_rotary_pos_emb,
)

from hyserve.layers.rotary import RotaryEmbedding
from hyserve.model import mrope
from hyserve.model.mrope import MRotaryEmbedding, decode_positions, mrope_positions, mrope_slice

ATOL = 1e-6
IMAGE, VSTART, VEND = 248056, 248053, 248054
MERGE = 2
THETA = 10_000_000.0


@pytest.fixture(scope="module")
def reference() -> Qwen3_5Model:
    text = {
        "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "layer_types": ["full_attention"], "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "linear_num_key_heads": 1, "linear_key_head_dim": 8, "linear_num_value_heads": 1,
        "linear_value_head_dim": 8,
    }
    vision = {"depth": 1, "hidden_size": 8, "intermediate_size": 16, "num_heads": 2, "patch_size": 4,
              "spatial_merge_size": MERGE, "temporal_patch_size": 2, "out_hidden_size": 16}
    cfg = Qwen3_5Config(text_config=text, vision_config=vision)
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == (IMAGE, VSTART, VEND)
    return Qwen3_5Model(cfg).eval()


def _prompt(layout: list[int | tuple[int, int, int]], seed: int = 0) -> tuple[list[int], list[tuple[int, int, int]]]:
    """An int n is n text tokens; a grid is ``<|vision_start|>`` + its image tokens + ``<|vision_end|>``, or just the
    image tokens when given as a negative-t grid (an image at the very start or end of the token list)."""
    rng = random.Random(seed)
    ids: list[int] = []
    grids: list[tuple[int, int, int]] = []
    for part in layout:
        if isinstance(part, int):
            ids += [rng.randrange(1000) for _ in range(part)]
            continue
        t, h, w = part
        bare = t < 0
        grid = (abs(t), h, w)
        grids.append(grid)
        pads = [IMAGE] * (abs(t) * h * w // MERGE**2)
        ids += pads if bare else [VSTART, *pads, VEND]
    return ids, grids


def _reference_positions(ref: Qwen3_5Model, ids: list[int],
                         grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, int]:
    input_ids = torch.tensor([ids])
    # transformers annotates LongTensor/IntTensor, which plain tensors do not satisfy for mypy.
    model: Any = ref
    position_ids, deltas = model.get_rope_index(
        input_ids,
        mm_token_type_ids=(input_ids == IMAGE).int(),
        image_grid_thw=torch.tensor(grids) if grids else None,
        attention_mask=torch.ones_like(input_ids),
    )
    return position_ids[:, 0], int(deltas.item())


LAYOUTS: dict[str, list[int | tuple[int, int, int]]] = {
    "text_only": [13],
    "one_image": [5, (1, 4, 6), 7],
    "three_images": [3, (1, 4, 6), 2, (1, 8, 4), 4, (1, 2, 2), 5],
    "adjacent_images": [4, (1, 6, 4), (1, 4, 8), (1, 2, 2), 3],
    "image_at_start": [(-1, 4, 4), 6],
    "image_at_end": [6, (-1, 6, 2)],
    "only_an_image": [(-1, 4, 6)],
    "wide_then_tall": [2, (1, 2, 12), 1, (1, 10, 2), 1],
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_positions_match_get_rope_index(reference: Qwen3_5Model, name: str) -> None:
    ids, grids = _prompt(LAYOUTS[name])
    expected, expected_delta = _reference_positions(reference, ids, grids)
    got, delta = mrope_positions(ids, grids, IMAGE, MERGE)
    assert got.dtype == torch.int64 and got.shape == (3, len(ids))
    assert torch.equal(got, expected)
    assert delta == expected_delta
    if grids:
        assert delta <= 0 and not torch.equal(got[1], got[2])  # the case is not vacuous


def test_random_prompts_match_get_rope_index(reference: Qwen3_5Model) -> None:
    rng = random.Random(1)
    for seed in range(20):
        layout: list[int | tuple[int, int, int]] = []
        for _ in range(rng.randrange(1, 6)):
            if rng.random() < 0.5:
                layout.append(rng.randrange(1, 5))
            else:
                layout.append((1, 2 * rng.randrange(1, 6), 2 * rng.randrange(1, 6)))
        ids, grids = _prompt(layout, seed)
        expected, expected_delta = _reference_positions(reference, ids, grids)
        got, delta = mrope_positions(ids, grids, IMAGE, MERGE)
        assert torch.equal(got, expected) and delta == expected_delta, layout


def test_text_only_positions_are_plain() -> None:
    got, delta = mrope_positions([1, 2, 3, 4], [], IMAGE, MERGE)
    assert torch.equal(got, torch.arange(4).expand(3, -1)) and delta == 0
    empty, delta = mrope_positions([], [], IMAGE, MERGE)
    assert empty.shape == (3, 0) and delta == 0


def test_run_length_mismatch_errors() -> None:
    ids, grids = _prompt([2, (1, 4, 4), 2, (1, 4, 6), 2])
    mrope_positions(ids, [grids[0], (1, 6, 4)], IMAGE, MERGE)  # same token count: positions differ, no error
    with pytest.raises(ValueError, match=r"image 1: 6 image tokens in the prompt, its grid \(1, 4, 8\) needs 8"):
        mrope_positions(ids, [grids[0], (1, 4, 8)], IMAGE, MERGE)
    with pytest.raises(ValueError, match="2 runs of image tokens but 1 images"):
        mrope_positions(ids, grids[:1], IMAGE, MERGE)
    touching = [IMAGE] * 4 + [IMAGE] * 6
    with pytest.raises(ValueError, match="1 runs of image tokens but 2 images"):
        mrope_positions(touching, [(1, 4, 4), (1, 4, 6)], IMAGE, MERGE)
    with pytest.raises(ValueError, match="spatial_merge_size"):
        mrope_positions([IMAGE] * 3, [(1, 3, 4)], IMAGE, MERGE)


# ---------------------------------------------------------------------------------------------------------------------
# Rotary cos/sin and rotated q/k.

# (head_dim, partial_rotary_factor, mrope_section): Qwen3.5's real layout (32 frequencies), and a tiny one where the
# section bounds the height/width slots (8 frequencies: height only at 1, width only at 2).
ROTARY_CASES = {"qwen3_5": (256, 0.25, [11, 11, 10]), "short_section": (32, 0.5, [2, 1, 1])}


def _text_rotary(head_dim: int, prf: float, section: list[int]) -> Qwen3_5TextRotaryEmbedding:
    kwargs: dict[str, Any] = {
        "head_dim": head_dim, "partial_rotary_factor": prf,
        "rope_parameters": {"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": prf,
                            "mrope_section": section, "mrope_interleaved": True},
    }
    cfg = Qwen3_5TextConfig(**kwargs)
    return Qwen3_5TextRotaryEmbedding(cfg)


def _ours(head_dim: int, prf: float, section: list[int]) -> MRotaryEmbedding:
    return MRotaryEmbedding(int(head_dim * prf), THETA, section)


def _positions() -> torch.Tensor:
    # Large offsets so every axis' angle is far from 0; non-square grids so height and width differ.
    ids, grids = _prompt([700, (1, 4, 10), 3, (1, 12, 2), 300, (1, 6, 6), 2])
    return mrope_positions(ids, grids, IMAGE, MERGE)[0]


def _reference_rotate(ref: Qwen3_5TextRotaryEmbedding, positions: torch.Tensor, q: torch.Tensor,
                      k: torch.Tensor) -> tuple[torch.Tensor, ...]:
    cos, sin = ref(q, positions[:, None, :])  # (1, T, rotary_dim), both halves
    # transformers' attention layout is (batch, heads, T, head_dim).
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return cos[0], sin[0], q_ref[0].transpose(0, 1), k_ref[0].transpose(0, 1)


def _max_diff(ours: MRotaryEmbedding, ref: Qwen3_5TextRotaryEmbedding, positions: torch.Tensor, head_dim: int) -> float:
    g = torch.Generator().manual_seed(0)
    t = positions.shape[1]
    q, k = torch.randn(t, 4, head_dim, generator=g), torch.randn(t, 2, head_dim, generator=g)
    cos_ref, sin_ref, q_ref, k_ref = _reference_rotate(ref, positions, q, k)
    ours.prepare(positions)
    q_ours, k_ours = ours(positions, q, k)
    assert ours._cos_sin is not None
    cos, sin = ours._cos_sin
    half = cos.shape[1]
    assert torch.equal(cos_ref[:, :half], cos_ref[:, half:])  # transformers repeats the halves
    return max(float((a - b).abs().max()) for a, b in
               [(cos, cos_ref[:, :half]), (sin, sin_ref[:, :half]), (q_ours, q_ref), (k_ours, k_ref)])


@pytest.mark.parametrize("case", sorted(ROTARY_CASES))
def test_rotary_matches_transformers(case: str) -> None:
    head_dim, prf, section = ROTARY_CASES[case]
    ours, ref = _ours(head_dim, prf, section), _text_rotary(head_dim, prf, section)
    positions = _positions()
    assert _max_diff(ours, ref, positions, head_dim) <= ATOL
    # Not vacuous: the text rotary (time positions on every axis) disagrees.
    ours.prepare(positions)
    text = RotaryEmbedding(ours.rotary_dim, THETA)
    text.prepare(positions[0])
    assert ours._cos_sin is not None and text._cos_sin is not None
    assert float((ours._cos_sin[0] - text._cos_sin[0]).abs().max()) > 1e-2


def test_cos_sin_are_contiguous() -> None:
    # The CUDA apply_rope asserts unit-stride cos/sin; a transposed gather must not leak its strides.
    rotary = _ours(*ROTARY_CASES["qwen3_5"])
    rotary.prepare(_positions())
    assert rotary._cos_sin is not None and all(t.is_contiguous() for t in rotary._cos_sin)


def test_frequency_axes_interleave() -> None:
    axes = mrope.frequency_axes(32, [11, 11, 10]).tolist()
    assert [i for i, a in enumerate(axes) if a == 1] == list(range(1, 32, 3))
    assert [i for i, a in enumerate(axes) if a == 2] == list(range(2, 30, 3))
    assert [i for i, a in enumerate(axes) if a == 0] == list(range(0, 31, 3))
    assert mrope.frequency_axes(8, [2, 1, 1]).tolist() == [0, 1, 2, 0, 0, 0, 0, 0]


def test_text_only_positions_give_text_rotary() -> None:
    head_dim, prf, section = ROTARY_CASES["qwen3_5"]
    ours, text = _ours(head_dim, prf, section), RotaryEmbedding(int(head_dim * prf), THETA)
    positions = torch.arange(50, 90)
    for p in (positions, positions.expand(3, -1)):
        ours.prepare(p)
        text.prepare(positions)
        assert ours._cos_sin is not None and text._cos_sin is not None
        assert torch.equal(ours._cos_sin[0], text._cos_sin[0]) and torch.equal(ours._cos_sin[1], text._cos_sin[1])
    # and against transformers with equal axes
    ref = _text_rotary(head_dim, prf, section)
    assert _max_diff(ours, ref, positions.expand(3, -1), head_dim) <= ATOL


def test_chunked_section_layout_mismatches(monkeypatch: pytest.MonkeyPatch) -> None:
    head_dim, prf, section = ROTARY_CASES["qwen3_5"]

    def chunked(num_freqs: int, sec: list[int]) -> torch.Tensor:
        # Qwen2-VL style: the first 11 frequencies time, the next 11 height, the last 10 width.
        return torch.repeat_interleave(torch.arange(3), torch.tensor(sec))[:num_freqs]

    monkeypatch.setattr(mrope, "frequency_axes", chunked)
    ours, ref = _ours(head_dim, prf, section), _text_rotary(head_dim, prf, section)
    assert _max_diff(ours, ref, _positions(), head_dim) > 1e-2


def test_swapped_height_width_mismatches() -> None:
    head_dim, prf, section = ROTARY_CASES["qwen3_5"]
    ours, ref = _ours(head_dim, prf, section), _text_rotary(head_dim, prf, section)
    positions = _positions()
    ours_swapped = positions[[0, 2, 1]]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(positions.shape[1], 4, head_dim, generator=g)
    _, _, q_ref, _ = _reference_rotate(ref, positions, q, q)
    ours.prepare(ours_swapped)
    q_ours, _ = ours(ours_swapped, q, q)
    assert float((q_ours - q_ref).abs().max()) > 1e-2


# ---------------------------------------------------------------------------------------------------------------------
# Chunks and decode.


def test_chunks_of_the_whole_prompt_give_the_same_rotary() -> None:
    head_dim, prf, section = ROTARY_CASES["qwen3_5"]
    rotary = _ours(head_dim, prf, section)
    ids, grids = _prompt([5, (1, 4, 10), 3, (1, 12, 2), 4, (1, 6, 6), 2])
    whole, delta = mrope_positions(ids, grids, IMAGE, MERGE)
    rotary.prepare(whole)
    assert rotary._cos_sin is not None
    cos_whole, sin_whole = rotary._cos_sin
    t = whole.shape[1]
    # Cuts inside the first image, between images, and inside the last one.
    for a, b in [(7, 30), (1, t - 1), (20, 21)]:
        parts = []
        for start, end in [(0, a), (a, b), (b, t)]:
            chunk = mrope_slice(whole, delta, start, end)
            assert torch.equal(chunk, whole[:, start:end])
            rotary.prepare(chunk)
            parts.append(rotary._cos_sin)
        assert torch.equal(torch.cat([p[0] for p in parts]), cos_whole)
        assert torch.equal(torch.cat([p[1] for p in parts]), sin_whole)


def test_slice_past_the_prompt_continues_with_decode_positions() -> None:
    ids, grids = _prompt([3, (1, 4, 6), 2])
    whole, delta = mrope_positions(ids, grids, IMAGE, MERGE)
    t = whole.shape[1]
    span = mrope_slice(whole, delta, t - 3, t + 4)
    assert torch.equal(span[:, :3], whole[:, t - 3:])
    assert torch.equal(span[:, 3:], decode_positions(t, 4, delta))
    assert torch.equal(mrope_slice(whole, delta, t + 2, t + 5), decode_positions(t + 2, 3, delta))
    # The first generated token follows the prompt's largest position.
    assert int(decode_positions(t, 1, delta)[0, 0]) == int(whole.max()) + 1


def test_decode_positions_match_generation(reference: Qwen3_5Model) -> None:
    model: Any = reference  # as in _reference_positions
    ids, grids = _prompt([4, (1, 4, 10), 3, (1, 8, 2), 2])
    input_ids = torch.tensor([ids])
    kwargs = {"image_grid_thw": torch.tensor(grids), "mm_token_type_ids": (input_ids == IMAGE).int()}
    model.rope_deltas = None
    prefill = model.compute_3d_position_ids(
        input_ids=input_ids, inputs_embeds=torch.zeros(1, len(ids), 16), **kwargs
    )
    whole, delta = mrope_positions(ids, grids, IMAGE, MERGE)
    assert torch.equal(prefill[:, 0], whole)
    t = len(ids)
    # Then one token per step (and a 3-token speculative step) against a cache of growing length.
    for cached, count in [(t, 1), (t + 1, 1), (t + 2, 3), (t + 40, 1)]:
        step = model.compute_3d_position_ids(
            input_ids=torch.zeros(1, count, dtype=torch.long), inputs_embeds=torch.zeros(1, count, 16),
            past_key_values=SimpleNamespace(get_seq_length=lambda c=cached: c), **kwargs,
        )
        assert torch.equal(step[:, 0], decode_positions(cached, count, delta)), (cached, count)
