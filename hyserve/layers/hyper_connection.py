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

On CUDA (``hyserve.kernels.moe.uses_triton``) the element-wise work runs in three fused kernels around the three
projections (``hyserve.kernels.hyper_connection``), and :meth:`GatedResidual.inject_and_mix` fuses one block's
injection with the next block's norm; elsewhere the torch formulation below, which defines the semantics.

The three projections are hyserve ``Linear`` layers (replicated) that take their method from ``quant`` by name
(``{prefix}.input_mix_weight_down``, ...): an FP8 checkpoint whose quantization_config quantizes them loads them in
FP8; without ``quant`` (or a config that leaves them out) they stay in the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyserve.kernels.hyper_connection import hc_gates, hc_inject, hc_inject_norm, hc_mix
from hyserve.kernels.moe import uses_triton
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
        if uses_triton(x):
            return self._mix_normed(self.hc_norm(x))  # GroupedRMSNorm: the norm kernel
        normed = self.hc_norm(x)
        gate = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(normed) / self.hc_count)))
        streams = (gate.unflatten(-1, (self.hc_count, self.hidden_size))
                   * normed.unflatten(-1, (self.hc_count, self.hidden_size)))
        mixed = streams.mean(dim=-2)
        if self.block_inject_weight is None:
            return mixed, None
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.hc_count)

    def inject_and_mix(self, x: torch.Tensor, out: torch.Tensor, weights: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The previous block's injection (``inject_into(x, out, weights)``), then this block's ``mix`` of the
        result: ``(x', the block's input, its injection weights)``; one fused kernel for the injection and the norm
        on CUDA."""
        if uses_triton(x):
            x, normed = hc_inject_norm(x, out, weights, self.hc_norm.weight, self.hc_count, self.hc_norm.eps)
            assert normed is not None
            return (x, *self._mix_normed(normed))
        x = self.inject_into(x, out, weights)
        return (x, *self.mix(x))

    def _mix_normed(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The kernel path of ``mix`` after the norm: the projections, then the fused gates and mix."""
        down = self.input_mix_weight_down(normed)
        inject = self.block_inject_weight(normed) if self.block_inject_weight is not None else None
        gate_in, weights = hc_gates(down, inject, self.hc_count)
        return hc_mix(self.input_mix_weight_up(gate_in), normed, self.hc_count), weights

    @staticmethod
    def inject_into(x: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x`` (T, S * H) plus the block's output ``out`` (T, H) into each stream, weighted by ``weights`` (T, S)."""
        if uses_triton(x):
            return hc_inject(x, out, weights)
        return x + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)
