"""Random-weight checkpoints of real model shapes, for GPU checks and benchmarks (no download needed).

    python benchmarks/shapes.py --shape 2b --out /tmp/qwen35-2b-shape [--device cuda] [--mtp] [--init spread|stable]

    python benchmarks/shapes.py --shape 35b-a3b --config-only [--fp8] --out /tmp/m35   # MoE: config only, VLM form
    python benchmarks/shapes.py --shape nemotron-h-8b --config-only --out /tmp/n8b      # Mamba2 (issue 33): config only

``--mtp`` adds one random multi-token-prediction layer (``mtp.*`` in a shard of its own, listed in the index;
``mtp_num_hidden_layers`` in config.json), as Qwen3.5 checkpoints carry it. ``--config-only`` writes config.json
alone, for ``--load-format dummy`` (random weights made at load: shapes whose checkpoints do not fit on disk).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHAPE_2B: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
    num_attention_heads=8, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, partial_rotary_factor=0.25, tie_word_embeddings=True, max_position_embeddings=32768,
)
# Qwen3.5-27B's text model (Qwen3_5ForConditionalGeneration, model_type qwen3_5; Qwen3.6-27B has the same text
# config): 64 layers (16 x (3 Gated DeltaNet + 1 gated attention)), hidden 5120, MLP 17408, 24 query heads and 4 KV
# heads of 256, GDN 16 key heads and 48 value heads of 128, conv 4, untied LM head, vocab 248320, partial rotary 0.25,
# rope theta 1e7, M-RoPE sections [11, 11, 10] interleaved, one MTP layer. No verbatim copy of the release's
# config.json was found. Sources: THUDM/slime scripts/models/qwen3.5-27B.sh (64 layers, hidden 5120, FFN 17408,
# 24 heads, 4 query groups, kv channels 256, rotary 0.25 of base 1e7, untied embeddings, vocab 248320, eps 1e-6);
# the GDN sizes and the rest from two further copies of the full text_config in the code index, which agree with
# each other and with those numbers: a Qwen3_5Config built for a Qwen3.5 27B VLM (every text_config field: GDN
# 16 / 48 heads of 128, conv 4, max_position_embeddings 262144, mtp_num_hidden_layers 1, tie_word_embeddings false)
# and InternLM/xtuner's test of its Qwen3.5-class 27B export (the same fields, "matches official shape").
# max_position_embeddings is the release's 262144 (the engines' max_model_len is set per run).
SHAPE_27B: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
    num_attention_heads=24, num_key_value_heads=4, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, partial_rotary_factor=0.25, tie_word_embeddings=False, max_position_embeddings=262144,
)
# The 27B class's vision tower, as the Qwen3.6-27B release's config.json has it (docs/vlm_facts.md section 4: the
# same sizes in two independent reports; transformers' Qwen3_5VisionConfig defaults agree): 27 blocks of 1152 with
# 16 heads and an MLP of 4304, patch 16, temporal patch 2, spatial merge 2, 2304 position embeddings, no deepstack.
# ``out_hidden_size`` is the text hidden size (5120), set where the tower is written.
VISION_27B: dict[str, Any] = dict(
    depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, temporal_patch_size=2,
    spatial_merge_size=2, num_position_embeddings=2304, in_channels=3, hidden_act="gelu_pytorch_tanh",
)
SHAPES = {"2b": SHAPE_2B, "27b": SHAPE_27B}

# The mixture-of-experts shapes of issue 31, written config-only (``write_moe_config``) and served with
# ``--load-format dummy``: Qwen3.5-35B-A3B as a Qwen3.5-MoE text config (``Qwen3_5MoeTextConfig``'s fields) in the VLM
# form vLLM needs, Qwen3-Next-80B-A3B as its own text-only config.
_QWEN35_ROPE: dict[str, Any] = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True}
# Qwen/Qwen3.5-35B-A3B's text model: 40 layers (3 Gated DeltaNet : 1 gated attention), 256 experts of 512, top 8, a
# shared expert of 512, one MTP layer (config values as the release publishes them; docs/vlm_facts.md for the form).
SHAPE_35B_A3B: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=40, full_attention_interval=4,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
    max_position_embeddings=262144, rope_parameters=_QWEN35_ROPE, mtp_num_hidden_layers=1,
)
# Qwen/Qwen3-Next-80B-A3B's config (Qwen3NextForCausalLM, text only: vLLM serves it without the VLM form): 48 layers
# (3 GDN with fused in_proj_qkvz / in_proj_ba : 1 gated attention), 512 experts of 512, top 10, a shared expert of
# 512 in every layer (decoder_sparse_step 1; intermediate_size, the dense MLP's width, unused), one MTP layer.
SHAPE_NEXT_80B: dict[str, Any] = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
    vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, full_attention_interval=4,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=262144, rope_theta=10_000_000,
    partial_rotary_factor=0.25, hidden_act="silu", attention_bias=False, num_nextn_predict_layers=1,
    bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16",
)
# Qwen4-Exp (issue 32) at the size of the first report's model as its PP split says (48 layers: 13, 13, 13, 9), with
# transformers 5.24's defaults for the rest (Qwen4ExpTextConfig: hidden 2048, 16/2 heads of 256, GDN 16x128 keys
# and 32x128 values, 512 experts of 512 top 10, a shared expert of 512, 4 residual streams of rank 128 (hc_lowrank's
# default), n-grams of 3 tokens with 4 hash heads per order, a PLE width of 2048). Not published, so chosen here and
# stated: PLE on four GDN layers (1-indexed 2, 14, 26, 38), each PLE layer's n-gram tables started at 1M rows
# instead of 20M (8 tables of 1M x 256 per layer: 2.1G parameters a layer instead of 41G, the card's memory; the
# gather reads one row per table and token either way), QSA on the 12 attention layers with an indexer of 16 heads
# of 128, blocks of 4 tokens and a budget of 2,048 tokens, one MTP layer. Text only (``Qwen4ExpForCausalLM``).
_QWEN4_LAYERS = 48
SHAPE_QWEN4_EXP: dict[str, Any] = dict(
    architectures=["Qwen4ExpForCausalLM"], model_type="qwen4_exp_text",
    vocab_size=248320, hidden_size=2048, num_hidden_layers=_QWEN4_LAYERS,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(_QWEN4_LAYERS)],
    num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, norm_topk_prob=True, hc_count=4, hc_lowrank=128,
    ple_layer_ids=[2, 14, 26, 38], ple_embed_dim=2048, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=4,
    ngram_vocab_size_base=1_000_000, make_ngram_vocab_size_divisible_by=128, split_ngram_parts=4, seed=1234,
    indexer_n_heads=16, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
    rms_norm_eps=1e-6, max_position_embeddings=262144, rope_parameters=_QWEN35_ROPE, tie_word_embeddings=False,
    mtp_num_hidden_layers=1, eos_token_id=248044, bos_token_id=None, pad_token_id=None, dtype="bfloat16",
)
MOE_SHAPES = {"35b-a3b": SHAPE_35B_A3B, "next-80b": SHAPE_NEXT_80B, "qwen4-exp": SHAPE_QWEN4_EXP}
# Issue 33's Mamba2 shapes (NemotronHForCausalLM, ``model_type: nemotron_h``), written config-only in the releases'
# form (``hybrid_override_pattern`` and the releases' field names, which transformers 5's NemotronHConfig, vLLM 0.24's
# nemotron_h model and hyserve's parser all read) and served with ``--load-format dummy``; bf16 only (hyserve's
# Nemotron MoE experts take no FP8 yet, so an FP8 pair would not be like for like).
#
# nvidia/Nemotron-H-8B-Base-8K. Sources: the dimensions of Megatron-Bridge's NemotronHModelProvider8B
# (NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/models/nemotronh/nemotron_h_provider.py: the pattern, hidden 4096,
# FFN 21504, 32 heads, 8 query groups, 128 Mamba heads of 64, state 128, 8 groups, seq_length 8192), the same pattern
# and sizes as the defaults of vLLM 0.24's own NemotronHConfig ("NemotronH-v0.1": vocab 131072, head_dim 128,
# layer_norm_epsilon 1e-5, conv 4, conv bias, no projection biases, bos 1 / eos 2 / pad 0) and transformers'; a
# write-up quoting the release's config.json (52 layers, 24 M, 24 -, 4 *, hidden 4096, expand 2, 128 Mamba heads of
# 64, state 128, 8 groups, conv 4, 8 KV heads, head dim 128, bfloat16). Assumed, not found quoted: chunk_size 128
# (transformers' default and Nemotron 3's; vLLM's "all" prefix-cache mode aligns its blocks to it), the time-step
# fields (time_step_min 0.001, max 0.1, floor 1e-4: every NemotronH config's), mamba_ssm_cache_dtype left out (vLLM
# then keeps the SSM state in float32, its NemotronH default); the release may name the attention head size
# ``attention_head_dim``: written as ``head_dim`` (128 = 4096 / 32 either way).
SHAPE_NEMOTRON_H_8B: dict[str, Any] = dict(
    architectures=["NemotronHForCausalLM"], model_type="nemotron_h",
    vocab_size=131072, hidden_size=4096, intermediate_size=21504, num_hidden_layers=52,
    hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    mamba_num_heads=128, mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4, expand=2, chunk_size=128,
    mamba_hidden_act="silu", mlp_hidden_act="relu2", use_conv_bias=True, use_bias=False, mamba_proj_bias=False,
    mlp_bias=False, attention_bias=False, residual_in_fp32=False, rescale_prenorm_residual=True,
    layer_norm_epsilon=1e-5, time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4,
    max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    torch_dtype="bfloat16",
)
# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16: its config.json as a public test quotes it whole (transformers_version
# 4.55.4; every field below is that file's), agreeing with Megatron-Bridge's Nemotron3NanoProvider (hidden 2688,
# 52 layers "MEMEM*EMEMEM*...", 23 M, 23 E, 6 *, 32 heads, 2 query groups of 128, 64 Mamba heads of 64, state 128, 128
# experts of 1856 top 6, a shared expert of 3712, scaling 2.5, one group, seq_length 262144) and with a planning note
# quoting the Omni model's inner LM config (same fields). No latent projections (moe_latent_size null: Nano has
# none, Super has 1024), no MTP layers. ``mamba_ssm_cache_dtype: float32`` is the release's: vLLM 0.24 reads it
# (NemotronHForCausalLMConfig), so both engines keep the SSM state in float32.
SHAPE_NEMOTRON3_NANO: dict[str, Any] = dict(
    architectures=["NemotronHForCausalLM"], model_type="nemotron_h",
    vocab_size=131072, hidden_size=2688, intermediate_size=1856, num_hidden_layers=52,
    hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    num_attention_heads=32, num_key_value_heads=2, head_dim=128,
    mamba_num_heads=64, mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4, expand=2, chunk_size=128,
    mamba_hidden_act="silu", mlp_hidden_act="relu2", use_conv_bias=True, use_bias=False, mamba_proj_bias=False,
    mlp_bias=False, attention_bias=False, residual_in_fp32=False, rescale_prenorm_residual=True,
    layer_norm_epsilon=1e-5, norm_eps=1e-5, time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4,
    n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=6, moe_intermediate_size=1856,
    moe_shared_expert_intermediate_size=3712, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
    mamba_ssm_cache_dtype="float32", max_position_embeddings=262144, rope_theta=10000, partial_rotary_factor=1.0,
    sliding_window=None, num_logits_to_keep=1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, torch_dtype="bfloat16",
)
MAMBA2_SHAPES = {"nemotron-h-8b": SHAPE_NEMOTRON_H_8B, "nemotron3-nano-30b-a3b": SHAPE_NEMOTRON3_NANO}


def write_mamba2_config(path: str, name: str, **overrides: Any) -> dict[str, Any]:
    """config.json of Mamba2 shape ``name`` as the release has it (``overrides`` replace fields: a shrunken copy for
    the CPU); no weights (``--load-format dummy``). Returns the config written."""
    raw = {**MAMBA2_SHAPES[name], **overrides}
    pattern = raw["hybrid_override_pattern"]
    if len(pattern) != raw["num_hidden_layers"]:
        raise ValueError(f"{name}: hybrid_override_pattern has {len(pattern)} blocks, num_hidden_layers "
                         f"{raw['num_hidden_layers']}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)
    # No tokenizer files: both engines take token-id prompts. vLLM's front end still builds a tokenizer, and
    # transformers' class for nemotron_h needs a vocabulary file (sentencepiece); Qwen2Tokenizer builds an empty one,
    # the tokenizer vLLM gets for the Qwen shapes' config-only directories. hyserve reads tokenizer.json alone.
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "Qwen2Tokenizer"}, f, indent=2)
    return raw


# The one-block vision tower the VLM form carries for text-only runs (peer_bench.py's ``toy``).
TOY_VISION: dict[str, Any] = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2)
# Block FP8 as Qwen's -FP8 releases write it (docs/fp8_facts.md sections 6-7): 128 x 128 weight blocks, dynamic
# activations, and the modules kept in bf16 named one by one in the checkpoint's (VLM) names.
FP8_BLOCK = [128, 128]


def fp8_modules_to_not_convert(text: dict[str, Any], vision_depth: int, mtp: bool = True,
                               prefix: str = "model.language_model") -> list[str]:
    """What Qwen's FP8 releases leave in bf16: ``lm_head``, the embedding, every norm, each MoE block's router
    (``mlp.gate``) and ``shared_expert_gate``, the GDN's ``in_proj_a`` / ``in_proj_b`` (``in_proj_ba``), ``conv1d``,
    ``A_log`` and ``dt_bias``, and the vision tower; the MTP layer's router and gates too. Which of these the
    releases list is not confirmed (docs/fp8_facts.md, open questions): the linear layers among them are what the
    FP8 engines keep in bf16, the rest name no linear layer and change nothing."""
    lm = prefix  # the text model's name in the checkpoint: "model" for a text-only one (Qwen3-Next)
    out = ["lm_head", f"{lm}.embed_tokens", f"{lm}.norm"]
    n = int(text["num_hidden_layers"])
    interval = int(text.get("full_attention_interval", 4))
    for i in range(n):
        layer = f"{lm}.layers.{i}"
        out += [f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm", f"{layer}.mlp.gate",
                f"{layer}.mlp.shared_expert_gate"]
        if (i + 1) % interval == 0:
            out += [f"{layer}.self_attn.q_norm", f"{layer}.self_attn.k_norm"]
        else:
            # in_proj_ba too: vLLM registers Qwen3.5's in_proj_b under that name (docs/fp8_facts.md section 7)
            out += [f"{layer}.linear_attn.{m}" for m in ("in_proj_a", "in_proj_b", "in_proj_ba", "conv1d", "A_log",
                                                          "dt_bias", "norm")]  # Qwen3-Next: in_proj_ba alone
    if mtp:
        out += ["mtp.norm", "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden",
                "mtp.layers.0.input_layernorm", "mtp.layers.0.post_attention_layernorm", "mtp.layers.0.mlp.gate",
                "mtp.layers.0.mlp.shared_expert_gate", "mtp.layers.0.self_attn.q_norm",
                "mtp.layers.0.self_attn.k_norm"]
    if not vision_depth:
        return out
    out += ["model.visual.patch_embed.proj", "model.visual.pos_embed", "model.visual.merger.norm",
            "model.visual.merger.linear_fc1", "model.visual.merger.linear_fc2"]
    for b in range(vision_depth):
        out += [f"model.visual.blocks.{b}.{m}" for m in ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.linear_fc1",
                                                         "mlp.linear_fc2")]
    return out


def _fp8_config(modules: list[str]) -> dict[str, Any]:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": FP8_BLOCK,
            "modules_to_not_convert": modules}


def _write_next_config(path: str, shape: dict[str, Any], fp8: bool) -> dict[str, Any]:
    """Qwen3-Next's config.json as the release has it (text only), with Qwen's block FP8 when ``fp8``."""
    raw = dict(shape)
    if fp8:
        raw["quantization_config"] = _fp8_config(fp8_modules_to_not_convert(
            shape, 0, mtp=int(shape["num_nextn_predict_layers"]) > 0, prefix="model"))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)
    return raw


def _write_qwen4_exp_config(path: str, shape: dict[str, Any], fp8: bool) -> dict[str, Any]:
    """Qwen4-Exp's text-only config.json, with Qwen's block FP8 when ``fp8``: kept in bf16 what Qwen3.5's FP8
    releases keep, and the hyper-connection linears (as ``hyserve.testing.fp8_qwen4_exp`` writes its checkpoints)."""
    raw = dict(shape)
    if fp8:
        n = int(shape["num_hidden_layers"])
        kept = fp8_modules_to_not_convert({**shape, "full_attention_interval": 4}, 0,
                                          mtp=int(shape["mtp_num_hidden_layers"]) > 0, prefix="model")
        hc = ("input_mix_weight_down", "input_mix_weight_up", "block_inject_weight")
        blocks = [f"model.layers.{i}.{b}" for i in range(n) for b in ("attn_hyper_connection", "mlp_hyper_connection")]
        blocks += ["model.hyper_connection_mixer", "mtp.layers.0.attn_hyper_connection",
                   "mtp.layers.0.mlp_hyper_connection", "mtp.hyper_connection_mixer"]
        kept += [f"{b}.{m}" for b in blocks for m in hc]
        raw["quantization_config"] = _fp8_config(kept)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)
    return raw


def write_moe_config(path: str, name: str, fp8: bool = False) -> dict[str, Any]:
    """config.json of MoE shape ``name``: Qwen3.5-MoE's in the VLM form (``Qwen3_5MoeForConditionalGeneration``:
    ``text_config``, a one-block ``vision_config``, the vision token ids) with the processor files vLLM's front end
    reads (preprocessor_config.json, video_preprocessor_config.json), Qwen3-Next's as its release (text only);
    ``fp8``: Qwen's block FP8 ``quantization_config``. No weights: both engines make them at load
    (``--load-format dummy``). Returns the config written."""
    shape = dict(MOE_SHAPES[name])
    if shape.get("model_type") == "qwen3_next":
        return _write_next_config(path, shape, fp8)
    if shape.get("model_type") == "qwen4_exp_text":
        return _write_qwen4_exp_config(path, shape, fp8)
    from transformers import Qwen2VLImageProcessor, Qwen3_5MoeConfig, Qwen3_5MoeTextConfig

    mtp = int(shape.pop("mtp_num_hidden_layers"))
    text = Qwen3_5MoeTextConfig(**shape, layer_types=None, dtype="bfloat16").to_dict()
    text["mtp_num_hidden_layers"] = mtp  # read by both engines (transformers' class has no such field)
    vision = dict(TOY_VISION, out_hidden_size=shape["hidden_size"])
    # The vision token ids: Qwen3.5's (248053...), or the top of a smaller vocabulary in the same order
    # (peer_bench.py's special_token_ids): random prompt ids are drawn below them.
    vocab = int(shape["vocab_size"])
    first = 248044 if vocab >= 248058 else vocab - 14
    ids: dict[str, Any] = {"vision_start_token_id": first + 9, "vision_end_token_id": first + 10,
                           "image_token_id": first + 12, "video_token_id": first + 13}
    cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=shape["tie_word_embeddings"],
                           **ids)
    cfg.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    raw = cfg.to_dict()
    raw["dtype"] = "bfloat16"
    raw["text_config"]["mtp_num_hidden_layers"] = mtp
    if fp8:
        raw["quantization_config"] = _fp8_config(fp8_modules_to_not_convert(shape, int(vision["depth"]), mtp=mtp > 0))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)
    Qwen2VLImageProcessor().save_pretrained(path)  # vLLM's VLM front end reads the processor files
    with open(os.path.join(path, "preprocessor_config.json"), encoding="utf-8") as f:
        processor = json.load(f)
    with open(os.path.join(path, "video_preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump(processor, f, indent=2)
    return raw


def write_random_checkpoint(path: str, shape: dict[str, Any], device: str = "cuda", seed: int = 0,
                            mtp: bool = False) -> int:
    """Write transformers' Qwen3_5ForCausalLM with random bf16 weights; returns the parameter count.

    transformers' init leaves the zero-centred norms at identity; they are spread a little so that a kernel that
    ignores a norm weight shows.
    """
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**shape, layer_types=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16)
    zero_centred = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(zero_centred):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    if mtp:
        n += add_random_mtp(path, cfg, seed)
    return n


def write_spread_checkpoint(path: str, shape: dict[str, Any], seed: int = 0, mtp: bool = False,
                            embed_std: float | None = None) -> int:
    """The shape with the test checkpoints' initialisation (hyserve.testing: activations O(1), logits spread wide),
    bf16, sharded. ``embed_std`` rescales the (tied) embedding to that standard deviation.

    Deep random models are chaotic: with this init at 24 layers, greedy outputs in bf16 and float32 part within a
    few tokens (on the CPU, 1-6 tokens; median top-2 margin 0.7 nats), so bf16 rounding differences between two
    paths that are equal in exact arithmetic (one-token decode, a multi-token verify pass) change greedy outputs.
    With ``embed_std=1.0`` the residual stream is dominated by the current token's embedding and, the embedding
    being tied, every token predicts itself with a margin of tens of nats: greedy output is stable under rounding
    (it repeats the last prompt token), which benchmarks that replay a greedy continuation in bf16 need. The
    arithmetic of a step does not depend on the weights' values, so the timing is that of any such model."""
    from hyserve.testing import write_tiny_checkpoint

    cfg = dict(shape)
    n_layers = cfg.pop("num_hidden_layers")
    rope = {"rope_type": "default", "rope_theta": 10_000_000.0,
            "partial_rotary_factor": cfg.pop("partial_rotary_factor")}
    tie = cfg.pop("tie_word_embeddings")
    types = (["linear_attention"] * 3 + ["full_attention"]) * (n_layers // 4)
    write_tiny_checkpoint(path, layer_types=types, tie_word_embeddings=tie, sharded=True, with_mtp=mtp, seed=seed,
                          dtype=torch.bfloat16, rope_parameters=rope, **cfg)
    with open(os.path.join(path, "model.safetensors.index.json"), encoding="utf-8") as f:
        index = json.load(f)
    if embed_std is not None:
        from safetensors.torch import load_file, save_file

        name = "model.embed_tokens.weight"
        shard = os.path.join(path, index["weight_map"][name])
        tensors = load_file(shard)
        emb = tensors[name].float()
        tensors[name] = (emb * (embed_std / emb.std())).to(torch.bfloat16).contiguous()
        save_file(tensors, shard, metadata={"format": "pt"})
    return int(index["metadata"]["total_size"]) // 2


def add_random_mtp(path: str, cfg: Any, seed: int) -> int:
    """Add ``mtp.*`` tensors (one layer, random bf16) as ``mtp.safetensors`` and list every tensor in the index."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from hyserve.testing import init_tensor, mtp_shapes

    gen = torch.Generator().manual_seed(seed + 1)
    tensors = {name: init_tensor(name, shape, gen).to(torch.bfloat16).contiguous()
               for name, shape in mtp_shapes(cfg).items()}
    save_file(tensors, os.path.join(path, "mtp.safetensors"), metadata={"format": "pt"})
    index_path = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):  # a lone model.safetensors is read without the index: make it a shard
        os.replace(single, os.path.join(path, "model-main.safetensors"))
        with safe_open(os.path.join(path, "model-main.safetensors"), framework="pt") as f:
            index = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), "model-main.safetensors")}
    else:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    index["weight_map"].update(dict.fromkeys(tensors, "mtp.safetensors"))
    with open(index_path, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    config_path = os.path.join(path, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["mtp_num_hidden_layers"] = 1
    if isinstance(config.get("text_config"), dict):  # the VLM form: engines read the text model's field
        config["text_config"]["mtp_num_hidden_layers"] = 1
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return sum(t.numel() for t in tensors.values())


def write_config_only(path: str, shape: dict[str, Any], mtp: bool = False) -> None:
    """config.json of ``shape`` (Qwen3_5ForCausalLM, bf16), with one MTP layer declared when ``mtp``."""
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**shape, layer_types=None, dtype="bfloat16")
    if mtp:
        cfg.mtp_num_hidden_layers = 1
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    cfg.save_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted([*SHAPES, *MOE_SHAPES, *MAMBA2_SHAPES]), default="2b",
                    help="MoE shapes (35b-a3b in the VLM form, next-80b: Qwen3-Next) and the Mamba2 shapes "
                         "(nemotron-h-8b, nemotron3-nano-30b-a3b) are written --config-only")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mtp", action="store_true", help="add one random MTP layer (mtp.* tensors)")
    ap.add_argument("--init", choices=("transformers", "spread", "stable"), default="transformers",
                    help="transformers: its own init (near-flat logits); spread: the test checkpoints' init (wide "
                         "logits); stable: spread with a dominant embedding (greedy output stable under bf16 "
                         "rounding, for benchmarks that replay a greedy continuation)")
    ap.add_argument("--config-only", action="store_true",
                    help="config.json alone, for hyserve's --load-format dummy (no weights written)")
    ap.add_argument("--fp8", action="store_true",
                    help="MoE shapes: Qwen's block FP8 quantization_config (weights made FP8 at a dummy load)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.shape in MAMBA2_SHAPES:
        if not args.config_only or args.fp8:
            ap.error(f"--shape {args.shape} is written --config-only, in bf16 (serve it with --load-format dummy)")
        raw = write_mamba2_config(args.out, args.shape)
        print(f"wrote the {args.shape} shape's config.json ({raw['architectures'][0]}, "
              f"{raw['hybrid_override_pattern']}) to {args.out} (load it with --load-format dummy)")
        return
    if args.shape in MOE_SHAPES:
        if not args.config_only:
            ap.error(f"--shape {args.shape} is written --config-only (serve it with --load-format dummy)")
        raw = write_moe_config(args.out, args.shape, fp8=args.fp8)
        what = f"{raw['architectures'][0]}{', block FP8' if args.fp8 else ''}"
        files = " and processor files" if "vision_config" in raw else ""
        print(f"wrote the {args.shape} shape's config.json ({what}){files} to {args.out} (load it with "
              "--load-format dummy)")
        return
    if args.fp8:
        ap.error("--fp8 is for the MoE shapes; quantize a dense checkpoint with peer_bench.py quantize")
    if args.config_only:
        write_config_only(args.out, SHAPES[args.shape], mtp=args.mtp)
        print(f"wrote the {args.shape} shape's config.json to {args.out} (load it with --load-format dummy)")
        return
    if args.init in ("spread", "stable"):
        n = write_spread_checkpoint(args.out, SHAPES[args.shape], mtp=args.mtp,
                                    embed_std=1.0 if args.init == "stable" else None)
    else:
        n = write_random_checkpoint(args.out, SHAPES[args.shape], args.device, mtp=args.mtp)
    what = f"{args.shape} shape" + (" with an MTP layer" if args.mtp else "")
    print(f"wrote {what} ({n / 1e9:.2f} B parameters) to {args.out}")


if __name__ == "__main__":
    main()
