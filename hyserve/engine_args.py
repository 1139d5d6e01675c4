"""The engine flag set shared by every subcommand: ``hyserve generate``, ``serve`` and ``demo`` (``hyserve.cli``) and
``hyserve bench`` and ``soak`` (``hyserve.tools``), and the ``LLM`` those flags build. Its own module so that the
command line and the tools both import it and neither imports the other."""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from hyserve.config import (
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MM_PROCESSOR_CACHE_GB,
    DEFAULT_SNAPSHOT_HOST_MEMORY_GB,
    DTYPE_CHOICES,
    KV_CACHE_DTYPES,
    MAMBA_SSM_CACHE_DTYPES,
    MM_DEFAULT_LIMIT,
    check_load_format,
    normalize_mm_limits,
    parse_size,
)
from hyserve.layers.quantization import QUANTIZATION_CHOICES

__all__ = ["EngineArgumentParser", "engine_args", "expand_dotted", "llm_kwargs", "load_chat_template",
           "local_media_dir", "make_llm", "mm_limits", "size_bytes"]

logger = logging.getLogger(__name__)

# Flags whose value is a JSON object; each also takes vLLM's dotted form (``--limit-mm-per-prompt.image 10``).
DICT_FLAGS = ("--limit-mm-per-prompt", "--speculative-config", "--compilation-config", "--override-generation-config")
# vLLM's environment variable for an uneven pipeline split: layer counts per stage, comma-separated.
PP_PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"
# --compilation-config's cudagraph_mode values and the keys hyserve reads.
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
COMPILATION_KEYS = ("cudagraph_mode", "cudagraph_capture_sizes")
MAMBA_CACHE_MODES = ("none", "all", "align")
# vLLM's environment variables whose purpose hyserve serves by construction, and why (one INFO line each when set).
VLLM_ENV_BY_CONSTRUCTION = {
    "VLLM_NO_USAGE_STATS": "no usage statistics are ever collected or sent",
    "VLLM_DO_NOT_TRACK": "no usage statistics are ever collected or sent",
    "VLLM_USE_FLASHINFER_SAMPLER": "sampling always runs hyserve's own torch sampler",
}
# The server's logprobs limit (hyserve.server.protocol.MAX_LOGPROBS, vLLM's default --max-logprobs), fixed.
FIXED_MAX_LOGPROBS = 20


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


def json_object(value: str) -> dict[str, Any] | None:
    """argparse type of a JSON-object flag (``--speculative-config``, ``--compilation-config``); ``null`` = none."""
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{value!r} is not valid JSON ({e})") from None
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"{value!r}: expected a JSON object such as '{{\"key\": value}}'")
    return obj


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
    p.add_argument("--mamba-ssm-cache-dtype", default=None, choices=MAMBA_SSM_CACHE_DTYPES,
                   help="the recurrent (GDN) SSM state's stored element type: float32 when not given; auto (the "
                        "model's dtype, vLLM's default), bfloat16 or float16 halve the state's bytes (computed in "
                        "float32, rounded where stored)")
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
    p.add_argument("--override-generation-config", type=json_object, default=None, metavar="JSON",
                   help="generation_config.json keys set over the --generation-config ones, e.g. "
                        "'{\"temperature\": 0.5}' or --override-generation-config.temperature 0.5 (keys: temperature, "
                        "top_p, top_k, min_p, repetition_penalty, max_new_tokens; default: none)")
    if serving:
        p.add_argument("--disable-log-stats", action="store_true",
                       help="no periodic throughput / queue / cache-usage log line (default: logged every 5 s)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="prefix caching of KV blocks and recurrent snapshots (default: on)")
    p.add_argument("--recurrent-snapshot-interval", type=int, default=2048,
                   help="prefix caching: also snapshot recurrent state every N tokens (default: 2048)")
    p.add_argument("--snapshot-memory-fraction", type=float, default=None,
                   help="prefix caching: share of cache memory for recurrent snapshots (default: 0.2, raised up to "
                        "0.4 to hold the snapshots that a --max-num-seqs you set can hold at once while decoding: "
                        "(2 + steps in flight) a request)")
    p.add_argument("--snapshot-host-memory-gb", type=float, default=None,
                   help="prefix caching: GiB of pinned host memory per worker that keeps the resume points the "
                        "snapshot budget evicts, copied back on a hit; 0 turns it off (default: "
                        f"{DEFAULT_SNAPSHOT_HOST_MEMORY_GB:g} on CUDA, 0 on the CPU)")
    p.add_argument("--snapshots-inside-rows", action=argparse.BooleanOptionalAction, default=None,
                   help="prefix caching: take recurrent snapshots inside prefill chunks instead of ending chunks at "
                        "snapshot points (default: where every recurrent layer can: GDN and Mamba2 models)")
    p.add_argument("--speculative-config", type=json_object, default=None, metavar="JSON",
                   help="speculative decoding, e.g. '{\"method\": \"mtp\", \"num_speculative_tokens\": 2}', or "
                        "dotted: --speculative-config.method mtp (default: none)")
    p.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling (default: 0)")
    p.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="pipeline stages of consecutive layers, tensor-parallel-size worker processes each "
                        "(default: 1)")
    p.add_argument("--pp-layer-partition", type=layer_counts, default=None, metavar="N,N,...",
                   help="decoder layers per pipeline stage, e.g. 13,13,13,9 (default: an even split, the remainder "
                        "on the stages before the last)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="tensor-parallel ranks, one worker process each (default: 1)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models with --tensor-parallel-size T > 1: each rank holds E/T whole experts instead of "
                        "a slice of every expert (the expert-parallel size is T: there is no data parallelism)")
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
    p.add_argument("--load-format", default="auto", metavar="FORMAT",
                   help="auto / safetensors: the checkpoint's safetensors files; dummy: small random weights from "
                        "config.json alone, seeded by --seed (benchmarks of shapes not on disk) (default: auto)")
    p.add_argument("--limit-mm-per-prompt", type=mm_limits, default=None, metavar="JSON",
                   help="most images one prompt may carry, e.g. '{\"image\": 2}' (vLLM's "
                        "'{\"image\": {\"count\": 2}}' too), or dotted: --limit-mm-per-prompt.image 2; image=0 turns "
                        "image input off "
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


    p.add_argument("--compilation-config", type=json_object, default=None, metavar="JSON",
                   help="vLLM's compilation config: its cudagraph_mode (FULL_AND_PIECEWISE, FULL, FULL_DECODE_ONLY: "
                        "decode and verify steps captured whole; NONE: as --enforce-eager; PIECEWISE is refused) and "
                        "cudagraph_capture_sizes (as --cuda-graph-sizes) are read, other keys refused; e.g. "
                        "'{\"cudagraph_mode\": \"FULL\"}' or --compilation-config.cudagraph_mode FULL (default: none)")
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="a Jinja chat template replacing the checkpoint's: a file, or the template text itself "
                        "(default: the checkpoint's)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="accepted only as MODEL_DIR itself: the tokenizer is always the checkpoint's (default: "
                        "MODEL_DIR)")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="accepted (INFO): prefills longer than the step's token budget are always chunked; "
                        "--no-enable-chunked-prefill is refused (default: on)")
    p.add_argument("--mamba-cache-mode", default=None, choices=MAMBA_CACHE_MODES,
                   help="accepted (INFO): the prefix cache snapshots recurrent state itself (prompt ends, request "
                        "ends, branch points, every --recurrent-snapshot-interval tokens); 'none' needs "
                        "--no-enable-prefix-caching (default: none given)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted (INFO): no code from the checkpoint is ever run (default: off)")
    if serving:
        p.add_argument("--disable-log-requests", action="store_true",
                       help="accepted (INFO): request contents are never logged (default: off)")
        p.add_argument("--enable-log-requests", action=RefusedFlag, reason="request contents are never logged",
                       help="refused: request contents are never logged (default: off)")
        p.add_argument("--max-logprobs", type=int, default=None,
                       help=f"accepted only as {FIXED_MAX_LOGPROBS}: the server's fixed limit on logprobs and "
                            f"top_logprobs (default: {FIXED_MAX_LOGPROBS})")


class RefusedFlag(argparse.Action):
    """A flag hyserve cannot honour: given, it stops the parse with an error naming it and saying why."""

    def __init__(self, option_strings: Sequence[str], dest: str, reason: str = "", **kw: Any) -> None:
        kw.setdefault("default", None)
        super().__init__(option_strings, dest, nargs=0, **kw)
        self.reason = reason

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> NoReturn:
        parser.error(f"{option_string} is not supported: {self.reason}")


def dotted_value(text: str) -> Any:
    """A dotted sub-option's value, as vLLM reads it: JSON when it parses (``10``, ``true``, ``[1, 2]``), else the
    string itself (``mtp``, ``FULL``)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def merge_into(target: dict[str, Any], update: dict[str, Any]) -> None:
    """Deep-merge ``update`` into ``target`` (nested objects merge, anything else is replaced)."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            merge_into(target[key], value)
        else:
            target[key] = value


def expand_dotted(argv: Sequence[str], flags: Sequence[str] = DICT_FLAGS) -> list[str]:
    """``argv`` with every JSON-object flag of ``flags`` given once, as JSON: vLLM's dotted sub-options
    (``--limit-mm-per-prompt.image 10``, ``--compilation-config.cudagraph_mode=FULL``, nested ``--a.b.c 1``) and its
    JSON form (``--speculative-config '{...}'``) merge, in the order given, into one object per flag, placed where
    the flag first appeared. A JSON form that is not an object is left as given (the flag's type reports it)."""
    out: list[str] = []
    merged: dict[str, dict[str, Any]] = {}
    slot: dict[str, int] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out.extend(argv[i:])
            break
        head, eq, inline = arg.partition("=")
        flag, dot, path = head.partition(".")
        if not arg.startswith("--") or flag not in flags or (not eq and i + 1 >= len(argv)):
            out.append(arg)
            i += 1
            continue
        text = inline if eq else argv[i + 1]
        i += 1 if eq else 2
        update: Any
        if dot:
            keys = path.split(".")
            if not all(keys):
                raise argparse.ArgumentTypeError(f"{head}: empty key in a dotted sub-option")
            update = {keys[-1]: dotted_value(text)}
            for key in reversed(keys[:-1]):
                update = {key: update}
        else:
            try:
                update = json.loads(text)
            except json.JSONDecodeError:
                update = None
            if not isinstance(update, dict):
                out.extend([flag, text])  # not an object: the flag's own type says what is wrong
                continue
        if flag not in slot:
            slot[flag] = len(out)
            out.append(flag)
            merged[flag] = {}
        merge_into(merged[flag], update)
    for flag, pos in sorted(slot.items(), key=lambda kv: -kv[1]):
        out.insert(pos + 1, json.dumps(merged[flag]))
    return out


class EngineArgumentParser(argparse.ArgumentParser):
    """The command line's parser: no abbreviated flags (``--chat-template`` must never be read as a prefix of
    ``--chat-template-timeout``, nor ``--max-num-seq`` as ``--max-num-seqs``) and vLLM's dotted sub-options of the
    JSON-object flags (``expand_dotted``). Subcommand parsers are of the same class."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw["allow_abbrev"] = False
        super().__init__(*args, **kw)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        import sys

        try:
            expanded = expand_dotted(sys.argv[1:] if args is None else args)
        except argparse.ArgumentTypeError as e:
            self.error(str(e))
        return super().parse_known_args(expanded, namespace)


def compilation_effects(config: dict[str, Any], enforce_eager: bool, cuda_graph_sizes: list[int] | None
                        ) -> dict[str, Any]:
    """What ``--compilation-config`` means here, as LLM keyword arguments: its ``cudagraph_mode`` maps onto CUDA
    graphs on or off (one INFO line saying what is captured), its ``cudagraph_capture_sizes`` onto
    ``cuda_graph_sizes``; anything else is refused (ValueError naming it)."""
    unknown = sorted(set(config) - set(COMPILATION_KEYS))
    if unknown:
        raise ValueError(f"--compilation-config: {', '.join(unknown)} not supported (nothing is compiled with "
                         f"torch.compile); the keys read are {', '.join(COMPILATION_KEYS)}")
    out: dict[str, Any] = {}
    if "cudagraph_mode" in config:
        mode = str(config["cudagraph_mode"]).upper()
        if mode not in CUDAGRAPH_MODES:
            raise ValueError(f"--compilation-config: cudagraph_mode {config['cudagraph_mode']!r} is not one of "
                             f"{', '.join(CUDAGRAPH_MODES)}")
        if mode == "PIECEWISE":
            raise ValueError("--compilation-config: cudagraph_mode PIECEWISE is not supported: no piecewise graphs "
                             "are captured; FULL_DECODE_ONLY (or FULL_AND_PIECEWISE, FULL) captures whole decode and "
                             "verify steps, NONE (or --enforce-eager) none")
        if mode == "NONE":
            out["enforce_eager"] = True
            logger.info("--compilation-config cudagraph_mode=NONE: no CUDA graphs, every step runs eagerly (as "
                        "--enforce-eager)")
        else:
            if enforce_eager:
                raise ValueError(f"--enforce-eager contradicts --compilation-config cudagraph_mode={mode}: give one")
            rest = "" if mode == "FULL_DECODE_ONLY" else \
                f"; {mode}'s graphs of prefill and mixed steps are not captured, the outputs are the same"
            logger.info("--compilation-config cudagraph_mode=%s: CUDA graphs capture whole decode and "
                        "speculative-verify steps, one per padded batch size, and prefill and mixed steps run "
                        "eagerly (FULL_DECODE_ONLY)%s", mode, rest)
    if "cudagraph_capture_sizes" in config:
        sizes = config["cudagraph_capture_sizes"]
        if not (isinstance(sizes, list) and sizes and all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                                         for n in sizes)):
            raise ValueError(f"--compilation-config: cudagraph_capture_sizes must be a list of positive integers "
                             f"(got {sizes!r})")
        if cuda_graph_sizes is not None and sorted(cuda_graph_sizes) != sorted(sizes):
            raise ValueError(f"--cuda-graph-sizes {cuda_graph_sizes} contradicts --compilation-config "
                             f"cudagraph_capture_sizes {sizes}: give one")
        out["cuda_graph_sizes"] = list(sizes)
    return out


def pp_partition(flag: list[int] | None, pp: int, model: str | None) -> list[int] | None:
    """The pipeline layer split: ``--pp-layer-partition``, or vLLM's ``VLLM_PP_LAYER_PARTITION`` (layer counts per
    stage, comma-separated, summing to the model's decoder layers: checked against the checkpoint's config.json
    here, so a mismatch names the variable before anything loads). Both given and different: refused."""
    text = os.environ.get(PP_PARTITION_ENV, "").strip()
    if not text:
        return flag
    try:
        counts = layer_counts(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"{PP_PARTITION_ENV}: {e}") from None
    if flag is not None and flag != counts:
        raise ValueError(f"--pp-layer-partition {','.join(map(str, flag))} contradicts {PP_PARTITION_ENV}={text}: "
                         "give one")
    from hyserve.distributed.parallel_state import layer_partition
    from hyserve.llm import default_model_dir
    from hyserve.model.registry import load_model_config

    num_layers = load_model_config(model if model is not None else default_model_dir()).num_hidden_layers
    try:
        layer_partition(num_layers, pp, counts)
    except ValueError as e:
        raise ValueError(f"{PP_PARTITION_ENV}={text}: {e} (--pipeline-parallel-size {pp})") from None
    logger.info("%s=%s: the %d pipeline stages hold %s decoder layers", PP_PARTITION_ENV, text, pp,
                ", ".join(map(str, counts)))
    return counts


def check_vllm_env(environ: Mapping[str, str]) -> None:
    """vLLM's environment variables: ``VLLM_PP_LAYER_PARTITION`` is read (``pp_partition``); those served by
    construction log one INFO line each; any other logs a WARNING that it is not read (an environment may carry
    variables meant for other programs, so they are named, not refused)."""
    for name in sorted(k for k in environ if k.startswith("VLLM_") and k != PP_PARTITION_ENV):
        if name in VLLM_ENV_BY_CONSTRUCTION:
            logger.info("%s=%s: nothing to change: %s", name, environ[name], VLLM_ENV_BY_CONSTRUCTION[name])
        else:
            logger.warning("%s is set but not read: no environment variable of that name changes hyserve "
                           "(docs/vllm_flags.md)", name)


def check_vllm_flags(args: argparse.Namespace, model: str | None, prefix_caching: bool) -> None:
    """vLLM's flags whose purpose hyserve serves by construction: each given one logs one INFO line saying why it
    changes nothing; a value that would mean something hyserve does not do is refused (ValueError naming it)."""
    chunked = getattr(args, "enable_chunked_prefill", None)
    if chunked is False:
        raise ValueError("--no-enable-chunked-prefill is not supported: prompts longer than the step's token budget "
                         "are always prefilled in chunks; a --max-num-batched-tokens of at least --max-model-len "
                         "prefills every prompt in one step")
    if chunked:
        logger.info("--enable-chunked-prefill: nothing to change: prompts longer than the step's token budget "
                    "(--max-num-batched-tokens) are always prefilled in chunks")
    mode = getattr(args, "mamba_cache_mode", None)
    if mode == "none" and prefix_caching:
        raise ValueError("--mamba-cache-mode none caches no recurrent state, which prefix caching needs: add "
                         "--no-enable-prefix-caching, or drop the flag")
    if mode == "none":
        logger.info("--mamba-cache-mode none: nothing to change: prefix caching is off, so no recurrent state is "
                    "cached")
    elif mode is not None:
        logger.info("--mamba-cache-mode %s: nothing to change: the prefix cache snapshots recurrent state by its own "
                    "rule (prompt ends, request ends, branch points, every --recurrent-snapshot-interval tokens)",
                    mode)
    if getattr(args, "trust_remote_code", False):
        logger.info("--trust-remote-code: nothing to change: no code from the checkpoint is ever run (each model "
                    "family is implemented here)")
    if getattr(args, "disable_log_requests", False):
        logger.info("--disable-log-requests: nothing to change: request contents are never logged")
    max_logprobs = getattr(args, "max_logprobs", None)
    if max_logprobs is not None and max_logprobs != FIXED_MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs {max_logprobs} is not supported: the server's limit on logprobs and "
                         f"top_logprobs is fixed at {FIXED_MAX_LOGPROBS}")
    if max_logprobs is not None:
        logger.info("--max-logprobs %d: nothing to change: the server's limit is %d", max_logprobs,
                    FIXED_MAX_LOGPROBS)
    tokenizer = getattr(args, "tokenizer", None)
    if tokenizer is not None:
        from hyserve.llm import default_model_dir

        model_dir = model if model is not None else default_model_dir()
        if os.path.realpath(tokenizer) != os.path.realpath(model_dir):
            raise ValueError(f"--tokenizer {tokenizer!r} is not supported: the tokenizer is always the checkpoint "
                             f"directory's ({model_dir!r})")
        logger.info("--tokenizer: nothing to change: it names the checkpoint directory, whose tokenizer is used")


def llm_kwargs(args: argparse.Namespace, model: str | None) -> dict[str, Any]:
    """The ``LLM`` keyword arguments the flags ``engine_args`` added mean (``model`` None = the packaged default
    model), vLLM's forms resolved: ``--compilation-config``, ``VLLM_PP_LAYER_PARTITION`` and the flags served by
    construction (``check_vllm_flags``: one INFO line each, or a refusal). ``EngineConfig(model, **kwargs)`` is
    the engine config the command line starts."""
    kw: dict[str, Any] = dict(
        device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching, speculative_config=args.speculative_config,
        seed=args.seed, pipeline_parallel_size=args.pipeline_parallel_size,
        pp_layer_partition=pp_partition(args.pp_layer_partition, args.pipeline_parallel_size, model),
        recurrent_snapshot_interval=args.recurrent_snapshot_interval,
        snapshot_memory_fraction=args.snapshot_memory_fraction,
        snapshot_host_memory_gb=args.snapshot_host_memory_gb,
        snapshots_inside_rows=args.snapshots_inside_rows,
        tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
        enable_expert_parallel=args.enable_expert_parallel,
        cuda_graph_sizes=args.cuda_graph_sizes, cpu_cache_memory_bytes=args.cpu_cache_memory,
        cpu_threads=args.cpu_threads, generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
        async_scheduling=args.async_scheduling, kv_cache_dtype=args.kv_cache_dtype,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        quantization=args.quantization, load_format=args.load_format,
        distributed_executor_backend=args.distributed_executor_backend,
        limit_mm_per_prompt=args.limit_mm_per_prompt, allowed_media_domains=args.allowed_media_domains,
        allowed_local_media_path=args.allowed_local_media_path,
        mm_processor_cache_gb=args.mm_processor_cache_gb,
        disable_log_stats=getattr(args, "disable_log_stats", True))
    if getattr(args, "compilation_config", None):
        kw.update(compilation_effects(args.compilation_config, args.enforce_eager, args.cuda_graph_sizes))
    check_vllm_flags(args, model, args.enable_prefix_caching)
    check_load_format(args.load_format)
    check_vllm_env(os.environ)
    return kw


def template_parser() -> Any:
    """A Jinja environment that parses what the tokenizer renders chat templates with: ``{% break %}`` /
    ``{% continue %}`` (loop controls) and ``{% generation %}...{% endgeneration %}`` (the tag transformers adds
    to mark assistant tokens), so that a template the tokenizer renders is never refused here."""
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it an instance variable)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                         extensions=[GenerationTag, "jinja2.ext.loopcontrols"])


def load_chat_template(value: str) -> str:
    """``--chat-template``'s template: the file ``value`` names, or ``value`` itself when it is a template (it has
    Jinja's braces or a newline) rather than a path; checked to compile. A missing file, an empty or invalid
    template: ValueError naming the flag."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
        where = f"file {value!r}"
    elif any(c in value for c in "{}\n"):
        text, where = value, "template"
    else:
        raise ValueError(f"--chat-template {value!r}: no such file (and not a template text: it has no Jinja "
                         "braces)")
    if not text.strip():
        raise ValueError(f"--chat-template {where} is empty")
    import jinja2

    try:
        template_parser().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template {where} is not a valid Jinja template (line {e.lineno}: {e.message})"
                         ) from None
    return text


def make_llm(args: argparse.Namespace, model: str | None, **overrides: Any) -> Any:
    """An ``LLM`` built from the flags ``engine_args`` added (``model`` None = the packaged default model), with
    ``--chat-template``'s template (read and checked before the model loads) in place of the checkpoint's;
    ``overrides``: engine config fields no flag sets (a benchmark's given cache counts)."""
    from hyserve.llm import LLM

    template = load_chat_template(args.chat_template) if getattr(args, "chat_template", None) else None
    llm = LLM(model=model, **llm_kwargs(args, model), **overrides)
    if template is not None:
        tokenizer = llm.get_tokenizer()
        if tokenizer is None:
            raise ValueError("--chat-template: this checkpoint has no tokenizer.json, so no chat template applies")
        tokenizer.hf_tokenizer.chat_template = template
    return llm
