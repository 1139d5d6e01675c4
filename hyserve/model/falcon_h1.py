"""The Falcon-H1 text model (transformers' ``FalconH1ForCausalLM``): every layer runs the Mamba2 mixer
(``hyserve.layers.mamba2``) and RoPE attention (``hyserve.layers.attention.PlainAttention``) side by side on one
normed input, adds both to the residual, then a SwiGLU MLP (``hyserve.layers.mlp.MLP``); then the final norm and the
LM head. The muP multipliers sit where transformers puts them (docs/mamba2_facts.md 4.3):

    x = embed(ids) * embedding_multiplier
    n = input_layernorm(x)
    x = x + (mamba(n) * ssm_out_multiplier + attn(n * attention_in_multiplier) * attention_out_multiplier)
    x = x + feed_forward(pre_ff_layernorm(x))          # gate and down multipliers inside
    logits = lm_head(final_layernorm(x)) * lm_head_multiplier

and inside the mixer (``ssm_in_multiplier`` on its input, ``ssm_multipliers`` on the segments of its input
projection's output) and the attention (``key_multiplier`` on k before RoPE).

One layer owns two caches: its ``mamba`` is a ``RecurrentLayer`` (conv window and SSM state per slot) and its
``self_attn`` a ``KVCacheLayer`` (paged K/V). ``CausalLM.attention_layers`` and ``recurrent_layers`` collect the
caching modules wherever they sit, each in module order, so the runner plans, binds, snapshots and commits both
kinds in every layer with no change to the layer abstraction.

Parameter names are the released checkpoints' (``model.embed_tokens``, ``model.layers.{i}.{input_layernorm,
mamba, self_attn, pre_ff_layernorm, feed_forward}``, ``model.final_layernorm``, ``lm_head``), which transformers
saves unchanged. The LM head is tied to the embedding when ``tie_word_embeddings`` says so. With pipeline
parallelism each stage holds its layers; a stage hands the next its residual stream alone (the last layer's output
added). Each residual add is fused into the norm after it (``ScaledRMSNorm.add``: ``x + (m + a)`` into
``pre_ff_layernorm``, the MLP's output into the next layer's ``input_layernorm`` or the final norm,
``hyserve.model.staged.stage_output``). With tensor parallelism
each rank holds its Mamba2 heads and groups (the segment multipliers scale its own segments), attention heads and
MLP channels. There is no draft head.
"""

from __future__ import annotations

import torch
from torch import nn

from hyserve.config import ModelConfig
from hyserve.distributed.parallel_state import is_first_stage, is_last_stage, stage_layers
from hyserve.layers.attention import PlainAttention
from hyserve.layers.linear import VocabParallelEmbedding
from hyserve.layers.mamba2 import Mamba2Mixer
from hyserve.layers.mlp import MLP
from hyserve.layers.norm import ScaledRMSNorm
from hyserve.layers.rotary import RotaryEmbedding
from hyserve.model.falcon_h1_config import FalconH1Config, falcon_h1_config
from hyserve.model.metadata import StepMetadata
from hyserve.model.qwen3_5 import Intermediate, MissingLayer
from hyserve.model.staged import StagedCausalLM, stage_output


class FalconH1DecoderLayer(nn.Module):
    """Mamba2 and attention in parallel, then the MLP; ``prefix``: the layer's name (``model.layers.3``)."""

    def __init__(self, cfg: FalconH1Config, rotary: RotaryEmbedding, prefix: str) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = ScaledRMSNorm(h, eps)
        self.mamba = Mamba2Mixer(cfg, f"{prefix}.mamba", in_multiplier=cfg.ssm_in_multiplier,
                                 segment_multipliers=cfg.ssm_multipliers, gated_norm=cfg.mamba_rms_norm,
                                 norm_before_gate=cfg.mamba_norm_before_gate, out_proj_bias=cfg.projectors_bias)
        self.self_attn = PlainAttention(cfg, f"{prefix}.self_attn", rotary=rotary, key_multiplier=cfg.key_multiplier)
        self.pre_ff_layernorm = ScaledRMSNorm(h, eps)
        gate_mult, down_mult = cfg.mlp_multipliers
        self.feed_forward = MLP(h, cfg.intermediate_size, cfg.quantization, f"{prefix}.feed_forward",
                                gate_multiplier=gate_mult, down_multiplier=down_mult)
        self.ssm_out_multiplier = cfg.ssm_out_multiplier
        self.attention_in_multiplier = cfg.attention_in_multiplier
        self.attention_out_multiplier = cfg.attention_out_multiplier

    def forward(self, x: torch.Tensor, meta: StepMetadata,
                pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the residual stream; ``pending``: the previous layer's MLP output, not yet added (its add is fused
        into this layer's first norm). Returns ``(residual, this layer's MLP output)``, the output pending."""
        if pending is None:
            n = self.input_layernorm(x)
        else:
            x, n = self.input_layernorm.add(x, pending)
        m = self.mamba(n, meta) * self.ssm_out_multiplier
        a = self.self_attn(n * self.attention_in_multiplier, meta) * self.attention_out_multiplier
        x, f = self.pre_ff_layernorm.add(x, m + a)  # x + (m + a), as transformers sums them
        return x, self.feed_forward(f)


class FalconH1Model(nn.Module):
    def __init__(self, cfg: FalconH1Config) -> None:
        super().__init__()
        self.start, self.end = stage_layers(cfg.num_hidden_layers)
        self.is_first, self.is_last = is_first_stage(), is_last_stage()
        self.embedding_multiplier = cfg.embedding_multiplier
        # RoPE over the whole head (transformers' rotary dim is head_dim), shared by the layers.
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.embed_tokens: VocabParallelEmbedding | None = None
        if self.is_first or (self.is_last and cfg.tie_word_embeddings):
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([FalconH1DecoderLayer(cfg, self.rotary, f"model.layers.{i}")
                                     if self.start <= i < self.end else MissingLayer()
                                     for i in range(cfg.num_hidden_layers)])
        self._own_layers = list(self.layers)[self.start : self.end]
        self.final_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last else None

    def forward(self, input_ids: torch.Tensor, meta: StepMetadata,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        if intermediate is None:
            assert self.embed_tokens is not None and self.is_first, "a later stage needs the previous one's output"
            x = self.embed_tokens(input_ids) * self.embedding_multiplier
        else:
            (x,) = intermediate
        self.rotary.prepare(meta.positions)
        pending: torch.Tensor | None = None
        for layer in self._own_layers:
            x, pending = layer(x, meta, pending)
        return stage_output(x, pending, self.final_layernorm)


class FalconH1ForCausalLM(StagedCausalLM):
    NORM = "final_layernorm"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = cfg = falcon_h1_config(config)
        self.model = FalconH1Model(cfg)
        self.make_head(cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings)

    def drop_unused_embedding(self, draft_head: bool) -> None:
        """A last pipeline stage keeps the input embedding only for a tied LM head."""
        if not self.model.is_first and not self.config.tie_word_embeddings:
            self.model.embed_tokens = None

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head_multiplier`` scales the head's input rather than its logits (the head has no bias, so this is
        the same product), so every path to the logits, the CUDA graphs' own included, applies it."""
        m = self.config.lm_head_multiplier
        return hidden if m == 1.0 else hidden * m

    def activation_width(self) -> int:
        cfg = self.config
        inner, gn = cfg.mamba_intermediate, cfg.n_groups * cfg.ssm_state_size
        return max(cfg.hidden_size, 2 * cfg.intermediate_size, 2 * inner + 2 * gn + cfg.mamba_num_heads,
                   (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim)
