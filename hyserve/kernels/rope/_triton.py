"""Triton kernel for :mod:`hyserve.kernels.rope` (imported lazily: only the CUDA path and interpreter tests)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_norm_rope_kernel", "_rope_kernel"]


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


@triton.jit
def _norm_rope_rows(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, h, T, D, R2, sx_t, sx_h, so_t, so_h, sc_t, eps,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Head ``h`` of ``BLOCK_T`` tokens: the zero-centred RMSNorm over the head (float32, ``* (1 + w)``, rounded to
    the dtype, as ``_rms_norm_kernel``), then ``_rope_kernel``'s rotation of its first ``2 * R2`` channels."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    dt = out_ptr.dtype.element_ty
    tmask = t < T
    i = tl.arange(0, BLOCK_R)
    rmask = i < R2
    m = tmask[:, None] & rmask[None, :]
    j = 2 * R2 + tl.arange(0, BLOCK_D)
    pmask = j < D
    mp = tmask[:, None] & pmask[None, :]
    xb = x_ptr + t[:, None] * sx_t + h * sx_h
    ob = out_ptr + t[:, None] * so_t + h * so_h
    x1 = tl.load(xb + i[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xb + (i + R2)[None, :], mask=m, other=0.0).to(tl.float32)
    xp = tl.load(xb + j[None, :], mask=mp, other=0.0).to(tl.float32)
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xp * xp, axis=1)
    rstd = 1.0 / tl.sqrt(ss / D + eps)
    w1 = tl.load(w_ptr + i, mask=rmask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + i + R2, mask=rmask, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + j, mask=pmask, other=0.0).to(tl.float32)
    n1 = ((x1 * rstd[:, None]) * (1.0 + w1)[None, :]).to(dt).to(tl.float32)
    n2 = ((x2 * rstd[:, None]) * (1.0 + w2)[None, :]).to(dt).to(tl.float32)
    npass = (xp * rstd[:, None]) * (1.0 + wp)[None, :]
    c = tl.load(cos_ptr + t[:, None] * sc_t + i[None, :], mask=m, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + t[:, None] * sc_t + i[None, :], mask=m, other=0.0).to(dt).to(tl.float32)
    o1 = (n1 * c).to(dt).to(tl.float32) + (-n2 * s).to(dt).to(tl.float32)
    o2 = (n2 * c).to(dt).to(tl.float32) + (n1 * s).to(dt).to(tl.float32)
    tl.store(ob + i[None, :], o1.to(dt), mask=m)
    tl.store(ob + (i + R2)[None, :], o2.to(dt), mask=m)
    tl.store(ob + j[None, :], npass.to(dt), mask=mp)


@triton.jit
def _norm_rope_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
    T, HQ, D, R2, sq_t, sq_h, sk_t, sk_h, sqo_t, sqo_h, sko_t, sko_h, sc_t, eps,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid (token blocks, Hq + Hk): the gated attention's q / k head norms and their rotation in one launch; heads
    ``< HQ`` are q's, the rest k's (``_norm_rope_rows``)."""
    h = tl.program_id(1)
    if h < HQ:
        _norm_rope_rows(q_ptr, qw_ptr, cos_ptr, sin_ptr, qo_ptr, h, T, D, R2, sq_t, sq_h, sqo_t, sqo_h, sc_t, eps,
                        BLOCK_T, BLOCK_R, BLOCK_D)
    else:
        _norm_rope_rows(k_ptr, kw_ptr, cos_ptr, sin_ptr, ko_ptr, h - HQ, T, D, R2, sk_t, sk_h, sko_t, sko_h, sc_t,
                        eps, BLOCK_T, BLOCK_R, BLOCK_D)
