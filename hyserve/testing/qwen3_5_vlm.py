"""A tiny ``Qwen3_5ForConditionalGeneration`` whose image path works end to end: the tokenizer has the vision tokens
(after the text tokenizer's ids, which it keeps), the tower is a complete tiny one, and preprocessor_config.json and
an image-aware chat template come with it. ``reference_vlm_model`` / ``reference_vlm_logits`` / ``reference_vlm_greedy``
run transformers' own model over it, image included."""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig, Qwen3_5VisionConfig

from hyserve.testing.files import write_json
from hyserve.testing.qwen3_5 import (
    conditional_name,
    config_json,
    make_tensors,
    tiny_text_config,
    use_torch_gated_delta_rule,
)
from hyserve.testing.tokenizer import ENDOFTEXT, IM_END, SPECIAL_TOKENS, tokenizer_config, tokenizer_json

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# The vision tower of ``write_tiny_vlm_checkpoint`` (``out_hidden_size`` is the text model's hidden size).
TINY_VLM_VISION = {
    "depth": 2, "hidden_size": 32, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 64, "num_heads": 2,
    "in_channels": 3, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "num_position_embeddings": 16,
}
# Pixel-area bounds of its preprocessor_config.json: resized sides are multiples of patch_size * merge_size = 8, so a
# 32x48 image is a 8x12 patch grid (24 placeholder tokens) and anything above 48x48 pixels is scaled down.
TINY_VLM_MIN_PIXELS = 16 * 16
TINY_VLM_MAX_PIXELS = 48 * 48

# Qwen3.5's chat template reduced to ChatML plus its content rendering: a string, or a list of parts where an image
# part (``type`` image or image_url, or an ``image``/``image_url`` key) renders as
# ``<|vision_start|><|image_pad|><|vision_end|>``, a video part the same with ``<|video_pad|>``, and a text part as its
# text. ``add_vision_id`` prefixes each image with "Picture N: " (each video with "Video N: ").
VLM_CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) %}"
    "{%- set video_count = namespace(value=0) %}"
    "{%- macro render_content(content) %}"
    "{%- if content is string %}{{- content }}"
    "{%- elif content is iterable and content is not mapping %}"
    "{%- for item in content %}"
    "{%- if 'image' in item or 'image_url' in item or item.type == 'image' or item.type == 'image_url' %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}{{- 'Picture ' ~ image_count.value ~ ': ' }}{%- endif %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif 'video' in item or item.type == 'video' %}"
    "{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}{{- 'Video ' ~ video_count.value ~ ': ' }}{%- endif %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in item %}{{- item.text }}"
    "{%- else %}{{- raise_exception('Unexpected item type in content.') }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- elif content is none or content is undefined %}{{- '' }}"
    "{%- else %}{{- raise_exception('Unexpected content type.') }}"
    "{%- endif %}"
    "{%- endmacro %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + render_content(message['content']) + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@functools.lru_cache(maxsize=1)
def vlm_tokenizer_json() -> str:
    """tokenizer.json of the VLM checkpoint: ``tokenizer_json()`` with ``VISION_TOKENS`` appended as special tokens
    (so every text token keeps its id)."""
    tok = Tokenizer.from_str(tokenizer_json())
    tok.add_special_tokens(list(VISION_TOKENS))
    return tok.to_str()


def vlm_special_token_ids() -> dict[str, int]:
    """Ids of ``SPECIAL_TOKENS`` and ``VISION_TOKENS`` in the VLM tokenizer."""
    tok = Tokenizer.from_str(vlm_tokenizer_json())
    ids = {t: tok.token_to_id(t) for t in (*SPECIAL_TOKENS, *VISION_TOKENS)}
    return {t: i for t, i in ids.items() if i is not None}


def _mrope_text_config(overrides: dict[str, Any]) -> Qwen3_5TextConfig:
    """``tiny_text_config(**overrides)`` with an interleaved ``mrope_section`` (as real Qwen3.5 checkpoints carry)
    splitting the rotary's frequencies over (t, h, w); an explicit ``mrope_section`` in the overrides is kept."""
    config = tiny_text_config(**overrides)
    rope = dict(config.rope_parameters or {})
    if "mrope_section" not in rope:
        half = int(config.head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
        # Frequency i turns with axis i % 3: the section sizes are the counts of each residue below ``half``.
        rope["mrope_section"] = [len(range(axis, half, 3)) for axis in range(3)]
        rope["mrope_interleaved"] = True
        config = tiny_text_config(**{**overrides, "rope_parameters": rope})
    return config


def tiny_vlm_config(**text_overrides: Any) -> Qwen3_5Config:
    """The ``Qwen3_5Config`` of ``write_tiny_vlm_checkpoint``: ``tiny_text_config(**text_overrides)`` with M-RoPE,
    ``TINY_VLM_VISION`` and the VLM tokenizer's vision token ids."""
    text = _mrope_text_config(text_overrides)
    ids = vlm_special_token_ids()
    size = Tokenizer.from_str(vlm_tokenizer_json()).get_vocab_size(with_added_tokens=True)
    if text.vocab_size < size:
        raise ValueError(f"vocab_size {text.vocab_size} is smaller than the VLM tokenizer ({size})")
    return Qwen3_5Config(
        text_config=text.to_dict(),
        vision_config={**TINY_VLM_VISION, "out_hidden_size": text.hidden_size},
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=bool(text.tie_word_embeddings),
    )


def _sub_configs(config: Qwen3_5Config) -> tuple[Qwen3_5TextConfig, Qwen3_5VisionConfig]:
    text, vision = config.text_config, config.vision_config
    if not isinstance(text, Qwen3_5TextConfig) or not isinstance(vision, Qwen3_5VisionConfig):
        raise TypeError("Qwen3_5Config did not build its text and vision sub-configs")
    return text, vision


def tiny_preprocessor_config() -> dict[str, Any]:
    """preprocessor_config.json of the VLM checkpoint, laid out as Qwen3.5's (pixel bounds ``TINY_VLM_*_PIXELS``)."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen3VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "patch_size": TINY_VLM_VISION["patch_size"],
        "temporal_patch_size": TINY_VLM_VISION["temporal_patch_size"],
        "merge_size": TINY_VLM_VISION["spatial_merge_size"],
        "size": {"shortest_edge": TINY_VLM_MIN_PIXELS, "longest_edge": TINY_VLM_MAX_PIXELS},
    }


def _vision_init(name: str, value: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A vision-tower tensor rescaled from transformers' init (std 0.02, zero biases, unit LayerNorms) to unit gain,
    with random biases and LayerNorm affines: the tower's output then differs by O(1) between images."""
    if name.endswith("pos_embed.weight"):
        return torch.randn(value.shape, generator=gen) * 0.5
    if value.dim() == 1:
        base = 1.0 if name.split(".")[-2].startswith("norm") and name.endswith("weight") else 0.0
        return base + torch.randn(value.shape, generator=gen) * 0.1
    fan_in = value[0].numel()
    return value / value.std() / math.sqrt(fan_in)


def _vlm_tensors(config: Qwen3_5Config, *, with_mtp: bool, seed: int) -> dict[str, torch.Tensor]:
    """float32 tensors by checkpoint name: the text ones (and ``mtp.*``) drawn as ``write_tiny_checkpoint`` draws its
    causal form's (equal to those for the same seed and config, renamed ``model.language_model.*``), the vision
    tower's from transformers' own init under ``torch.manual_seed(seed)`` (the global RNG restored after), rescaled
    by ``_vision_init``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForConditionalGeneration(config).float()
    text_config, _ = _sub_configs(config)
    expected = model.state_dict()
    if text_config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)  # tied: saved checkpoints have none
    text = make_tensors(text_config, form="causal", with_mtp=with_mtp, seed=seed, dtype=torch.float32)
    tensors = {conditional_name(n): t for n, t in text.items()}
    gen = torch.Generator().manual_seed(seed + 1)
    for name, value in expected.items():
        if name.startswith("model.visual."):
            tensors[name] = _vision_init(name, value.detach(), gen).contiguous()
    names = set(tensors) - {n for n in tensors if n.startswith("mtp.")}
    if names != set(expected):
        raise AssertionError(f"tensor names differ from the model's: {sorted(names ^ set(expected))[:8]}")
    for name, value in expected.items():
        if tensors[name].shape != value.shape:
            raise AssertionError(f"{name}: shape {tuple(tensors[name].shape)}, the model has {tuple(value.shape)}")
    return tensors


def write_tiny_vlm_checkpoint(
    path: str | os.PathLike[str],
    *,
    with_mtp: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **text_overrides: Any,
) -> str:
    """Write a tiny random ``Qwen3_5ForConditionalGeneration`` checkpoint with working image input; returns the path.

    The directory holds config.json (``tiny_vlm_config``), model.safetensors (``model.language_model.*``,
    ``model.visual.*``, ``lm_head.weight``, and ``mtp.*`` with ``with_mtp``), tokenizer.json
    (``vlm_tokenizer_json``), tokenizer_config.json (``VLM_CHAT_TEMPLATE``, the vision tokens in
    added_tokens_decoder), preprocessor_config.json (``tiny_preprocessor_config``) and generation_config.json.
    ``text_overrides`` go to ``tiny_text_config`` (``layer_types``, ``tie_word_embeddings``, ``hidden_size``, ...).
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    config = tiny_vlm_config(**text_overrides)
    text_config, vision_config = _sub_configs(config)
    tensors = _vlm_tensors(config, with_mtp=with_mtp, seed=seed)
    save_file({n: t.to(dtype).contiguous() for n, t in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})

    raw = config_json(text_config, form="conditional", dtype=dtype, with_mtp=with_mtp)
    vision = vision_config.to_diff_dict()
    vision.pop("transformers_version", None)
    raw["vision_config"] = {"model_type": "qwen3_5_vision", **vision}
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        raw[key] = int(getattr(config, key))
    write_json(os.path.join(path, "config.json"), raw)

    ids = vlm_special_token_ids()
    generation = {"eos_token_id": [ids[IM_END], ids[ENDOFTEXT]], "pad_token_id": ids[ENDOFTEXT],
                  "do_sample": False, "transformers_version": "5.17.0"}
    write_json(os.path.join(path, "generation_config.json"), generation)
    with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(vlm_tokenizer_json())
    tok_config = tokenizer_config(ids, 4096)
    for token in VISION_TOKENS:
        tok_config["added_tokens_decoder"][str(ids[token])] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True,
        }
    tok_config["chat_template"] = VLM_CHAT_TEMPLATE
    write_json(os.path.join(path, "tokenizer_config.json"), tok_config)
    write_json(os.path.join(path, "preprocessor_config.json"), tiny_preprocessor_config())
    return path


def reference_vlm_model(path: str | os.PathLike[str]) -> Qwen3_5ForConditionalGeneration:
    """transformers' own ``Qwen3_5ForConditionalGeneration`` loaded from the directory, float32, eval, on the CPU
    (``mtp.*`` is in its ignore-on-load list)."""
    use_torch_gated_delta_rule()
    model = Qwen3_5ForConditionalGeneration.from_pretrained(os.fspath(path), dtype=torch.float32,
                                                            local_files_only=True)
    return model.eval()


@torch.no_grad()
def reference_vlm_logits(model: Qwen3_5ForConditionalGeneration, token_ids: list[int],
                         pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """Teacher-forced logits of one uncached forward, float32 on the CPU, shape ``(len(token_ids), vocab)``.

    ``token_ids`` holds each image's placeholders already expanded (``expand_image_placeholders``); transformers
    computes the M-RoPE positions itself from them and ``image_grid_thw``. ``pixel_values=None``: a text-only prompt.
    """
    input_ids = torch.tensor([token_ids], dtype=torch.long)
    # Which tokens are image placeholders (transformers' processor returns this next to input_ids).
    mm_token_type_ids = (input_ids == model.config.image_token_id).int()
    model.model.rope_deltas = None  # a previous generate's state must not shift these positions
    kwargs: dict[str, Any] = {}
    if pixel_values is not None:
        kwargs = {"pixel_values": pixel_values.float(), "image_grid_thw": image_grid_thw,
                  "mm_token_type_ids": mm_token_type_ids}
    out = model(input_ids=input_ids, use_cache=False, **kwargs)
    return out.logits[0].float().cpu()


def reference_vlm_greedy(model: Qwen3_5ForConditionalGeneration, token_ids: list[int],
                         pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
                         max_tokens: int) -> list[int]:
    """``max_tokens`` greedy tokens after ``token_ids`` (placeholders expanded), each from a full uncached forward
    over the prompt and the tokens so far; eos is not treated specially (compare with an engine run ignoring eos)."""
    ids = list(token_ids)
    out: list[int] = []
    for _ in range(max_tokens):
        logits = reference_vlm_logits(model, ids + out, pixel_values, image_grid_thw)
        out.append(int(logits[-1].argmax()))
    return out


def reference_vlm_inputs(path: str | os.PathLike[str], text: str, images: list[Any]
                         ) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
    """A ChatML ``text`` with one image placeholder per image as a reference sees it, built from the ``tokenizers``
    library and transformers' image processor alone (no engine code): the ids with each placeholder widened by its
    image's grid, the pixel values and the grids (None, None without images)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ids = Tokenizer.from_file(os.path.join(path, "tokenizer.json")).encode(text, add_special_tokens=False).ids
    if not images:
        return ids, None, None
    processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    proc = processor(images=images, return_tensors="pt")
    grid = proc["image_grid_thw"]
    counts = [int(t * h * w) // int(processor.merge_size) ** 2 for t, h, w in grid.tolist()]
    pad = vlm_special_token_ids()["<|image_pad|>"]
    if ids.count(pad) != len(images):
        raise ValueError(f"{ids.count(pad)} image placeholders for {len(images)} images")
    out: list[int] = []
    n = 0
    for t in ids:
        if t == pad:
            out += [pad] * counts[n]
            n += 1
        else:
            out.append(t)
    return out, proc["pixel_values"], grid

