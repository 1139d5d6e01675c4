"""hyserve's Qwen3.5 vision tower against transformers' Qwen3_5VisionModel (tiny random weights, CPU, float32).

Tolerance: max abs diff <= 1e-5 on outputs of order 1 (the two differ only in float rounding: a GEMM in place of
the patch Conv3d, batched vs per-segment attention).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5VisionConfig
from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

from hyserve.model import vision
from hyserve.model.vision import VisionConfig, VisionModel, load_vision_weights, vision_token_count

ATOL = 1e-5
PATCH, MERGE, TEMPORAL = 4, 2, 2
MULTI_GRID = [[1, 4, 6], [1, 8, 4], [1, 2, 2]]


def _tiny_config(attn: str) -> Qwen3_5VisionConfig:
    cfg = Qwen3_5VisionConfig(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL, out_hidden_size=48, num_position_embeddings=16,
    )
    cfg._attn_implementation = attn
    return cfg


def _reference(attn: str) -> Qwen3_5VisionModel:
    torch.manual_seed(0)
    model = Qwen3_5VisionModel(_tiny_config(attn)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            # Biases start at 0 and LayerNorm weights at 1: perturb everything so every parameter matters.
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def models(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[Qwen3_5VisionModel, VisionModel]:
    ref = _reference(request.param)
    checkpoint = {f"model.visual.{k}": v.clone() for k, v in ref.state_dict().items()}
    checkpoint["model.language_model.embed_tokens.weight"] = torch.zeros(4, 4)  # not the tower's: ignored
    path = tmp_path_factory.mktemp("vision") / "model.safetensors"
    save_file(checkpoint, str(path))
    ours = VisionModel.from_config_dict(ref.config.to_dict()).eval()
    load_vision_weights(ours, load_file(str(path)))
    return ref, ours


def _pixels(grid: list[list[int]], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    grid_thw = torch.tensor(grid)
    g = torch.Generator().manual_seed(seed)
    rows = int(grid_thw.prod(-1).sum())
    return torch.randn(rows, 3 * TEMPORAL * PATCH * PATCH, generator=g), grid_thw


def _max_diff(ref: Qwen3_5VisionModel, ours: VisionModel, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> float:
    with torch.no_grad():
        expected = ref(pixel_values, grid_thw=grid_thw).pooler_output
        got = ours(pixel_values, grid_thw)
    assert got.shape == expected.shape == (sum(vision_token_count(grid_thw, MERGE)), 48)
    assert expected.abs().max() > 0.1  # the comparison is not vacuous
    return float((got - expected).abs().max())


def test_config_from_dict_reads_checkpoint_fields() -> None:
    cfg = VisionConfig.from_dict(_tiny_config("sdpa").to_dict())
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.patch_size, cfg.out_hidden_size) == (2, 32, 2, 4, 48)
    assert cfg.num_grid_per_side == 4 and cfg.rope_theta == 10000.0 and cfg.patch_dim == 96
    assert VisionConfig.from_dict({}) == VisionConfig()
    with pytest.raises(ValueError, match="deepstack"):
        VisionConfig.from_dict({"deepstack_visual_indexes": [1]})


def test_vision_token_count() -> None:
    assert vision_token_count(torch.tensor(MULTI_GRID), 2) == [6, 8, 1]
    assert vision_token_count([[2, 4, 4]], 2) == [8]
    with pytest.raises(ValueError, match="spatial_merge_size"):
        vision_token_count([[1, 3, 4]], 2)


def test_one_image_matches(models: tuple[Qwen3_5VisionModel, VisionModel]) -> None:
    assert _max_diff(*models, *_pixels([[1, 4, 6]])) <= ATOL


def test_several_images_match(models: tuple[Qwen3_5VisionModel, VisionModel]) -> None:
    assert _max_diff(*models, *_pixels(MULTI_GRID)) <= ATOL


def test_video_frames_match(models: tuple[Qwen3_5VisionModel, VisionModel]) -> None:
    # t > 1: transformers attends within each frame; ours batches the equal-length frames.
    assert _max_diff(*models, *_pixels([[3, 4, 4], [1, 2, 6]])) <= ATOL


def test_processor_pixels_line_up_with_grid(models: tuple[Qwen3_5VisionModel, VisionModel]) -> None:
    assert "Qwen2VLImageProcessor" in str(IMAGE_PROCESSOR_MAPPING_NAMES["qwen3_5"])
    processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE, min_pixels=8 * 8, max_pixels=48 * 48
    )
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(30, 20), (16, 40)]]
    out = processor(images=images, return_tensors="pt")
    pixel_values, grid_thw = out["pixel_values"], out["image_grid_thw"]
    assert pixel_values.shape == (int(grid_thw.prod(-1).sum()), 3 * TEMPORAL * PATCH * PATCH)
    assert grid_thw[:, 0].tolist() == [1, 1] and len({tuple(g) for g in grid_thw.tolist()}) == 2
    assert _max_diff(*models, pixel_values, grid_thw) <= ATOL


def test_swapped_rotary_axes_mismatch(models: tuple[Qwen3_5VisionModel, VisionModel],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    original = vision.rotary_position_ids
    monkeypatch.setattr(vision, "rotary_position_ids", lambda g, m: original(g, m).flip(-1))
    assert _max_diff(*models, *_pixels(MULTI_GRID)) > 1e-3


def test_attention_across_images_mismatch(models: tuple[Qwen3_5VisionModel, VisionModel],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vision, "attention_segments", lambda g: [int(g.prod(-1).sum())])
    assert _max_diff(*models, *_pixels(MULTI_GRID)) > 1e-3


def test_unflipped_position_grid_mismatch(models: tuple[Qwen3_5VisionModel, VisionModel],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Position embeddings resampled with height and width exchanged (only a non-square grid can tell).
    original = vision._axis_taps
    sizes = iter([6, 4])
    monkeypatch.setattr(vision, "_axis_taps", lambda size, side: original(next(sizes), side))
    assert _max_diff(*models, *_pixels([[1, 4, 6]])) > 1e-3


def test_loader_names_missing_and_unexpected_tensors() -> None:
    ref = _reference("sdpa")
    ours = VisionModel.from_config_dict(ref.config.to_dict())
    checkpoint = {f"model.visual.{k}": v for k, v in ref.state_dict().items()}
    del checkpoint["model.visual.blocks.1.attn.qkv.bias"]
    checkpoint["model.visual.merger_list.0.norm.weight"] = torch.ones(32)
    with pytest.raises(ValueError) as err:
        load_vision_weights(ours, checkpoint)
    assert "missing: model.visual.blocks.1.attn.qkv.bias" in str(err.value)
    assert "unexpected: model.visual.merger_list.0.norm.weight" in str(err.value)


def test_loader_names_shape_mismatch() -> None:
    ref = _reference("sdpa")
    ours = VisionModel.from_config_dict(ref.config.to_dict())
    checkpoint = {f"model.visual.{k}": v for k, v in ref.state_dict().items()}
    checkpoint["model.visual.pos_embed.weight"] = torch.zeros(36, 32)
    with pytest.raises(ValueError, match=r"shape mismatch: model.visual.pos_embed.weight is \(36, 32\)"):
        load_vision_weights(ours, checkpoint)


def test_wrong_pixel_rows_rejected(models: tuple[Qwen3_5VisionModel, VisionModel]) -> None:
    pixel_values, grid_thw = _pixels([[1, 4, 4]])
    with pytest.raises(ValueError, match="grid_thw needs"):
        models[1](pixel_values[:-1], grid_thw)
