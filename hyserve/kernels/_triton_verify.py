"""Triton kernels for :mod:`hyserve.kernels.verify`, imported lazily (CUDA path and interpreter tests only).

Verification never writes live state: every kernel here only *reads* ``conv_state`` / ``ssm_state`` and records the
state after each position ``j`` of row ``r`` in the row-indexed scratch (``scratch[r, j]``, for ``j < min(n_r, P)``).
Nothing else is stored (an empty row stores nothing). ``_commit_kernel`` then copies one candidate per accepted row
into its slot.

* ``_conv1d_verify_kernel`` mirrors ``_conv1d_fwd_kernel``: one program per (token block, row, channel block). The
  window after token ``t`` is inputs ``t - K + 2 .. t``, i.e. exactly the taps ``1 .. K - 1`` the output at ``t``
  already loads, so each tap's tile is stored to scratch as it is read.
* ``_gdn_verify_kernel`` mirrors ``_gdn_recurrent_kernel``: one program per (row, value head, ``BV`` block) keeps the
  ``(Dk, BV)`` float32 state tile in registers and stores it to scratch after every token.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_commit_kernel", "_conv1d_verify_kernel", "_gdn_verify_kernel"]


@triton.jit
def _conv1d_verify_kernel(
    x_ptr, w_ptr, state_ptr, slots_ptr, qsl_ptr, out_ptr, scr_ptr,
    D, P,
    sx_t, sx_d, sw_d, sw_k, ss_s, ss_d, ss_k, so_t,
    sc_r, sc_p, sc_d, sc_k,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid (token blocks, R, channel blocks). out = silu(sum_k w[:, k] * window[k]) in fp32; scratch[r, t] = window
    after token t (taps 1..K-1), for t < min(n, P)."""
    tb = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    db = tl.program_id(2)
    start = tl.load(qsl_ptr + r).to(tl.int64)
    n = tl.load(qsl_ptr + r + 1).to(tl.int64) - start
    slot = tl.load(slots_ptr + r).to(tl.int64)
    offs_d = db * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < n
    m = t_mask[:, None] & d_mask[None, :]
    cm = m & (offs_t < P)[:, None]
    srow = state_ptr + slot * ss_s + offs_d[None, :] * ss_d
    crow = scr_ptr + r * sc_r + offs_t[:, None] * sc_p + offs_d[None, :] * sc_d

    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(K):
        rel = offs_t - (K - 1) + k
        from_x = (rel >= 0)[:, None]
        xv = tl.load(x_ptr + (start + rel)[:, None] * sx_t + offs_d[None, :] * sx_d, mask=m & from_x, other=0.0)
        sv = tl.load(srow + (K - 1 + rel)[:, None] * ss_k, mask=m & (~from_x), other=0.0)
        wk = tl.load(w_ptr + offs_d * sw_d + k * sw_k, mask=d_mask, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * wk[None, :]
        if k > 0:
            win = tl.where(from_x, xv.to(sv.dtype), sv)
            tl.store(crow + (k - 1) * sc_k, win.to(scr_ptr.dtype.element_ty), mask=cm)
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + (start + offs_t)[:, None] * so_t + offs_d[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _gdn_verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, qsl_ptr, out_ptr, scr_ptr,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h,
    ss_s, ss_h, ss_k, ss_v, so_t, so_h,
    sc_r, sc_p, sc_h, sc_k, sc_v,
    P, scale,
    DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Per token: q, k l2-normalised (eps 1e-6), q *= scale; S *= exp(g); S += k (beta (v - S^T k))^T; o = S^T q;
    scratch[r, i] = S (for i < P). The live state is only loaded."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    start = tl.load(qsl_ptr + r).to(tl.int64)
    n = tl.load(qsl_ptr + r + 1).to(tl.int64) - start
    slot = tl.load(slots_ptr + r).to(tl.int64)
    hk = h // GROUP

    ok = tl.arange(0, BK)
    ov = vb * BV + tl.arange(0, BV)
    kmask = ok < DK
    vmask = ov < DV
    tile = kmask[:, None] & vmask[None, :]
    s_ptrs = state_ptr + slot * ss_s + h * ss_h + ok[:, None] * ss_k + ov[None, :] * ss_v
    S = tl.load(s_ptrs, mask=tile & (n > 0), other=0.0).to(tl.float32)
    c_ptrs = scr_ptr + r * sc_r + h * sc_h + ok[:, None] * sc_k + ov[None, :] * sc_v

    for i in range(0, n):
        t = start + i
        qv = tl.load(q_ptr + t * sq_t + hk * sq_h + ok, mask=kmask, other=0.0).to(tl.float32)
        kv = tl.load(k_ptr + t * sk_t + hk * sk_h + ok, mask=kmask, other=0.0).to(tl.float32)
        vv = tl.load(v_ptr + t * sv_t + h * sv_h + ov, mask=vmask, other=0.0).to(tl.float32)
        gt = tl.load(g_ptr + t * sg_t + h * sg_h).to(tl.float32)
        bt = tl.load(beta_ptr + t * sb_t + h * sb_h).to(tl.float32)
        qv = qv * (1.0 / tl.sqrt(tl.sum(qv * qv, axis=0) + 1e-6)) * scale
        kv = kv * (1.0 / tl.sqrt(tl.sum(kv * kv, axis=0) + 1e-6))
        S = S * tl.exp(gt)
        mem = tl.sum(S * kv[:, None], axis=0)  # (BV,) = S^T k
        delta = (vv - mem) * bt
        S = S + kv[:, None] * delta[None, :]
        o = tl.sum(S * qv[:, None], axis=0)
        tl.store(out_ptr + t * so_t + h * so_h + ov, o.to(out_ptr.dtype.element_ty), mask=vmask)
        tl.store(c_ptrs + i * sc_p, S, mask=tile & (i < P))


@triton.jit
def _commit_kernel(
    src_ptr, dst_ptr, slots_ptr, acc_ptr,
    N, s_r, s_p, d_s,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid (R, blocks of N): dst[slots[r]] = src[r, acc[r]] (each entry N contiguous elements) where acc[r] >= 0."""
    r = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    a = tl.load(acc_ptr + r).to(tl.int64)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    mask = (offs < N) & (a >= 0)
    vals = tl.load(src_ptr + r * s_r + a * s_p + offs, mask=mask)
    tl.store(dst_ptr + slot * d_s + offs, vals, mask=mask)
