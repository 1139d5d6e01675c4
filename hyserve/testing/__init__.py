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
registers it in ``families``. The Qwen3.5 family's writer and reference are re-exported here.
"""

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
