"""Triton kernel for :mod:`hyserve.kernels.activation` (imported lazily: only the Triton path and compile checks)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_relu_squared_kernel"]


@triton.jit
def _relu_squared_kernel(x_ptr, out_ptr, n_cols, sx_row, BLOCK: tl.constexpr):
    """``out[row, cols] = square(relu(x[row, cols]))``, squared in float32 and rounded once to the output's dtype.
    ``x < 0 ? 0 : x`` keeps NaN, as torch's ``relu`` does; ``out`` is contiguous."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * sx_row + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.where(x < 0.0, 0.0, x)
    tl.store(out_ptr + row * n_cols + cols, (r * r).to(out_ptr.dtype.element_ty), mask=mask)
