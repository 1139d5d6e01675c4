"""Partial NeoX-style rotary embedding.

Qwen3.5 rotates only the first ``rotary_dim = head_dim * partial_rotary_factor`` channels of each head, pairing
channel ``i`` with ``i + rotary_dim / 2`` (NeoX ``rotate_half``). For text the model's multimodal RoPE reduces to this,
since the temporal, height and width positions are all equal.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, base: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.base = base
        self._inv_freq: torch.Tensor | None = None

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        # A plain attribute, not a buffer: casting the model to bf16 must not touch it.
        if self._inv_freq is None or self._inv_freq.device != device:
            r = self.rotary_dim
            self._inv_freq = 1.0 / (self.base ** (torch.arange(0, r, 2, dtype=torch.float32, device=device) / r))
        return self._inv_freq

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (T, Hq, D), k: (T, Hk, D); positions: (T,). Returns rotated copies.

        cos/sin are computed from the positions each call in float32 (as the reference does), so no table sized by
        the context length is needed.
        """
        freqs = positions.float().unsqueeze(1) * self.inv_freq(positions.device).unsqueeze(0)
        cos = freqs.cos().unsqueeze(1)
        sin = freqs.sin().unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        half = r // 2
        cos = cos.to(x.dtype)
        sin = sin.to(x.dtype)
        x_rot, x_pass = x[..., :r], x[..., r:]
        x1, x2 = x_rot[..., :half], x_rot[..., half:]
        c = torch.cat((cos, cos), dim=-1)
        s = torch.cat((sin, sin), dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        return torch.cat((x_rot * c + rotated * s, x_pass), dim=-1)
