"""The Nemotron-H text model (transformers' ``NemotronHForCausalLM``): a stack of blocks, each
``x + mixer(norm(x))`` with its one mixer by ``layer_types[i]``: the Mamba2 mixer (``hyserve.layers.mamba2``),
attention with no position embedding (``hyserve.layers.attention.PlainAttention``), the squared-ReLU MLP
(``hyserve.layers.mlp.ReluSquaredMLP``) or the MoE block (``hyserve.layers.sigmoid_moe``); then the final norm and
the LM head. Norms scale by ``w``
(``ScaledRMSNorm``).

Parameter names are the released checkpoints' (``backbone.embeddings``, ``backbone.layers.{i}.norm`` and
``.mixer.*``, ``backbone.norm_f``, ``lm_head``), which is also how transformers 5 saves the model. With pipeline
parallelism each stage holds its layers (``stage_layers``), the first the embedding, the last the final norm and
the head (never tied to the embedding); a stage hands the next its residual stream alone (the last block's output
added). Each block's output is added to the residual stream by the next block's norm, fused into its launch
(``ScaledRMSNorm.add``), the last one by the final norm (``hyserve.model.staged.stage_output``). With tensor parallelism
each rank holds its Mamba2 heads and the groups they read, attention heads, MLP channels and each expert's channels
(``hyserve.layers.mamba2``, ``hyserve.layers.sigmoid_moe``). There is no draft head.
The Mamba2 mixer runs on the CPU (plain torch) and on CUDA (Triton kernels and fla-core; ``hyserve.kernels.mamba2``);
docs/mamba2_facts.md has transformers' formulas.
"""

from __future__ import annotations

import torch
from torch import nn

from hyserve.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from hyserve.distributed.parallel_state import is_first_stage, is_last_stage, stage_layers
from hyserve.layers.attention import PlainAttention
from hyserve.layers.linear import VocabParallelEmbedding
from hyserve.layers.mamba2 import Mamba2Mixer
from hyserve.layers.mlp import ReluSquaredMLP
from hyserve.layers.norm import ScaledRMSNorm
from hyserve.layers.sigmoid_moe import SigmoidMoE
from hyserve.model.metadata import StepMetadata
from hyserve.model.nemotron_h_config import MOE, NemotronHConfig, nemotron_h_config
from hyserve.model.qwen3_5 import Intermediate, MissingLayer
from hyserve.model.staged import StagedCausalLM, stage_output


class NemotronHBlock(nn.Module):
    """``x + mixer(norm(x))``, the add left to the next norm; ``prefix``: the block's name (``backbone.layers.3``)."""

    def __init__(self, cfg: NemotronHConfig, layer_idx: int, prefix: str) -> None:
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        self.norm = ScaledRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer: nn.Module
        if self.layer_type == LINEAR_ATTENTION:
            self.mixer = Mamba2Mixer(cfg, f"{prefix}.mixer")
        elif self.layer_type == FULL_ATTENTION:
            self.mixer = PlainAttention(cfg, f"{prefix}.mixer")
        elif self.layer_type == MOE:
            self.mixer = SigmoidMoE(cfg, f"{prefix}.mixer")
        else:
            self.mixer = ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size, cfg.quantization, f"{prefix}.mixer")

    def forward(self, x: torch.Tensor, meta: StepMetadata,
                pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the residual stream; ``pending``: the previous block's output, not yet added (its add is fused into
        this block's norm). Returns ``(residual, this block's output)``, the output pending."""
        if pending is None:
            h = self.norm(x)
        else:
            x, h = self.norm.add(x, pending)
        return x, (self.mixer(h) if self.layer_type not in (LINEAR_ATTENTION, FULL_ATTENTION)
                   else self.mixer(h, meta))


class NemotronHBackbone(nn.Module):
    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.start, self.end = stage_layers(cfg.num_hidden_layers)
        self.is_first, self.is_last = is_first_stage(), is_last_stage()
        # The LM head is never tied to the embedding (transformers' Nemotron-H; the parser refuses a config saying
        # otherwise), so only the first stage holds it.
        self.embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if self.is_first else None
        self.layers = nn.ModuleList([NemotronHBlock(cfg, i, f"backbone.layers.{i}") if self.start <= i < self.end
                                     else MissingLayer() for i in range(cfg.num_hidden_layers)])
        self._own_layers = list(self.layers)[self.start : self.end]
        self.norm_f = ScaledRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon) if self.is_last else None

    def forward(self, input_ids: torch.Tensor, meta: StepMetadata,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        if intermediate is None:
            assert self.embeddings is not None and self.is_first, "a later stage needs the previous one's output"
            x = self.embeddings(input_ids)
        else:
            (x,) = intermediate
        pending: torch.Tensor | None = None
        for layer in self._own_layers:
            x, pending = layer(x, meta, pending)
        return stage_output(x, pending, self.norm_f)


class NemotronHForCausalLM(StagedCausalLM):
    STACK, EMBED, NORM = "backbone", "embeddings", "norm_f"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = cfg = nemotron_h_config(config)
        self.backbone = NemotronHBackbone(cfg)
        self.make_head(cfg.hidden_size, cfg.vocab_size, tie=False)

    def activation_width(self) -> int:
        cfg = self.config
        inner = cfg.mamba_num_heads * cfg.mamba_head_dim
        return max(cfg.hidden_size, cfg.intermediate_size, 2 * inner + 2 * cfg.n_groups * cfg.ssm_state_size
                   + cfg.mamba_num_heads, 2 * cfg.num_attention_heads * cfg.head_dim,
                   cfg.num_experts_per_tok * cfg.moe_intermediate_size, cfg.moe_shared_expert_intermediate_size)
