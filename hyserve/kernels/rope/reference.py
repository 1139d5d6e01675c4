"""Plain-torch reference of :mod:`hyserve.kernels.rope` (the CPU path and the yardstick for the Triton kernel)."""

from __future__ import annotations

import torch

__all__ = ["apply_rope_ref"]


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``(T, H, D)``; ``cos``, ``sin`` ``(T, R2)`` float32 with ``2 * R2 <= D``."""
    r = 2 * cos.shape[-1]
    c = cos.unsqueeze(1).to(x.dtype)
    s = sin.unsqueeze(1).to(x.dtype)
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2 :]
    c2 = torch.cat((c, c), dim=-1)
    s2 = torch.cat((s, s), dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x_rot * c2 + rotated * s2, x_pass), dim=-1)
