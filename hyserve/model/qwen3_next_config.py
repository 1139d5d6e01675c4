"""Qwen3-Next's config.json (``model_type: qwen3_next``) read into ``Qwen3NextConfig``: Qwen3.5-MoE's config
(``hyserve.model.qwen3_5_moe_config``: Qwen3.5's mixers and norms, the sparse MoE block) with a feed-forward block
chosen per layer (the registry's parser for ``Qwen3NextForCausalLM``; the model itself is
``hyserve.model.qwen3_next``).

As transformers' ``Qwen3NextDecoderLayer``: layer i's feed-forward block is the sparse MoE block unless i is in
``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``, in which case it is the dense gated MLP of width
``intermediate_size``. The MTP head (``num_nextn_predict_layers`` of them; the released config.json files do not
have the field while their checkpoints hold one MTP layer, so an absent field means 1, as vLLM's ``qwen3_next_mtp``
reads it) applies the same rule to its one layer, index 0, as vLLM does. Rope is plain (no M-RoPE), partial
(``partial_rotary_factor``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hyserve.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from hyserve.model.qwen3_5_config import Qwen3_5Config, parse_qwen3_5_config
from hyserve.model.qwen3_5_moe_config import Qwen3_5MoeConfig, parse_moe_fields

MODEL_TYPE = "qwen3_next"
ARCHITECTURE = "Qwen3NextForCausalLM"
# Layer type names older configs use (transformers' ``remap_legacy_layer_types``).
_LEGACY_LAYER_TYPES = {"attention": FULL_ATTENTION, "mamba": LINEAR_ATTENTION}


@dataclass(slots=True, kw_only=True)
class Qwen3NextConfig(Qwen3_5MoeConfig):
    """Field names follow transformers' ``Qwen3NextConfig``; ``intermediate_size`` is the dense MLP's width (the
    layers without experts), unlike Qwen3.5-MoE's."""

    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def sparse_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s feed-forward block is the sparse MoE block (else the dense MLP)."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0

    def _layers_with_mlp(self) -> list[int]:
        """The model's layers' indices, and the MTP layer's (0) when there is one."""
        return list(range(self.num_hidden_layers)) + ([0] if self.mtp_num_hidden_layers > 0 else [])

    def tensor_parallel_counts(self, expert_parallel: bool = False) -> dict[str, int]:
        """Qwen3.5-MoE's, and the dense MLP's width where a layer has one."""
        counts = Qwen3_5MoeConfig.tensor_parallel_counts(self, expert_parallel)
        if not all(self.sparse_layer(i) for i in self._layers_with_mlp()):
            counts["intermediate_size"] = self.intermediate_size
        return counts

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Qwen3.5's count (a dense MLP in every layer) with the sparse layers' MLPs replaced by the MoE block."""
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        sparse = sum(self.sparse_layer(i) for i in range(self.num_hidden_layers))
        return Qwen3_5Config.num_parameters(self, include_embeddings) + sparse * (
            self.moe_block_parameters() - dense_mlp)


def qwen3_next_config(cfg: ModelConfig) -> Qwen3NextConfig:
    """``cfg`` as Qwen3-Next's config (what ``parse_qwen3_next_config`` returned), for the family's modules."""
    if not isinstance(cfg, Qwen3NextConfig):
        raise TypeError(f"a Qwen3-Next model needs the config parse_qwen3_next_config returns, "
                        f"not {type(cfg).__name__}")
    return cfg


def parse_qwen3_next_config(raw: dict[str, Any]) -> Qwen3NextConfig:
    """A ``qwen3_next`` config.json (text fields at the top level). Refuses M-RoPE and other rope types, value
    heads that do not group evenly over the key heads, a non-SiLU activation, and out-of-range
    ``mlp_only_layers`` / ``decoder_sparse_step``."""
    if raw.get("model_type") != MODEL_TYPE:
        raise ValueError(f"config.json: model_type {raw.get('model_type')!r} is not Qwen3-Next's ({MODEL_TYPE!r})")
    text = dict(raw)
    if text.get("layer_types") is not None:
        text["layer_types"] = [_LEGACY_LAYER_TYPES.get(t, t) for t in text["layer_types"]]
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"config.json: unsupported rope_type {rope_type!r} for Qwen3-Next (supported: default)")
    if text.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: unsupported hidden_act {text['hidden_act']!r} (supported: silu)")
    if "mtp_num_hidden_layers" not in text:  # the releases carry the MTP layer but not the field: 1, as vLLM reads it
        text["mtp_num_hidden_layers"] = int(text.get("num_nextn_predict_layers", 1) or 0)
    moe = parse_moe_fields(text)
    base = parse_qwen3_5_config({**text, "model_type": "qwen3_5_text"})
    nk, nv = base.linear_num_key_heads, base.linear_num_value_heads
    if nv % nk:
        raise ValueError(f"config.json: linear_num_value_heads={nv} is not a multiple of linear_num_key_heads={nk} "
                         "(in_proj_qkvz groups whole value heads per key head)")
    step = int(1 if text.get("decoder_sparse_step") is None else text["decoder_sparse_step"])
    if step < 1:
        raise ValueError(f"config.json: decoder_sparse_step={step} must be at least 1")
    only = tuple(sorted({int(i) for i in text.get("mlp_only_layers") or ()}))
    if only and not 0 <= only[0] <= only[-1] < base.num_hidden_layers:
        raise ValueError(f"config.json: mlp_only_layers {list(only)} must be layer indices in "
                         f"0..{base.num_hidden_layers - 1}")
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    architectures = raw.get("architectures") or []
    return Qwen3NextConfig(**{**fields, "architecture": architectures[0] if architectures else ARCHITECTURE},
                           **moe, decoder_sparse_step=step, mlp_only_layers=only)
