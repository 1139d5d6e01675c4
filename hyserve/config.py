"""Configuration: the model's shape (parsed from a checkpoint's config.json by its family's parser, beside the
family's model file; which parser reads a checkpoint is ``hyserve.model.registry``'s, ``load_model_config``) and the
engine's knobs."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from hyserve.layers.quantization import QuantizationConfig

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


@dataclass(frozen=True, slots=True)
class MultimodalConfig:
    """What a ``Qwen3_5ForConditionalGeneration`` checkpoint says about image input: the special token ids, the text
    rotary's M-RoPE layout (``hyserve.model.mrope``) and the vision tower's config (``hyserve.model.vision``).
    Defaults are transformers' ``Qwen3_5Config``'s."""

    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    mrope_section: tuple[int, ...] = (11, 11, 10)
    vision_config: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ModelConfig:
    """What the engine reads of a checkpoint's model, whatever its family: the layer kinds, the attention heads, the
    vocabulary, the context length, the dtype and the quantization. A family's parser (beside its model file, named
    by ``hyserve.model.registry``) returns a subclass that adds what only its layers read (``Qwen3_5Config``); the
    caches are planned from the specs the built layers declare, not from fields here."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: list[str]
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    eos_token_id: list[int] = field(default_factory=list)
    architecture: str = ""
    torch_dtype: str | None = None
    # How the linear layers' weights are kept (the checkpoint's quantization_config, or online FP8); None: in the
    # model dtype (hyserve.layers.quantization).
    quantization: QuantizationConfig | None = None
    # Image input: the checkpoint's vision tower and M-RoPE layout (None: a text-only checkpoint).
    multimodal: MultimodalConfig | None = None
    # The recurrent layers' temporal (SSM) state's element type, a torch dtype name: float32 unless the engine was
    # told otherwise (EngineConfig.mamba_ssm_cache_dtype, resolved by resolve_ssm_state_dtype).
    ssm_state_dtype: str = "float32"

    @property
    def image_refusal(self) -> str | None:
        """Why this checkpoint refuses image input although it has a vision tower (None: it takes images)."""
        return None

    @property
    def residual_width(self) -> int:
        """Elements per token of what the model's forward returns and pipeline stages hand over (the hidden
        states the LM head and the draft head read): ``hidden_size``, or wider for a family with several residual
        streams (Qwen4-Exp's hyper-connections)."""
        return self.hidden_size

    @property
    def stage_handover_parts(self) -> int:
        """Tensors of ``residual_width`` per token that a pipeline stage hands the next one: the residual stream
        and the last layer's pending MLP output (whose add the next stage fuses into its first norm), or one for a
        family whose layers leave nothing pending (Qwen4-Exp's streams)."""
        return 2

    @property
    def attention_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def linear_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    # Checkpoint tensors under this prefix are the draft head's: the loader returns them instead of loading them.
    draft_prefix: ClassVar[str | None] = None

    def checkpoint_name(self, name: str) -> str:
        """The model's name for checkpoint tensor ``name`` (the loader's name map; by default the same name)."""
        return name

    def disk_name(self, name: str, names_on_disk: list[str]) -> str:
        """How a checkpoint holding ``names_on_disk`` would name the model's tensor ``name`` (the inverse of
        ``checkpoint_name``, for messages about missing tensors; by default the same name)."""
        return name

    def tensor_parallel_counts(self, expert_parallel: bool = False) -> dict[str, int]:
        """The sizes a tensor-parallel size must divide, by config name (a family adds those its layers shard;
        ``expert_parallel``: its MoE layers place whole experts on ranks)."""
        return {"num_attention_heads": self.num_attention_heads, "vocab_size": self.vocab_size}

    def check_tensor_parallel(self, tp: int, expert_parallel: bool = False) -> None:
        """Refuse (naming both numbers) a tensor-parallel size that does not split the model's heads (and experts,
        with ``expert_parallel``)."""
        if tp == 1:
            return
        for name, n in self.tensor_parallel_counts(expert_parallel).items():
            if n % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={n} of this checkpoint; use a "
                                 "--tensor-parallel-size that divides it")
        kv = self.num_key_value_heads
        if kv % tp and tp % kv:
            raise ValueError(f"tensor_parallel_size={tp} and num_key_value_heads={kv}: one must divide the other")

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """The model's parameter count, as the family's config computes it from its shapes."""
        raise NotImplementedError(f"{type(self).__name__} does not count its parameters")


# vLLM's dtype names (``float`` and ``half`` included) and their short forms.
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")
DTYPE_CHOICES_TEXT = "auto, half, float16, bfloat16, float or float32"


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
        raise ValueError(f"unsupported dtype {dtype!r}; use {DTYPE_CHOICES_TEXT}")
    return _DTYPES[dtype]


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's torch dtype; FP8 needs a CUDA GPU of compute capability 8.9 or newer (or the CPU, where the
    reference kernels emulate it)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}")
    if device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        if cc < (8, 9):
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs FP8 support (compute capability 8.9 or newer); "
                             f"{torch.cuda.get_device_name(device)} has {cc[0]}.{cc[1]}")
    return torch.float8_e4m3fn


# --mamba-ssm-cache-dtype (vLLM's name and values): "auto" is the model's dtype, as vLLM reads it.
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_ssm_state_dtype(mamba_ssm_cache_dtype: str | None, model_dtype: torch.dtype) -> str:
    """The recurrent state's element type (a torch dtype name) for ``--mamba-ssm-cache-dtype``: None (not given)
    keeps it in float32, hyserve's default (the delta rule accumulates over the whole sequence); "auto" takes the
    model's dtype, as vLLM's default does; a dtype name takes that dtype. The state is computed in float32 in every
    case and rounded to this dtype where it is stored."""
    if mamba_ssm_cache_dtype is None:
        return "float32"
    if mamba_ssm_cache_dtype not in MAMBA_SSM_CACHE_DTYPES:
        raise ValueError(f"mamba_ssm_cache_dtype={mamba_ssm_cache_dtype!r} is not supported; use one of "
                         f"{', '.join(MAMBA_SSM_CACHE_DTYPES)} (--mamba-ssm-cache-dtype)")
    if mamba_ssm_cache_dtype == "auto":
        return str(model_dtype).removeprefix("torch.")
    return mamba_ssm_cache_dtype


# --snapshot-host-memory-gb's default on CUDA (GiB per worker): 55 float32 snapshots of the 27B shape's GDN state.
DEFAULT_SNAPSHOT_HOST_MEMORY_GB = 8.0


def snapshot_host_memory_bytes(gb: float | None, device_type: str) -> int:
    """Bytes per worker of the prefix cache's host tier for ``--snapshot-host-memory-gb`` (None: the default)."""
    if gb is None:
        gb = DEFAULT_SNAPSHOT_HOST_MEMORY_GB if device_type == "cuda" else 0.0
    return int(gb * 2**30)


def _finite_gb(value: object) -> bool:
    """A size in GiB as a flag takes it: a finite number >= 0 (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


# --mm-processor-cache-gb: vLLM's default (GiB).
DEFAULT_MM_PROCESSOR_CACHE_GB = 4.0


@dataclass(slots=True)
class EngineConfig:
    """Engine knobs; names follow vLLM's engine arguments."""

    model: str
    dtype: str | torch.dtype = "auto"
    device: str | None = None
    max_model_len: int | None = None
    # None: DEFAULT_MAX_NUM_SEQS, lowered quietly (INFO) to what the cache holds; a value the user set is lowered with
    # a WARNING.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    speculative_config: dict[str, Any] | None = None
    seed: int = 0
    gpu_memory_utilization: float = 0.9
    # CPU has no device memory to profile: the KV cache + state pool get this many bytes.
    cpu_cache_memory_bytes: int = 256 * 1024 * 1024
    # torch's intra-op threads on the CPU (None: see resolve_cpu_threads).
    cpu_threads: int | None = None
    # Default sampling parameters: "auto" = the checkpoint's generation_config.json, "vllm" = none (SamplingParams'
    # own defaults), or a directory holding a generation_config.json (see hyserve.tokenizer.generation_defaults).
    generation_config: str = "auto"
    # vLLM's --override-generation-config: generation_config.json keys set over (or, with "vllm", instead of) the
    # file's (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens).
    override_generation_config: dict[str, Any] | None = None
    # Periodic throughput / queue / cache-usage log lines from LLMEngine.step (on for serve, off offline).
    disable_log_stats: bool = True
    log_stats_interval_s: float = 5.0
    # Test and expert overrides: fix the pool sizes instead of deriving them from a budget.
    num_kv_blocks: int | None = None
    num_state_slots: int | None = None
    # Pipeline parallelism: stages of consecutive decoder layers, one worker process per stage (x the tensor-
    # parallel size); pp_layer_partition gives each stage's layer count (default: an even split).
    pipeline_parallel_size: int = 1
    pp_layer_partition: list[int] | None = None
    tensor_parallel_size: int = 1
    # MoE models with tensor_parallel_size > 1: each rank holds whole experts (E / T of them, contiguous) instead of
    # a slice of every expert; attention, the recurrent mixers and the shared expert stay tensor-parallel.
    enable_expert_parallel: bool = False
    # Where the workers run: "uni" (in this process, the default), "mp" (one process per worker, started here) or
    # "torchrun" (every rank started by torchrun; rank 0 runs the engine).
    distributed_executor_backend: str | None = None
    # Prefix caching: recurrent snapshots every this many tokens (a multiple of block_size), besides the end of each
    # prompt, the end of each request and branch points; and the share of the cache budget snapshots may use.
    # 2048: on the Qwen3.5 shapes one snapshot (all GDN layers) takes the memory of ~1.6k tokens of KV, so interval
    # snapshots cost at most about as much as the KV they index; multi-turn resumes and siblings hit at prompt ends,
    # request ends and branch points, which do not depend on the interval (benchmarks/results/prefix_cache.md).
    recurrent_snapshot_interval: int = 2048
    # None: DEFAULT_SNAPSHOT_MEMORY_FRACTION, raised (up to MAX_SNAPSHOT_MEMORY_FRACTION) to hold the snapshots a
    # max_num_seqs the user set can hold at once while decoding (hyserve.cache.planner.plan_caches).
    snapshot_memory_fraction: float | None = None
    num_snapshot_slots: int | None = None
    # The prefix cache's host tier: GiB of host memory per worker for the resume points the snapshot budget evicts
    # (hyserve.cache.prefix_cache). None: DEFAULT_SNAPSHOT_HOST_MEMORY_GB on CUDA, 0 on the CPU (where the cache is
    # host memory already); 0: off. num_host_snapshot_slots: the count instead (tests, replays).
    snapshot_host_memory_gb: float | None = None
    num_host_snapshot_slots: int | None = None
    # Snapshots at points inside a prefill chunk are written from the state the prefill computes there, so chunks
    # need not end at snapshot points. None: where every recurrent layer can (GDN and Mamba2 models; Qwen4-Exp's
    # PLE layers cannot yet), else chunks end at snapshot points; True: required (refused at startup where a layer
    # cannot); False: chunks end at snapshot points.
    snapshots_inside_rows: bool | None = None
    # CUDA graphs for decode steps (CUDA only): off with enforce_eager; the padded batch sizes to capture
    # (default: hyserve.worker.cuda_graphs.DEFAULT_CAPTURE_SIZES up to max_num_seqs).
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None
    # Async scheduling: step n + 1 is scheduled and launched before step n's result is read (its sampled ids stay
    # on the device and feed step n + 1). None = on with CUDA, off on the CPU (where it buys little).
    async_scheduling: bool | None = None
    # "fp8": quantize an unquantized checkpoint's linear layers to FP8 as they load (vLLM's online FP8). FP8
    # checkpoints need no flag: their quantization_config says how they are quantized.
    quantization: str | None = None
    # The attention KV cache's element type: "auto" = the model's dtype; "fp8" (= "fp8_e4m3") stores K and V in
    # float8_e4m3fn, each divided by its layer's per-tensor scale (1.0: vLLM's default without checkpoint scales).
    # The block size and the recurrent state (float32) do not change.
    kv_cache_dtype: str = "auto"
    # The recurrent layers' SSM state's element type (vLLM's mamba_ssm_cache_dtype): None keeps float32; "auto" is
    # the model's dtype (vLLM's default); "float32" / "bfloat16" / "float16". The conv window keeps the model dtype.
    mamba_ssm_cache_dtype: str | None = None
    # Image input (vLLM's names): the most images one prompt may carry (None: MM_DEFAULT_LIMIT per modality; only
    # "image" is served); the hosts http(s) image URLs may be fetched from (exact names; none: no remote fetch);
    # the directory file:// image URLs may read under (None: no local files).
    limit_mm_per_prompt: dict[str, int] | None = None
    allowed_media_domains: list[str] | None = None
    allowed_local_media_path: str | None = None
    # GiB of processed images (pixel rows) kept by content hash, so an image sent again is not processed again
    # (vLLM's mm_processor_cache_gb and its default; 0 keeps none). hyserve.multimodal.processor_cache.
    mm_processor_cache_gb: float = DEFAULT_MM_PROCESSOR_CACHE_GB
    # Where the weights come from (vLLM's load_format): "auto" / "safetensors" = the checkpoint's safetensors files;
    # "dummy" = small random values from config.json alone (hyserve.model.dummy_weights), seeded by ``seed``.
    load_format: str = "auto"

    @property
    def image_limit(self) -> int:
        """The most images one prompt may carry (``limit_mm_per_prompt["image"]``, default MM_DEFAULT_LIMIT)."""
        return (self.limit_mm_per_prompt or {}).get("image", MM_DEFAULT_LIMIT)

    def validate(self) -> None:
        check_load_format(self.load_format)
        for modality, limit in (self.limit_mm_per_prompt or {}).items():
            if modality not in MM_MODALITIES:
                raise ValueError(f"limit_mm_per_prompt: modality {modality!r} is not served; the modalities are "
                                 f"{', '.join(MM_MODALITIES)} (--limit-mm-per-prompt)")
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
                raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be a non-negative integer (got {limit!r})")
        if not _finite_gb(self.mm_processor_cache_gb):
            raise ValueError(f"mm_processor_cache_gb must be a finite number >= 0 (got {self.mm_processor_cache_gb!r}) "
                             "(--mm-processor-cache-gb)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; use one of "
                             f"{', '.join(KV_CACHE_DTYPES)} (--kv-cache-dtype)")
        if self.mamba_ssm_cache_dtype is not None:
            resolve_ssm_state_dtype(self.mamba_ssm_cache_dtype, torch.float32)
        if self.block_size <= 0 or (self.block_size % 8 != 0 and self.block_size not in (1, 2, 4)):
            raise ValueError(f"block_size must be a positive power of two (got {self.block_size})")
        if self.max_num_seqs is not None and self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive (got {self.max_num_seqs})")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive (got {self.max_num_batched_tokens})")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive (got {self.max_model_len})")
        if self.snapshot_memory_fraction is not None and not (
                _finite_gb(self.snapshot_memory_fraction) and self.snapshot_memory_fraction < 1):
            raise ValueError(f"snapshot_memory_fraction must be a number in [0, 1) (got "
                             f"{self.snapshot_memory_fraction!r}) (--snapshot-memory-fraction)")
        if self.snapshot_host_memory_gb is not None and not _finite_gb(self.snapshot_host_memory_gb):
            raise ValueError(f"snapshot_host_memory_gb must be a finite number >= 0 (got "
                             f"{self.snapshot_host_memory_gb!r}) (--snapshot-host-memory-gb)")
        if self.num_host_snapshot_slots is not None and self.num_host_snapshot_slots < 0:
            raise ValueError(f"num_host_snapshot_slots must be >= 0 (got {self.num_host_snapshot_slots})")
        if self.cpu_cache_memory_bytes <= 0:
            raise ValueError(f"cpu_cache_memory_bytes must be positive (got {self.cpu_cache_memory_bytes})")
        if self.cpu_threads is not None and self.cpu_threads <= 0:
            raise ValueError(f"cpu_threads must be positive (got {self.cpu_threads})")
        if self.log_stats_interval_s <= 0:
            raise ValueError(f"log_stats_interval_s must be positive (got {self.log_stats_interval_s})")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1] (got {self.gpu_memory_utilization})")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be positive (got {self.pipeline_parallel_size})")
        if self.pp_layer_partition is not None and self.pipeline_parallel_size == 1 \
                and len(self.pp_layer_partition) != 1:
            raise ValueError(f"pp_layer_partition {self.pp_layer_partition} needs pipeline_parallel_size="
                             f"{len(self.pp_layer_partition)} (--pipeline-parallel-size)")
        if self.distributed_executor_backend not in (None, "uni", "mp", "torchrun"):
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r}; use 'uni', 'mp' "
                             "or 'torchrun' (--distributed-executor-backend)")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be positive (got {self.tensor_parallel_size})")
        if self.world_size > 1 and self.distributed_executor_backend == "uni":
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} x pipeline_parallel_size="
                             f"{self.pipeline_parallel_size} needs one process per rank: use "
                             "--distributed-executor-backend mp (the default with more than one rank)")

    @property
    def world_size(self) -> int:
        """Worker processes: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


DEFAULT_MAX_NUM_SEQS = 256
# vLLM's --load-format values: the ones served, and vLLM's others (refused, naming the flag).
LOAD_FORMATS = ("auto", "safetensors", "dummy")
OTHER_VLLM_LOAD_FORMATS = ("pt", "npcache", "tensorizer", "sharded_state", "gguf", "bitsandbytes", "mistral",
                           "runai_streamer", "runai_streamer_sharded", "fastsafetensors")


def check_load_format(load_format: object) -> None:
    """Refuse a ``load_format`` hyserve does not serve, naming the flag."""
    if load_format in LOAD_FORMATS:
        return
    what = "vLLM's load format" if load_format in OTHER_VLLM_LOAD_FORMATS else "load format"
    raise ValueError(f"{what} {load_format!r} is not supported (--load-format): use 'auto' or 'safetensors' (the "
                     "checkpoint's safetensors files) or 'dummy' (random weights from config.json alone)")
# --limit-mm-per-prompt: vLLM's default for a modality the flag does not name; the modalities served.
MM_DEFAULT_LIMIT = 999
MM_MODALITIES = ("image",)
# Token budget per step when max_num_batched_tokens is not given: on a GPU large enough that a 16k-token prefill
# step runs near the GEMMs' throughput (vLLM's offline default on large cards is the same); on the CPU small steps
# keep chunked prefill interleaved with decodes.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 16384, "cpu": 2048}


def default_max_num_batched_tokens(device_type: str) -> int:
    return DEFAULT_MAX_NUM_BATCHED_TOKENS.get(device_type, 2048)


def normalize_mm_limits(value: Any) -> dict[str, int]:
    """``limit_mm_per_prompt`` as EngineConfig takes it: ``{"image": 2}``, or vLLM's ``{"image": {"count": 2}}``.
    vLLM's ``width``/``height`` (the size of its memory-profiling images) are refused: hyserve's profile encodes
    the processor's largest image, so they would be accepted and ignored. Raises ValueError naming the entry;
    modalities are checked by ``EngineConfig.validate``."""
    if not isinstance(value, Mapping):
        raise ValueError(f"limit_mm_per_prompt must be a JSON object such as {{\"image\": 2}} (got {value!r})")
    out: dict[str, int] = {}
    for modality, limit in value.items():
        if isinstance(limit, Mapping):
            sized = [k for k in ("width", "height") if k in limit]
            if sized:
                verb = "is" if len(sized) == 1 else "are"
                raise ValueError(f"limit_mm_per_prompt[{modality!r}]: {' and '.join(sized)} {verb} not used (the "
                                 "memory profile encodes the largest image the checkpoint's processor makes); give "
                                 "only the "
                                 f"count, e.g. {{\"{modality}\": {{\"count\": {limit.get('count', 2)}}}}}")
            extra = sorted(set(limit) - {"count"})
            if extra or "count" not in limit:
                raise ValueError(f"limit_mm_per_prompt[{modality!r}]: give a count, e.g. {{\"{modality}\": 2}} or "
                                 f"{{\"{modality}\": {{\"count\": 2}}}} (got {json.dumps(limit)})")
            limit = limit["count"]
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be a non-negative integer (got {limit!r})")
        out[str(modality)] = limit
    return out


_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "tb": 10**12}


def parse_size(text: str) -> int:
    """Bytes from ``'268435456'``, ``'256MiB'``, ``'1GiB'``, ``'1.5 GB'`` (binary and decimal units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"invalid size {text!r}: use bytes or a number with KiB, MiB, GiB, KB, MB or GB")
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"invalid size {text!r}: must be positive")
    return value


# The thread count hyserve itself last gave torch: a later engine must not take its own earlier choice for the user's.
_threads_set_by_engine: int | None = None
# torch's thread count when hyserve was imported: a change since then is the user's torch.set_num_threads.
_threads_at_import = torch.get_num_threads()


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, as taskset / cgroup cpusets set it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def resolve_cpu_threads(requested: int | None) -> tuple[int | None, str]:
    """torch's intra-op thread count for a CPU engine, and why (for the startup log); ``None`` = leave it.

    torch defaults to one thread per core. On a busy machine its OpenMP threads then wait on each other in spin
    barriers while another process holds a core: decode of the packaged model ran 2.3 tok/s with 2 threads on
    2 cores beside one busy process, 61 tok/s with 1. So the default is one thread fewer than the CPUs available
    (one is left to the engine loop, the server and whatever else runs), at least 1. A choice the user made wins:
    ``cpu_threads``, else ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``, else a ``torch.set_num_threads`` call made
    after hyserve was imported.
    """
    if requested is not None:
        return requested, "as asked"
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if os.environ.get(var):
            return None, f"{var}={os.environ[var]} is set"
    current = torch.get_num_threads()
    if current != _threads_at_import and current != _threads_set_by_engine:
        return None, "torch.set_num_threads was called"
    cpus = available_cpus()
    return max(1, cpus - 1), f"{cpus} CPUs available, one left for the engine loop and other work"


def apply_cpu_threads(requested: int | None) -> tuple[int, str]:
    """Set torch's intra-op threads per ``resolve_cpu_threads``; returns the count in effect and the reason."""
    global _threads_set_by_engine
    n, why = resolve_cpu_threads(requested)
    if n is not None:
        torch.set_num_threads(n)
        _threads_set_by_engine = n
    return torch.get_num_threads(), why
