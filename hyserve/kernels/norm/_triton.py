"""Triton kernels for :mod:`hyserve.kernels.norm` (imported lazily: only the CUDA path and interpreter tests need them).

One program normalises ``ROWS`` rows of ``D`` elements in float32 and stores them in the output's dtype, repeating
the roundings of the torch reference so that bf16 results agree with it to within the reduction order.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_add_rms_norm_kernel", "_gated_rms_norm_kernel", "_l2_norm_heads_kernel", "_rms_norm_kernel",
           "_silu_mul_kernel"]


@triton.jit
def _rows_rstd(x_ptr, N, D, sx, eps, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's rows of ``x`` in float32 and their ``rsqrt(mean(x^2) + eps)``, with the index masks."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK_D)
    dmask = offs < D
    mask = (rows < N)[:, None] & dmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * sx + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    return rows, offs, dmask, mask, x, rstd


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, N, D, sx, so, eps,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """``out = x * rsqrt(mean(x^2) + eps) * (1 + w)`` (zero-centred weight), float32 inside."""
    rows, offs, dmask, mask, x, rstd = _rows_rstd(x_ptr, N, D, sx, eps, ROWS, BLOCK_D)
    w = tl.load(w_ptr + offs, mask=dmask, other=0.0).to(tl.float32)
    y = (x * rstd[:, None]) * (1.0 + w)[None, :]
    tl.store(out_ptr + rows[:, None] * so + offs[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, g_ptr, w_ptr, out_ptr, N, D, sx, sg, so, eps,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """``out = (w * norm(x).to(dtype)).to(dtype) * silu(gate)``, as the reference (and transformers) round."""
    rows, offs, dmask, mask, x, rstd = _rows_rstd(x_ptr, N, D, sx, eps, ROWS, BLOCK_D)
    dt = out_ptr.dtype.element_ty
    n = (x * rstd[:, None]).to(dt).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=dmask, other=0.0).to(tl.float32)
    o = (w[None, :] * n).to(dt).to(tl.float32)
    g = tl.load(g_ptr + rows[:, None] * sg + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    y = o * (g * tl.sigmoid(g))
    tl.store(out_ptr + rows[:, None] * so + offs[None, :], y.to(dt), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, d_ptr, w_ptr, res_ptr, out_ptr, N, D, sx, sd, sr, so, eps,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """``res = x + d`` (rounded to the dtype, as a torch add is) and ``out = rms_norm(res) * (1 + w)``."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK_D)
    dmask = offs < D
    mask = (rows < N)[:, None] & dmask[None, :]
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + rows[:, None] * sx + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + rows[:, None] * sd + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    r = (x + d).to(dt)
    tl.store(res_ptr + rows[:, None] * sr + offs[None, :], r, mask=mask)
    rf = r.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(rf * rf, axis=1) / D + eps)
    w = tl.load(w_ptr + offs, mask=dmask, other=0.0).to(tl.float32)
    y = (rf * rstd[:, None]) * (1.0 + w)[None, :]
    tl.store(out_ptr + rows[:, None] * so + offs[None, :], y.to(dt), mask=mask)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, N, F, sg, su, so, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr):
    """``out = silu(g) * u``, each op rounded to the dtype as in torch (``F.silu(g) * u``)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < N)[:, None] & (cols < F)[None, :]
    dt = out_ptr.dtype.element_ty
    g = tl.load(g_ptr + rows[:, None] * sg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * su + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * so + cols[None, :], (s * u).to(dt), mask=mask)


@triton.jit
def _l2_norm_heads_kernel(
    x_ptr, out_ptr, N, H, D, st, sh, eps,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rows (t, h) of a strided ``(T, H, D)`` ``x`` (unit last stride): ``out = x * rsqrt(sum(x^2) + eps)`` into a
    contiguous ``(T, H, D)`` output, float32 inside."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK_D)
    mask = (rows < N)[:, None] & (offs < D)[None, :]
    src = (rows // H).to(tl.int64) * st + (rows % H).to(tl.int64) * sh
    x = tl.load(x_ptr + src[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + eps)
    y = x * rstd[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + offs[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
