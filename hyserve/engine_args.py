"""The engine flag set shared by every subcommand: ``hyserve generate``, ``serve`` and ``demo`` (``hyserve.cli``) and
``hyserve bench`` and ``soak`` (``hyserve.tools``), and the ``LLM`` those flags build. Its own module so that the
command line and the tools both import it and neither imports the other."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from hyserve.config import (
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MM_PROCESSOR_CACHE_GB,
    DTYPE_CHOICES,
    KV_CACHE_DTYPES,
    MM_DEFAULT_LIMIT,
    normalize_mm_limits,
    parse_size,
)
from hyserve.layers.quantization import QUANTIZATION_CHOICES

__all__ = ["engine_args", "local_media_dir", "make_llm", "mm_limits", "size_bytes"]


def size_bytes(value: str) -> int:
    """argparse type of a memory size: bytes or a number with a unit (``256MiB``, ``1GiB``, ``2GB``)."""
    try:
        return parse_size(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def layer_counts(value: str) -> list[int]:
    """argparse type of ``--pp-layer-partition``: comma-separated positive layer counts."""
    try:
        counts = [int(x) for x in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give layer counts separated by commas, e.g. 13,13,13,9"
                                         ) from None
    if any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"{value!r}: every stage needs at least one layer")
    return counts


def mm_limits(value: str) -> dict[str, int]:
    """argparse type of ``--limit-mm-per-prompt``: JSON, ``{"image": 2}`` or ``{"image": {"count": 2}}``."""
    try:
        return normalize_mm_limits(json.loads(value))
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{value!r} is not valid JSON ({e}); e.g. '{{\"image\": 2}}'") from None
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def local_media_dir(value: str) -> str:
    """argparse type of ``--allowed-local-media-path``: an existing directory (returned absolute)."""
    if not os.path.isdir(value):
        what = "is not a directory" if os.path.exists(value) else "does not exist"
        raise argparse.ArgumentTypeError(f"{value!r} {what}: give the directory file:// image URLs may read under")
    return os.path.abspath(value)


def engine_args(p: argparse.ArgumentParser, serving: bool = False) -> None:
    """Add the engine flags (every subcommand takes them; ``serving`` adds the server-only ones) to ``p``."""
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weights and activations; auto = the checkpoint's on CUDA, float32 on the CPU (default: auto)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's, capped by the KV cache")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"most requests running at once (default: {DEFAULT_MAX_NUM_SEQS}, or fewer if the cache "
                        "cannot hold their recurrent state)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default: 16384 on CUDA, 2048 on the CPU)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens (default: 16)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="attention KV cache element type: auto (the model's dtype) or fp8 (= fp8_e4m3; the block "
                        "size stays the same)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: the share of the card this instance may use, weights and activations included "
                        "(default: 0.9)")
    p.add_argument("--cpu-cache-memory", type=size_bytes, default=256 * 2**20, metavar="SIZE",
                   help="CPU: memory for the KV cache, recurrent state and snapshots, in bytes or with a unit "
                        "(256MiB, 1GiB) (default: 256MiB)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="CPU: torch's intra-op threads (default: OMP_NUM_THREADS if set, else the available CPUs "
                        "minus one, at least 1)")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="default sampling parameters: auto = the checkpoint's generation_config.json (temperature, "
                        "top_p, top_k, min_p, max_new_tokens), vllm = ignore it, or a directory holding one "
                        "(default: auto)")
    if serving:
        p.add_argument("--disable-log-stats", action="store_true",
                       help="no periodic throughput / queue / cache-usage log line (default: logged every 5 s)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="prefix caching of KV blocks and recurrent snapshots (default: on)")
    p.add_argument("--recurrent-snapshot-interval", type=int, default=2048,
                   help="prefix caching: also snapshot recurrent state every N tokens (default: 2048)")
    p.add_argument("--snapshot-memory-fraction", type=float, default=0.2,
                   help="prefix caching: share of cache memory for recurrent snapshots (default: 0.2)")
    p.add_argument("--speculative-config", type=json.loads, default=None, help="JSON, e.g. '{\"method\": \"mtp\"}'")
    p.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling (default: 0)")
    p.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="pipeline stages of consecutive layers, tensor-parallel-size worker processes each "
                        "(default: 1)")
    p.add_argument("--pp-layer-partition", type=layer_counts, default=None, metavar="N,N,...",
                   help="decoder layers per pipeline stage, e.g. 13,13,13,9 (default: an even split, the remainder "
                        "on the stages before the last)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="tensor-parallel ranks, one worker process each (default: 1)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: run every step eagerly")
    p.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "torchrun"],
                   help="where the workers run: uni = in this process (default with one rank), mp = one process "
                        "per rank started here (default with more), torchrun = every rank started by torchrun")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch step n+1 before step n's result is read (default: on with CUDA, off "
                        "on the CPU)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                   help="fp8: quantize a bf16 checkpoint's linear layers to FP8 as it loads (per channel; activations "
                        "per token). FP8 checkpoints (compressed-tensors, Qwen's block FP8) need no flag "
                        "(default: none)")
    p.add_argument("--limit-mm-per-prompt", type=mm_limits, default=None, metavar="JSON",
                   help="most images one prompt may carry, e.g. '{\"image\": 2}' (vLLM's "
                        "'{\"image\": {\"count\": 2}}' too); image=0 turns image input off "
                        f"(default: {MM_DEFAULT_LIMIT} images)")
    p.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="hosts whose http(s) image URLs may be fetched, exact names (default: none: remote image "
                        "URLs are refused; data: URLs always work)")
    p.add_argument("--allowed-local-media-path", type=local_media_dir, default=None, metavar="DIR",
                   help="a directory file:// image URLs may read under, symlinks resolved (default: none: file:// "
                        "URLs are refused)")
    p.add_argument("--mm-processor-cache-gb", type=float, default=DEFAULT_MM_PROCESSOR_CACHE_GB, metavar="GIB",
                   help="GiB of processed images kept by content hash, so an image sent again (an agent's earlier "
                        "screenshot) is not resized and normalised again; 0 keeps none "
                        f"(default: {DEFAULT_MM_PROCESSOR_CACHE_GB:g}, as vLLM)")
    p.add_argument("--cuda-graph-sizes", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="decode batch sizes to capture, comma-separated (default: 1,2,4,8,16,24,32,48,64,...,256 "
                        "up to --max-num-seqs)")


def make_llm(args: argparse.Namespace, model: str | None) -> Any:
    """An ``LLM`` built from the flags ``engine_args`` added (``model`` None = the packaged default model)."""
    from hyserve.llm import LLM

    return LLM(model=model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
               enable_prefix_caching=args.enable_prefix_caching, speculative_config=args.speculative_config,
               seed=args.seed, pipeline_parallel_size=args.pipeline_parallel_size,
               pp_layer_partition=args.pp_layer_partition,
               recurrent_snapshot_interval=args.recurrent_snapshot_interval,
               snapshot_memory_fraction=args.snapshot_memory_fraction,
               tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
               cuda_graph_sizes=args.cuda_graph_sizes, cpu_cache_memory_bytes=args.cpu_cache_memory,
               cpu_threads=args.cpu_threads, generation_config=args.generation_config,
               async_scheduling=args.async_scheduling, kv_cache_dtype=args.kv_cache_dtype,
               quantization=args.quantization,
               distributed_executor_backend=args.distributed_executor_backend,
               limit_mm_per_prompt=args.limit_mm_per_prompt, allowed_media_domains=args.allowed_media_domains,
               allowed_local_media_path=args.allowed_local_media_path,
               mm_processor_cache_gb=args.mm_processor_cache_gb,
               disable_log_stats=getattr(args, "disable_log_stats", True))
