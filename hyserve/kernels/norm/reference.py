"""Plain-torch references of :mod:`hyserve.kernels.norm` (the CPU path and the yardstick for the Triton kernels).

They define the semantics: normalise in float32 and cast back to the input dtype; the gated form rounds to the input
dtype before its weight and after it, as transformers does. The scaled form (weight ``w``, not ``1 + w``) rounds the
norm to the input dtype, then multiplies by the weight in the promoted dtype (transformers' ``NemotronHRMSNorm``),
and its residual add may scale the delta first (Granite's ``residual_multiplier``: ``x + d * s``, ``d * s`` rounded
to ``d``'s dtype). Mamba2's grouped gated norm runs in float32 on the scan's float32 output and rounds once, to the
output projection's input dtype.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

__all__ = ["add_rms_norm_ref", "add_scaled_rms_norm_ref", "gated_rms_norm_ref", "gated_sum_squares_ref",
           "grouped_gated_rms_norm_ref", "l2_norm_heads_ref", "rms_norm_ref", "scaled_rms_norm_ref", "sigmoid_mul_ref",
           "silu_gate_ref", "silu_mul_ref"]


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


def sigmoid_mul_ref(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(gate)


def l2_norm_heads_ref(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype).contiguous()


def scaled_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_scaled_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                            scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    res = x + delta if scale == 1.0 else x + delta * scale
    return res, scaled_rms_norm_ref(res, weight, eps)


def gated_sum_squares_ref(y: torch.Tensor, z: torch.Tensor, norm_before_gate: bool) -> torch.Tensor:
    """Per token, float32: ``sum(h^2)`` over the last dim, ``h = y`` or ``y * silu(z)``."""
    h = y.float() if norm_before_gate else y.float() * F.silu(z.float())
    return h.pow(2).sum(-1)


def grouped_gated_rms_norm_ref(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float,
                               norm_before_gate: bool, out_dtype: torch.dtype,
                               sum_squares: torch.Tensor | None = None) -> torch.Tensor:
    """``w * norm(y * silu(z))`` (``norm_before_gate``: ``(w * norm(y)) * silu(z)``) over groups of ``group_size``
    channels, the norm rounded to ``y``'s dtype before the weight (float32 for the scan's output: no rounding),
    returned in ``out_dtype``. ``sum_squares``: one group over the whole last dim whose per-token sums of squares
    (``gated_sum_squares_ref``, all-reduced over ranks) are given, ``group_size`` its full width."""
    dtype = y.dtype
    gate = F.silu(z.float())
    h = y.float() if norm_before_gate else y.float() * gate
    if sum_squares is not None:
        normed = h * torch.rsqrt(sum_squares.unsqueeze(-1) / group_size + eps)
    else:
        grouped = h.view(*h.shape[:-1], h.shape[-1] // group_size, group_size)  # -1 is ambiguous at T = 0
        normed = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)).view(h.shape)
    out = weight * normed.to(dtype)
    return ((out * gate).to(dtype) if norm_before_gate else out).to(out_dtype)


def silu_gate_ref(y: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``y * silu(z)`` (``silu`` in ``z``'s dtype) in ``out_dtype``: Mamba2's gate without its norm."""
    return (y * F.silu(z)).to(out_dtype)
