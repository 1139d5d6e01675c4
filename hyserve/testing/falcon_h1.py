"""The Falcon-H1 family's tiny checkpoints for tests, laid out as the released ones, and their reference.

``write_tiny_falcon_h1_checkpoint`` builds transformers' own ``FalconH1ForCausalLM`` from a tiny config whose muP
multipliers are all different from 1 and from each other (a multiplier dropped or put in another's place shows),
whose Mamba2 width (``mamba_d_ssm``) is not ``mamba_expand * hidden_size`` and whose attention ``head_dim`` is not
``hidden_size / heads``; it gives the parameters spread random values (the Mamba2 ``A_log``, ``dt_bias`` and ``D``
around their usual ranges) and writes it with ``save_pretrained`` (on-disk names = transformers' names, as the
releases). config.json then takes the releases' form: ``rope_theta`` at the top level in place of transformers 5's
``rope_parameters``, ``mamba_use_mlp: true`` and ``attn_layer_indices: null``. Tokenizer and generation_config.json
as Qwen3.5's writers. ``load_falcon_h1_reference``: transformers' ``FalconH1ForCausalLM.from_pretrained`` (float32,
CPU, eval; its torch Mamba2 path).

Variants are config overrides: ``FALCON_H1_VARIANTS`` names the ones the tests run (the release default without the
gated norm; the gated norm before and after the gate, with every projection bias, a tied LM head and a dt limit).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
from transformers import FalconH1Config, FalconH1ForCausalLM

from hyserve.testing.families import FamilyCheckpoints, register_family
from hyserve.testing.files import write_json
from hyserve.testing.qwen3_5 import write_generation_config_and_tokenizer
from hyserve.testing.tokenizer import ENDOFTEXT, special_token_ids

HYBRID = "hybrid"
# Falcon-H1 has one layer kind; the "patterns" are layer counts.
FALCON_H1_PATTERNS = {"hybrid3": [HYBRID] * 3, "hybrid4": [HYBRID] * 4}
FALCON_H1_VARIANTS: dict[str, dict[str, Any]] = {
    "release": {},  # mamba_rms_norm=False, as the released checkpoints
    "norm_before_gate": dict(mamba_rms_norm=True, mamba_norm_before_gate=True, mamba_proj_bias=True,
                             projectors_bias=True, attention_bias=True, tie_word_embeddings=True),
    "norm_after_gate": dict(mamba_rms_norm=True, mamba_norm_before_gate=False, time_step_limit=(0.0, 1.0)),
}
MULTIPLIERS: dict[str, Any] = dict(
    embedding_multiplier=2.5, lm_head_multiplier=0.6, key_multiplier=0.7, attention_in_multiplier=1.3,
    attention_out_multiplier=0.8, ssm_in_multiplier=1.25, ssm_out_multiplier=0.65,
    ssm_multipliers=[0.5, 1.5, 0.75, 1.2, 0.6], mlp_multipliers=[0.9, 0.55])


def tiny_falcon_h1_config(num_layers: int, **overrides: Any) -> FalconH1Config:
    """Hidden 64; Mamba2 with 4 heads of 12 (``mamba_d_ssm`` 48, not 2 * 64) in 2 groups, state 16, conv 4;
    attention 4 / 2 heads of 12 with RoPE; MLP 96; the multipliers above; the tiny tokenizer's vocabulary and end
    token."""
    eos = special_token_ids()[ENDOFTEXT]
    kwargs: dict[str, Any] = dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, intermediate_size=96, mamba_d_ssm=48, mamba_n_heads=4, mamba_d_head=12, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, mamba_rms_norm=False,
        mamba_norm_before_gate=False, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e5},
        eos_token_id=eos, pad_token_id=eos, bos_token_id=eos, tie_word_embeddings=False, **MULTIPLIERS)
    kwargs.update(overrides)
    return FalconH1Config(**kwargs)


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator, tied: bool) -> torch.Tensor:
    if name.endswith("A_log"):
        return torch.rand(shape, generator=gen) * 1.5 - 0.5
    if name.endswith(("dt_bias", ".D")):
        return torch.randn(shape, generator=gen) * 0.5
    if name.endswith("norm.weight"):
        return 1 + 0.2 * torch.randn(shape, generator=gen)
    if name.endswith("bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("embed_tokens.weight") and not tied:  # tied: the head's scale, or each token predicts itself
        return torch.randn(shape, generator=gen)
    head = "lm_head" in name or "embed_tokens" in name
    return torch.randn(shape, generator=gen) * (2.0 if head else 1.0) / math.sqrt(shape[-1])


def write_tiny_falcon_h1_checkpoint(path: str | os.PathLike[str], *, form: str = "causal",
                                    layer_types: list[str] | None = None, seed: int = 0, variant: str = "release",
                                    **overrides: Any) -> str:
    """Write a tiny random Falcon-H1 checkpoint (float32) into ``path`` and return it; ``variant`` names one of
    ``FALCON_H1_VARIANTS``, ``overrides`` replace config fields."""
    if form != "causal":
        raise ValueError(f"Falcon-H1 has one checkpoint form, 'causal' (got {form!r})")
    types = list(layer_types or FALCON_H1_PATTERNS["hybrid3"])
    if set(types) != {HYBRID}:
        raise ValueError(f"every Falcon-H1 layer is {HYBRID!r} (got {sorted(set(types))})")
    path = os.fspath(path)
    config = tiny_falcon_h1_config(len(types), **{**FALCON_H1_VARIANTS[variant], **overrides})
    gen = torch.Generator().manual_seed(seed)
    model = FalconH1ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head is not listed apart from the embedding
            p.copy_(_init(name, tuple(p.shape), gen, config.tie_word_embeddings))
    model.save_pretrained(path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        raw = json.load(f)
    rope = raw.pop("rope_parameters")
    raw.update(rope_theta=rope["rope_theta"], rope_scaling=None, mamba_use_mlp=True, attn_layer_indices=None)
    write_json(cfg_path, raw)
    write_generation_config_and_tokenizer(path)
    return path


def load_falcon_h1_reference(path: str | os.PathLike[str]) -> FalconH1ForCausalLM:
    """transformers' ``FalconH1ForCausalLM`` holding the checkpoint in ``path``, float32, eval mode."""
    model = FalconH1ForCausalLM.from_pretrained(os.fspath(path), dtype=torch.float32, local_files_only=True)
    return model.eval()


FALCON_H1 = register_family(FamilyCheckpoints("falcon_h1", write_tiny_falcon_h1_checkpoint,
                                              load_falcon_h1_reference, FALCON_H1_PATTERNS))
