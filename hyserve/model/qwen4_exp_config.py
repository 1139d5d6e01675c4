"""Qwen4-Exp's config.json, in either checkpoint form, read into ``Qwen4ExpConfig``: Qwen3.5-MoE's config
(``hyserve.model.qwen3_5_moe_config``) and what only Qwen4-Exp's parts read (the registry's parser for both
Qwen4-Exp architectures; the model itself is ``hyserve.model.qwen4_exp``).

What Qwen4-Exp adds (docs/qwen4_exp_facts.md, from transformers 5.24's ``qwen4_exp``):

* hyper-connections: ``hc_count`` residual streams of ``hidden_size`` each between layers, mixed by a rank
  ``hc_lowrank`` gate before each mixer and each MoE block (``hyserve.layers.hyper_connection``);
* Per-Layer Embeddings on the GDN layers of ``ple_layer_ids`` (1-indexed): hashed n-grams of up to ``ngram_size``
  tokens, restarting after the first ``eos_token_id`` (``hyserve.layers.ple``);
* QSA sparse attention when the ``indexer_*`` fields are set: an indexer picks ``indexer_budget`` tokens in blocks
  of ``indexer_compress_ratio`` (``hyserve.layers.qsa``); without them the attention is dense.

The released config names its attention layers ``full_attention`` where transformers writes ``indexed_attention``
(and its older alias ``qwen_sparse_attention``): all name the attention layer here. Its RoPE defaults are
transformers' for this model (theta 10000, the whole head rotated), not Qwen3.5's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hyserve.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from hyserve.model.qwen3_5_moe_config import Qwen3_5MoeConfig, parse_qwen3_5_moe_config

# config.json model_type of each form -> Qwen3.5-MoE's, whose parser reads the shared fields.
_MOE_MODEL_TYPE = {"qwen4_exp": "qwen3_5_moe", "qwen4_exp_text": "qwen3_5_moe_text"}
# Layer type names of released and transformers-written configs -> the engine's.
_LAYER_TYPES = {"linear_attention": LINEAR_ATTENTION, "mamba": LINEAR_ATTENTION, "full_attention": FULL_ATTENTION,
                "indexed_attention": FULL_ATTENTION, "qwen_sparse_attention": FULL_ATTENTION,
                "attention": FULL_ATTENTION}
_INDEXER_FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
                   "indexer_compress_ratio")


@dataclass(slots=True, kw_only=True)
class Qwen4ExpConfig(Qwen3_5MoeConfig):
    """Field names follow transformers' ``Qwen4ExpTextConfig``; ``ple_eos_token_id`` is the first of its
    ``eos_token_id`` (the PLE n-grams' restart and fill token); ``indexer_compress_ratio`` 0: dense attention."""

    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layer_ids: tuple[int, ...] = ()
    ple_embed_dim: int = 0
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    split_ngram_parts: int = 512
    ple_eos_token_id: int = -1
    indexer_n_heads: int = 0
    indexer_head_dim: int = 0
    indexer_budget: int = 0
    indexer_compress_ratio: int = 0

    @property
    def hc_width(self) -> int:
        """The residual between layers: ``hc_count`` streams of ``hidden_size``."""
        return self.hc_count * self.hidden_size

    @property
    def residual_width(self) -> int:
        """The model's forward returns the streams; the LM head's input is their mix (``compute_logits``)."""
        return self.hc_width

    @property
    def stage_handover_parts(self) -> int:
        """The streams alone: each layer injects its own outputs, nothing is pending."""
        return 1

    @property
    def qsa(self) -> bool:
        return self.indexer_compress_ratio > 0

    def ple_index(self, layer_idx: int) -> int | None:
        """The position of 0-based layer ``layer_idx`` among the PLE layers (its tables' index), or None."""
        one_based = layer_idx + 1
        return self.ple_layer_ids.index(one_based) if one_based in self.ple_layer_ids else None

    def tensor_parallel_counts(self, expert_parallel: bool = False) -> dict[str, int]:
        return Qwen3_5MoeConfig.tensor_parallel_counts(self, expert_parallel)


def qwen4_exp_config(cfg: ModelConfig) -> Qwen4ExpConfig:
    """``cfg`` as Qwen4-Exp's config (what ``parse_qwen4_exp_config`` returned), for the family's modules."""
    if not isinstance(cfg, Qwen4ExpConfig):
        raise TypeError(f"a Qwen4-Exp model needs the config parse_qwen4_exp_config returns, not {type(cfg).__name__}")
    return cfg


def parse_qwen4_exp_config(raw: dict[str, Any]) -> Qwen4ExpConfig:
    """Either Qwen4-Exp checkpoint form: ``qwen4_exp`` (text fields under ``text_config``, a vision tower) or
    ``qwen4_exp_text``. Checks what transformers' ``validate_architecture`` checks."""
    model_type = raw.get("model_type")
    if model_type not in _MOE_MODEL_TYPE:
        raise ValueError(f"config.json: model_type {model_type!r} is not Qwen4-Exp's ({', '.join(_MOE_MODEL_TYPE)})")
    text = dict(raw.get("text_config") or {}) if model_type == "qwen4_exp" else dict(raw)
    if model_type == "qwen4_exp" and not text:
        raise ValueError("config.json has model_type 'qwen4_exp' but no 'text_config'")
    text["layer_types"] = _layer_types(text)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope.setdefault("rope_theta", float(text.get("rope_theta") or 10000.0))
    rope.setdefault("partial_rotary_factor", float(text.get("partial_rotary_factor") or 1.0))
    text["rope_parameters"] = rope
    gate = text.get("output_gate_type")
    if gate is not None and gate != text.get("hidden_act", "silu"):
        raise ValueError(f"config.json: output_gate_type {gate!r} (the GDN output gate's activation) is not supported; "
                         f"supported: the hidden_act ({text.get('hidden_act', 'silu')!r})")
    moe_raw = {**raw, "model_type": _MOE_MODEL_TYPE[model_type]}
    if model_type == "qwen4_exp":
        moe_raw["text_config"] = text
    else:
        moe_raw = {**moe_raw, **text, "model_type": "qwen3_5_moe_text"}
    base = parse_qwen3_5_moe_config(moe_raw)
    architectures = raw.get("architectures") or []
    arch = architectures[0] if architectures else (
        "Qwen4ExpForConditionalGeneration" if model_type == "qwen4_exp" else "Qwen4ExpForCausalLM")
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return Qwen4ExpConfig(**{**fields, "architecture": arch}, **_own_fields(text, base))


def _layer_types(text: dict[str, Any]) -> list[str]:
    n_layers = int(text.get("num_hidden_layers", 0))
    given = text.get("layer_types")
    if given is None:
        interval = int(text.get("full_attention_interval", 4))
        return [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(n_layers)]
    out = []
    for t in given:
        if t not in _LAYER_TYPES:
            raise ValueError(f"config.json: unsupported layer type {t!r} (Qwen4-Exp has linear_attention and "
                             "indexed_attention / full_attention)")
        out.append(_LAYER_TYPES[t])
    return out


def _own_fields(text: dict[str, Any], base: Qwen3_5MoeConfig) -> dict[str, Any]:
    hidden = base.hidden_size
    hc_count = int(text.get("hc_count", 4))
    if hc_count <= 1:
        raise ValueError(f"config.json: hc_count must be > 1 (got {hc_count})")
    ple_ids = tuple(sorted(set(int(i) for i in (text.get("ple_layer_ids") or []))))
    for i in ple_ids:
        if not 1 <= i <= base.num_hidden_layers or base.layer_types[i - 1] != LINEAR_ATTENTION:
            raise ValueError(f"config.json: ple_layer_ids holds {i}: PLE layers are 1-indexed linear_attention layers")
    fields: dict[str, Any] = {
        "hc_count": hc_count, "hc_lowrank": int(text.get("hc_lowrank", 320)), "ple_layer_ids": ple_ids,
        "ple_embed_dim": int(text.get("ple_embed_dim") or hidden),
        "ple_conv_kernel_size": int(text.get("ple_conv_kernel_size", 4)), "ngram_size": int(text.get("ngram_size", 3)),
        "heads_per_ngram": int(text.get("heads_per_ngram", 8)),
        "ngram_vocab_size_base": int(text.get("ngram_vocab_size_base", 20_000_000)),
        "make_ngram_vocab_size_divisible_by": int(text.get("make_ngram_vocab_size_divisible_by", 128)),
        "seed": int(text.get("seed", 1234)), "split_ngram_parts": int(text.get("split_ngram_parts", 512)),
    }
    if ple_ids:
        if not base.eos_token_id:
            raise ValueError("config.json: PLE layers (ple_layer_ids) need eos_token_id (the n-grams' restart token)")
        fields["ple_eos_token_id"] = base.eos_token_id[0]
        heads = (fields["ngram_size"] - 1) * fields["heads_per_ngram"]
        if fields["ngram_size"] < 2 or fields["ple_embed_dim"] % heads:
            raise ValueError(f"config.json: ple_embed_dim {fields['ple_embed_dim']} must divide by (ngram_size - 1) x "
                             f"heads_per_ngram = {heads}, with ngram_size >= 2")
    given = [k for k in _INDEXER_FIELDS if text.get(k) is not None]
    if given and len(given) != len(_INDEXER_FIELDS):
        raise ValueError(f"config.json: the indexer_* fields go together (QSA on) or not at all; given only {given}")
    if given:
        if int(text["indexer_kv_heads"]) != 1:
            raise ValueError(f"config.json: indexer_kv_heads must be 1 (got {text['indexer_kv_heads']})")
        budget, ratio = int(text["indexer_budget"]), int(text["indexer_compress_ratio"])
        if ratio <= 0 or budget <= 0 or budget % ratio:
            raise ValueError(f"config.json: indexer_budget {budget} must be a positive multiple of "
                             f"indexer_compress_ratio {ratio}")
        head_dim = int(text["indexer_head_dim"])
        if head_dim < base.rotary_dim:
            raise ValueError(f"config.json: indexer_head_dim {head_dim} is under the attention's rotary width "
                             f"{base.rotary_dim}")
        fields.update(indexer_n_heads=int(text["indexer_n_heads"]), indexer_head_dim=head_dim,
                      indexer_budget=budget, indexer_compress_ratio=ratio)
    return fields
