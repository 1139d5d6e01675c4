"""Plain-torch reference of :mod:`hyserve.kernels.gating` (the CPU path and the yardstick for the Triton kernel)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

__all__ = ["gdn_gating_ref"]


def gdn_gating_ref(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                   dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    beta = b.float().sigmoid()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, beta
