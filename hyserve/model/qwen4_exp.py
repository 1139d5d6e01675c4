"""The Qwen4-Exp text model (transformers 5.24's ``qwen4_exp``; docs/qwen4_exp_facts.md): Qwen3.5-MoE's mixers
and MoE blocks (``hyserve.layers.gdn``, ``hyserve.layers.attention``, ``hyserve.layers.moe``) between
hyper-connections (``hyserve.layers.hyper_connection``: ``hc_count`` residual streams), Per-Layer Embeddings on some
GDN layers (``hyserve.layers.ple``: two more recurrent states per such layer, the n-gram token context and the PLE
conv window) and, when the config sets the indexer, QSA sparse attention (``hyserve.layers.qsa``: the indexer's
per-token keys in the paged KV blocks). Every state is declared by its layer, so slots, snapshots, the verify
scratch and the prefix cache handle them without knowing the family.

Decoder layer (every layer; the feed-forward block is always the MoE block)::

    X = X + ple(X, token ids)                                   # PLE layers only
    u, w = attn_hyper_connection.mix(X);  X = X + w * mixer(u)  # into each of the S streams
    u, w = mlp_hyper_connection.mix(X);   X = X + w * mlp(u)

The model embeds, repeats the embedding into the S streams, runs the layers, and mixes the streams into the LM
head's input (``hyper_connection_mixer``): there is no final norm. Parameter names are those of transformers'
``Qwen4ExpForCausalLM``; the conditional (VLM) form's ``model.language_model.*`` and ``model.visual.*`` load as for
Qwen3.5.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from hyserve.config import FULL_ATTENTION
from hyserve.distributed.parallel_state import is_first_stage, is_last_stage, stage_layers
from hyserve.layers.attention import Attention
from hyserve.layers.gdn import GatedDeltaNet
from hyserve.layers.hyper_connection import GatedResidual
from hyserve.layers.linear import VocabParallelEmbedding
from hyserve.layers.moe import SparseMoeBlock
from hyserve.layers.ple import PerLayerEmbedding
from hyserve.layers.qsa import IndexedAttention
from hyserve.layers.rotary import RotaryEmbedding
from hyserve.model.metadata import StepMetadata
from hyserve.model.mrope import text_rotary, with_image_rows
from hyserve.model.qwen3_5 import DecoderLayer, Intermediate, MissingLayer, Qwen3_5ForCausalLM, TextModel
from hyserve.model.qwen3_5_config import Qwen3_5Config
from hyserve.model.qwen4_exp_config import Qwen4ExpConfig, qwen4_exp_config


class Qwen4ExpDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3_5Config, layer_idx: int, rotary: RotaryEmbedding, prefix: str) -> None:
        super().__init__()
        cfg = qwen4_exp_config(config)
        self.layer_idx = layer_idx
        self.layer_type = cfg.layer_types[layer_idx]
        self.mixer: nn.Module
        if self.layer_type == FULL_ATTENTION:
            attn = IndexedAttention if cfg.qsa else Attention
            self.self_attn = attn(cfg, rotary, f"{prefix}.self_attn")
            self.mixer = self.self_attn
        else:
            self.linear_attn = GatedDeltaNet(cfg, f"{prefix}.linear_attn")
            self.mixer = self.linear_attn
        self.mlp = SparseMoeBlock(cfg, f"{prefix}.mlp")
        ple_index = cfg.ple_index(layer_idx)
        self.ple = PerLayerEmbedding(cfg, ple_index, f"{prefix}.ple") if ple_index is not None else None
        self.attn_hyper_connection = gated_residual(cfg, f"{prefix}.attn_hyper_connection")
        self.mlp_hyper_connection = gated_residual(cfg, f"{prefix}.mlp_hyper_connection")

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """``x``: the (T, S * H) streams; ``input_ids``: the step's tokens (the PLE n-grams read them)."""
        if self.ple is not None:
            x = x + self.ple(x, input_ids, meta)
        h, w = self.attn_hyper_connection.mix(x)
        assert w is not None
        x, h, w = self.mlp_hyper_connection.inject_and_mix(x, self.mixer(h, meta), w)
        assert w is not None
        return GatedResidual.inject_into(x, self.mlp(h), w)


def gated_residual(cfg: Qwen4ExpConfig, prefix: str, use_combine: bool = True) -> GatedResidual:
    """``prefix``: the module's checkpoint name (its projections take their linear method by name)."""
    return GatedResidual(cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank, cfg.rms_norm_eps, use_combine,
                         quant=cfg.quantization, prefix=prefix)


class Qwen4ExpTextModel(TextModel):
    """The decoder, or with pipeline parallelism the layers of this process's stage (``TextModel``'s split): the
    first stage embeds and repeats the embedding into the streams, the last holds ``hyper_connection_mixer`` (the LM
    head's input; and the embedding when the LM head is tied to it). Between stages the handover is the wide
    residual alone, the (T, S * H) streams (``stage_handover_parts`` 1: each layer adds its outputs itself, nothing is
    pending as in Qwen3.5's handover). With tensor parallelism the GDN, attention and MoE layers
    shard themselves; the hyper-connection linears, the PLE layers and the QSA indexer are whole on every rank."""

    def __init__(self, config: Qwen3_5Config, decoder_layer: type[DecoderLayer]) -> None:
        nn.Module.__init__(self)
        cfg = qwen4_exp_config(config)
        self.start, self.end = stage_layers(cfg.num_hidden_layers)
        self.is_first, self.is_last = is_first_stage(), is_last_stage()
        self.hc_count = cfg.hc_count
        self.rotary = text_rotary(cfg.rotary_dim, cfg.rope_theta, cfg.multimodal)
        self.embed_tokens: VocabParallelEmbedding | None = None
        if self.is_first or (self.is_last and (cfg.tie_word_embeddings or cfg.mtp_num_hidden_layers > 0)):
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([decoder_layer(cfg, i, self.rotary, f"model.layers.{i}")
                                     if self.start <= i < self.end else MissingLayer()
                                     for i in range(cfg.num_hidden_layers)])
        self._own_layers = list(self.layers)[self.start : self.end]
        self.norm = None
        self.hyper_connection_mixer = (gated_residual(cfg, "model.hyper_connection_mixer", use_combine=False)
                                       if self.is_last else None)

    def forward(self, input_ids: torch.Tensor, meta: StepMetadata,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        if intermediate is None:
            assert self.embed_tokens is not None and self.is_first, "a later stage needs the previous one's output"
            x = with_image_rows(self.embed_tokens(input_ids), meta).repeat(1, self.hc_count)
        else:
            x = intermediate[0]  # the previous stage's streams; nothing is pending
        self.rotary.prepare(meta.rotary_positions)
        for layer in self._own_layers:
            x = layer(x, input_ids, meta)
        if not self.is_last:
            return (x,)
        return x  # the streams: the draft head reads them; compute_logits mixes them for the LM head

    def holds(self, name: str) -> bool:
        if name.startswith("model.hyper_connection_mixer."):
            return self.is_last
        return super().holds(name)


class Qwen4ExpForCausalLM(Qwen3_5ForCausalLM):
    """Both Qwen4-Exp architectures (the conditional form with its vision tower, as Qwen3.5's)."""

    decoder_layer: ClassVar[type[DecoderLayer]] = Qwen4ExpDecoderLayer  # type: ignore[assignment]
    text_model: ClassVar[type[TextModel]] = Qwen4ExpTextModel

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden``: rows of the (T, S * H) streams, mixed into the LM head's input (there is no final norm)."""
        mixer = self.model.hyper_connection_mixer
        assert isinstance(mixer, GatedResidual), "only the last pipeline stage mixes the streams for the LM head"
        return mixer.mix(hidden)[0]

    def activation_width(self) -> int:
        cfg = qwen4_exp_config(self.config)
        moe = cfg.num_experts_per_tok * max(2 * cfg.moe_intermediate_size, cfg.hidden_size)
        indexer = (cfg.indexer_n_heads + 1) * cfg.indexer_head_dim
        return max(super().activation_width(), moe, cfg.num_experts, 2 * cfg.shared_expert_intermediate_size,
                   2 * cfg.hc_width, cfg.ple_embed_dim, indexer)
