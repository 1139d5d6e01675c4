"""Qwen4-Exp's hyper-connections: the residual between layers is ``hc_count`` streams of ``hidden_size`` each
(``(T, S * H)``, stream ``s`` in channels ``[s * H, (s + 1) * H)``), and each mixer and MoE block reads one
``H``-wide mix of them and writes its output back into every stream with a per-stream weight.

``GatedResidual`` (transformers' ``Qwen4ExpTextGatedResidual``)::

    N      = hc_norm(X)                                      # RMSNorm per stream (1 + w), float32 inside
    mixed  = mean_s( sigmoid(W_up silu(W_down N / S))_s * N_s )
    inject = 2 sigmoid(W_inject N / S)                       # (T, S): only with ``use_combine``
    X'     = X + inject[..., s] * block(mixed)               # every stream s (``inject_into``)

The model's last mixer (``use_combine=False``) feeds the LM head with ``mixed``: the model has no final norm. The
gates run in the activation dtype, as the reference does.

The three projections are hyserve ``Linear`` layers (replicated) that take their method from ``quant`` by name
(``{prefix}.input_mix_weight_down``, ...): an FP8 checkpoint whose quantization_config quantizes them loads them in
FP8; without ``quant`` (or a config that leaves them out) they stay in the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyserve.layers.linear import Linear
from hyserve.layers.norm import GroupedRMSNorm
from hyserve.layers.quantization.base import QuantizationConfig


class GatedResidual(nn.Module):
    def __init__(self, hidden_size: int, hc_count: int, lowrank: int, eps: float, use_combine: bool = True, *,
                 quant: QuantizationConfig | None = None, prefix: str = "") -> None:
        """``quant``, ``prefix``: the model's quantization config and this module's name (its projections take
        their linear method by ``{prefix}.{projection}``)."""
        super().__init__()
        self.hidden_size, self.hc_count = hidden_size, hc_count
        width = hc_count * hidden_size

        def name(projection: str) -> str:
            return f"{prefix}.{projection}" if prefix else projection

        self.hc_norm = GroupedRMSNorm(width, hidden_size, eps)
        self.input_mix_weight_down = Linear(width, lowrank, quant=quant, prefix=name("input_mix_weight_down"))
        self.input_mix_weight_up = Linear(lowrank, width, quant=quant, prefix=name("input_mix_weight_up"))
        self.block_inject_weight = Linear(width, hc_count, quant=quant, prefix=name("block_inject_weight")) \
            if use_combine else None

    def mix(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` (T, S * H) -> (the block's input (T, H), the injection weights (T, S), None without combine)."""
        normed = self.hc_norm(x)
        gate = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(normed) / self.hc_count)))
        streams = (gate.unflatten(-1, (self.hc_count, self.hidden_size))
                   * normed.unflatten(-1, (self.hc_count, self.hidden_size)))
        mixed = streams.mean(dim=-2)
        if self.block_inject_weight is None:
            return mixed, None
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.hc_count)

    @staticmethod
    def inject_into(x: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x`` (T, S * H) plus the block's output ``out`` (T, H) into each stream, weighted by ``weights`` (T, S)."""
        return x + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)
