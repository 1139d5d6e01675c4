"""Nemotron-H's config.json (``model_type: nemotron_h``, ``NemotronHForCausalLM``) read into ``NemotronHConfig``
(the registry's parser; the model is ``hyserve.model.nemotron_h``; docs/mamba2_facts.md has transformers' fields).

Every layer is one block: ``M`` a Mamba2 mixer, ``*`` attention (no position embedding), ``-`` the squared-ReLU MLP,
``E`` the MoE block; the pattern is config.json's ``hybrid_override_pattern`` (the released checkpoints) or the list
``layers_block_type`` / ``layer_types`` that transformers 5 writes. ``ModelConfig.layer_types`` holds the list in
transformers' names (``linear_attention``, ``full_attention``, ``mlp``, ``moe``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hyserve.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from hyserve.layers.mamba2 import check_mamba2_tensor_parallel

MODEL_TYPE = "nemotron_h"
ARCHITECTURE = "NemotronHForCausalLM"
MLP, MOE = "mlp", "moe"
_PATTERN = {"M": LINEAR_ATTENTION, "*": FULL_ATTENTION, "-": MLP, "E": MOE}
# Older names of the block types (transformers' remap_legacy_layer_types).
_LEGACY = {"mamba": LINEAR_ATTENTION, "attention": FULL_ATTENTION}


@dataclass(slots=True, kw_only=True)
class NemotronHConfig(ModelConfig):
    """Field names follow transformers' ``NemotronHConfig``."""

    intermediate_size: int
    layer_norm_epsilon: float = 1e-5
    mlp_hidden_act: str = "relu2"
    attention_bias: bool = False  # the attention layer's config protocol; always False (refused otherwise)
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    n_groups: int = 8
    ssm_state_size: int = 128
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False
    # (lower, upper) clamp of each Mamba2 step's dt: transformers' mixer takes (time_step_min, inf).
    time_step_limit: tuple[float, float] = (0.001, math.inf)
    # The MoE blocks (``E``; hyserve.layers.sigmoid_moe).
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True

    rms_norm_eps: float = 1e-5  # the attention layer's config protocol; Nemotron-H's attention has no norm

    def disk_name(self, name: str, names_on_disk: list[str]) -> str:
        """The MoE experts' static input scales (``experts.up_proj_input_scale`` [E], ModelOpt FP8) as checkpoints
        store them, one per expert (``experts.{e}.up_proj.input_scale``): named by the first expert's."""
        for proj in ("up_proj", "down_proj"):
            stacked = f".experts.{proj}_input_scale"
            if name.endswith(stacked):
                return f"{name.removesuffix(stacked)}.experts.0.{proj}.input_scale"
        return name

    @property
    def stage_handover_parts(self) -> int:
        """A pipeline stage hands over its residual stream alone, its last block's output added."""
        return 1

    @property
    def num_experts(self) -> int:
        """The routed experts of each MoE block (0 without MoE blocks)."""
        return self.n_routed_experts if MOE in self.layer_types else 0

    def tensor_parallel_counts(self, expert_parallel: bool = False) -> dict[str, int]:
        """Attention heads, vocabulary, the Mamba2 heads, and the channels of the blocks it has: the MLP's, the
        MoE experts' and shared expert's (each expert's intermediate split over the ranks; with ``expert_parallel``
        the experts themselves, whole)."""
        counts = {"num_attention_heads": self.num_attention_heads, "vocab_size": self.vocab_size}
        if LINEAR_ATTENTION in self.layer_types:
            counts["mamba_num_heads"] = self.mamba_num_heads
        if MLP in self.layer_types:
            counts["intermediate_size"] = self.intermediate_size
        if MOE in self.layer_types:
            if expert_parallel:
                counts["n_routed_experts"] = self.n_routed_experts
            else:
                counts["moe_intermediate_size"] = self.moe_intermediate_size
            counts["moe_shared_expert_intermediate_size"] = self.moe_shared_expert_intermediate_size
        return counts

    def check_tensor_parallel(self, tp: int, expert_parallel: bool = False) -> None:
        ModelConfig.check_tensor_parallel(self, tp, expert_parallel)  # a slots class: no bare super()
        if LINEAR_ATTENTION in self.layer_types:
            inner = self.mamba_num_heads * self.mamba_head_dim
            check_mamba2_tensor_parallel(self.mamba_num_heads, self.mamba_head_dim, self.n_groups, tp,
                                         inner // self.n_groups)

    def num_parameters(self, include_embeddings: bool = True) -> int:
        h = self.hidden_size
        inner = self.mamba_num_heads * self.mamba_head_dim
        conv = inner + 2 * self.n_groups * self.ssm_state_size
        n = h  # the final norm
        for t in self.layer_types:
            n += h  # the block's norm
            if t == LINEAR_ATTENTION:
                n += h * (inner + conv + self.mamba_num_heads) + conv * self.conv_kernel + 3 * self.mamba_num_heads
                n += inner + inner * h + (conv if self.use_conv_bias else 0)
            elif t == FULL_ATTENTION:
                qd, kvd = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
                n += 2 * h * qd + 2 * h * kvd
            elif t == MOE:
                width = self.moe_latent_size or h
                n += self.n_routed_experts * (h + 1 + 2 * width * self.moe_intermediate_size)
                n += 2 * h * self.moe_shared_expert_intermediate_size
                n += 2 * h * self.moe_latent_size if self.moe_latent_size else 0
            else:
                n += 2 * h * self.intermediate_size
        if include_embeddings:
            n += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return n


def nemotron_h_config(cfg: ModelConfig) -> NemotronHConfig:
    if not isinstance(cfg, NemotronHConfig):
        raise TypeError(f"a Nemotron-H model needs the config parse_nemotron_h_config returns, not "
                        f"{type(cfg).__name__}")
    return cfg


def _block_types(raw: dict[str, Any]) -> list[str]:
    listed = raw.get("layers_block_type") or raw.get("layer_types")
    if listed:
        return [_LEGACY.get(str(t), str(t)) for t in listed]
    pattern = raw.get("hybrid_override_pattern")
    if not pattern:
        raise ValueError("config.json has neither hybrid_override_pattern nor layers_block_type")
    bad = sorted(set(pattern) - set(_PATTERN))
    if bad:
        raise ValueError(f"config.json: hybrid_override_pattern has unknown block letters {bad} (known: M * - E)")
    return [_PATTERN[c] for c in pattern]


def _pick(raw: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of ``keys`` that config.json sets (transformers' current name first, then its older aliases)."""
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    if default is None:
        raise ValueError(f"config.json is missing required field {keys[0]!r}")
    return default


def parse_nemotron_h_config(raw: dict[str, Any]) -> NemotronHConfig:
    types = _block_types(raw)
    unknown = sorted(set(types) - {LINEAR_ATTENTION, FULL_ATTENTION, MLP, MOE})
    if unknown:
        raise ValueError(f"config.json: unknown Nemotron-H block types {unknown}")
    act = str(raw.get("mlp_hidden_act", "relu2"))
    if act != "relu2":
        raise ValueError(f"config.json: mlp_hidden_act {act!r} is not supported (Nemotron-H's is relu2)")
    mamba_act = str(raw.get("mamba_hidden_act", "silu"))
    if mamba_act != "silu":
        raise ValueError(f"config.json: mamba_hidden_act {mamba_act!r} is not supported (silu)")
    # transformers' model reads none of these (its LM head is never tied, whatever tie_word_embeddings says)
    for flag in ("attention_bias", "residual_in_fp32", "tie_word_embeddings"):
        if raw.get(flag):
            raise ValueError(f"config.json: {flag}=true is not supported (transformers' Nemotron-H ignores it, so "
                             "what the checkpoint means by it is unclear)")
    if raw.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true (biases on the MLP projections) is not supported yet")
    if raw.get("num_nextn_predict_layers"):
        raise ValueError("Nemotron-H MTP layers (num_nextn_predict_layers) are not supported yet")
    hidden = int(_pick(raw, "hidden_size"))
    heads = int(_pick(raw, "num_attention_heads"))
    eos = raw.get("eos_token_id")
    eos_list = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    return NemotronHConfig(
        vocab_size=int(_pick(raw, "vocab_size")),
        hidden_size=hidden,
        num_hidden_layers=len(types),
        num_attention_heads=heads,
        num_key_value_heads=int(_pick(raw, "num_key_value_heads", default=heads)),
        head_dim=int(_pick(raw, "head_dim", default=hidden // heads)),
        layer_types=types,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        eos_token_id=eos_list,
        architecture=ARCHITECTURE,
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        intermediate_size=int(_pick(raw, "intermediate_size")),
        layer_norm_epsilon=float(raw.get("layer_norm_epsilon", 1e-5)),
        rms_norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        mlp_hidden_act=act,
        mamba_num_heads=int(_pick(raw, "mamba_num_heads")),
        mamba_head_dim=int(_pick(raw, "mamba_head_dim")),
        n_groups=int(_pick(raw, "n_groups", "mamba_n_groups", default=1)),
        ssm_state_size=int(_pick(raw, "ssm_state_size", default=128)),
        conv_kernel=int(_pick(raw, "conv_kernel", "mamba_d_conv", default=4)),
        use_conv_bias=bool(_pick(raw, "use_conv_bias", "mamba_conv_bias", default=True)),
        use_bias=bool(raw.get("use_bias", False)),  # not mamba_proj_bias: transformers' mixer reads use_bias
        time_step_limit=(float(_pick(raw, "time_step_min", "mamba_dt_min", default=0.001)), math.inf),
        n_routed_experts=int(_pick(raw, "n_routed_experts", "num_local_experts", default=8)),
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 7688)),
        moe_shared_expert_intermediate_size=int(raw.get("moe_shared_expert_intermediate_size", 7688)),
        moe_latent_size=None if raw.get("moe_latent_size") is None else int(raw["moe_latent_size"]),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        n_group=int(raw.get("n_group", 1)),
        topk_group=int(raw.get("topk_group", 1)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
    )
