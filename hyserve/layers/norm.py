"""RMSNorm variants of Qwen3.5.

Every RMSNorm in the model is zero-centred (scale ``1 + w``) except the Gated DeltaNet output norm, which scales by
``w`` and gates with ``silu(z)``. Both normalise in float32 (:mod:`hyserve.kernels.norm`: one Triton launch on CUDA).
"""

from __future__ import annotations

import torch
from torch import nn

from hyserve.kernels.norm import add_rms_norm, gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: ``norm(x) * (1 + w)``, computed in float32, cast back to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add fused in: ``(x + delta, norm(x + delta))``."""
        return add_rms_norm(x, delta, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """GDN output norm: ``w * norm(x) * silu(gate)``; the weight is not zero-centred."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)
