"""The tiny Qwen3_5ForConditionalGeneration checkpoint (``hyserve.testing.write_tiny_vlm_checkpoint``): it loads in
transformers with every weight, its tokenizer, chat template and preprocessor config drive the image path, and the
image reaches transformers' logits."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer as RawTokenizer
from transformers import Qwen3_5ForConditionalGeneration
from transformers.models.auto.image_processing_auto import AutoImageProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from hyserve.model.registry import load_model_config
from hyserve.model.vision import VisionConfig
from hyserve.multimodal.image import ImageProcessorSettings, expand_image_placeholders, load_image, process_images
from hyserve.testing import (
    IM_END,
    IM_START,
    IMAGE_PAD,
    TINY_VLM_MAX_PIXELS,
    TINY_VLM_MIN_PIXELS,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    VISION_TOKENS,
    png_data_url,
    read_checkpoint_tensors,
    reference_vlm_greedy,
    reference_vlm_logits,
    reference_vlm_model,
    special_token_ids,
    tiny_png,
    tokenizer_json,
    vlm_special_token_ids,
    write_tiny_checkpoint,
    write_tiny_vlm_checkpoint,
)
from hyserve.tokenizer import Tokenizer

IMAGE_PART = VISION_START + IMAGE_PAD + VISION_END


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_vlm_checkpoint(tmp_path_factory.mktemp("vlm"), with_mtp=True)


@pytest.fixture(scope="module")
def model(checkpoint: str) -> Qwen3_5ForConditionalGeneration:
    return reference_vlm_model(checkpoint)


def _config(checkpoint: str) -> dict:
    with open(os.path.join(checkpoint, "config.json")) as f:
        return json.load(f)


def _image(width: int, height: int, seed: int) -> Image.Image:
    return load_image(png_data_url(tiny_png(width, height, seed)))


def test_loads_in_transformers_with_every_weight(checkpoint: str) -> None:
    model, info = Qwen3_5ForConditionalGeneration.from_pretrained(checkpoint, output_loading_info=True,
                                                                  local_files_only=True)
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["error_msgs"]
    assert not info["unexpected_keys"]  # mtp.* is on the class's ignore list
    on_disk = read_checkpoint_tensors(checkpoint)
    assert any(n.startswith("mtp.") for n in on_disk)
    assert {n for n in on_disk if not n.startswith("mtp.")} == set(model.state_dict())
    assert any(n.startswith("model.visual.blocks.1.") for n in on_disk)
    loaded = model.state_dict()
    for name in ("model.visual.merger.linear_fc2.weight", "model.language_model.embed_tokens.weight",
                 "lm_head.weight"):
        assert torch.equal(loaded[name], on_disk[name])


def test_text_weights_equal_the_causal_text_checkpoint(checkpoint: str, tmp_path: str) -> None:
    text = read_checkpoint_tensors(write_tiny_checkpoint(tmp_path, with_mtp=True))
    vlm = read_checkpoint_tensors(checkpoint)
    renamed = {n.replace("model.", "model.language_model.", 1): t for n, t in text.items()}
    assert set(renamed) == {n for n in vlm if not n.startswith("model.visual.")}
    assert all(torch.equal(t, vlm[n]) for n, t in renamed.items())


def test_tied_and_bfloat16_variants(tmp_path: str) -> None:
    path = write_tiny_vlm_checkpoint(tmp_path, tie_word_embeddings=True, dtype=torch.bfloat16, seed=3)
    tensors = read_checkpoint_tensors(path)
    assert "lm_head.weight" not in tensors and not any(n.startswith("mtp.") for n in tensors)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    _, info = Qwen3_5ForConditionalGeneration.from_pretrained(path, output_loading_info=True, local_files_only=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_vision_tokens_are_single_ids_matching_config(checkpoint: str) -> None:
    ids = vlm_special_token_ids()
    config = _config(checkpoint)
    assert config["image_token_id"] == ids[IMAGE_PAD]
    assert config["video_token_id"] == ids[VIDEO_PAD]
    assert config["vision_start_token_id"] == ids[VISION_START]
    assert config["vision_end_token_id"] == ids[VISION_END]
    assert max(ids.values()) < config["text_config"]["vocab_size"]
    # The text tokenizer's ids are unchanged; the vision tokens come after them.
    assert {t: ids[t] for t in special_token_ids()} == special_token_ids()
    base = RawTokenizer.from_str(tokenizer_json()).get_vocab_size(with_added_tokens=True)
    assert sorted(ids[t] for t in VISION_TOKENS) == list(range(base, base + len(VISION_TOKENS)))
    tok = Tokenizer.from_model_dir(checkpoint)
    for token in VISION_TOKENS:
        assert tok.encode(token, add_special_tokens=False) == [ids[token]]
        assert tok.hf_tokenizer.convert_tokens_to_ids(token) == ids[token]
    text = "Look: " + IMAGE_PART + " ok"
    encoded = tok.encode(text, add_special_tokens=False)
    assert encoded.count(ids[IMAGE_PAD]) == 1
    assert tok.decode(encoded, skip_special_tokens=False) == text
    assert tok.decode(encoded) == "Look:  ok"  # special tokens skipped
    with open(os.path.join(checkpoint, "tokenizer_config.json")) as f:
        decoder = json.load(f)["added_tokens_decoder"]
    assert {decoder[str(ids[t])]["content"] for t in VISION_TOKENS} == set(VISION_TOKENS)


def test_chat_template_renders_image_parts(checkpoint: str) -> None:
    tok = Tokenizer.from_model_dir(checkpoint)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "with"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]},
    ]
    text = tok.apply_chat_template(messages)
    assert text == (f"{IM_START}system\nBe brief.{IM_END}\n"
                    f"{IM_START}user\nCompare{IMAGE_PART}with{IMAGE_PART}{IM_END}\n{IM_START}assistant\n")
    ids = vlm_special_token_ids()
    encoded = tok.encode(text, add_special_tokens=False)
    pad = encoded.index(ids[IMAGE_PAD])
    assert encoded[pad - 1:pad + 2] == [ids[VISION_START], ids[IMAGE_PAD], ids[VISION_END]]
    assert encoded.count(ids[IMAGE_PAD]) == 2
    numbered = tok.apply_chat_template([messages[1]], add_generation_prompt=False, add_vision_id=True)
    assert numbered == f"{IM_START}user\nComparePicture 1: {IMAGE_PART}withPicture 2: {IMAGE_PART}{IM_END}\n"


def test_process_images_matches_transformers(checkpoint: str) -> None:
    settings = ImageProcessorSettings.from_checkpoint(checkpoint)
    assert (settings.patch_size, settings.merge_size, settings.temporal_patch_size) == (4, 2, 2)
    assert (settings.min_pixels, settings.max_pixels) == (TINY_VLM_MIN_PIXELS, TINY_VLM_MAX_PIXELS)
    reference = AutoImageProcessor.from_pretrained(checkpoint, backend="pil")
    assert type(reference) is Qwen2VLImageProcessorPil
    images = [_image(32, 48, 0), _image(40, 40, 1), _image(64, 32, 2), _image(96, 80, 3)]
    got = process_images(images, checkpoint)
    expected = reference(images=images, return_tensors="pt")
    assert torch.equal(got.pixel_values, expected["pixel_values"])
    assert torch.equal(got.grid_thw, expected["image_grid_thw"])
    assert got.grid_thw.tolist()[:3] == [[1, 12, 8], [1, 10, 10], [1, 8, 16]]
    assert got.token_counts[:3] == [24, 25, 32]
    _, h, w = got.grid_thw[3].tolist()  # 96x80 is over max_pixels: scaled down
    assert h * w * 16 <= TINY_VLM_MAX_PIXELS


def test_model_config_reads_multimodal(checkpoint: str) -> None:
    cfg = load_model_config(checkpoint)
    ids = vlm_special_token_ids()
    assert cfg.architecture == "Qwen3_5ForConditionalGeneration" and cfg.mtp_num_hidden_layers == 1
    mm = cfg.multimodal
    assert mm is not None
    assert (mm.image_token_id, mm.video_token_id, mm.vision_start_token_id, mm.vision_end_token_id) == (
        ids[IMAGE_PAD], ids[VIDEO_PAD], ids[VISION_START], ids[VISION_END])
    # The rotary's 4 frequencies (head_dim 16, partial factor 0.5) interleaved over (t, h, w).
    assert mm.mrope_section == (2, 1, 1)
    vision = VisionConfig.from_dict(mm.vision_config)
    assert (vision.depth, vision.hidden_size, vision.num_heads, vision.patch_size) == (2, 32, 2, 4)
    assert (vision.spatial_merge_size, vision.temporal_patch_size, vision.num_grid_per_side) == (2, 2, 4)
    assert vision.out_hidden_size == cfg.hidden_size


def _prompt(checkpoint: str, n_images: int) -> list[int]:
    tok = Tokenizer.from_model_dir(checkpoint)
    parts: list[dict] = [{"type": "text", "text": "Look at this"}]
    for _ in range(n_images):
        parts += [{"type": "image"}, {"type": "text", "text": " and"}]
    parts.append({"type": "text", "text": " tell me what it is."})
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": parts}]), add_special_tokens=False)


def test_image_reaches_reference_logits(checkpoint: str, model: Qwen3_5ForConditionalGeneration) -> None:
    prompt = _prompt(checkpoint, 2)
    image_token = vlm_special_token_ids()[IMAGE_PAD]

    def run(seeds: tuple[int, int]) -> tuple[list[int], torch.Tensor]:
        images = process_images([_image(32, 48, seeds[0]), _image(64, 32, seeds[1])], checkpoint)
        ids = expand_image_placeholders(prompt, images.token_counts, image_token)
        assert len(ids) == len(prompt) - 2 + 24 + 32
        return ids, reference_vlm_logits(model, ids, images.pixel_values, images.grid_thw)

    ids, a = run((0, 1))
    _, b = run((5, 1))  # the first image differs
    assert a.shape == (len(ids), 512) and a.dtype == torch.float32 and torch.isfinite(a).all()
    first = ids.index(image_token)
    # Before the first image the logits are equal; from it on (and at the last position) they differ.
    assert torch.equal(a[:first], b[:first])
    assert (a[first:] - b[first:]).abs().amax(-1).min() > 1e-3
    assert (a[-1] - b[-1]).abs().max() > 0.1
    assert torch.equal(a, run((0, 1))[1])  # deterministic
    assert len(set(a.argmax(-1).tolist())) > 10  # not degenerate

    # Greedy: one token from the teacher-forced logits, and the continuation is not one repeated token.
    images = process_images([_image(32, 48, 0), _image(64, 32, 1)], checkpoint)
    greedy = reference_vlm_greedy(model, ids, images.pixel_values, images.grid_thw, 4)
    assert greedy[0] == int(a[-1].argmax()) and len(set(greedy)) > 1
    tf = reference_vlm_logits(model, ids + greedy[:-1], images.pixel_values, images.grid_thw)
    assert tf[len(ids) - 1:].argmax(-1).tolist() == greedy


def test_text_only_prompt_on_the_vlm(checkpoint: str, model: Qwen3_5ForConditionalGeneration) -> None:
    prompt = _prompt(checkpoint, 0)
    logits = reference_vlm_logits(model, prompt, None, None)
    assert logits.shape == (len(prompt), 512)
    assert torch.allclose(logits, reference_vlm_logits(model, prompt, None, None))


def test_tiny_png() -> None:
    data = tiny_png(24, 16, 7)
    img = Image.open(io.BytesIO(data))
    assert img.format == "PNG" and img.size == (24, 16) and img.mode == "RGB"
    assert data == tiny_png(24, 16, 7) and data != tiny_png(24, 16, 8)
    url = png_data_url(data)
    assert url.startswith("data:image/png;base64,")
    assert load_image(url).tobytes() == img.tobytes()
