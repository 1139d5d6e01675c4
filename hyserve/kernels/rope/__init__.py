"""Partial NeoX rotary embedding applied to ``(T, H, D)`` queries or keys with per-token float32 ``cos``/``sin``.

Entry point :func:`apply_rope`: on CUDA one Triton launch per tensor (``_triton.py``; the torch formulation takes
about ten); elsewhere the plain-torch reference of ``reference.py``, which defines the semantics: ``cos``/``sin`` are
cast to the tensor's dtype and ``x_rot * [cos, cos] + rotate_half(x_rot) * [sin, sin]`` is computed in that dtype (as
transformers does); channels past ``2 * R2`` pass through.
"""

from __future__ import annotations

import torch

from hyserve.kernels.rope.reference import apply_rope_ref

__all__ = ["apply_rope", "apply_rope_ref"]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if not x.is_cuda:
        return apply_rope_ref(x, cos, sin)
    return apply_rope_triton(x, cos, sin)


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from hyserve.kernels.rope._triton import _rope_kernel

    t, h, d = x.shape
    r2 = cos.shape[-1]
    assert cos.shape == sin.shape == (t, r2) and 2 * r2 <= d, "cos, sin must be (T, R2) with 2 * R2 <= D"
    assert x.stride(-1) == 1 and cos.stride() == sin.stride() and cos.stride(-1) == 1, "unit last strides"
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t and h:
        block_r = max(16, 1 << (r2 - 1).bit_length())
        block_d = max(16, 1 << (max(d - 2 * r2, 1) - 1).bit_length())
        block_t = 16
        _rope_kernel[(-(-t // block_t), h)](x, cos, sin, out, t, h, d, r2, x.stride(0), x.stride(1),
                                            out.stride(0), out.stride(1), cos.stride(0),
                                            BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
    return out
