"""FP8 (e4m3) linear layers: activation quantization and ``x W^T`` with float8 weights and float32 scales.

Semantics (the plain-torch references below define them; the CPU runs them, and tests hold the CUDA paths to them):

* A scale multiplies on dequantization: ``w = w_fp8 * scale`` (compressed-tensors' ``weight_scale`` and Qwen's
  ``weight_scale_inv`` alike, docs/fp8_facts.md sections 4 and 6).
* Weight scales are per output channel ``(N, 1)`` (a per-tensor scale is expanded to its rows at load) or per
  ``(bn, bk)`` block ``(ceil(N / bn), ceil(K / bk))``; the last block of a dimension that ``bn``/``bk`` does not
  divide is partial.
* Activations are quantized per token (dynamic), per token and ``bk``-wide group of K (dynamic, with block
  weights), or with one static scale: ``s = max(amax, 1e-10) / 448`` over the token (or group),
  ``q = fp8(clamp(x / s, -448, 448))`` (round to nearest even), ``x ~ q * s``. A static scale is used as given.

Entry points: :func:`fp8_linear` (channel-scaled weights) and :func:`fp8_block_linear` (block-scaled weights). On
CUDA the channel path runs ``torch._scaled_mm`` (cuBLASLt; rowwise scales: the token's times the channel's); the
block path dequantizes the weight and runs a bf16 GEMM on the emulated activations. Everywhere else, and on CUDA for
shapes ``_scaled_mm`` refuses (K or N not a multiple of 16), the references run: the weight dequantized, the
activation quantization emulated exactly, one float32 matmul.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

__all__ = ["FP8_DTYPE", "FP8_MAX", "check_fp8_device", "dequantize_block_weight", "fp8_block_linear",
           "fp8_block_linear_ref", "fp8_linear", "fp8_linear_ref", "quantize_fp8", "quantize_per_token",
           "quantize_per_token_group"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# The smallest amax a scale is taken from: an all-zero token quantizes to zeros instead of dividing by zero.
AMAX_EPS = 1e-10
# The first CUDA compute capability with FP8 tensor cores (Ada; Hopper is 9.0), which ``torch._scaled_mm`` needs.
MIN_FP8_CAPABILITY = (8, 9)


def check_fp8_device(device: torch.device) -> None:
    """Refuse a CUDA device without FP8 support (compute capability < 8.9), naming it."""
    if device.type != "cuda":
        return
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"FP8 weights need a GPU with FP8 support (compute capability 8.9 or newer: Ada, Hopper or "
                         f"later); {name} has {cap[0]}.{cap[1]}. Run a bf16 checkpoint without --quantization, or "
                         "use device='cpu' (which emulates FP8)")


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


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T`` for ``(M, K)`` activations and a ``(N, K)`` FP8 weight with ``(N, 1)`` scales; activations per
    token, or with the static ``input_scale`` (one element). Float32 math, output in ``x.dtype``."""
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


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T`` over the last dimension of ``x`` (any leading shape) for a per-channel FP8 weight (see
    :func:`fp8_linear_ref`); output in ``x.dtype``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    n, k = weight.shape
    if not x.is_cuda or k % 16 or n % 16 or x2.shape[0] == 0:
        return fp8_linear_ref(x2, weight, weight_scale, input_scale).view(*lead, n)
    if input_scale is None:
        q, s = quantize_per_token(x2)
    else:
        s = input_scale.float().reshape(1, 1).expand(x2.shape[0], 1).contiguous()
        q = quantize_fp8(x2, s)
    # cuBLASLt takes the second operand column-major: the contiguous (N, K) weight's transpose is; rowwise scaling
    # is a (M, 1) scale for the tokens and a (1, N) one for the channels, and gives a bf16 output.
    y = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=weight_scale.view(1, n), out_dtype=torch.bfloat16)
    return y.to(x.dtype).view(*lead, n)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
                     group: int | None) -> torch.Tensor:
    """``x W^T`` over the last dimension of ``x`` for a block-scaled FP8 weight (see :func:`fp8_block_linear_ref`);
    output in ``x.dtype``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    n = weight.shape[0]
    if not x.is_cuda:
        return fp8_block_linear_ref(x2, weight, weight_scale, block, group).view(*lead, n)
    # The simplest correct CUDA path, dequantize-then-bf16-GEMM: the activations' quantization emulated (quantized,
    # then dequantized to x.dtype) and the weight dequantized on every call, so the GEMM reads three times the bytes
    # of the FP8 weight. A fused block-scaled kernel (Triton, or _scaled_mm's 1x128 / 128x128 recipe) is faster.
    xd = _quantize_dequantize(x2, group).to(x.dtype)
    w = dequantize_block_weight(weight, weight_scale, block).to(x.dtype)
    return F.linear(xd, w).view(*lead, n)
