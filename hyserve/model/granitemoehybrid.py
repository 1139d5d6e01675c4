"""The Granite-4.0-H text model (transformers' ``GraniteMoeHybridForCausalLM``): the embedding times
``embedding_multiplier``, then layers of

    x = x + residual_multiplier * mixer(input_layernorm(x))        Mamba2 or attention, by layer_types[i]
    n = post_attention_layernorm(x)
    x = x + residual_multiplier * (moe(n) + shared_mlp(n))          or shared_mlp(n) alone without experts

then the final norm, the LM head and the logits divided by ``logits_scaling`` (the head's input divided:
``head_input``). The Mamba2 mixer is
``hyserve.layers.mamba2`` with its gated norm over the whole width (Granite ignores ``mamba_n_groups`` there);
attention is ``hyserve.layers.attention.PlainAttention`` at the softmax scale ``attention_multiplier``, with RoPE
only for ``position_embedding_type: rope``; the feed-forward blocks are ``hyserve.layers.granite_moe``. Norms scale
by ``w`` (``ScaledRMSNorm``). docs/mamba2_facts.md sections 1.2, 4.2 and 5.2 give transformers' code.

Parameter names are transformers' in-memory ones (``model.embed_tokens``, ``model.layers.{i}.mamba`` /
``.self_attn``, ``.block_sparse_moe.{router, experts}``, ``.shared_mlp``, ``model.norm``, ``lm_head``); the releases'
on-disk MoE names map to them in the config (``checkpoint_name``). The LM head is tied to the embedding when
``tie_word_embeddings`` (the releases'), and a tied checkpoint has no ``lm_head.weight``. With pipeline parallelism
each stage holds its layers, the first the embedding, the last the final norm, the head (and the embedding too when
tied); a stage hands the next its residual stream alone (the last layer's output added). Each residual add is fused
into the norm after it (``ScaledRMSNorm.add`` with ``residual_multiplier``: ``x + d * m``, rounded as transformers
rounds it), the last one into the final norm (``hyserve.model.staged.stage_output``). With tensor parallelism each
rank holds its Mamba2 heads (the gated norm's squares summed over the ranks), attention heads, experts' and shared
MLP's channels. There is no draft head.
"""

from __future__ import annotations

import torch
from torch import nn

from hyserve.config import LINEAR_ATTENTION, ModelConfig
from hyserve.distributed.parallel_state import all_reduce, is_first_stage, is_last_stage, stage_layers
from hyserve.layers.attention import PlainAttention
from hyserve.layers.granite_moe import SharedMLP, SoftmaxTopKMoE
from hyserve.layers.linear import VocabParallelEmbedding
from hyserve.layers.mamba2 import Mamba2Mixer
from hyserve.layers.norm import ScaledRMSNorm
from hyserve.layers.rotary import RotaryEmbedding
from hyserve.model.granitemoehybrid_config import GraniteMoeHybridConfig, granitemoehybrid_config
from hyserve.model.metadata import StepMetadata
from hyserve.model.qwen3_5 import Intermediate, MissingLayer
from hyserve.model.staged import StagedCausalLM, stage_output


class GraniteMoeHybridLayer(nn.Module):
    """One layer (module docstring); ``prefix``: its name (``model.layers.3``)."""

    def __init__(self, cfg: GraniteMoeHybridConfig, layer_idx: int, rotary: RotaryEmbedding | None,
                 prefix: str) -> None:
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        self.residual_multiplier = cfg.residual_multiplier
        self.input_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: PlainAttention | None = None
        if self.layer_type == LINEAR_ATTENTION:
            self.mamba = Mamba2Mixer(cfg, f"{prefix}.mamba", norm_group_size=cfg.mamba_intermediate)
        else:
            self.self_attn = PlainAttention(cfg, f"{prefix}.self_attn", scale=cfg.attention_multiplier, rotary=rotary)
        self.block_sparse_moe = SoftmaxTopKMoE(cfg, f"{prefix}.block_sparse_moe") if cfg.num_local_experts else None
        self.shared_mlp = SharedMLP(cfg.hidden_size, cfg.shared_intermediate_size, cfg.quantization,
                                    f"{prefix}.shared_mlp")
        if self.block_sparse_moe is not None:  # both partial sums when tensor-parallel: one all-reduce
            self.shared_mlp.output_linear.reduce_results = False

    def forward(self, x: torch.Tensor, meta: StepMetadata,
                pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the residual stream; ``pending``: the previous layer's feed-forward output, not yet added (its
        ``x + pending * residual_multiplier`` is fused into this layer's first norm). Returns ``(residual, this
        layer's feed-forward output)``, the output pending."""
        m = self.residual_multiplier
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add(x, pending, m)
        if self.mamba is not None:
            mixed = self.mamba(h, meta)
        else:
            assert self.self_attn is not None
            mixed = self.self_attn(h, meta)
        x, h = self.post_attention_layernorm.add(x, mixed, m)
        ff = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            ff = all_reduce(self.block_sparse_moe(h) + ff)
        return x, ff


class GraniteMoeHybridModel(nn.Module):
    def __init__(self, cfg: GraniteMoeHybridConfig) -> None:
        super().__init__()
        self.start, self.end = stage_layers(cfg.num_hidden_layers)
        self.is_first, self.is_last = is_first_stage(), is_last_stage()
        self.embedding_multiplier = cfg.embedding_multiplier
        self.residual_multiplier = cfg.residual_multiplier  # the last layer's pending output's, at the stage's end
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta) if cfg.use_rope else None
        self.embed_tokens: VocabParallelEmbedding | None = None
        if self.is_first or (self.is_last and cfg.tie_word_embeddings):
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([GraniteMoeHybridLayer(cfg, i, self.rotary, f"model.layers.{i}")
                                     if self.start <= i < self.end else MissingLayer()
                                     for i in range(cfg.num_hidden_layers)])
        self._own_layers = list(self.layers)[self.start : self.end]
        self.norm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last else None

    def forward(self, input_ids: torch.Tensor, meta: StepMetadata,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        if intermediate is None:
            assert self.embed_tokens is not None and self.is_first, "a later stage needs the previous one's output"
            x = self.embed_tokens(input_ids) * self.embedding_multiplier
        else:
            (x,) = intermediate
        if self.rotary is not None:
            self.rotary.prepare(meta.positions)
        pending: torch.Tensor | None = None
        for layer in self._own_layers:
            x, pending = layer(x, meta, pending)
        return stage_output(x, pending, self.norm, self.residual_multiplier)


class GraniteMoeHybridForCausalLM(StagedCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = cfg = granitemoehybrid_config(config)
        self.model = GraniteMoeHybridModel(cfg)
        self.logits_scaling = cfg.logits_scaling
        self.make_head(cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings)

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm's rows divided by ``logits_scaling``: the head has no bias, so its logits are
        transformers' ``lm_head(x) / logits_scaling``, on every path that reads the head (the CUDA graphs' logits
        call the head on ``head_input`` themselves, not ``compute_logits``)."""
        return hidden / self.logits_scaling

    def activation_width(self) -> int:
        cfg = self.config
        inner = cfg.mamba_intermediate
        return max(cfg.hidden_size, 2 * inner + 2 * cfg.n_groups * cfg.ssm_state_size + cfg.mamba_num_heads,
                   2 * cfg.num_attention_heads * cfg.head_dim, 2 * cfg.shared_intermediate_size,
                   2 * cfg.num_experts_per_tok * cfg.intermediate_size)
