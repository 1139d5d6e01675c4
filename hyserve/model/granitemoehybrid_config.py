"""Granite-4.0-H's config.json (``model_type: granitemoehybrid``, ``GraniteMoeHybridForCausalLM``) read into
``GraniteMoeHybridConfig`` (the registry's parser; the model is ``hyserve.model.granitemoehybrid``;
docs/mamba2_facts.md sections 1.2 and 4.2 have transformers' fields).

Every layer has one mixer, Mamba2 or attention by ``layer_types[i]`` (the releases write ``mamba`` / ``attention``,
transformers 5 ``linear_attention`` / ``full_attention``), then the MoE (``num_local_experts`` > 0) plus the shared
MLP, or the shared MLP alone. ``ModelConfig.layer_types`` holds transformers' names.

The Mamba2 fields are kept under the names the mixer reads (``hyserve.layers.mamba2.Mamba2Config``):
``mamba_n_heads`` -> ``mamba_num_heads``, ``mamba_d_head`` -> ``mamba_head_dim``, ``mamba_n_groups`` ->
``n_groups``, ``mamba_d_state`` -> ``ssm_state_size``, ``mamba_d_conv`` -> ``conv_kernel``, ``mamba_conv_bias`` ->
``use_conv_bias``, ``mamba_proj_bias`` -> ``use_bias``; ``rms_norm_eps`` is every norm's epsilon, the Mamba2 gated
norm's (``layer_norm_epsilon``) included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hyserve.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from hyserve.layers.mamba2 import check_mamba2_tensor_parallel

MODEL_TYPE = "granitemoehybrid"
ARCHITECTURE = "GraniteMoeHybridForCausalLM"
# The releases' names of the layer types (transformers' remap_legacy_layer_types).
_LEGACY = {"mamba": LINEAR_ATTENTION, "attention": FULL_ATTENTION}
# The releases' on-disk names of the MoE tensors -> the model's (transformers' in-memory names).
# FP8 (compressed-tensors) releases add each fused projection's ``weight_scale`` ([E, N, 1] per channel, as
# llm-compressor's Granite-4 recipe saves it; blocks [E, N / bn, K / bk]).
_ON_DISK = {".block_sparse_moe.input_linear.weight": ".block_sparse_moe.experts.gate_up_proj",
            ".block_sparse_moe.output_linear.weight": ".block_sparse_moe.experts.down_proj",
            ".block_sparse_moe.input_linear.weight_scale": ".block_sparse_moe.experts.gate_up_proj_scale",
            ".block_sparse_moe.output_linear.weight_scale": ".block_sparse_moe.experts.down_proj_scale",
            ".block_sparse_moe.router.layer.weight": ".block_sparse_moe.router.weight"}
_IN_MODEL = {v: k for k, v in _ON_DISK.items()}


@dataclass(slots=True, kw_only=True)
class GraniteMoeHybridConfig(ModelConfig):
    """Field names follow transformers' ``GraniteMoeHybridConfig`` except the Mamba2 ones (module docstring)."""

    intermediate_size: int  # each routed expert's width
    shared_intermediate_size: int = 1024
    num_local_experts: int = 8  # 0: no MoE, the shared MLP alone
    num_experts_per_tok: int = 2
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    # The multipliers (docs/mamba2_facts.md 4.2): the embedding's output, both residual branches, the attention's
    # softmax scale (in place of head_dim ** -0.5) and the logits' divisor.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Rotary position embedding on the attention layers (position_embedding_type "rope"), else none.
    use_rope: bool = False
    rope_theta: float = 10000.0
    # Mamba2 (the mixer's names).
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    n_groups: int = 1
    ssm_state_size: int = 256
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False
    layer_norm_epsilon: float = 1e-6
    # Each Mamba2 step's dt clamp, at every token (transformers clamps its chunked prefill only; the default
    # (0, inf) clamps nothing either way).
    time_step_limit: tuple[float, float] = (0.0, math.inf)

    @property
    def stage_handover_parts(self) -> int:
        """A pipeline stage hands over its residual stream alone, its last layer's output added."""
        return 1

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    def checkpoint_name(self, name: str) -> str:
        """The releases' MoE names (``block_sparse_moe.input_linear``, ``output_linear``, ``router.layer``) ->
        the model's (``experts.gate_up_proj``, ``experts.down_proj``, ``router``); others unchanged."""
        for disk, model in _ON_DISK.items():
            if name.endswith(disk):
                return name[: -len(disk)] + model
        return name

    def disk_name(self, name: str, names_on_disk: list[str]) -> str:
        for model, disk in _IN_MODEL.items():
            if name.endswith(model):
                return name[: -len(model)] + disk
        return name

    @property
    def num_experts(self) -> int:
        """The routed experts of each MoE block (0: dense MLP layers)."""
        return self.num_local_experts

    def tensor_parallel_counts(self, expert_parallel: bool = False) -> dict[str, int]:
        """Attention heads, vocabulary, the Mamba2 heads, the shared MLP's channels and each expert's (with
        ``expert_parallel`` the experts themselves, whole)."""
        counts = {"num_attention_heads": self.num_attention_heads, "vocab_size": self.vocab_size,
                  "shared_intermediate_size": self.shared_intermediate_size}
        if LINEAR_ATTENTION in self.layer_types:
            counts["mamba_num_heads"] = self.mamba_num_heads
        if self.num_local_experts:
            if expert_parallel:
                counts["num_local_experts"] = self.num_local_experts
            else:
                counts["intermediate_size"] = self.intermediate_size
        return counts

    def check_tensor_parallel(self, tp: int, expert_parallel: bool = False) -> None:
        ModelConfig.check_tensor_parallel(self, tp, expert_parallel)  # a slots class: no bare super()
        if LINEAR_ATTENTION in self.layer_types:
            # The gated norm is one group over the whole width: its squares are summed over the ranks.
            check_mamba2_tensor_parallel(self.mamba_num_heads, self.mamba_head_dim, self.n_groups, tp,
                                         self.mamba_intermediate)

    def num_parameters(self, include_embeddings: bool = True) -> int:
        h, inner = self.hidden_size, self.mamba_intermediate
        conv = inner + 2 * self.n_groups * self.ssm_state_size
        e = self.num_local_experts
        n = h  # the final norm
        for t in self.layer_types:
            n += 2 * h  # the two norms
            if t == LINEAR_ATTENTION:
                n += h * (inner + conv + self.mamba_num_heads) + conv * self.conv_kernel + 3 * self.mamba_num_heads
                n += inner + inner * h + (conv if self.use_conv_bias else 0)
                n += (inner + conv + self.mamba_num_heads + h) if self.use_bias else 0
            else:
                qd, kvd = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
                n += 2 * h * qd + 2 * h * kvd + ((qd + 2 * kvd + h) if self.attention_bias else 0)
            n += e * (h + 3 * h * self.intermediate_size) + 3 * h * self.shared_intermediate_size
        if include_embeddings:
            n += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return n


def granitemoehybrid_config(cfg: ModelConfig) -> GraniteMoeHybridConfig:
    if not isinstance(cfg, GraniteMoeHybridConfig):
        raise TypeError(f"a Granite-4.0-H model needs the config parse_granitemoehybrid_config returns, not "
                        f"{type(cfg).__name__}")
    return cfg


def _layer_types(raw: dict[str, Any]) -> list[str]:
    listed = raw.get("layer_types") or raw.get("layers_block_type")
    if not listed:  # transformers' default: every layer Mamba2
        return [LINEAR_ATTENTION] * int(_required(raw, "num_hidden_layers"))
    types = [_LEGACY.get(str(t), str(t)) for t in listed]
    unknown = sorted(set(types) - {LINEAR_ATTENTION, FULL_ATTENTION})
    if unknown:
        raise ValueError(f"config.json: layer_types has unknown types {unknown} (known: mamba / linear_attention, "
                         "attention / full_attention)")
    n = raw.get("num_hidden_layers")
    if n is not None and int(n) != len(types):
        raise ValueError(f"config.json: num_hidden_layers={n} but layer_types lists {len(types)} layers")
    return types


def _required(raw: dict[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise ValueError(f"config.json is missing required field {key!r}")
    return raw[key]


def _float(value: Any) -> float:
    """A number of config.json: JSON's, a string (``"Infinity"``) or transformers' ``{"__float__": "Infinity"}``."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    return float(value)


def _rope(raw: dict[str, Any]) -> tuple[bool, float]:
    """(RoPE on, its theta): on for ``position_embedding_type == "rope"`` alone (transformers' rule); the theta from
    ``rope_parameters`` (transformers 5) or ``rope_theta`` (the releases); only the default rope type."""
    kind = raw.get("position_embedding_type")
    if kind not in (None, "nope", "rope"):
        raise ValueError(f"config.json: position_embedding_type {kind!r} is not supported (None, 'nope' or 'rope')")
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError("config.json: rope_parameters must be an object")
    theta = float(params.get("rope_theta", raw.get("rope_theta") or 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if kind == "rope" and rope_type != "default":
        raise ValueError(f"config.json: rope_type {rope_type!r} (rope_parameters / rope_scaling) is not supported "
                         "yet for Granite-4.0-H (the default RoPE only)")
    return kind == "rope", theta


def parse_granitemoehybrid_config(raw: dict[str, Any]) -> GraniteMoeHybridConfig:
    types = _layer_types(raw)
    act = str(raw.get("hidden_act", "silu"))
    if act != "silu":  # the experts', the shared MLP's and the Mamba2 conv's activation
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (silu)")
    norm = raw.get("normalization_function", "rmsnorm")
    if norm != "rmsnorm":
        raise ValueError(f"config.json: normalization_function {norm!r} is not supported (rmsnorm)")
    for flag in ("mlp_bias", "num_nextn_predict_layers"):
        if raw.get(flag):
            raise ValueError(f"config.json: {flag} is set, which transformers' Granite-4.0-H does not read, so what "
                             "the checkpoint means by it is unclear; not supported")
    use_rope, theta = _rope(raw)
    hidden = int(_required(raw, "hidden_size"))
    heads = int(_required(raw, "num_attention_heads"))
    mamba_heads = int(raw.get("mamba_n_heads", 128))
    expand = raw.get("mamba_expand", 2)
    inner = int(expand * hidden)
    d_head = raw.get("mamba_d_head", "auto")
    head_dim_m = inner // mamba_heads if d_head in (None, "auto") else int(d_head)
    if head_dim_m * mamba_heads != inner:
        raise ValueError(f"config.json: mamba_d_head={head_dim_m} x mamba_n_heads={mamba_heads} is not "
                         f"mamba_expand x hidden_size = {inner}")
    limit = raw.get("time_step_limit")
    lo, hi = (0.0, math.inf) if limit is None else (_float(limit[0]), _float(limit[1]))
    experts = int(raw.get("num_local_experts", 8) or 0)
    top_k = int(raw.get("num_experts_per_tok", 2))
    if experts and not 1 <= top_k <= experts:
        raise ValueError(f"config.json: num_experts_per_tok={top_k} must be in [1, num_local_experts={experts}]")
    eos = raw.get("eos_token_id")
    eos_list = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    eps = float(raw.get("rms_norm_eps", 1e-6))
    return GraniteMoeHybridConfig(
        vocab_size=int(_required(raw, "vocab_size")),
        hidden_size=hidden,
        num_hidden_layers=len(types),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),  # not a transformers field, but honoured
        layer_types=types,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_id=eos_list,
        architecture=ARCHITECTURE,
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        intermediate_size=int(_required(raw, "intermediate_size")),
        shared_intermediate_size=int(raw.get("shared_intermediate_size", 1024)),
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        rms_norm_eps=eps,
        attention_bias=bool(raw.get("attention_bias", False)),
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        attention_multiplier=float(raw.get("attention_multiplier", 1.0)),
        logits_scaling=float(raw.get("logits_scaling", 1.0)),
        use_rope=use_rope,
        rope_theta=theta,
        mamba_num_heads=mamba_heads,
        mamba_head_dim=head_dim_m,
        n_groups=int(raw.get("mamba_n_groups", 1)),
        ssm_state_size=int(raw.get("mamba_d_state", 256)),
        conv_kernel=int(raw.get("mamba_d_conv", 4)),
        use_conv_bias=bool(raw.get("mamba_conv_bias", True)),
        use_bias=bool(raw.get("mamba_proj_bias", False)),
        layer_norm_epsilon=eps,
        time_step_limit=(lo, hi),
    )
