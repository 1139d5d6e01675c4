"""Triton kernels for :mod:`hyserve.kernels.hyper_connection` (Qwen4-Exp's hyper-connections): each rounds to the
activation dtype where the torch formulation (``hyserve.layers.hyper_connection``) does, so the two differ only in
the order of float32 sums.

* ``_hc_inject_norm_kernel``: grid (T, S). The injection ``x + out * w[s]`` into stream ``s`` (written to a new
  tensor) and/or the stream's zero-centred RMSNorm (float32 inside, times ``1 + weight``).
* ``_hc_gates_kernel``: one program per token: ``silu(d / S)`` over the low-rank width and ``2 sigmoid(i / S)`` over
  the streams.
* ``_hc_mix_kernel``: grid (T, cdiv(H, BLOCK)): ``mean_s(sigmoid(u_s) * n_s)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_hc_gates_kernel", "_hc_inject_norm_kernel", "_hc_mix_kernel"]


@triton.jit
def _hc_inject_norm_kernel(
    x_ptr, o_ptr, w_ptr, xo_ptr, y_ptr, nw_ptr,
    sx_t, so_t, sw_t, sxo_t, sy_t, eps,
    H: tl.constexpr, BLOCK_H: tl.constexpr, INJECT: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    oh = tl.arange(0, BLOCK_H)
    m = oh < H
    x = tl.load(x_ptr + t * sx_t + s * H + oh, mask=m, other=0.0)
    if INJECT:
        o = tl.load(o_ptr + t * so_t + oh, mask=m, other=0.0)
        w = tl.load(w_ptr + t * sw_t + s)
        prod = (o.to(tl.float32) * w.to(tl.float32)).to(x.dtype)
        x = (x.to(tl.float32) + prod.to(tl.float32)).to(x.dtype)
        tl.store(xo_ptr + t * sxo_t + s * H + oh, x, mask=m)
    if NORM:
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
        nw = tl.load(nw_ptr + s * H + oh, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * sy_t + s * H + oh, (xf * inv * (1.0 + nw)).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _hc_gates_kernel(
    d_ptr, i_ptr, g_ptr, iw_ptr,
    sd_t, si_t, sg_t, siw_t, S,
    R: tl.constexpr, BLOCK_R: tl.constexpr, NS: tl.constexpr, BLOCK_S: tl.constexpr, HAS_INJECT: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    orr = tl.arange(0, BLOCK_R)
    mr = orr < R
    d = tl.load(d_ptr + t * sd_t + orr, mask=mr, other=0.0)
    q = (d.to(tl.float32) / S).to(d.dtype).to(tl.float32)
    tl.store(g_ptr + t * sg_t + orr, (q * tl.sigmoid(q)).to(g_ptr.dtype.element_ty), mask=mr)
    if HAS_INJECT:
        os_ = tl.arange(0, BLOCK_S)
        ms = os_ < NS
        i = tl.load(i_ptr + t * si_t + os_, mask=ms, other=0.0)
        qi = (i.to(tl.float32) / S).to(i.dtype).to(tl.float32)
        sg = tl.sigmoid(qi).to(i.dtype).to(tl.float32)
        tl.store(iw_ptr + t * siw_t + os_, (2.0 * sg).to(iw_ptr.dtype.element_ty), mask=ms)


@triton.jit
def _hc_mix_kernel(
    u_ptr, n_ptr, m_ptr,
    su_t, sn_t, sm_t,
    NS: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    oh = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mh = oh < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(NS):
        u = tl.load(u_ptr + t * su_t + s * H + oh, mask=mh, other=0.0)
        n = tl.load(n_ptr + t * sn_t + s * H + oh, mask=mh, other=0.0)
        g = tl.sigmoid(u.to(tl.float32)).to(u.dtype)
        acc += (g.to(tl.float32) * n.to(tl.float32)).to(u.dtype).to(tl.float32)
    tl.store(m_ptr + t * sm_t + oh, (acc / NS).to(m_ptr.dtype.element_ty), mask=mh)
