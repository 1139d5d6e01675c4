"""Configuration: the model's shape (parsed from a checkpoint's config.json) and the engine's knobs."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


@dataclass(slots=True)
class ModelConfig:
    """The text model's shape. Field names follow transformers' ``Qwen3_5TextConfig``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: list[str]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    eos_token_id: list[int] = field(default_factory=list)
    architecture: str = "Qwen3_5ForCausalLM"
    torch_dtype: str | None = None

    @property
    def attention_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def linear_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

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

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse either checkpoint form: ``qwen3_5`` (text fields under ``text_config``) or ``qwen3_5_text``."""
        model_type = raw.get("model_type")
        architectures = raw.get("architectures") or []
        arch = architectures[0] if architectures else None
        if model_type not in SUPPORTED_MODEL_TYPES or (arch is not None and arch not in SUPPORTED_ARCHITECTURES):
            name = arch or model_type or "<none>"
            raise ValueError(
                f"unsupported architecture {name!r} (model_type={model_type!r}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
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
            raise ValueError(f"config.json: unsupported rope_type {rope_type!r} (supported: default)")
        rope_theta = float(rope.get("rope_theta") or text.get("rope_theta") or 10000000.0)
        prf = float(rope.get("partial_rotary_factor") or text.get("partial_rotary_factor") or 0.25)
        hidden = int(text["hidden_size"])
        n_heads = int(text["num_attention_heads"])
        eos = _first_set(text, raw, keys=("eos_token_id",))
        eos_list = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        tie = bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        if "tie_word_embeddings" in text:
            tie = bool(text["tie_word_embeddings"])
        return cls(
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
        )

    @classmethod
    def from_model_dir(cls, model_dir: str) -> ModelConfig:
        if not os.path.isdir(model_dir):
            raise FileNotFoundError(f"model directory not found: {model_dir!r}")
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config.json not found in model directory {model_dir!r}")
        with open(path, encoding="utf-8") as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: invalid JSON ({e})") from e
        return cls.from_dict(raw)


def _first_set(*sources: dict[str, Any], keys: tuple[str, ...]) -> Any:
    """First non-null value of ``keys`` in ``sources`` (in order): transformers writes explicit nulls
    (``"eos_token_id": null``, ``"dtype": null``) into ``text_config``, which must not hide the top-level value."""
    for source in sources:
        for key in keys:
            if source.get(key) is not None:
                return source[key]
    return None


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto`` takes the checkpoint's dtype on CUDA and float32 on the CPU (bf16 matmuls are slow there)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16, float16 or auto")
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return _DTYPES.get(str(model_config.torch_dtype), torch.bfloat16)
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16, float16 or auto")
    return _DTYPES[dtype]


@dataclass(slots=True)
class EngineConfig:
    """Engine knobs; names follow vLLM's engine arguments."""

    model: str
    dtype: str | torch.dtype = "auto"
    device: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    speculative_config: dict[str, Any] | None = None
    seed: int = 0
    gpu_memory_utilization: float = 0.9
    # CPU has no device memory to profile: the KV cache + state pool get this many bytes.
    cpu_cache_memory_bytes: int = 256 * 1024 * 1024
    # Test and expert overrides: fix the pool sizes instead of deriving them from a budget.
    num_kv_blocks: int | None = None
    num_state_slots: int | None = None
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    # Prefix caching: recurrent snapshots every this many tokens (a multiple of block_size), besides the end of each
    # prompt, the end of each request and branch points; and the share of the cache budget snapshots may use.
    # 2048: on the Qwen3.5 shapes one snapshot (all GDN layers) takes the memory of ~1.6k tokens of KV, so interval
    # snapshots cost at most about as much as the KV they index; multi-turn resumes and siblings hit at prompt ends,
    # request ends and branch points, which do not depend on the interval (benchmarks/results/prefix_cache.md).
    recurrent_snapshot_interval: int = 2048
    snapshot_memory_fraction: float = 0.2
    num_snapshot_slots: int | None = None
    # CUDA graphs for decode steps (CUDA only): off with enforce_eager; the padded batch sizes to capture
    # (default: hyserve.engine.cuda_graphs.DEFAULT_CAPTURE_SIZES up to max_num_seqs).
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None

    def validate(self) -> None:
        if self.block_size <= 0 or (self.block_size % 8 != 0 and self.block_size not in (1, 2, 4)):
            raise ValueError(f"block_size must be a positive power of two (got {self.block_size})")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive (got {self.max_num_seqs})")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive (got {self.max_num_batched_tokens})")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive (got {self.max_model_len})")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1] (got {self.gpu_memory_utilization})")
        if self.pipeline_parallel_size != 1:
            raise ValueError(
                f"pipeline_parallel_size={self.pipeline_parallel_size} is not supported yet; "
                "set --pipeline-parallel-size 1"
            )
        if self.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} is not supported yet; "
                "set --tensor-parallel-size 1"
            )
