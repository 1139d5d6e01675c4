"""The Granite-4.0-H family's tiny checkpoints for tests, laid out as the released ones, and their reference.

``write_tiny_granitemoehybrid_checkpoint`` builds transformers' own ``GraniteMoeHybridForCausalLM`` from a tiny
config, gives its parameters spread random values (transformers' init gives nearly flat logits; the Mamba2
``A_log``, ``dt_bias`` and ``D`` spread around their usual ranges) and writes it with ``save_pretrained`` (the
releases' names: ``block_sparse_moe.input_linear`` / ``output_linear`` / ``router.layer``, no ``lm_head.weight``
when tied). config.json then reads as the releases' do: ``layer_types`` in ``mamba`` / ``attention``,
``position_embedding_type: nope`` for no RoPE, ``rope_theta`` and ``rope_scaling: null`` in place of
``rope_parameters``, ``normalization_function: rmsnorm``. The multipliers are far from 1 (and the attention's from
``head_dim ** -0.5``) and the Mamba2 layers have two groups (Granite's gated norm ignores them), so a multiplier
dropped or a norm grouped shows. Tokenizer and generation_config.json as Qwen3.5's writers.
``load_granitemoehybrid_reference``: transformers' ``GraniteMoeHybridForCausalLM.from_pretrained`` (float32, CPU,
eval; its torch Mamba2 path).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

from hyserve.testing.families import FamilyCheckpoints, register_family
from hyserve.testing.files import write_json
from hyserve.testing.qwen3_5 import write_generation_config_and_tokenizer
from hyserve.testing.tokenizer import ENDOFTEXT, special_token_ids

M, ATTN = "linear_attention", "full_attention"
_RELEASE_NAME = {M: "mamba", ATTN: "attention"}
GRANITE_H_PATTERNS = {
    "mamba_first": [M, ATTN, M, M],
    "attn_first": [ATTN, M, M, ATTN],
    "mamba_run": [M, M, M, ATTN, M],
    "attention_only": [ATTN, ATTN, ATTN],  # Granite-4.0-Micro's kind: no Mamba2 layer
}
# Multipliers of the tiny checkpoints (the releases' are of this kind: 12, 0.22, 0.0078125, 8).
MULTIPLIERS = {"embedding_multiplier": 0.6, "residual_multiplier": 1.6, "attention_multiplier": 0.09,
               "logits_scaling": 2.5}


def tiny_granitemoehybrid_config(layer_types: list[str], **overrides: Any) -> GraniteMoeHybridConfig:
    """Hidden 64; Mamba2 with 4 heads of 32 in 2 groups, state 16, conv 4; attention 4 / 2 heads of 16 (no RoPE
    unless ``position_embedding_type="rope"``); 8 experts of 32 top 3 and a shared MLP of 48; the multipliers of
    ``MULTIPLIERS``; the LM head tied (the releases'); the tiny tokenizer's vocabulary and end token."""
    eos = special_token_ids()[ENDOFTEXT]
    kwargs: dict[str, Any] = dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=len(layer_types), layer_types=list(layer_types),
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=32, shared_intermediate_size=48,
        num_local_experts=8, num_experts_per_tok=3, mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, rms_norm_eps=1e-5, eos_token_id=eos,
        pad_token_id=eos, bos_token_id=eos, tie_word_embeddings=True, position_embedding_type=None,
        rope_parameters={"rope_theta": 500.0, "rope_type": "default"}, **MULTIPLIERS)
    kwargs.update(overrides)
    return GraniteMoeHybridConfig(**kwargs)


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("A_log"):
        return torch.rand(shape, generator=gen) * 1.5 - 0.5
    if name.endswith(("dt_bias", ".D")):
        return torch.randn(shape, generator=gen) * 0.5
    if name.endswith("norm.weight"):
        return 1 + 0.2 * torch.randn(shape, generator=gen)
    if name.endswith("bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    # the blocks' outputs larger than the embedding's, so that the last token's own embedding does not decide the
    # tied head's logits
    out = name.endswith(("out_proj.weight", "o_proj.weight", "output_linear.weight", "experts.down_proj"))
    return torch.randn(shape, generator=gen) * (2.0 if "lm_head" in name or out else 1.0) / math.sqrt(shape[-1])


def write_tiny_granitemoehybrid_checkpoint(path: str | os.PathLike[str], *, form: str = "causal",
                                           layer_types: list[str] | None = None, seed: int = 0,
                                           **overrides: Any) -> str:
    """Write a tiny random Granite-4.0-H checkpoint (float32) into ``path`` and return it."""
    if form != "causal":
        raise ValueError(f"Granite-4.0-H has one checkpoint form, 'causal' (got {form!r})")
    path = os.fspath(path)
    config = tiny_granitemoehybrid_config(list(layer_types or GRANITE_H_PATTERNS["mamba_first"]), **overrides)
    gen = torch.Generator().manual_seed(seed)
    model = GraniteMoeHybridForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_init(name, tuple(p.shape), gen))
    model.save_pretrained(path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        raw = json.load(f)
    raw["layer_types"] = [_RELEASE_NAME[t] for t in raw["layer_types"]]
    raw["position_embedding_type"] = raw.get("position_embedding_type") or "nope"
    rope = raw.pop("rope_parameters")
    raw["rope_theta"], raw["rope_scaling"] = rope["rope_theta"], None
    raw["normalization_function"] = "rmsnorm"
    write_json(cfg_path, raw)
    write_generation_config_and_tokenizer(path)
    return path


def load_granitemoehybrid_reference(path: str | os.PathLike[str]) -> GraniteMoeHybridForCausalLM:
    """transformers' ``GraniteMoeHybridForCausalLM`` holding the checkpoint in ``path``, float32, eval mode."""
    model = GraniteMoeHybridForCausalLM.from_pretrained(os.fspath(path), dtype=torch.float32, local_files_only=True)
    return model.eval()


GRANITE_H = register_family(FamilyCheckpoints("granitemoehybrid", write_tiny_granitemoehybrid_checkpoint,
                                              load_granitemoehybrid_reference, GRANITE_H_PATTERNS))
