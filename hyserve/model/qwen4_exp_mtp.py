"""Qwen4-Exp's multi-token-prediction (MTP) head, the draft model of speculative decoding on the wide residual.

transformers 5.24 has no Qwen4-Exp MTP head (it drops every ``mtp.*`` tensor at load: docs/qwen4_exp_facts.md §6),
so the formula is the one public ports build (§6.1), with S = ``hc_count`` streams of H = ``hidden_size``::

    e     = fc_embedding(pre_fc_norm_embedding(embed(token_{i+1})))            (T, H)
    h     = fc_hidden(pre_fc_norm_hidden(X_i).view(T, S, H))                    (T, S, H): fc_hidden on each stream
    fused = (e[:, None, :] + h).view(T, S * H)                                  the embedding term in every stream
    Y     = mtp.layers.{mtp_num_hidden_layers - 1}( ... mtp.layers.0(fused))   the family's decoder layers
    draft = argmax(lm_head(mtp.hyper_connection_mixer(Y)))                      the target's LM head

``X_i`` is the target's **wide** residual at position i, the streams before its final ``hyper_connection_mixer``
(what ``Qwen4ExpForCausalLM``'s forward returns). The head's decoder layers are ``Qwen4ExpDecoderLayer``s built as
attention layers (QSA when the config sets the indexer; the layer's own MoE block and hyper-connections) and with no
PLE, from a config copy that makes them so. The head returns the wide ``Y``: a chained draft feeds it back as the
next pass's ``X`` (as Qwen3.5's head feeds back its output), and its logits come from the head's own mixer
(``head_input``, which the drafter uses in place of the target's) and the target's ``lm_head``.

``pre_fc_norm_hidden`` is ``S * H`` wide. It is applied here per stream (``GroupedRMSNorm`` with group H, like every
other wide norm of the family: a Rust port's choice, with a higher reported acceptance); the MLX port normalizes the
whole ``S * H`` with one statistic. Nothing public is authoritative: **the released weights decide** between
per-stream and whole-width normalization (§6.1; a test that plants a head cannot tell them apart), so check the
acceptance of both against the released checkpoint when one is available.

The head's KV (and, with QSA, its index keys) at position i depends on token i + 1, as Qwen3.5's does
(``hyserve.model.mtp``; docs/design.md invariant 5). Checkpoint names: ``mtp.fc_embedding.weight`` (H, H),
``mtp.fc_hidden.weight`` (H, H), ``mtp.pre_fc_norm_embedding.weight`` (H), ``mtp.pre_fc_norm_hidden.weight``
(S * H), ``mtp.layers.{i}.*`` as the model's attention layers' (experts fused or one tensor per expert),
``mtp.hyper_connection_mixer.{hc_norm,input_mix_weight_down,input_mix_weight_up}.weight``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hyserve.config import FULL_ATTENTION, ModelConfig
from hyserve.layers.attention import Attention
from hyserve.layers.linear import Linear
from hyserve.layers.norm import GroupedRMSNorm, RMSNorm
from hyserve.model.metadata import StepMetadata
from hyserve.model.mrope import text_rotary, with_image_rows
from hyserve.model.mtp import load_mtp_weights
from hyserve.model.qwen4_exp import Qwen4ExpDecoderLayer, gated_residual
from hyserve.model.qwen4_exp_config import qwen4_exp_config

__all__ = ["Qwen4ExpMTPHead", "load_qwen4_exp_mtp_weights"]


class Qwen4ExpMTPHead(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = cfg = qwen4_exp_config(config)
        n = cfg.mtp_num_hidden_layers
        if n < 1:
            raise ValueError("Qwen4-Exp's MTP head needs mtp_num_hidden_layers >= 1 in config.json")
        h, s, eps = cfg.hidden_size, cfg.hc_count, cfg.rms_norm_eps
        self.hidden_size, self.hc_count = h, s
        # The head's layers: attention (QSA with the indexer), no PLE, indices 0 .. n - 1.
        layer_cfg = dataclasses.replace(cfg, layer_types=[FULL_ATTENTION] * n, num_hidden_layers=n, ple_layer_ids=())
        self.rotary = text_rotary(cfg.rotary_dim, cfg.rope_theta, cfg.multimodal)
        self.fc_embedding = Linear(h, h, quant=cfg.quantization, prefix="mtp.fc_embedding")
        self.fc_hidden = Linear(h, h, quant=cfg.quantization, prefix="mtp.fc_hidden")
        self.pre_fc_norm_embedding = RMSNorm(h, eps)
        self.pre_fc_norm_hidden = GroupedRMSNorm(s * h, h, eps)  # per stream: see the module docstring
        self.layers = nn.ModuleList([Qwen4ExpDecoderLayer(layer_cfg, i, self.rotary, f"mtp.layers.{i}")
                                     for i in range(n)])
        self.hyper_connection_mixer = gated_residual(cfg, "mtp.hyper_connection_mixer", use_combine=False)

    @property
    def attention(self) -> Attention:
        """The first layer's attention (tests read its KV cache, as Qwen3.5's head's)."""
        layer = self.layers[0]
        assert isinstance(layer, Qwen4ExpDecoderLayer)
        return layer.self_attn  # type: ignore[no-any-return]

    def fuse(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta: StepMetadata,
             embed: nn.Module) -> torch.Tensor:
        """The first layer's input: the next tokens' embedding term added to ``fc_hidden`` of each stream of
        ``hidden`` (T, S * H); (T, S * H)."""
        t, s, h = hidden.shape[0], self.hc_count, self.hidden_size
        tokens = with_image_rows(embed(input_ids), meta)  # position p's input is token p + 1, an image row or not
        e = self.fc_embedding(self.pre_fc_norm_embedding(tokens))
        streams = self.fc_hidden(self.pre_fc_norm_hidden(hidden).view(t * s, h)).view(t, s, h)
        return (e.unsqueeze(1) + streams).view(t, s * h)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta: StepMetadata,
                embed: nn.Module) -> torch.Tensor:
        """``input_ids`` (T,): the token after each position; ``hidden`` (T, S * H): the target's streams (or this
        head's own output, chained). Returns the head's streams (T, S * H); ``head_input`` mixes them."""
        x = self.fuse(input_ids, hidden, meta, embed)
        self.rotary.prepare(meta.rotary_positions)
        for layer in self.layers:
            x = layer(x, input_ids, meta)
        return x

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's input from rows of the head's output: its own mixer (not the target's)."""
        return self.hyper_connection_mixer.mix(hidden)[0]


def load_qwen4_exp_mtp_weights(head: Qwen4ExpMTPHead, weights: dict[str, torch.Tensor]) -> None:
    """Qwen3.5's MTP loader (``hyserve.model.mtp.load_mtp_weights``: names, shapes and dtypes exactly, experts fused
    or per expert), named in this module for the registry."""
    load_mtp_weights(head, weights)  # type: ignore[arg-type]
