"""Qwen3.5-MoE's config.json, in either checkpoint form, read into ``Qwen3_5MoeConfig``: Qwen3.5's config
(``hyserve.model.qwen3_5_config``) and the sparse MoE block's fields (the registry's parser for both Qwen3.5-MoE
architectures; the model itself is ``hyserve.model.qwen3_5_moe``).

Every decoder layer's feed-forward block is the sparse MoE block (``hyserve.layers.moe``): ``num_experts`` experts
of width ``moe_intermediate_size``, ``num_experts_per_tok`` chosen per token, and a shared expert of width
``shared_expert_intermediate_size``. ``intermediate_size`` (which dense Qwen3.5 reads) is the shared expert's width.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hyserve.config import ModelConfig
from hyserve.model.qwen3_5_config import Qwen3_5Config, parse_qwen3_5_config

# config.json model_type of each form -> the dense form's, whose parser reads the shared fields.
_DENSE_MODEL_TYPE = {"qwen3_5_moe": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_text"}


@dataclass(slots=True, kw_only=True)
class Qwen3_5MoeConfig(Qwen3_5Config):
    """Field names follow transformers' ``Qwen3_5MoeTextConfig`` (``norm_topk_prob``: transformers always
    renormalizes the top-k weights, the default here)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool = True

    def tensor_parallel_counts(self, expert_parallel: bool = False) -> dict[str, int]:
        """Expert parallel: the ranks split the experts (whole), not each expert's intermediate dimension."""
        counts = {k: v for k, v in Qwen3_5Config.tensor_parallel_counts(self).items() if k != "intermediate_size"}
        experts = {"num_experts": self.num_experts} if expert_parallel else \
            {"moe_intermediate_size": self.moe_intermediate_size}
        return {**counts, **experts, "shared_expert_intermediate_size": self.shared_expert_intermediate_size}

    def moe_block_parameters(self) -> int:
        """One sparse MoE block: router, experts (gate, up, down each), shared expert and its gate."""
        h, e = self.hidden_size, self.num_experts
        return e * h + e * 3 * h * self.moe_intermediate_size + 3 * h * self.shared_expert_intermediate_size + h

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Qwen3.5's count with each dense MLP (``3 h f``, f the shared expert's width) replaced by the MoE block."""
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = self.moe_block_parameters() - dense_mlp
        return Qwen3_5Config.num_parameters(self, include_embeddings) + self.num_hidden_layers * per_layer


def qwen3_5_moe_config(cfg: ModelConfig) -> Qwen3_5MoeConfig:
    """``cfg`` as Qwen3.5-MoE's config (what ``parse_qwen3_5_moe_config`` returned), for the family's modules."""
    if not isinstance(cfg, Qwen3_5MoeConfig):
        raise TypeError(f"a Qwen3.5-MoE model needs the config parse_qwen3_5_moe_config returns, "
                        f"not {type(cfg).__name__}")
    return cfg


def parse_qwen3_5_moe_config(raw: dict[str, Any]) -> Qwen3_5MoeConfig:
    """Either Qwen3.5-MoE checkpoint form: ``qwen3_5_moe`` (text fields under ``text_config``) or
    ``qwen3_5_moe_text``. Refuses layers without experts (``mlp_only_layers``, ``decoder_sparse_step`` > 1)."""
    model_type = raw.get("model_type")
    if model_type not in _DENSE_MODEL_TYPE:
        raise ValueError(f"config.json: model_type {model_type!r} is not Qwen3.5-MoE's "
                         f"({', '.join(_DENSE_MODEL_TYPE)})")
    text = dict(raw.get("text_config") or {}) if model_type == "qwen3_5_moe" else dict(raw)
    if model_type == "qwen3_5_moe" and not text:
        raise ValueError("config.json has model_type 'qwen3_5_moe' but no 'text_config'")
    if text.get("mlp_only_layers") or int(text.get("decoder_sparse_step", 1)) != 1:
        raise ValueError("config.json: layers without experts (mlp_only_layers, decoder_sparse_step) are not "
                         "supported for Qwen3.5-MoE")
    moe = parse_moe_fields(text)
    text["intermediate_size"] = moe["shared_expert_intermediate_size"]
    dense_raw = {**raw, "model_type": _DENSE_MODEL_TYPE[model_type]}
    if model_type == "qwen3_5_moe":
        dense_raw["text_config"] = text
    else:
        dense_raw = {**dense_raw, **text, "model_type": "qwen3_5_text"}
    base = parse_qwen3_5_config(dense_raw)
    architectures = raw.get("architectures") or []
    arch = architectures[0] if architectures else (
        "Qwen3_5MoeForConditionalGeneration" if model_type == "qwen3_5_moe" else "Qwen3_5MoeForCausalLM")
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return Qwen3_5MoeConfig(**{**fields, "architecture": arch}, **moe)


def parse_moe_fields(text: dict[str, Any]) -> dict[str, Any]:
    """The sparse MoE block's fields (``Qwen3_5MoeConfig``'s own) of a config.json's text fields, checked."""
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if key not in text:
            raise ValueError(f"config.json is missing required field {key!r}")
    n_experts, top_k = int(text["num_experts"]), int(text["num_experts_per_tok"])
    if not 0 < top_k <= n_experts:
        raise ValueError(f"config.json: num_experts_per_tok={top_k} must be in 1..num_experts={n_experts}")
    return {"num_experts": n_experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(text["moe_intermediate_size"]),
            "shared_expert_intermediate_size": int(text["shared_expert_intermediate_size"]),
            "norm_topk_prob": bool(text.get("norm_topk_prob", True))}
