"""Triton kernel for :mod:`hyserve.kernels.rope` (imported lazily: only the CUDA path and interpreter tests)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_rope_kernel"]


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, T, H, D, R2, sx_t, sx_h, so_t, so_h, sc_t,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rotate channels ``[0, 2 * R2)`` of head ``program_id(1)`` for ``BLOCK_T`` tokens (NeoX pairs ``i``, ``i + R2``),
    copy the rest. Products are cast to the output dtype before the sum, as the torch reference rounds them; the GPU
    compiler may fold that cast pair away (bf16 then differs from the reference by one ulp in a fraction of elements,
    measured on the H200), which only removes a rounding."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    dt = out_ptr.dtype.element_ty
    tmask = t < T
    i = tl.arange(0, BLOCK_R)
    m = tmask[:, None] & (i < R2)[None, :]
    xb = x_ptr + t[:, None] * sx_t + h * sx_h
    ob = out_ptr + t[:, None] * so_t + h * so_h
    x1 = tl.load(xb + i[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xb + (i + R2)[None, :], mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t[:, None] * sc_t + i[None, :], mask=m, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + t[:, None] * sc_t + i[None, :], mask=m, other=0.0).to(dt).to(tl.float32)
    o1 = (x1 * c).to(dt).to(tl.float32) + (-x2 * s).to(dt).to(tl.float32)
    o2 = (x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)
    tl.store(ob + i[None, :], o1.to(dt), mask=m)
    tl.store(ob + (i + R2)[None, :], o2.to(dt), mask=m)
    j = 2 * R2 + tl.arange(0, BLOCK_D)
    mp = tmask[:, None] & (j < D)[None, :]
    tl.store(ob + j[None, :], tl.load(xb + j[None, :], mask=mp, other=0.0), mask=mp)
