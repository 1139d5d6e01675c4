"""The Nemotron-H family's tiny checkpoints for tests, laid out as the released ones, and their reference.

``write_tiny_nemotron_h_checkpoint`` builds transformers' own ``NemotronHForCausalLM`` from a tiny config, gives
its parameters spread random values (transformers' init gives nearly flat logits; the Mamba2 ``A_log``, ``dt_bias``
and ``D`` spread around their usual ranges) and writes it with ``save_pretrained`` (``backbone.*`` names, as the
releases). config.json then names its blocks as the releases do, in ``hybrid_override_pattern`` (``M*M-``), in
place of the ``layers_block_type`` list transformers 5 writes. Tokenizer and generation_config.json as Qwen3.5's
writers. ``load_nemotron_h_reference``: transformers' ``NemotronHForCausalLM.from_pretrained`` (float32, CPU, eval;
its torch Mamba2 path).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

from hyserve.testing.families import FamilyCheckpoints, register_family
from hyserve.testing.files import write_json
from hyserve.testing.qwen3_5 import write_generation_config_and_tokenizer
from hyserve.testing.tokenizer import ENDOFTEXT, special_token_ids

M, ATTN, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
_LETTER = {M: "M", ATTN: "*", MLP: "-", MOE: "E"}
NEMOTRON_H_PATTERNS = {
    "m_attn_m_mlp": [M, ATTN, M, MLP],
    "attn_first": [ATTN, M, MLP, M, MLP],
    "mamba_run": [M, M, MLP, ATTN, M, MLP],
    "moe": [M, MOE, ATTN, M, MOE],  # Nemotron 3's pattern: MoE blocks in place of MLPs
}


def tiny_nemotron_h_config(layer_types: list[str], **overrides: Any) -> NemotronHConfig:
    """Hidden 64; Mamba2 with 4 heads of 16 in 2 groups, state 16, conv 4; attention 4 / 2 heads of 16; MLP 96;
    MoE 8 experts of 48 top 3 in 4 groups (2 kept), scaled 2.5, a shared expert of 40; the tiny tokenizer's
    vocabulary and end token."""
    eos = special_token_ids()[ENDOFTEXT]
    kwargs: dict[str, Any] = dict(
        vocab_size=512, hidden_size=64, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
        conv_kernel=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        chunk_size=8, layer_norm_epsilon=1e-5, eos_token_id=eos, pad_token_id=eos, bos_token_id=eos,
        hybrid_override_pattern="".join(_LETTER[t] for t in layer_types), tie_word_embeddings=False,
        n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, moe_shared_expert_intermediate_size=40,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    kwargs.update(overrides)
    return NemotronHConfig(**kwargs)


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("A_log"):
        return torch.rand(shape, generator=gen) * 1.5 - 0.5
    if name.endswith(("dt_bias", ".D")):
        return torch.randn(shape, generator=gen) * 0.5
    if name.endswith(("norm.weight", "norm_f.weight")):
        return 1 + 0.2 * torch.randn(shape, generator=gen)
    if name.endswith("bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("embeddings.weight"):
        return torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) * (2.0 if "lm_head" in name else 1.0) / math.sqrt(shape[-1])


def write_tiny_nemotron_h_checkpoint(path: str | os.PathLike[str], *, form: str = "causal",
                                     layer_types: list[str] | None = None, seed: int = 0, **overrides: Any) -> str:
    """Write a tiny random Nemotron-H checkpoint (float32) into ``path`` and return it."""
    if form != "causal":
        raise ValueError(f"Nemotron-H has one checkpoint form, 'causal' (got {form!r})")
    path = os.fspath(path)
    config = tiny_nemotron_h_config(list(layer_types or NEMOTRON_H_PATTERNS["m_attn_m_mlp"]), **overrides)
    gen = torch.Generator().manual_seed(seed)
    model = NemotronHForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_init(name, tuple(p.shape), gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # choices that the bias moves
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        raw = json.load(f)
    blocks = raw.pop("layers_block_type")
    raw.pop("layer_types", None)
    raw["hybrid_override_pattern"] = "".join(_LETTER[t] for t in blocks)
    write_json(cfg_path, raw)
    write_generation_config_and_tokenizer(path)
    return path


def load_nemotron_h_reference(path: str | os.PathLike[str]) -> NemotronHForCausalLM:
    """transformers' ``NemotronHForCausalLM`` holding the checkpoint in ``path``, float32, eval mode."""
    model = NemotronHForCausalLM.from_pretrained(os.fspath(path), dtype=torch.float32, local_files_only=True)
    return model.eval()


NEMOTRON_H = register_family(FamilyCheckpoints("nemotron_h", write_tiny_nemotron_h_checkpoint,
                                               load_nemotron_h_reference, NEMOTRON_H_PATTERNS))
