"""Test support, public so that every test folder and the benchmarks share one copy (docs/testing.md).

Family-neutral:
- ``files``: safetensors weights (one file or shards with an index), JSON, reading every tensor back.
- ``tokenizer``: the tiny byte-level BPE tokenizer (Qwen's pipeline, ChatML special tokens) every checkpoint carries.
- ``families``: each family's checkpoint writer and reference loader (``register_family``), and ``CheckpointCache``.
- ``engine``: ``make_llm``, ``drive`` (staggered arrivals and aborts), ``assert_matches_reference``, ``SlotRecorder``.
- ``scenarios``: the arrivals / aborts / preemption / prefix-hit scenario every scheduling mode must run identically.
- ``speculative``: an oracle proposer with planted errors, drafts recorded per verify step.
- ``server``: uvicorn in a thread, ports, processes.
- ``scripted``: a model that answers what a test plants (the server's answer parsers), a tool-aware chat template.
- ``executors``: ``PicklingExecutor`` (every message crosses the scheduler/worker seam as bytes).
- ``images``: random PNGs and data URLs.
- ``triton_interpreter``: the Triton interpreter made to compute as the GPU does (kernels on CPU tensors).

One module per family (``qwen3_5``, ``qwen3_5_vlm``, ``fp8`` for its FP8 checkpoints); a new family adds its own and
registers it in ``families``. The Qwen3.5 family's writer and reference are re-exported here, imported on first
use (``__getattr__``): a process that imports one submodule (the Triton interpreter's subprocesses take
``triton_interpreter`` alone) does not pay for transformers, which ``qwen3_5`` imports (5 s of CPU on a CI core).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hyserve.testing.executors import (
        PicklingExecutor,
    )
    from hyserve.testing.files import (
        read_checkpoint_tensors,
    )
    from hyserve.testing.images import (
        png_data_url,
        tiny_png,
    )
    from hyserve.testing.qwen3_5 import (
        DEFAULT_LAYER_TYPES,
        init_tensor,
        load_reference_model,
        mtp_shapes,
        reference_greedy_check,
        reference_logits,
        tiny_text_config,
        use_torch_gated_delta_rule,
        write_tiny_checkpoint,
    )
    from hyserve.testing.qwen3_5_vlm import (
        IMAGE_PAD,
        TINY_VLM_MAX_PIXELS,
        TINY_VLM_MIN_PIXELS,
        VIDEO_PAD,
        VISION_END,
        VISION_START,
        VISION_TOKENS,
        VLM_CHAT_TEMPLATE,
        reference_vlm_greedy,
        reference_vlm_inputs,
        reference_vlm_logits,
        reference_vlm_model,
        tiny_vlm_config,
        vlm_special_token_ids,
        vlm_tokenizer_json,
        write_tiny_vlm_checkpoint,
    )
    from hyserve.testing.tokenizer import (
        CHAT_TEMPLATE,
        ENDOFTEXT,
        IM_END,
        IM_START,
        SPECIAL_TOKENS,
        special_token_ids,
        tokenizer_config,
        tokenizer_json,
        tokenizer_size,
        train_bpe,
    )

# Each re-exported name's module.
_SOURCES = {
    "PicklingExecutor": "hyserve.testing.executors",
    "read_checkpoint_tensors": "hyserve.testing.files",
    "png_data_url": "hyserve.testing.images",
    "tiny_png": "hyserve.testing.images",
    "DEFAULT_LAYER_TYPES": "hyserve.testing.qwen3_5",
    "init_tensor": "hyserve.testing.qwen3_5",
    "load_reference_model": "hyserve.testing.qwen3_5",
    "mtp_shapes": "hyserve.testing.qwen3_5",
    "reference_greedy_check": "hyserve.testing.qwen3_5",
    "reference_logits": "hyserve.testing.qwen3_5",
    "tiny_text_config": "hyserve.testing.qwen3_5",
    "use_torch_gated_delta_rule": "hyserve.testing.qwen3_5",
    "write_tiny_checkpoint": "hyserve.testing.qwen3_5",
    "IMAGE_PAD": "hyserve.testing.qwen3_5_vlm",
    "TINY_VLM_MAX_PIXELS": "hyserve.testing.qwen3_5_vlm",
    "TINY_VLM_MIN_PIXELS": "hyserve.testing.qwen3_5_vlm",
    "VIDEO_PAD": "hyserve.testing.qwen3_5_vlm",
    "VISION_END": "hyserve.testing.qwen3_5_vlm",
    "VISION_START": "hyserve.testing.qwen3_5_vlm",
    "VISION_TOKENS": "hyserve.testing.qwen3_5_vlm",
    "VLM_CHAT_TEMPLATE": "hyserve.testing.qwen3_5_vlm",
    "reference_vlm_greedy": "hyserve.testing.qwen3_5_vlm",
    "reference_vlm_inputs": "hyserve.testing.qwen3_5_vlm",
    "reference_vlm_logits": "hyserve.testing.qwen3_5_vlm",
    "reference_vlm_model": "hyserve.testing.qwen3_5_vlm",
    "tiny_vlm_config": "hyserve.testing.qwen3_5_vlm",
    "vlm_special_token_ids": "hyserve.testing.qwen3_5_vlm",
    "vlm_tokenizer_json": "hyserve.testing.qwen3_5_vlm",
    "write_tiny_vlm_checkpoint": "hyserve.testing.qwen3_5_vlm",
    "CHAT_TEMPLATE": "hyserve.testing.tokenizer",
    "ENDOFTEXT": "hyserve.testing.tokenizer",
    "IM_END": "hyserve.testing.tokenizer",
    "IM_START": "hyserve.testing.tokenizer",
    "SPECIAL_TOKENS": "hyserve.testing.tokenizer",
    "special_token_ids": "hyserve.testing.tokenizer",
    "tokenizer_config": "hyserve.testing.tokenizer",
    "tokenizer_json": "hyserve.testing.tokenizer",
    "tokenizer_size": "hyserve.testing.tokenizer",
    "train_bpe": "hyserve.testing.tokenizer",
}


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value
    return value


__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_LAYER_TYPES",
    "ENDOFTEXT",
    "IMAGE_PAD",
    "IM_END",
    "IM_START",
    "SPECIAL_TOKENS",
    "TINY_VLM_MAX_PIXELS",
    "TINY_VLM_MIN_PIXELS",
    "VIDEO_PAD",
    "VISION_END",
    "VISION_START",
    "VISION_TOKENS",
    "VLM_CHAT_TEMPLATE",
    "PicklingExecutor",
    "init_tensor",
    "load_reference_model",
    "mtp_shapes",
    "png_data_url",
    "read_checkpoint_tensors",
    "reference_greedy_check",
    "reference_logits",
    "reference_vlm_greedy",
    "reference_vlm_inputs",
    "reference_vlm_logits",
    "reference_vlm_model",
    "special_token_ids",
    "tiny_png",
    "tiny_text_config",
    "tiny_vlm_config",
    "tokenizer_config",
    "tokenizer_json",
    "tokenizer_size",
    "train_bpe",
    "use_torch_gated_delta_rule",
    "vlm_special_token_ids",
    "vlm_tokenizer_json",
    "write_tiny_checkpoint",
    "write_tiny_vlm_checkpoint",
]
