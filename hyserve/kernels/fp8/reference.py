"""Plain-torch references of :mod:`hyserve.kernels.fp8` (the CPU path and the yardstick for the CUDA paths).

They define the semantics (see the package docstring): scales multiply on dequantization; activations quantized per
token, per token and ``bk``-wide group of K, or with one static scale (``s = max(amax, 1e-10) / 448``,
``q = fp8(clamp(x / s, -448, 448))``, round to nearest even); the weight dequantized and one float32 matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

__all__ = ["AMAX_EPS", "FP8_DTYPE", "FP8_MAX", "Fp8Activation", "dequantize_block_weight", "fp8_block_linear_dequant",
           "fp8_block_linear_ref", "fp8_linear_ref", "quantize_activation_ref", "quantize_fp8", "quantize_per_token",
           "quantize_per_token_group"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# The smallest amax a scale is taken from: an all-zero token quantizes to zeros instead of dividing by zero.
AMAX_EPS = 1e-10


@dataclass(frozen=True, slots=True)
class Fp8Activation:
    """An activation handed to FP8 GEMMs already quantized per token by the kernel that produced it (a norm, the
    SwiGLU): ``q`` ``(M, K)`` float8_e4m3fn and ``scale`` ``(M, 1)`` float32, exactly :func:`quantize_per_token` of
    the ``(M, K)`` activation ``dtype`` would have held; ``plain``, that activation itself where an unquantized GEMM
    reads the same input too (a merged projection with bf16 parts), else None. The GEMM's output is in ``dtype``."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    plain: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quantize_activation_ref(x: torch.Tensor, keep_plain: bool = False) -> Fp8Activation:
    """``x`` ``(..., K)`` as an :class:`Fp8Activation` of its ``(M, K)`` rows (quantized per token)."""
    x2 = x.reshape(-1, x.shape[-1])
    q, s = quantize_per_token(x2)
    return Fp8Activation(q, s, x.dtype, x2 if keep_plain else None)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8(clamp(x / scale))``; ``scale`` broadcasts against ``x`` (float32)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of a ``(M, K)`` activation: one float32 scale per token, ``(M, 1)``."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=AMAX_EPS) / FP8_MAX
    return quantize_fp8(x, scale), scale


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with one float32 scale per token and ``group``-wide slice of K, ``(M, ceil(K / group))``; a
    last partial group takes its own amax."""
    m, k = x.shape
    g = -(-k // group)
    padded = F.pad(x.float(), (0, g * group - k)).view(m, g, group)
    scale = padded.abs().amax(dim=-1).clamp_(min=AMAX_EPS) / FP8_MAX
    q = quantize_fp8(padded, scale.unsqueeze(-1)).view(m, g * group)[:, :k]
    return q, scale


def dequantize_block_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The float32 ``(N, K)`` weight of a block-scaled FP8 weight (``scale``: ``(ceil(N / bn), ceil(K / bk))``)."""
    n, k = weight.shape
    bn, bk = block
    full = scale.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return weight.float() * full


def fp8_linear_ref(x: torch.Tensor | Fp8Activation, weight: torch.Tensor, weight_scale: torch.Tensor,
                   input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T`` for ``(M, K)`` activations and a ``(N, K)`` FP8 weight with ``(N, 1)`` scales; activations per
    token, or with the static ``input_scale`` (one element), or quantized already (an :class:`Fp8Activation`).
    Float32 math, output in ``x.dtype``."""
    if isinstance(x, Fp8Activation):
        assert input_scale is None, "an activation quantized per token meets a static input scale"
        w = weight.float() * weight_scale.float()
        return torch.matmul(x.q.float() * x.scale, w.t()).to(x.dtype)
    if input_scale is None:
        q, s = quantize_per_token(x)
    else:
        s = input_scale.float().reshape(1, 1)
        q = quantize_fp8(x, s)
    w = weight.float() * weight_scale.float()
    return torch.matmul(q.float() * s, w.t()).to(x.dtype)


def _quantize_dequantize(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """The float32 activations as the GEMM sees them: quantized per token (``group`` None) or per token and
    ``group``-wide slice of K, then dequantized."""
    if group is None:
        q, s = quantize_per_token(x)
        return q.float() * s
    q, s = quantize_per_token_group(x, group)
    return q.float() * s.repeat_interleave(group, dim=1)[:, : q.shape[1]]


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
                         group: int | None) -> torch.Tensor:
    """``x W^T`` for a block-scaled FP8 weight; activations per token and ``group``-wide slice of K (``None``: per
    token). Float32 math, output in ``x.dtype``."""
    w = dequantize_block_weight(weight, weight_scale, block)
    return torch.matmul(_quantize_dequantize(x, group), w.t()).to(x.dtype)


def fp8_block_linear_dequant(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                             block: tuple[int, int], group: int | None) -> torch.Tensor:
    """The block path before the Triton kernel, kept as the benchmark's baseline: the activations' quantization
    emulated, the weight dequantized on every call, a bf16 GEMM (three times the bytes of the FP8 weight)."""
    x2 = x.reshape(-1, x.shape[-1])
    xd = _quantize_dequantize(x2, group).to(x.dtype)
    w = dequantize_block_weight(weight, weight_scale, block).to(x.dtype)
    return F.linear(xd, w).view(*x.shape[:-1], weight.shape[0])
