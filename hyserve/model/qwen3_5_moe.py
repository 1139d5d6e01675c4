"""The Qwen3.5-MoE text model: Qwen3.5's decoder (``hyserve.model.qwen3_5``: Gated DeltaNet and gated attention
mixers, the same vision tower in the conditional form) with every feed-forward block the sparse MoE block
(``hyserve.layers.moe``), and its MTP head, whose one decoder layer has its own MoE block.

Parameter names are those of transformers' ``Qwen3_5MoeForCausalLM`` (``mlp.gate``, ``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``, ``mlp.shared_expert.*``, ``mlp.shared_expert_gate``); checkpoints that store each expert
apart load too (``hyserve.layers.moe.Experts.checkpoint_parts``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from hyserve.layers.moe import SparseMoeBlock
from hyserve.model.mtp import MTPHead, load_mtp_weights
from hyserve.model.qwen3_5 import DecoderLayer, Qwen3_5ForCausalLM
from hyserve.model.qwen3_5_config import Qwen3_5Config
from hyserve.model.qwen3_5_moe_config import qwen3_5_moe_config


class MoeDecoderLayer(DecoderLayer):
    def make_mlp(self, cfg: Qwen3_5Config, prefix: str) -> nn.Module:
        return SparseMoeBlock(qwen3_5_moe_config(cfg), prefix)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    decoder_layer: ClassVar[type[DecoderLayer]] = MoeDecoderLayer

    def activation_width(self) -> int:
        """Besides the dense widths: a token's k expert rows (gate and up) and the router's logits."""
        cfg = qwen3_5_moe_config(self.config)
        moe = cfg.num_experts_per_tok * max(2 * cfg.moe_intermediate_size, cfg.hidden_size)
        return max(super().activation_width(), moe, cfg.num_experts, 2 * cfg.shared_expert_intermediate_size)


class Qwen3_5MoeMTPHead(MTPHead):
    """Qwen3.5's MTP head whose decoder layer's feed-forward block is the MoE block (``mtp.layers.0.mlp.*``)."""

    decoder_layer = MoeDecoderLayer


def load_moe_mtp_weights(head: Qwen3_5MoeMTPHead, weights: dict[str, torch.Tensor]) -> None:
    """Qwen3.5's MTP loader (``hyserve.model.mtp.load_mtp_weights``), named in this module for the registry."""
    load_mtp_weights(head, weights)
