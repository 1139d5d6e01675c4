"""Qwen3.5's config.json, in either checkpoint form, read into ``Qwen3_5Config``: the engine's ``ModelConfig`` and
what only Qwen3.5's layers read (the registry's parser for both Qwen3.5 architectures; the model itself is
``hyserve.model.qwen3_5``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from hyserve.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig, MultimodalConfig

# Where a ``Qwen3_5ForConditionalGeneration`` checkpoint keeps the text model's tensors.
VLM_TEXT_PREFIX = "model.language_model."


@dataclass(slots=True, kw_only=True)
class Qwen3_5Config(ModelConfig):
    """Qwen3.5's text model. Field names follow transformers' ``Qwen3_5TextConfig``."""

    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000000.0
    partial_rotary_factor: float = 0.25
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    hidden_act: str = "silu"
    attention_bias: bool = False

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: [q | k | v]."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    draft_prefix: ClassVar[str | None] = "mtp."

    def checkpoint_name(self, name: str) -> str:
        """``model.language_model.X`` (``Qwen3_5ForConditionalGeneration`` checkpoints) -> ``model.X``;
        ``model.visual.X`` / ``visual.X`` (the vision tower) -> ``visual.X``; others unchanged."""
        if name.startswith(("model.visual.", "visual.")):
            return "visual." + name.split("visual.", 1)[1]
        if name.startswith(VLM_TEXT_PREFIX):
            return "model." + name[len(VLM_TEXT_PREFIX):]
        return name

    def disk_name(self, name: str, names_on_disk: list[str]) -> str:
        """``model.X`` -> ``model.language_model.X`` when the checkpoint is in the conditional (VLM) form."""
        if name.startswith("model.") and any(n.startswith(VLM_TEXT_PREFIX) for n in names_on_disk):
            return VLM_TEXT_PREFIX + name[len("model."):]
        return name

    def tensor_parallel_counts(self, expert_parallel: bool = False) -> dict[str, int]:
        return {"num_attention_heads": self.num_attention_heads, "linear_num_key_heads": self.linear_num_key_heads,
                "linear_num_value_heads": self.linear_num_value_heads, "intermediate_size": self.intermediate_size,
                "vocab_size": self.vocab_size}

    def num_parameters(self, include_embeddings: bool = True) -> int:
        h, f = self.hidden_size, self.intermediate_size
        n = 0
        for t in self.layer_types:
            n += 3 * h * f + 2 * h
            if t == FULL_ATTENTION:
                qd = self.num_attention_heads * self.head_dim
                kvd = self.num_key_value_heads * self.head_dim
                n += h * 2 * qd + 2 * h * kvd + qd * h + 2 * self.head_dim
            else:
                n += h * self.conv_dim + h * self.linear_value_dim + 2 * h * self.linear_num_value_heads
                n += self.conv_dim * self.linear_conv_kernel_dim + 2 * self.linear_num_value_heads
                n += self.linear_value_head_dim + self.linear_value_dim * h
        n += h
        if include_embeddings:
            n += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return n


def qwen3_5_config(cfg: ModelConfig) -> Qwen3_5Config:
    """``cfg`` as Qwen3.5's config (what ``parse_qwen3_5_config`` returned), for the family's modules."""
    if not isinstance(cfg, Qwen3_5Config):
        raise TypeError(f"a Qwen3.5 model needs the config parse_qwen3_5_config returns, not {type(cfg).__name__}")
    return cfg


def parse_qwen3_5_config(raw: dict[str, Any]) -> Qwen3_5Config:
    """Either Qwen3.5 checkpoint form: ``qwen3_5`` (text fields under ``text_config``) or ``qwen3_5_text``."""
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or []
    arch = architectures[0] if architectures else None
    text = dict(raw.get("text_config") or {}) if model_type == "qwen3_5" else dict(raw)
    if model_type == "qwen3_5" and not text:
        raise ValueError("config.json has model_type 'qwen3_5' but no 'text_config'")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads"):
        if key not in text:
            raise ValueError(f"config.json is missing required field {key!r}")
    n_layers = int(text["num_hidden_layers"])
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4))
        layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(n_layers)]
    if len(layer_types) != n_layers:
        raise ValueError(
            f"config.json: layer_types has {len(layer_types)} entries, num_hidden_layers is {n_layers}"
        )
    for t in layer_types:
        if t not in (LINEAR_ATTENTION, FULL_ATTENTION):
            raise ValueError(f"config.json: unsupported layer type {t!r}")
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"config.json: unsupported rope_type {rope_type!r} (supported: default, mrope)")
    rope_theta = float(rope.get("rope_theta") or text.get("rope_theta") or 10000000.0)
    prf = float(rope.get("partial_rotary_factor") or text.get("partial_rotary_factor") or 0.25)
    hidden = int(text["hidden_size"])
    n_heads = int(text["num_attention_heads"])
    eos = _first_set(text, raw, keys=("eos_token_id",))
    eos_list = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    tie = bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    if "tie_word_embeddings" in text:
        tie = bool(text["tie_word_embeddings"])
    return Qwen3_5Config(
        vocab_size=int(text["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(text["intermediate_size"]),
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(text["num_key_value_heads"]),
        head_dim=int(text.get("head_dim") or hidden // n_heads),
        layer_types=list(layer_types),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        partial_rotary_factor=prf,
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
        linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
        hidden_act=str(text.get("hidden_act", "silu")),
        attention_bias=bool(text.get("attention_bias", False)),
        tie_word_embeddings=tie,
        mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", raw.get("mtp_num_hidden_layers", 0)) or 0),
        eos_token_id=eos_list,
        architecture=arch
        or ("Qwen3_5ForConditionalGeneration" if model_type == "qwen3_5" else "Qwen3_5ForCausalLM"),
        torch_dtype=_first_set(text, raw, keys=("dtype", "torch_dtype")),
        multimodal=_multimodal_config(raw, rope) if model_type == "qwen3_5" and raw.get("vision_config") else None,
    )


def _multimodal_config(raw: dict[str, Any], rope: dict[str, Any]) -> MultimodalConfig:
    """The image-input fields of a ``qwen3_5`` config.json (top level, and the text config's rope parameters)."""
    d = MultimodalConfig()
    ids = {k: int(raw.get(k, getattr(d, k))) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                         "vision_end_token_id")}
    section = tuple(int(x) for x in rope.get("mrope_section", d.mrope_section))
    if len(section) != 3 or min(section) < 0:
        raise ValueError(f"config.json: mrope_section must be three non-negative sizes, got {list(section)}")
    vision = raw["vision_config"]
    if not isinstance(vision, dict):
        raise ValueError("config.json: vision_config must be an object")
    return MultimodalConfig(mrope_section=section, vision_config=dict(vision), **ids)


def _first_set(*sources: dict[str, Any], keys: tuple[str, ...]) -> Any:
    """First non-null value of ``keys`` in ``sources`` (in order): transformers writes explicit nulls
    (``"eos_token_id": null``, ``"dtype": null``) into ``text_config``, which must not hide the top-level value."""
    for source in sources:
        for key in keys:
            if source.get(key) is not None:
                return source[key]
    return None
