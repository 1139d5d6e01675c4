"""Qwen4-Exp's config.json in both forms: the released layer-type names, RoPE defaults, PLE and indexer checks."""

from __future__ import annotations

from typing import Any

import pytest

from hyserve.config import FULL_ATTENTION, LINEAR_ATTENTION
from hyserve.model import registry
from hyserve.model.qwen4_exp_config import Qwen4ExpConfig, parse_qwen4_exp_config


def _text(**over: Any) -> dict[str, Any]:
    text = {"model_type": "qwen4_exp_text", "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "layer_types": ["linear_attention", "linear_attention", "full_attention", "indexed_attention"],
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24, "hc_count": 4, "hc_lowrank": 8, "ple_layer_ids": [2, 1],
            "ple_embed_dim": 16, "ngram_size": 3, "heads_per_ngram": 2, "eos_token_id": [7, 9],
            "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
            "indexer_compress_ratio": 4}
    text.update(over)
    return text


def test_text_form_reads_the_released_names_and_transformers_defaults() -> None:
    cfg = parse_qwen4_exp_config(_text())
    assert isinstance(cfg, Qwen4ExpConfig) and cfg.architecture == "Qwen4ExpForCausalLM"
    assert cfg.layer_types == [LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION, FULL_ATTENTION]
    assert cfg.ple_layer_ids == (1, 2) and cfg.ple_index(0) == 0 and cfg.ple_index(1) == 1 and cfg.ple_index(2) is None
    assert cfg.ple_eos_token_id == 7
    assert cfg.rope_theta == 10000.0 and cfg.rotary_dim == 16  # the whole head, theta 1e4 (not Qwen3.5's)
    assert cfg.qsa and (cfg.indexer_budget, cfg.indexer_compress_ratio) == (8, 4)
    assert cfg.hc_width == 128 and cfg.num_experts == 4


def test_vlm_form_and_registry() -> None:
    raw = {"model_type": "qwen4_exp", "architectures": ["Qwen4ExpForConditionalGeneration"],
           "text_config": _text(model_type="qwen4_exp_text", rope_parameters={"rope_type": "default",
                                                                              "partial_rotary_factor": 0.5}),
           "vision_config": {"depth": 1}}
    cfg = registry.parse_model_config(raw)
    assert isinstance(cfg, Qwen4ExpConfig) and cfg.architecture == "Qwen4ExpForConditionalGeneration"
    assert cfg.multimodal is not None and cfg.rotary_dim == 8


def test_without_indexer_attention_is_dense() -> None:
    text = {k: v for k, v in _text().items() if not k.startswith("indexer_")}
    assert not parse_qwen4_exp_config(text).qsa


@pytest.mark.parametrize(("over", "match"), [
    ({"ple_layer_ids": [3]}, "1-indexed linear_attention"),
    ({"ple_layer_ids": [0]}, "1-indexed linear_attention"),
    ({"eos_token_id": None}, "need eos_token_id"),
    ({"ple_embed_dim": 15}, "must divide"),
    ({"hc_count": 1}, "hc_count must be > 1"),
    ({"indexer_budget": None}, "go together"),
    ({"indexer_budget": 6}, "multiple of"),
    ({"indexer_kv_heads": 2}, "must be 1"),
    ({"indexer_head_dim": 8}, "rotary width"),
    ({"layer_types": ["linear_attention", "linear_attention", "sliding_attention", "full_attention"]},
     "unsupported layer type"),
    ({"output_gate_type": "sigmoid"}, "output_gate_type"),
])
def test_bad_configs_say_why(over: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_qwen4_exp_config(_text(**over))
