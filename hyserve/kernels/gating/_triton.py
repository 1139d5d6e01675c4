"""Triton kernel for :mod:`hyserve.kernels.gating` (imported lazily: only the CUDA path and interpreter tests)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_gdn_gating_kernel"]


@triton.jit
def _gdn_gating_kernel(
    a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, N, H, sa, sb,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``, float32, for ``ROWS`` tokens."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK_H)
    hmask = offs < H
    mask = (rows < N)[:, None] & hmask[None, :]
    a = tl.load(a_ptr + rows[:, None] * sa + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows[:, None] * sb + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    alog = tl.load(alog_ptr + offs, mask=hmask, other=0.0).to(tl.float32)
    dtb = tl.load(dtb_ptr + offs, mask=hmask, other=0.0).to(tl.float32)
    x = a + dtb[None, :]
    # softplus = log1p(exp(x)) (torch: x itself above 20). log1p(y) as log(u) * y / (u - 1), u = 1 + y: exact to a
    # few ulps for small y, where log(1 + y) would keep only the rounding of 1 + y.
    y = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))
    sp = tl.where(x > 20.0, x, log1p)
    g = -tl.exp(alog)[None, :] * sp
    beta = tl.sigmoid(b)
    out = rows[:, None] * H + offs[None, :]
    tl.store(g_ptr + out, g, mask=mask)
    tl.store(beta_ptr + out, beta, mask=mask)
