"""RMSNorm variants of Qwen3.5.

Every RMSNorm in the model is zero-centred (scale ``1 + w``) except the Gated DeltaNet output norm, which scales by
``w`` and gates with ``silu(z)``. Both normalise in float32 (:mod:`hyserve.kernels.norm`: one Triton launch on CUDA).
``ScaledRMSNorm`` (scale ``w``) is the Mamba2 families' (Nemotron-H, Granite-4.0-H, Falcon-H1), with the residual add
(optionally scaled) fused in as ``RMSNorm.add``: one Triton launch on CUDA and under the Triton interpreter.
"""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from hyserve.kernels.fp8 import Fp8Activation
from hyserve.kernels.gemv import NormedInput
from hyserve.kernels.hyper_connection import hc_inject_norm
from hyserve.kernels.moe import uses_triton
from hyserve.kernels.norm import add_rms_norm, add_scaled_rms_norm, gated_rms_norm, rms_norm, scaled_rms_norm


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: ``norm(x) * (1 + w)``, computed in float32, cast back to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    @overload
    def forward(self, x: torch.Tensor, quant: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, quant: str | None) -> torch.Tensor | Fp8Activation: ...

    def forward(self, x: torch.Tensor, quant: str | None = None) -> torch.Tensor | Fp8Activation:
        """``quant``: the output quantized per token for the FP8 GEMMs that read it, in the same launch
        (``hyserve.kernels.norm.QUANT_MODES``)."""
        return rms_norm(x, self.weight, self.eps, quant)

    @overload
    def add(self, x: torch.Tensor, delta: torch.Tensor, quant: None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    @overload
    def add(self, x: torch.Tensor, delta: torch.Tensor,
            quant: str | None) -> tuple[torch.Tensor, torch.Tensor | Fp8Activation]: ...

    def add(self, x: torch.Tensor, delta: torch.Tensor,
            quant: str | None = None) -> tuple[torch.Tensor, torch.Tensor | Fp8Activation]:
        """The residual add fused in: ``(x + delta, norm(x + delta))``, the norm in the form ``quant`` asks for."""
        return add_rms_norm(x, delta, self.weight, self.eps, quant)


    def deferred(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, NormedInput]:
        """The norm (with the residual add when ``delta``) left to the GEMM that reads it, in its prologue
        (``hyserve.kernels.gemv``): ``(residual, input)``, the residual written by that GEMM (``x`` itself when
        there is no add)."""
        if delta is None:
            return x, NormedInput(x, self.weight, self.eps)
        residual = torch.empty_like(x)
        return residual, NormedInput(x, self.weight, self.eps, delta, residual)


class ScaledRMSNorm(nn.Module):
    """RMSNorm scaled by ``w`` itself (not zero-centred): ``w * norm(x)``, normalised in float32 and cast back to the
    input dtype before the weight multiplies it (transformers' ``NemotronHRMSNorm``, T5's layer norm;
    ``hyserve.kernels.norm.scaled_rms_norm``: one launch where ``uses_triton``, the reference elsewhere)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled_rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, delta: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add fused in: ``(r, norm(r))`` for ``r = x + delta * scale`` (Granite's
        ``residual_multiplier``; each product and sum rounded as torch rounds ``x + delta * scale``)."""
        return add_scaled_rms_norm(x, delta, self.weight, self.eps, scale)


class GatedRMSNorm(nn.Module):
    """GDN output norm: ``w * norm(x) * silu(gate)``; the weight is not zero-centred."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps, out)


class GroupedRMSNorm(nn.Module):
    """Zero-centred RMSNorm over each ``group``-wide chunk of the last dimension, with one weight as wide as the whole
    (Qwen4-Exp's hyper-connection and PLE norms over the ``hc_count`` residual streams): float32 inside, cast back.
    On CUDA one launch (``hyserve.kernels.hyper_connection.hc_inject_norm``) instead of about nine."""

    def __init__(self, dim: int, group: int, eps: float) -> None:
        super().__init__()
        if dim % group:
            raise ValueError(f"GroupedRMSNorm: width {dim} is not a multiple of its group {group}")
        self.eps, self.group = eps, group
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if uses_triton(x) and x.dim() == 2:
            normed = hc_inject_norm(x, None, None, self.weight, x.shape[1] // self.group, self.eps)[1]
            assert normed is not None
            return normed
        xf = x.float().unflatten(-1, (-1, self.group))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf.flatten(-2) * (1.0 + self.weight.float())).to(x.dtype)
