"""Qwen3.5's multi-token-prediction (MTP) head, used as the draft model of speculative decoding.

    x_i   = fc([pre_fc_norm_embedding(embed(token_{i+1})), pre_fc_norm_hidden(h_i)])   (embedding first)
    out_i = norm(decoder_layer(x_i))           one full-attention layer with its own paged KV cache
    draft = argmax(lm_head(out_i))             predicts token_{i+2}; lm_head and embed are the target's

``h_i`` is the target's post-final-norm hidden state at position i. Multi-step drafting reuses the layer, feeding
its own output as the next step's hidden state. The MTP layer's KV at position i depends on token i+1
(docs/design.md invariant 5): with MTP the prefix cache keys each block by its tokens and the one after it, so a
cached block's MTP entries are always those of the request that hits it (``hyserve/cache/prefix_cache.py``,
lookahead).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import nn

from hyserve.config import FULL_ATTENTION, ModelConfig
from hyserve.layers.attention import Attention
from hyserve.layers.linear import Linear
from hyserve.layers.norm import RMSNorm
from hyserve.model.loader import (
    apply_kv_scale,
    check_tensor,
    checkpoint_parts,
    checkpoint_tensors,
    copy_into,
    finish_loading,
    foreign_parts,
    kv_layer_names,
    parts_given,
    safetensors_dtype,
    split_kv_scale,
)
from hyserve.model.metadata import StepMetadata
from hyserve.model.mrope import text_rotary, with_image_rows
from hyserve.model.qwen3_5 import DecoderLayer
from hyserve.model.qwen3_5_config import qwen3_5_config


class MTPHead(nn.Module):
    """A variant family's head subclasses it with its own ``decoder_layer`` (the MoE family's)."""

    decoder_layer: ClassVar[type[DecoderLayer]] = DecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = cfg = qwen3_5_config(config)
        h = cfg.hidden_size
        layer_cfg = dataclasses.replace(cfg, layer_types=[FULL_ATTENTION], num_hidden_layers=1)
        self.rotary = text_rotary(cfg.rotary_dim, cfg.rope_theta, cfg.multimodal)
        self.fc = Linear(2 * h, h, quant=cfg.quantization, prefix="mtp.fc")
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([self.decoder_layer(layer_cfg, 0, self.rotary, "mtp.layers.0")])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)

    @property
    def attention(self) -> Attention:
        layer = self.layers[0]
        assert isinstance(layer, DecoderLayer)
        return layer.self_attn

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta: StepMetadata,
                embed: nn.Embedding) -> torch.Tensor:
        tokens = with_image_rows(embed(input_ids), meta)  # position p's input is token p + 1, an image row or not
        x = torch.cat([self.pre_fc_norm_embedding(tokens), self.pre_fc_norm_hidden(hidden)], dim=-1)
        self.rotary.prepare(meta.rotary_positions)
        residual, pending = self.layers[0](self.fc(x), meta)
        return self.norm.add(residual, pending)[1]


def load_mtp_weights(head: MTPHead, weights: dict[str, torch.Tensor]) -> None:
    """Copy the checkpoint's ``mtp.*`` tensors into ``head``; names, shapes and dtypes must match exactly (FP8
    weights and their scales into the layers the head quantizes, as the loader checks the model's)."""
    params = checkpoint_tensors(head)
    foreign = foreign_parts(head)  # other expert-parallel ranks' experts
    given = {n: t for n, t in ((name.removeprefix("mtp."), t) for name, t in weights.items()) if n not in foreign}
    for name, (whole, view) in parts_given(checkpoint_parts(head), set(given)).items():
        t = given.pop(name)
        check_tensor(f"mtp.{name}", view, tuple(t.shape), safetensors_dtype(t), head.config)
        with torch.no_grad():
            copy_into(view, t)
        params.pop(whole, None)
    for name in list(given):  # an FP8 KV cache's scales for the head's attention layer
        kv = split_kv_scale(name)
        if kv is not None and kv[0] in kv_layer_names(head):
            apply_kv_scale(head, kv[0], kv[1], given.pop(name), f"mtp.{name}")
    missing = sorted(set(params) - set(given))
    if missing:
        raise ValueError(f"checkpoint is missing MTP tensors: {', '.join('mtp.' + m for m in missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    unexpected = sorted(set(given) - set(params))
    if unexpected:
        raise ValueError(f"unexpected MTP tensor mtp.{unexpected[0]} (this engine supports one MTP layer)")
    with torch.no_grad():
        for name, p in params.items():
            t = given[name]
            check_tensor(f"mtp.{name}", p, tuple(t.shape), safetensors_dtype(t), head.config)
            copy_into(p, t)
        finish_loading(head)
