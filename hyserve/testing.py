"""Tiny Qwen3.5 checkpoints for tests and the demo, written the way real checkpoints are laid out on disk.

``write_tiny_checkpoint`` writes config.json, safetensors weights (single file or sharded + index), tokenizer files
and generation_config.json into a directory, in either of the two published forms:

* ``causal``: ``model_type: qwen3_5_text``, ``Qwen3_5ForCausalLM``, tensors named ``model.*`` + ``lm_head.weight``;
* ``conditional``: ``model_type: qwen3_5`` with ``text_config``/``vision_config``, ``Qwen3_5ForConditionalGeneration``,
  tensors named ``model.language_model.*`` + ``lm_head.weight`` + a few fake ``model.visual.*`` tensors.

Weights are drawn from a seeded local generator (never the global RNG) with scales chosen so activations stay O(1)
and the logits differ by several units between tokens: transformers' own init (std 0.02, zero norms) gives nearly
flat logits, under which a broken kernel could still pick the same greedy token. Norm weights, ``A_log`` and
``dt_bias`` are random too, so mistakes such as using ``w`` instead of ``1 + w`` in the zero-centred RMSNorm show.

``load_reference_model`` loads the written directory with transformers (both forms load through
``Qwen3_5ForCausalLM.from_pretrained``: transformers 5.17 reads ``text_config`` and strips ``language_model``) and
``reference_logits`` runs one uncached float32 forward pass over a token list.

``write_tiny_vlm_checkpoint`` writes a ``Qwen3_5ForConditionalGeneration`` whose image path works end to end: the
tokenizer has the vision tokens (after the text tokenizer's ids, which it keeps), the tower is a complete tiny one,
and preprocessor_config.json and an image-aware chat template come with it. ``reference_vlm_model`` /
``reference_vlm_logits`` / ``reference_vlm_greedy`` run transformers' own model over it, image included;
``tiny_png`` / ``png_data_url`` make test images.
"""

from __future__ import annotations

import base64
import functools
import inspect
import io
import json
import math
import os
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
    Qwen3_5VisionConfig,
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

DEFAULT_LAYER_TYPES = ("linear_attention", "linear_attention", "linear_attention", "full_attention")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The pre-tokenizer regex of Qwen3.5's tokenizer.json (and transformers' Qwen3_5Tokenizer).
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A language model predicts the next token from the tokens before it.
Hybrid models mix linear attention layers, which keep a fixed-size recurrent state, with full attention layers,
which keep a key-value cache that grows with the sequence. The engine schedules requests, batches their tokens,
and streams the generated text back to the user one token at a time. Once upon a time there was a little robot
who wanted to learn how to write poems about the sea, the stars and the mountains.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? The capital is Paris.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, fibonacci(i))

class Request:
    def __init__(self, prompt: str, max_tokens: int = 16) -> None:
        self.prompt = prompt
        self.max_tokens = max_tokens
你好，世界！今天天气很好。我们一起学习语言模型。
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828
"""

_TOKENIZER_BASE_VOCAB = 448  # byte alphabet (256) + merges; the three special tokens come after it


def train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with Qwen3.5's pipeline trained on ``texts``: ``vocab_size`` ids, the special tokens last.

    The pipeline (NFC, Qwen's split regex, byte-level without its own regex, byte-level decoder) is the one Qwen3.5's
    tokenizer.json uses, so transformers' ``Qwen3_5Tokenizer`` (which rebuilds that pipeline from vocab/merges and
    ignores the file's pre-tokenizer) and the raw ``tokenizers`` file agree. The special tokens are appended after
    the trained vocabulary, at the top of the id range, as in the real checkpoints.
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """Train (once per process) the tiny tokenizer of the test checkpoints; returns its tokenizer.json text."""
    texts = _TRAINING_TEXT.splitlines(keepends=True) * 4
    return train_bpe(texts, _TOKENIZER_BASE_VOCAB + len(SPECIAL_TOKENS)).to_str()


def tokenizer_size() -> int:
    """Number of token ids the tiny tokenizer uses (trained vocabulary + special tokens)."""
    return Tokenizer.from_str(tokenizer_json()).get_vocab_size(with_added_tokens=True)


def special_token_ids() -> dict[str, int]:
    tok = Tokenizer.from_str(tokenizer_json())
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    return {t: i for t, i in ids.items() if i is not None}


def tiny_text_config(
    *, layer_types: list[str] | None = None, tie_word_embeddings: bool = False, **overrides: Any
) -> Qwen3_5TextConfig:
    """The tiny text config; ``overrides`` replace any field (e.g. ``hidden_size``, ``rope_parameters``)."""
    types = list(layer_types) if layer_types is not None else list(DEFAULT_LAYER_TYPES)
    ids = special_token_ids()
    kwargs: dict[str, Any] = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": len(types),
        "layer_types": types,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "tie_word_embeddings": tie_word_embeddings,
        "eos_token_id": ids[ENDOFTEXT],
        "bos_token_id": None,
        "pad_token_id": None,
    }
    kwargs.update(overrides)
    # Keep the legacy top-level ``partial_rotary_factor`` equal to the one in ``rope_parameters``: transformers
    # otherwise serializes its 0.25 default next to the real value.
    rope = dict(kwargs["rope_parameters"] or {})
    prf = overrides.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5))
    kwargs["rope_parameters"] = {**rope, "partial_rotary_factor": prf}
    kwargs["partial_rotary_factor"] = prf
    if kwargs["vocab_size"] < tokenizer_size():
        raise ValueError(f"vocab_size {kwargs['vocab_size']} is smaller than the tokenizer ({tokenizer_size()})")
    return Qwen3_5TextConfig(**kwargs)


def init_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A random tensor for parameter ``name``; scales keep activations O(1) and logits well spread."""
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(0.5, 8.0, generator=gen).log_()
    if name.endswith("dt_bias"):
        return torch.randn(shape, generator=gen) * 0.5
    if name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: plain ``w * x``
        return torch.empty(shape).uniform_(0.5, 1.5, generator=gen)
    if name == "model.norm.weight":  # final norm: gain (1 + w) in [2, 3] spreads the (tied) logits
        return torch.empty(shape).uniform_(1.0, 2.0, generator=gen)
    if len(shape) == 1:  # zero-centred RMSNorms: ``(1 + w) * x``
        return torch.empty(shape).uniform_(-0.5, 0.5, generator=gen)
    if name.endswith("conv1d.weight"):
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    if name.endswith("embed_tokens.weight"):
        # Small next to the layers' outputs: with tied embeddings a large one makes every token predict itself.
        return torch.randn(shape, generator=gen) * 0.1
    if name == "lm_head.weight":
        return torch.randn(shape, generator=gen) * (2.0 / math.sqrt(shape[1]))
    scale = 0.5 if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")) else 1.0
    return torch.randn(shape, generator=gen) * (scale / math.sqrt(shape[1]))


def _text_shapes(config: Qwen3_5TextConfig) -> dict[str, tuple[int, ...]]:
    """Parameter names/shapes of ``Qwen3_5ForCausalLM`` (built on the meta device: no memory, no RNG use)."""
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if not config.tie_word_embeddings:
        shapes.setdefault("lm_head.weight", (config.vocab_size, config.hidden_size))
    return shapes


def mtp_shapes(config: Qwen3_5TextConfig) -> dict[str, tuple[int, ...]]:
    """Qwen3.5's multi-token-prediction head: fc over [embedding; hidden] and one full-attention decoder layer."""
    h, hd = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    f = config.intermediate_size
    layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (2 * q, h),  # query and output gate
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }
    shapes: dict[str, tuple[int, ...]] = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
    }
    shapes.update({f"mtp.layers.0.{k}": v for k, v in layer.items()})
    return shapes


# The conditional form's vision tower (out_hidden_size: the text model's hidden size).
_TINY_VISION = {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 8, "intermediate_size": 16, "num_heads": 2,
                "in_channels": 3, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
                "num_position_embeddings": 64}


def _visual_shapes(out_hidden_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the conditional form's vision tower: the checkpoint holds a complete one."""
    from hyserve.model.vision import VisionModel

    with torch.device("meta"):
        tower = VisionModel.from_config_dict({**_TINY_VISION, "out_hidden_size": out_hidden_size})
    return {f"model.visual.{n}": tuple(t.shape) for n, t in tower.state_dict().items()}


def _make_tensors(
    config: Qwen3_5TextConfig, *, form: str, with_mtp: bool, seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = _text_shapes(config)
    if with_mtp:
        shapes.update(mtp_shapes(config))
    if form == "conditional":
        shapes = {_conditional_name(n): s for n, s in shapes.items()}
        shapes.update(_visual_shapes(config.hidden_size))
    return {name: init_tensor(name, shape, gen).to(dtype).contiguous() for name, shape in shapes.items()}


def _conditional_name(name: str) -> str:
    return "model.language_model." + name[len("model."):] if name.startswith("model.") else name


def _config_json(config: Qwen3_5TextConfig, *, form: str, dtype: torch.dtype, with_mtp: bool) -> dict[str, Any]:
    """config.json as ``save_pretrained`` writes it (diff form), plus the fields real Qwen3.5 checkpoints carry."""
    text = config.to_diff_dict()
    text.pop("transformers_version", None)
    text["model_type"] = "qwen3_5_text"
    text["dtype"] = str(dtype).removeprefix("torch.")
    text["layer_types"] = list(config.layer_types or [])
    text["tie_word_embeddings"] = bool(config.tie_word_embeddings)
    if with_mtp:
        text["mtp_num_hidden_layers"] = 1
    if form == "causal":
        return {"architectures": ["Qwen3_5ForCausalLM"], **text}
    vision = {**_TINY_VISION, "out_hidden_size": config.hidden_size}
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": vision,
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "dtype": text["dtype"],
    }


def _save_weights(path: str, tensors: dict[str, torch.Tensor], *, sharded: bool) -> None:
    if not sharded:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    n_shards = 3
    weight_map: dict[str, str] = {}
    for i in range(n_shards):
        shard = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::n_shards]}
        save_file(part, os.path.join(path, shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(os.path.join(path, "model.safetensors.index.json"), index)


def _write_tokenizer(path: str) -> None:
    with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json())
    _write_json(os.path.join(path, "tokenizer_config.json"), tokenizer_config(special_token_ids(), 4096))


def tokenizer_config(ids: dict[str, int], model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json of a ChatML byte-level BPE tokenizer with ``SPECIAL_TOKENS`` at ``ids``."""
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "errors": "replace",
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_tiny_checkpoint(
    path: str | os.PathLike[str],
    *,
    form: str = "causal",
    layer_types: list[str] | None = None,
    tie_word_embeddings: bool = False,
    sharded: bool = False,
    with_mtp: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> str:
    """Write a tiny random Qwen3.5 checkpoint to ``path`` (created if needed) and return the path as ``str``.

    With ``tie_word_embeddings`` the checkpoint has no ``lm_head.weight`` (as transformers saves tied models).
    ``config_overrides`` go to ``Qwen3_5TextConfig`` (e.g. ``vocab_size=640``, ``hidden_size=32``).
    """
    if form not in ("causal", "conditional"):
        raise ValueError(f"form must be 'causal' or 'conditional' (got {form!r})")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    config = tiny_text_config(layer_types=layer_types, tie_word_embeddings=tie_word_embeddings, **config_overrides)
    tensors = _make_tensors(config, form=form, with_mtp=with_mtp, seed=seed, dtype=dtype)
    _save_weights(path, tensors, sharded=sharded)
    _write_json(os.path.join(path, "config.json"), _config_json(config, form=form, dtype=dtype, with_mtp=with_mtp))
    ids = special_token_ids()
    generation = {"eos_token_id": [ids[IM_END], ids[ENDOFTEXT]], "pad_token_id": ids[ENDOFTEXT],
                  "do_sample": False, "transformers_version": "5.17.0"}
    _write_json(os.path.join(path, "generation_config.json"), generation)
    _write_tokenizer(path)
    return path


def read_checkpoint_tensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a written checkpoint, by its on-disk name (for tests comparing loaded weights)."""
    path = os.fspath(path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not a dict)
    return out


def load_reference_model(path: str | os.PathLike[str]) -> Qwen3_5ForCausalLM:
    """transformers' own ``Qwen3_5ForCausalLM`` loaded from the directory, float32, eval mode.

    transformers 5.17 loads both forms this way: for ``model_type: qwen3_5`` it takes ``text_config`` and its
    conversion mapping strips ``language_model.`` from the tensor names; ``mtp.*`` and ``model.visual.*`` are in
    the class's ignore-on-load lists.
    """
    use_torch_gated_delta_rule()
    model = Qwen3_5ForCausalLM.from_pretrained(os.fspath(path), dtype=torch.float32, local_files_only=True)
    return model.eval()


def use_torch_gated_delta_rule() -> None:
    """Make the reference take transformers' own PyTorch gated delta rule even where fla is installed.

    transformers binds its module-level ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` to
    fla's kernels at import when fla is importable; those need CUDA tensors (and round differently), while the
    reference runs in float32 on the CPU. The torch originals are what the wrappers wrap.
    """
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        setattr(m, name, inspect.unwrap(getattr(m, name)))


@torch.no_grad()
def reference_logits(ref_model: Qwen3_5ForCausalLM, token_ids: list[int], device: str | torch.device = "cpu"
                     ) -> torch.Tensor:
    """Teacher-forced logits of one uncached forward pass, float32 on the CPU, shape ``(len(token_ids), vocab)``."""
    input_ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    out = ref_model(input_ids=input_ids, use_cache=False)
    return out.logits[0].float().cpu()


def reference_greedy_check(
    ref_model: Qwen3_5ForCausalLM, prompt_ids: list[int], output_ids: list[int], *, tol: float = 1e-3
) -> torch.Tensor:
    """Check that ``output_ids`` is a greedy continuation of ``prompt_ids``; returns the teacher-forced logits.

    One uncached forward over prompt + output (teacher forcing). Each output token must be the reference argmax or
    within ``tol`` logit units of the maximum (near-ties may flip under another summation order or dtype: pass a
    larger ``tol`` for bfloat16). Returns the float32 logits that predicted each output token, shape
    ``(len(output_ids), vocab_size)``; raises AssertionError naming the first divergence.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if not output_ids:
        return torch.empty(0, ref_model.config.vocab_size)
    logits = reference_logits(ref_model, list(prompt_ids) + list(output_ids)[:-1])
    step_logits = logits[len(prompt_ids) - 1:]
    greedy = step_logits.argmax(dim=-1).tolist()
    for i, (tok, ref) in enumerate(zip(output_ids, greedy, strict=True)):
        gap = float(step_logits[i, ref] - step_logits[i, tok])
        if tok != ref and gap > tol:
            raise AssertionError(
                f"output token {i} is {tok} but the reference greedy token is {ref} (logit gap {gap:.4g} > {tol})"
            )
    return step_logits


# ---------------------------------------------------------------------------------------------------------------------
# A tiny Qwen3_5ForConditionalGeneration whose image path works end to end (vision tokens in the vocabulary, a real
# vision tower, a preprocessor config and an image-aware chat template).

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
    text = _make_tensors(text_config, form="causal", with_mtp=with_mtp, seed=seed, dtype=torch.float32)
    tensors = {_conditional_name(n): t for n, t in text.items()}
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

    raw = _config_json(text_config, form="conditional", dtype=dtype, with_mtp=with_mtp)
    vision = vision_config.to_diff_dict()
    vision.pop("transformers_version", None)
    raw["vision_config"] = {"model_type": "qwen3_5_vision", **vision}
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        raw[key] = int(getattr(config, key))
    _write_json(os.path.join(path, "config.json"), raw)

    ids = vlm_special_token_ids()
    generation = {"eos_token_id": [ids[IM_END], ids[ENDOFTEXT]], "pad_token_id": ids[ENDOFTEXT],
                  "do_sample": False, "transformers_version": "5.17.0"}
    _write_json(os.path.join(path, "generation_config.json"), generation)
    with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(vlm_tokenizer_json())
    tok_config = tokenizer_config(ids, 4096)
    for token in VISION_TOKENS:
        tok_config["added_tokens_decoder"][str(ids[token])] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True,
        }
    tok_config["chat_template"] = VLM_CHAT_TEMPLATE
    _write_json(os.path.join(path, "tokenizer_config.json"), tok_config)
    _write_json(os.path.join(path, "preprocessor_config.json"), tiny_preprocessor_config())
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


def tiny_png(width: int, height: int, seed: int) -> bytes:
    """A ``width`` x ``height`` PNG of uniform random RGB pixels drawn from ``seed``."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def png_data_url(data: bytes) -> str:
    """``data:image/png;base64,...`` for PNG bytes."""
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


class PicklingExecutor:
    """Test executor: every ``SchedulerOutput`` and ``RunnerOutput`` crosses the seam as bytes (``pickle``), as it
    would to a worker in another process; it refuses a message that carries a tensor or a live request.

    Built like ``UniProcExecutor`` (tests substitute it for the engine's executor class).
    """

    FORBIDDEN = (b"torch", b"hyserve.request")

    def __init__(self, worker: Any) -> None:
        from hyserve.executor.uniproc import UniProcExecutor

        self._inner = UniProcExecutor(worker)
        self.num_messages = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_inner"], name)

    def _cross(self, obj: Any) -> Any:
        import pickle

        data = pickle.dumps(obj)
        bad = [f.decode() for f in self.FORBIDDEN if f in data]
        if bad:
            raise AssertionError(f"{type(obj).__name__} is not plain data: it pickles {bad}")
        self.num_messages += 1
        return pickle.loads(data)

    def execute_model(self, scheduler_output: Any) -> Any:
        return self._cross(self._inner.execute_model(self._cross(scheduler_output)))

    def execute_model_async(self, scheduler_output: Any) -> Any:
        handle = self._inner.execute_model_async(self._cross(scheduler_output))
        executor = self

        class Handle:
            def result(self) -> Any:
                return executor._cross(handle.result())

        return Handle()
