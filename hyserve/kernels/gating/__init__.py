"""The Gated DeltaNet's per-token gates from its ``a`` and ``b`` projections.

``g = -exp(A_log) * softplus(a + dt_bias)`` (the log-decay, ``<= 0``) and ``beta = sigmoid(b)``, both float32
``(T, Hv)`` (in half precision ``A`` can overflow to inf). On CUDA one Triton launch (the torch formulation takes
about ten: ``_triton.py``); elsewhere the plain-torch reference of ``reference.py``, which defines the semantics.
"""

from __future__ import annotations

import torch

from hyserve.kernels.gating.reference import gdn_gating_ref

__all__ = ["gdn_gating", "gdn_gating_ref"]


def gdn_gating(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
               dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)`` float32 ``(T, Hv)`` from ``a``, ``b`` ``(T, Hv)`` and the per-head ``A_log``, ``dt_bias``."""
    if not a.is_cuda:
        return gdn_gating_ref(a, b, a_log, dt_bias)
    return gdn_gating_triton(a, b, a_log, dt_bias)


def gdn_gating_triton(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                      dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from hyserve.kernels.gating._triton import _gdn_gating_kernel

    t, h = a.shape
    assert b.shape == (t, h) and a_log.shape == (h,) and dt_bias.shape == (h,), "a, b (T, H); A_log, dt_bias (H,)"
    assert a.stride(-1) == 1 and b.stride(-1) == 1, "the head dim must be contiguous"
    g = torch.empty((t, h), dtype=torch.float32, device=a.device)
    beta = torch.empty((t, h), dtype=torch.float32, device=a.device)
    if t:
        block_h = max(16, 1 << (h - 1).bit_length())
        rows = max(1, min(64, 1024 // block_h))
        _gdn_gating_kernel[(-(-t // rows),)](a, b, a_log, dt_bias, g, beta, t, h, a.stride(0), b.stride(0),
                                             ROWS=rows, BLOCK_H=block_h, num_warps=4)
    return g, beta
