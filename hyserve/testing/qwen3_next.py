"""The Qwen3-Next family's tiny checkpoints for tests, laid out as the real release is, and their reference.

``write_tiny_next_checkpoint`` builds transformers' own ``Qwen3NextForCausalLM`` from a tiny ``Qwen3NextConfig``,
gives its parameters the spread random values of the Qwen3.5 writers (``hyserve.testing.qwen3_5_moe.moe_init``:
transformers' init gives nearly flat logits) and writes it with ``save_pretrained``: config.json, and weights in
the release's layout (fused ``in_proj_qkvz`` / ``in_proj_ba``, one tensor per expert and projection). With
``with_mtp`` an MTP head is planted as vLLM's ``qwen3_next_mtp`` reads it (``mtp.fc``, ``mtp.pre_fc_norm_*``,
``mtp.layers.0.*`` whose feed-forward block is the one layer 0 of the model has, ``mtp.norm``) and config.json
announces it with ``num_nextn_predict_layers: 1``. Tokenizer and generation_config.json as Qwen3.5's writers.

``load_next_reference_model``: transformers' ``Qwen3NextForCausalLM.from_pretrained`` (float32, CPU, eval; it
stacks the per-expert tensors itself and ignores ``mtp.*``), with transformers' PyTorch gated delta rule.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Any

import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_next import modeling_qwen3_next

from hyserve.testing.families import LAYER_PATTERNS, FamilyCheckpoints, register_family
from hyserve.testing.files import read_checkpoint_tensors, save_weights, write_json
from hyserve.testing.qwen3_5 import mtp_shapes, write_generation_config_and_tokenizer
from hyserve.testing.qwen3_5_moe import moe_init, tiny_moe_fields

# Dense layers' MLP width (unlike Qwen3.5-MoE, Qwen3-Next's intermediate_size is its own).
DENSE_INTERMEDIATE = 96


def tiny_next_config(layer_types: list[str], **overrides: Any) -> Qwen3NextConfig:
    """The MoE families' tiny fields (``hyserve.testing.qwen3_5_moe.tiny_moe_fields``) and a dense MLP width;
    ``overrides`` go to ``Qwen3NextConfig`` (``decoder_sparse_step``, ``mlp_only_layers``, ...)."""
    kwargs = {**tiny_moe_fields(layer_types), "intermediate_size": DENSE_INTERMEDIATE, **overrides}
    if kwargs.get("mlp_only_layers") is not None:  # a tuple in the checkpoint cache's keys
        kwargs["mlp_only_layers"] = list(kwargs["mlp_only_layers"])
    return Qwen3NextConfig(**kwargs)


def _mtp_tensors(config: Qwen3NextConfig, tensors: dict[str, torch.Tensor], gen: torch.Generator
                 ) -> dict[str, torch.Tensor]:
    """The MTP head: Qwen3.5's head without its MLP, and the feed-forward block of the model's layer 0 (MoE or
    dense, as the config makes index 0), fresh values of the same names under ``mtp.layers.0.mlp.``."""
    shapes = {n: s for n, s in mtp_shapes(config).items() if ".mlp." not in n}  # type: ignore[arg-type]
    block = "model.layers.0.mlp."
    shapes.update({f"mtp.layers.0.mlp.{n.removeprefix(block)}": tuple(t.shape) for n, t in tensors.items()
                   if n.startswith(block)})
    return {n: moe_init(n, s, gen).contiguous() for n, s in shapes.items()}


def write_tiny_next_checkpoint(
    path: str | os.PathLike[str], *, form: str = "causal", layer_types: list[str] | None = None,
    with_mtp: bool = False, seed: int = 0, **overrides: Any,
) -> str:
    """Write a tiny random Qwen3-Next checkpoint (float32) into ``path`` and return it; ``overrides`` go to
    ``Qwen3NextConfig`` (``num_experts_per_tok=3``, ``decoder_sparse_step=2``, ``mlp_only_layers=[0]``, ...)."""
    if form != "causal":
        raise ValueError(f"Qwen3-Next has one checkpoint form, 'causal' (got {form!r})")
    path = os.fspath(path)
    config = tiny_next_config(list(layer_types or LAYER_PATTERNS["gdn3_attn1"]), **overrides)
    gen = torch.Generator().manual_seed(seed)
    model = Qwen3NextForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(moe_init(name, tuple(p.shape), gen))
    model.save_pretrained(path)
    if with_mtp:
        tensors = read_checkpoint_tensors(path)
        tensors.update(_mtp_tensors(config, tensors, gen))
        save_weights(path, tensors, sharded=False)
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
        write_json(os.path.join(path, "config.json"), {**raw, "num_nextn_predict_layers": 1})
    write_generation_config_and_tokenizer(path)
    return path


def load_next_reference_model(path: str | os.PathLike[str]) -> Qwen3NextForCausalLM:
    """transformers' ``Qwen3NextForCausalLM`` holding the checkpoint in ``path``, float32, eval mode."""
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):  # not fla's CUDA kernels
        setattr(modeling_qwen3_next, name, inspect.unwrap(getattr(modeling_qwen3_next, name)))
    model = Qwen3NextForCausalLM.from_pretrained(os.fspath(path), dtype=torch.float32, local_files_only=True)
    return model.eval()


QWEN3_NEXT = register_family(FamilyCheckpoints("qwen3_next", write_tiny_next_checkpoint, load_next_reference_model,
                                               LAYER_PATTERNS))
