"""The Qwen3.5 family's tiny checkpoints for tests and the demo, written the way real checkpoints are laid out on disk.

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
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Any

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from hyserve.testing.files import save_weights, write_json
from hyserve.testing.tokenizer import ENDOFTEXT, IM_END, special_token_ids, tokenizer_size, write_tokenizer

DEFAULT_LAYER_TYPES = ("linear_attention", "linear_attention", "linear_attention", "full_attention")


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


def text_shapes(config: Qwen3_5TextConfig) -> dict[str, tuple[int, ...]]:
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


def visual_shapes(out_hidden_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the conditional form's vision tower: the checkpoint holds a complete one."""
    from hyserve.model.vision import VisionModel

    with torch.device("meta"):
        tower = VisionModel.from_config_dict({**_TINY_VISION, "out_hidden_size": out_hidden_size})
    return {f"model.visual.{n}": tuple(t.shape) for n, t in tower.state_dict().items()}


def make_tensors(
    config: Qwen3_5TextConfig, *, form: str, with_mtp: bool, seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = text_shapes(config)
    if with_mtp:
        shapes.update(mtp_shapes(config))
    if form == "conditional":
        shapes = {conditional_name(n): s for n, s in shapes.items()}
        shapes.update(visual_shapes(config.hidden_size))
    return {name: init_tensor(name, shape, gen).to(dtype).contiguous() for name, shape in shapes.items()}


def conditional_name(name: str) -> str:
    return "model.language_model." + name[len("model."):] if name.startswith("model.") else name


def config_json(config: Qwen3_5TextConfig, *, form: str, dtype: torch.dtype, with_mtp: bool) -> dict[str, Any]:
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
    tensors = make_tensors(config, form=form, with_mtp=with_mtp, seed=seed, dtype=dtype)
    save_weights(path, tensors, sharded=sharded)
    write_json(os.path.join(path, "config.json"), config_json(config, form=form, dtype=dtype, with_mtp=with_mtp))
    write_generation_config_and_tokenizer(path)
    return path


def write_generation_config_and_tokenizer(path: str) -> None:
    """generation_config.json (greedy, the chat template's two end tokens) and the tiny tokenizer's files."""
    ids = special_token_ids()
    generation = {"eos_token_id": [ids[IM_END], ids[ENDOFTEXT]], "pad_token_id": ids[ENDOFTEXT],
                  "do_sample": False, "transformers_version": "5.17.0"}
    write_json(os.path.join(path, "generation_config.json"), generation)
    write_tokenizer(path)


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


