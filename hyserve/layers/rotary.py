"""Partial NeoX-style rotary embedding.

Qwen3.5 rotates only the first ``rotary_dim = head_dim * partial_rotary_factor`` channels of each head, pairing
channel ``i`` with ``i + rotary_dim / 2`` (NeoX ``rotate_half``). For text the model's multimodal RoPE reduces to this,
since the temporal, height and width positions are all equal.
"""

from __future__ import annotations

import torch
from torch import nn

from hyserve.kernels.rope import apply_rope, rms_norm_rope


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, base: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.base = base
        self._inv_freq: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        # A plain attribute, not a buffer: casting the model to bf16 must not touch it.
        if self._inv_freq is None or self._inv_freq.device != device:
            r = self.rotary_dim
            self._inv_freq = 1.0 / (self.base ** (torch.arange(0, r, 2, dtype=torch.float32, device=device) / r))
        return self._inv_freq

    # Whether positions may come in three axes (M-RoPE: ``hyserve.model.mrope.MRotaryEmbedding``).
    multi_axis = False

    def axes(self, device: torch.device) -> torch.Tensor | None:
        """The axis (0 time, 1 height, 2 width) each frequency turns with under M-RoPE; None: one axis (text)."""
        return None

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (T, H, D) rotated at this forward's positions (those given to ``prepare``) on its first
        ``rotary_dim`` channels, with the same cos/sin as ``forward``: a copy."""
        cos_sin = self._cos_sin
        assert cos_sin is not None and cos_sin[0].shape[0] == x.shape[0], "prepare() not called this step"
        return apply_rope(x.contiguous(), *cos_sin)

    def prepare(self, positions: torch.Tensor) -> None:
        """Compute this forward's ``cos``/``sin`` (float32, ``(T, rotary_dim / 2)``) once for every layer."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq(positions.device).unsqueeze(0)
        self._cos_sin = (freqs.cos(), freqs.sin())

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (T, Hq, D), k: (T, Hk, D); positions: (T,) as given to this forward's ``prepare``. Rotated copies.

        cos/sin come from the positions in float32 (as the reference does), so no table sized by the context length
        is needed; they are computed once per forward (``prepare``), not once per layer.
        """
        cos_sin = self._cos_sin
        assert cos_sin is not None and cos_sin[0].shape[0] == positions.shape[0], "prepare() not called this step"
        cos, sin = cos_sin
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def norm_rotate(self, q: torch.Tensor, q_weight: torch.Tensor, k: torch.Tensor, k_weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` of q and k first put through their zero-centred per-head RMSNorms (``q_weight``, ``k_weight``):
        one launch on CUDA for all four (``hyserve.kernels.rope.rms_norm_rope``). Rotated copies."""
        cos_sin = self._cos_sin
        assert cos_sin is not None and cos_sin[0].shape[0] == q.shape[0], "prepare() not called this step"
        return rms_norm_rope(q, q_weight, k, k_weight, eps, *cos_sin)
