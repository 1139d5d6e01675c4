"""RMSNorm over the last dimension: the zero-centred form (scale ``1 + w``) and the GDN output's gated form.

Entry points :func:`rms_norm`, :func:`add_rms_norm` (the residual add fused in) and :func:`gated_rms_norm`, and the
MLP's :func:`silu_mul`: on CUDA one Triton launch each (the torch formulation
takes six to twelve launches per call, which a host-bound decode step pays dozens of times per layer); elsewhere
the plain-torch references of ``reference.py``, which define the semantics: normalise in float32 and cast back to the
input dtype; the gated form rounds to the input dtype before its weight and after it, as transformers does. The Triton
kernels are in ``_triton.py``.
"""

from __future__ import annotations

import torch

from hyserve.kernels.norm.reference import (
    add_rms_norm_ref,
    gated_rms_norm_ref,
    l2_norm_heads_ref,
    rms_norm_ref,
    silu_mul_ref,
)

__all__ = ["add_rms_norm", "add_rms_norm_ref", "gated_rms_norm", "gated_rms_norm_ref", "rms_norm", "rms_norm_ref",
           "silu_mul", "silu_mul_ref"]

_MAX_BLOCK_D = 16384


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rms_norm(x + delta))``: the residual stream and its norm, the add rounded to ``x.dtype``."""
    if not x.is_cuda:
        return add_rms_norm_ref(x, delta, weight, eps)
    return add_rms_norm_triton(x, delta, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (SwiGLU), in ``gate.dtype``."""
    if not gate.is_cuda:
        return silu_mul_ref(gate, up)
    return silu_mul_triton(gate, up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` over the last dim, in float32, returned in ``x.dtype``."""
    if not x.is_cuda:
        return rms_norm_ref(x, weight, eps)
    return rms_norm_triton(x, weight, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * norm(x) * silu(gate)`` over the last dim (weight not zero-centred), returned in ``x.dtype``."""
    if not x.is_cuda:
        return gated_rms_norm_ref(x, gate, weight, eps)
    return gated_rms_norm_triton(x, gate, weight, eps)


def l2_norm_heads(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim of a ``(T, H, D)`` tensor (any strides but a unit last one),
    in float32, returned contiguous in ``x.dtype`` (the q/k norm of the gated delta rule)."""
    if not x.is_cuda:
        return l2_norm_heads_ref(x, eps)
    return l2_norm_heads_triton(x, eps)


def l2_norm_heads_triton(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    from hyserve.kernels.norm._triton import _l2_norm_heads_kernel

    t, h, d = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    n = t * h
    if n:
        block_d, rows, warps = _launch(d)
        _l2_norm_heads_kernel[(-(-n // rows),)](x, out, n, h, d, x.stride(0), x.stride(1), float(eps),
                                                ROWS=rows, BLOCK_D=block_d, num_warps=warps)
    return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``(N, D)`` rows with a unit last stride (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(d: int) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS per program, num_warps): several rows per program when rows are short (q/k norms)."""
    block_d = max(16, 1 << (d - 1).bit_length())
    if block_d > _MAX_BLOCK_D:
        raise ValueError(f"rms_norm supports a last dim of at most {_MAX_BLOCK_D} (got {d})")
    rows = max(1, min(16, 2048 // block_d))
    warps = 4 if block_d * rows <= 4096 else 8
    return block_d, rows, warps


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from hyserve.kernels.norm._triton import _rms_norm_kernel

    d = x.shape[-1]
    assert weight.shape == (d,), "weight must be (D,)"
    x2 = _rows(x)
    n = x2.shape[0]
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n:
        block_d, rows, warps = _launch(d)
        _rms_norm_kernel[(-(-n // rows),)](x2, weight, out, n, d, x2.stride(0), out.stride(0), float(eps),
                                            ROWS=rows, BLOCK_D=block_d, num_warps=warps)
    return out.view(x.shape)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from hyserve.kernels.norm._triton import _gated_rms_norm_kernel

    d = x.shape[-1]
    assert weight.shape == (d,) and gate.shape == x.shape, "weight must be (D,) and gate shaped like x"
    x2, g2 = _rows(x), _rows(gate)
    n = x2.shape[0]
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n:
        block_d, rows, warps = _launch(d)
        _gated_rms_norm_kernel[(-(-n // rows),)](x2, g2, weight, out, n, d, x2.stride(0), g2.stride(0),
                                                  out.stride(0), float(eps),
                                                  ROWS=rows, BLOCK_D=block_d, num_warps=warps)
    return out.view(x.shape)


def add_rms_norm_triton(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from hyserve.kernels.norm._triton import _add_rms_norm_kernel

    d = x.shape[-1]
    assert weight.shape == (d,) and delta.shape == x.shape, "weight must be (D,) and delta shaped like x"
    x2, d2 = _rows(x), _rows(delta)
    n = x2.shape[0]
    res = torch.empty((n, d), dtype=x.dtype, device=x.device)
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n:
        block_d, rows, warps = _launch(d)
        _add_rms_norm_kernel[(-(-n // rows),)](x2, d2, weight, res, out, n, d, x2.stride(0), d2.stride(0),
                                                res.stride(0), out.stride(0), float(eps),
                                                ROWS=rows, BLOCK_D=block_d, num_warps=warps)
    return res.view(x.shape), out.view(x.shape)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    from hyserve.kernels.norm._triton import _silu_mul_kernel

    assert gate.shape == up.shape, "gate and up must have one shape"
    g2, u2 = _rows(gate), _rows(up)
    n, f = g2.shape
    out = torch.empty((n, f), dtype=gate.dtype, device=gate.device)
    if n and f:
        block_t, block_f = 4, 1024
        _silu_mul_kernel[(-(-n // block_t), -(-f // block_f))](g2, u2, out, n, f, g2.stride(0), u2.stride(0),
                                                                 out.stride(0), BLOCK_T=block_t, BLOCK_F=block_f,
                                                                 num_warps=4)
    return out.view(gate.shape)
