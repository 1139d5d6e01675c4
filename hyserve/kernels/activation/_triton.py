"""Triton kernel for :mod:`hyserve.kernels.activation` (imported lazily: only the Triton path and compile checks)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_relu_squared_kernel"]


@triton.jit
def _relu_squared_kernel(x_ptr, out_ptr, n_rows, n_cols, sx_row, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """``out[rows, cols] = square(relu(x[rows, cols]))`` for a ``(ROWS, BLOCK)`` tile, squared in float32 and rounded
    once to the output's dtype. ``x < 0 ? 0 : x`` keeps NaN, as torch's ``relu`` does; ``out`` is contiguous."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + rows[:, None] * sx_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.where(x < 0.0, 0.0, x)
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], (r * r).to(out_ptr.dtype.element_ty), mask=mask)
