"""Falcon-H1's config.json (``model_type: falcon_h1``, ``FalconH1ForCausalLM``) read into ``FalconH1Config`` (the
registry's parser; the model is ``hyserve.model.falcon_h1``; docs/mamba2_facts.md sections 1.3 and 4.3 have
transformers' fields and formulas).

Every layer is the same ``hybrid`` layer (``ModelConfig.layer_types`` holds transformers' name for it): Mamba2 and
attention side by side on one normed input, then a SwiGLU MLP, with the muP multipliers of the release. Each field
transformers' model reads is either honoured or refused here by name; the fields it reads only to initialise
weights (``time_step_min``, ``initializer_range``, ...) or for generation (``num_logits_to_keep``) mean nothing to
inference, and ``mamba_chunk_size`` only picks how transformers' scan is blocked, which does not change its results
(hyserve's scan is a recurrence).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hyserve.config import ModelConfig
from hyserve.layers.mamba2 import check_mamba2_tensor_parallel

MODEL_TYPE = "falcon_h1"
ARCHITECTURE = "FalconH1ForCausalLM"
HYBRID = "hybrid"  # transformers' layer type: attention + Mamba2 + MLP in every layer
# transformers' FalconH1Config default for mamba_d_ssm, taken when config.json does not name the field at all.
DEFAULT_D_SSM = 1024


@dataclass(slots=True, kw_only=True)
class FalconH1Config(ModelConfig):
    """Field names follow transformers' ``FalconH1Config``, except the Mamba2 mixer's, which take the names the mixer
    reads (``hyserve.layers.mamba2.Mamba2Config``, Nemotron-H's): config.json's ``mamba_n_heads`` is
    ``mamba_num_heads``, ``mamba_d_head`` ``mamba_head_dim``, ``mamba_n_groups`` ``n_groups``, ``mamba_d_state``
    ``ssm_state_size``, ``mamba_d_conv`` ``conv_kernel``, ``mamba_conv_bias`` ``use_conv_bias``, ``mamba_proj_bias``
    (the input projection's bias) ``use_bias``; ``layer_norm_epsilon`` is ``rms_norm_eps``."""

    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_bias: bool = False
    mamba_num_heads: int = 128
    mamba_head_dim: int = 8
    n_groups: int = 1
    ssm_state_size: int = 256
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False
    projectors_bias: bool = False  # the Mamba2 output projection's bias
    layer_norm_epsilon: float = 1e-5
    # (lower, upper) clamp of each step's dt. transformers clamps on its chunked (prompt) path only; hyserve clamps
    # every token, so a decode step matches a teacher-forced forward. The default clamps nothing (dt > 0).
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    mamba_rms_norm: bool = False
    mamba_norm_before_gate: bool = True
    # The muP multipliers (transformers' names and places).
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    key_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = field(default=(1.0, 1.0, 1.0, 1.0, 1.0))  # z, x, B, C, dt
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)  # gate, down

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def stage_handover_parts(self) -> int:
        """A pipeline stage hands over its residual stream alone, its last layer's output added."""
        return 1

    def tensor_parallel_counts(self, expert_parallel: bool = False) -> dict[str, int]:
        return {"num_attention_heads": self.num_attention_heads, "vocab_size": self.vocab_size,
                "intermediate_size": self.intermediate_size, "mamba_num_heads": self.mamba_num_heads}

    def check_tensor_parallel(self, tp: int, expert_parallel: bool = False) -> None:
        ModelConfig.check_tensor_parallel(self, tp, expert_parallel)  # a slots class: no bare super()
        check_mamba2_tensor_parallel(self.mamba_num_heads, self.mamba_head_dim, self.n_groups, tp,
                                     self.mamba_intermediate // self.n_groups if self.mamba_rms_norm else None)

    def num_parameters(self, include_embeddings: bool = True) -> int:
        h, inner = self.hidden_size, self.mamba_intermediate
        gn, nh = self.n_groups * self.ssm_state_size, self.mamba_num_heads
        conv, proj = inner + 2 * gn, 2 * inner + 2 * gn + nh
        qd, kvd = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        layer = 2 * h  # the two norms
        layer += h * proj + (proj if self.use_bias else 0) + conv * self.conv_kernel
        layer += (conv if self.use_conv_bias else 0) + 3 * nh + (inner if self.mamba_rms_norm else 0)
        layer += inner * h + (h if self.projectors_bias else 0)
        layer += 2 * h * qd + 2 * h * kvd + ((qd + 2 * kvd + h) if self.attention_bias else 0)
        layer += 3 * h * self.intermediate_size
        n = self.num_hidden_layers * layer + h  # and the final norm
        if include_embeddings:
            n += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return n


def falcon_h1_config(cfg: ModelConfig) -> FalconH1Config:
    if not isinstance(cfg, FalconH1Config):
        raise TypeError(f"a Falcon-H1 model needs the config parse_falcon_h1_config returns, not {type(cfg).__name__}")
    return cfg


def _required(raw: dict[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise ValueError(f"config.json is missing required field {key!r}")
    return raw[key]


def _floats(raw: dict[str, Any], key: str, n: int) -> tuple[float, ...]:
    values = raw.get(key)
    if values is None:
        return (1.0,) * n
    if not isinstance(values, list | tuple) or len(values) != n:
        raise ValueError(f"config.json: {key} must list {n} numbers (got {values!r})")
    return tuple(float(v) for v in values)


def _json_float(value: Any) -> float:
    """A number of config.json; transformers 5 writes infinity as ``{"__float__": "Infinity"}``."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def _multiplier(raw: dict[str, Any], key: str) -> float:
    value = raw.get(key, 1.0)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"config.json: {key} must be a number (got {value!r})")
    return float(value)


def _rope_theta(raw: dict[str, Any]) -> float:
    """transformers 5's ``rope_parameters``, or the older ``rope_theta`` / ``rope_scaling`` of the releases."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"config.json: rope_type {rope_type!r} is not supported (Falcon-H1's is default)")
    return float(rope.get("rope_theta") or raw.get("rope_theta") or 10000.0)


def _d_ssm(raw: dict[str, Any], hidden: int) -> int:
    """The Mamba2 inner width: ``mamba_d_ssm``, transformers' default 1024 when config.json has no such key, or
    ``mamba_expand * hidden_size`` when it says null."""
    if "mamba_d_ssm" not in raw:
        return DEFAULT_D_SSM
    if raw["mamba_d_ssm"] is None:
        return int(float(raw.get("mamba_expand", 2)) * hidden)
    return int(raw["mamba_d_ssm"])


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    act = str(raw.get("hidden_act", "silu"))
    if act != "silu":
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (Falcon-H1's is silu; it is both the MLP's "
                         "and the Mamba2 conv's activation)")
    if raw.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true (biases on the MLP projections) is not supported yet")
    # Fields of the original Falcon-H1 code that transformers' model does not read: it builds attention, Mamba2 and
    # the MLP in every layer whatever they say, so only the values meaning exactly that are accepted.
    if raw.get("attn_layer_indices") is not None:
        raise ValueError("config.json: attn_layer_indices is not supported (transformers' Falcon-H1 has attention in "
                         "every layer and ignores it)")
    if raw.get("mamba_use_mlp") is False:
        raise ValueError("config.json: mamba_use_mlp=false is not supported (transformers' Falcon-H1 has an MLP in "
                         "every layer and ignores it)")
    if raw.get("num_nextn_predict_layers"):
        raise ValueError("Falcon-H1 MTP layers (num_nextn_predict_layers) are not supported")


def parse_falcon_h1_config(raw: dict[str, Any]) -> FalconH1Config:
    _refuse_unsupported(raw)
    hidden = int(_required(raw, "hidden_size"))
    heads = int(_required(raw, "num_attention_heads"))
    n_layers = int(_required(raw, "num_hidden_layers"))
    d_ssm = _d_ssm(raw, hidden)
    m_heads = int(raw.get("mamba_n_heads", 128))
    d_head = raw.get("mamba_d_head", "auto")
    m_head_dim = d_ssm // m_heads if d_head in (None, "auto") else int(d_head)
    if m_head_dim * m_heads != d_ssm:
        raise ValueError(f"config.json: mamba_d_head={m_head_dim} times mamba_n_heads={m_heads} is not the Mamba2 "
                         f"width mamba_d_ssm={d_ssm}")
    groups = int(raw.get("mamba_n_groups", 1))
    if m_heads % groups:
        raise ValueError(f"config.json: mamba_n_heads={m_heads} is not a multiple of mamba_n_groups={groups}")
    limit = raw.get("time_step_limit")
    lo, hi = (0.0, math.inf) if limit is None else (_json_float(limit[0]), _json_float(limit[1]))
    eps = float(raw.get("rms_norm_eps", 1e-5))
    eos = raw.get("eos_token_id")
    eos_list = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    kv = raw.get("num_key_value_heads")
    gate_mult, down_mult = _floats(raw, "mlp_multipliers", 2)
    return FalconH1Config(
        vocab_size=int(_required(raw, "vocab_size")),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads if kv is None else int(kv),
        head_dim=int(raw.get("head_dim") or hidden // heads),  # not a transformers field, but honoured when present
        layer_types=[HYBRID] * n_layers,
        max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_id=eos_list,
        architecture=ARCHITECTURE,
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        intermediate_size=int(_required(raw, "intermediate_size")),
        rms_norm_eps=eps,
        rope_theta=_rope_theta(raw),
        attention_bias=bool(raw.get("attention_bias", False)),
        mamba_num_heads=m_heads,
        mamba_head_dim=m_head_dim,
        n_groups=groups,
        ssm_state_size=int(raw.get("mamba_d_state", 256)),
        conv_kernel=int(raw.get("mamba_d_conv", 4)),
        use_conv_bias=bool(raw.get("mamba_conv_bias", True)),
        use_bias=bool(raw.get("mamba_proj_bias", False)),
        projectors_bias=bool(raw.get("projectors_bias", False)),
        layer_norm_epsilon=eps,
        time_step_limit=(lo, hi),
        mamba_rms_norm=bool(raw.get("mamba_rms_norm", False)),
        mamba_norm_before_gate=bool(raw.get("mamba_norm_before_gate", True)),
        embedding_multiplier=_multiplier(raw, "embedding_multiplier"),
        lm_head_multiplier=_multiplier(raw, "lm_head_multiplier"),
        key_multiplier=_multiplier(raw, "key_multiplier"),
        attention_in_multiplier=_multiplier(raw, "attention_in_multiplier"),
        attention_out_multiplier=_multiplier(raw, "attention_out_multiplier"),
        ssm_in_multiplier=_multiplier(raw, "ssm_in_multiplier"),
        ssm_out_multiplier=_multiplier(raw, "ssm_out_multiplier"),
        ssm_multipliers=_floats(raw, "ssm_multipliers", 5),
        mlp_multipliers=(gate_mult, down_mult),
    )
