"""The Qwen3.5 dense text model: a decoder of Gated DeltaNet (``hyserve.layers.gdn``) and gated full-attention
(``hyserve.layers.attention``) mixers, each followed by the gated MLP (``hyserve.layers.mlp``).

Parameter names are exactly those of transformers' ``Qwen3_5ForCausalLM`` so that checkpoints load by name.

The layers keep no per-request state of their own. Attention layers write K/V into the paged cache through
``slot_mapping`` and read it through ``block_tables``; GDN layers read and write the conv window and the float32 SSM
state of ``state_slots[r]`` for each row r. The cache tensors are bound once by the model runner (``bind_caches``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from hyserve.config import FULL_ATTENTION, ModelConfig
from hyserve.distributed.parallel_state import is_first_stage, is_last_stage, stage_layers
from hyserve.kernels.fp8 import Fp8Activation
from hyserve.kernels.gemv import DeferredInput, deferrable
from hyserve.layers.attention import Attention
from hyserve.layers.gdn import GatedDeltaNet
from hyserve.layers.linear import ParallelLMHead, VocabParallelEmbedding, fp8_input_for, takes_deferred_input
from hyserve.layers.mlp import MLP
from hyserve.layers.norm import RMSNorm
from hyserve.layers.rotary import RotaryEmbedding
from hyserve.model.base import CausalLM
from hyserve.model.metadata import StepMetadata
from hyserve.model.mrope import text_rotary, with_image_rows
from hyserve.model.qwen3_5_config import Qwen3_5Config, qwen3_5_config
from hyserve.model.vision import VisionModel


class DecoderLayer(nn.Module):
    """``prefix``: the layer's name in the text model's naming (``model.layers.3``, ``mtp.layers.0``). A variant
    family sets ``linear_attention`` (its GDN layer class) or overrides ``make_mlp``."""

    linear_attention: ClassVar[type[GatedDeltaNet]] = GatedDeltaNet

    def __init__(self, cfg: Qwen3_5Config, layer_idx: int, rotary: RotaryEmbedding, prefix: str) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = cfg.layer_types[layer_idx]
        self.mixer: GatedDeltaNet | Attention
        if self.layer_type == FULL_ATTENTION:
            self.self_attn = Attention(cfg, rotary, f"{prefix}.self_attn")
            self.mixer = self.self_attn
        else:
            self.linear_attn = self.linear_attention(cfg, f"{prefix}.linear_attn")
            self.mixer = self.linear_attn
        self.mlp = self.make_mlp(cfg, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # FP8 projections that take their input quantized per token get it from the norm's own launch; bf16 ones
        # may compute the norm in their prologue at a decode step (hyserve.kernels.gemv).
        self.mixer_input, self.mlp_input = fp8_input_for(self.mixer), fp8_input_for(self.mlp)
        self.mixer_deferred, self.mlp_deferred = takes_deferred_input(self.mixer), takes_deferred_input(self.mlp)

    def make_mlp(self, cfg: Qwen3_5Config, prefix: str) -> nn.Module:
        """The feed-forward block after the mixer (a variant family overrides this one method; ``self.layer_idx``
        is the layer's index)."""
        return MLP(cfg.hidden_size, cfg.intermediate_size, cfg.quantization, prefix)

    def forward(self, x: torch.Tensor, meta: StepMetadata,
                pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the residual stream; ``pending``: the previous layer's MLP output, not yet added (its add is fused
        into this layer's first norm). Returns ``(residual, this layer's MLP output)``, the MLP output pending."""
        h: torch.Tensor | Fp8Activation | DeferredInput
        if self.mixer_deferred and deferrable(x):
            x, h = self.input_layernorm.deferred(x, pending)
        elif pending is None:
            h = self.input_layernorm(x, self.mixer_input)
        else:
            x, h = self.input_layernorm.add(x, pending, self.mixer_input)
        out = self.mixer(h, meta)
        if self.mlp_deferred and deferrable(x):
            x, h = self.post_attention_layernorm.deferred(x, out)
        else:
            x, h = self.post_attention_layernorm.add(x, out, self.mlp_input)
        return x, self.mlp(h)


class MissingLayer(nn.Module):
    """A decoder layer that another pipeline stage holds (keeps the indices of the checkpoint's names)."""


# Between pipeline stages (``ModelConfig.stage_handover_parts`` tensors): Qwen3.5's (residual stream, the last
# layer's MLP output whose add is fused into the next norm); a family with nothing pending hands its residual alone.
Intermediate = tuple[torch.Tensor, ...]


class TextModel(nn.Module):
    """The decoder, or with pipeline parallelism the layers of this process's stage: the first stage embeds, the
    last applies the final norm (and also holds the embedding when the LM head is tied to it or the MTP head reads
    it); the others take and return ``Intermediate``."""

    def __init__(self, cfg: Qwen3_5Config, decoder_layer: type[DecoderLayer] = DecoderLayer) -> None:
        super().__init__()
        self.start, self.end = stage_layers(cfg.num_hidden_layers)
        self.is_first, self.is_last = is_first_stage(), is_last_stage()
        self.rotary = text_rotary(cfg.rotary_dim, cfg.rope_theta, cfg.multimodal)
        self.embed_tokens: VocabParallelEmbedding | None = None
        if self.is_first or (self.is_last and (cfg.tie_word_embeddings or cfg.mtp_num_hidden_layers > 0)):
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([decoder_layer(cfg, i, self.rotary, f"model.layers.{i}")
                                     if self.start <= i < self.end else MissingLayer()
                                     for i in range(cfg.num_hidden_layers)])
        self._own_layers = list(self.layers)[self.start : self.end]  # a plain list: no ModuleList slice per step
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last else None

    def forward(self, input_ids: torch.Tensor, meta: StepMetadata,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        pending: torch.Tensor | None
        if intermediate is None:
            assert self.embed_tokens is not None and self.is_first, "a later stage needs the previous one's output"
            x, pending = with_image_rows(self.embed_tokens(input_ids), meta), None
        else:
            x, pending = intermediate
        self.rotary.prepare(meta.rotary_positions)
        for layer in self._own_layers:
            x, pending = layer(x, meta, pending)
        if self.norm is None:
            assert pending is not None
            return x, pending
        return self.norm(x) if pending is None else self.norm.add(x, pending)[1]

    def holds(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` (the model's naming) belongs to this stage."""
        if name.startswith("model.layers."):
            return self.start <= int(name.split(".")[2]) < self.end
        if name.startswith("model.embed_tokens."):
            return self.embed_tokens is not None
        if name.startswith(("model.norm.", "lm_head.", "mtp.")):
            return self.is_last
        return True


class Qwen3_5ForCausalLM(CausalLM):
    """Returns post-final-norm hidden states (the MTP head consumes them); ``compute_logits`` applies lm_head. With
    pipeline parallelism a stage other than the last returns ``Intermediate`` and has no lm_head. A variant family
    subclasses it with its own ``decoder_layer`` (docs/adding_a_model.md)."""

    decoder_layer: ClassVar[type[DecoderLayer]] = DecoderLayer
    text_model: ClassVar[type[TextModel]] = TextModel

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = cfg = qwen3_5_config(config)
        self.model = self.text_model(cfg, self.decoder_layer)
        # The vision tower: every tensor-parallel rank holds it whole, on the first pipeline stage (the images'
        # embeddings) and on the last when the MTP head may read image rows (dropped by drop_unused_embedding
        # without a draft head).
        self.visual: VisionModel | None = None
        if cfg.multimodal is not None and (self.model.is_first or
                                           (self.model.is_last and cfg.mtp_num_hidden_layers > 0)):
            self.visual = VisionModel.from_config_dict(cfg.multimodal.vision_config)
        if self.model.is_last:
            self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)
            if cfg.tie_word_embeddings:
                assert self.model.embed_tokens is not None
                self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, meta: StepMetadata,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        return self.model(input_ids, meta, intermediate)

    def holds(self, name: str) -> bool:
        if name.startswith("visual."):
            return self.visual is not None or self.model.is_first
        return self.model.holds(name)

    def drop_unused_embedding(self, draft_head: bool) -> None:
        """A last pipeline stage keeps the input embedding only for a tied LM head or the draft head's inputs."""
        if not self.model.is_first and not self.config.tie_word_embeddings and not draft_head:
            self.model.embed_tokens = None
        if not self.model.is_first and not draft_head:
            self.visual = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        logits = head(self.head_input(hidden))
        return (head.gather(logits) if isinstance(head, ParallelLMHead) else logits).float()

    def input_embeddings(self) -> nn.Embedding:
        assert self.model.embed_tokens is not None, "this pipeline stage holds no embedding"
        return self.model.embed_tokens

    def activation_width(self) -> int:
        cfg = self.config
        return max(cfg.hidden_size, cfg.intermediate_size, cfg.conv_dim + cfg.linear_value_dim,
                   2 * cfg.num_attention_heads * cfg.head_dim)

    def gdn_layers(self) -> list[GatedDeltaNet]:
        return [m for m in self.recurrent_layers() if isinstance(m, GatedDeltaNet)]
