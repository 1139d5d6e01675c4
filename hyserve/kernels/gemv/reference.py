"""Plain-torch references of :mod:`hyserve.kernels.gemv`: the inputs a decode GEMM computes in its prologue, and what
they stand for.

A :class:`NormedInput` is ``rms_norm(x)`` or, with ``delta``, ``rms_norm(x + delta)`` with the residual stream
``x + delta`` written into ``residual`` (the zero-centred norm, ``* (1 + w)``); a :class:`SwigluInput` is
``silu(gate) * up``. :meth:`materialize` computes the plain activation once (the norm kernels on CUDA, the
references elsewhere) and keeps it, so an input read by several GEMMs, or by a GEMM without the prologue, is the
unfused path's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["DeferredInput", "NormedInput", "SwigluInput", "decode_linear_ref"]


@dataclass(eq=False)
class NormedInput:
    """``rms_norm(x [+ delta]) * (1 + weight)`` (``(T, K)`` rows), computed by the GEMM that reads it; ``residual``
    (with ``delta``) receives ``x + delta`` rounded to ``x.dtype``, from that GEMM's prologue or from
    :meth:`materialize`."""

    x: torch.Tensor
    weight: torch.Tensor
    eps: float
    delta: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    _plain: torch.Tensor | None = field(default=None, repr=False)

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    def materialize(self) -> torch.Tensor:
        """The plain normed activation (computed once; writes ``residual``)."""
        if self._plain is None:
            from hyserve.kernels.norm import add_rms_norm, rms_norm

            if self.delta is None:
                out = rms_norm(self.x, self.weight, self.eps)
            else:
                assert self.residual is not None
                res, out = add_rms_norm(self.x, self.delta, self.weight, self.eps)
                self.residual.copy_(res)
            assert isinstance(out, torch.Tensor)
            self._plain = out
        return self._plain


@dataclass(eq=False)
class SwigluInput:
    """``silu(gate) * up`` (``(T, F)`` each, strided views of one projection's output), computed by the GEMM that
    reads it."""

    gate: torch.Tensor
    up: torch.Tensor
    _plain: torch.Tensor | None = field(default=None, repr=False)

    @property
    def shape(self) -> torch.Size:
        return self.gate.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.gate.dtype

    def materialize(self) -> torch.Tensor:
        """The plain activation (computed once)."""
        if self._plain is None:
            from hyserve.kernels.norm import silu_mul

            out = silu_mul(self.gate, self.up)
            assert isinstance(out, torch.Tensor)
            self._plain = out
        return self._plain


DeferredInput = NormedInput | SwigluInput


def decode_linear_ref(a: DeferredInput | torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``a W^T`` with the deferred input computed first (float32 accumulation, output in the input's dtype)."""
    x = a if isinstance(a, torch.Tensor) else a.materialize()
    return torch.matmul(x.float(), weight.float().t()).to(x.dtype)
