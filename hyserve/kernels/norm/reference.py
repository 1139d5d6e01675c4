"""Plain-torch references of :mod:`hyserve.kernels.norm` (the CPU path and the yardstick for the Triton kernels).

They define the semantics: normalise in float32 and cast back to the input dtype; the gated form rounds to the input
dtype before its weight and after it, as transformers does.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

__all__ = ["add_rms_norm_ref", "gated_rms_norm_ref", "l2_norm_heads_ref", "rms_norm_ref", "silu_mul_ref"]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    return (out * F.silu(gate.float())).to(dtype)


def add_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    res = x + delta
    return res, rms_norm_ref(res, weight, eps)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def l2_norm_heads_ref(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype).contiguous()
