"""Triton kernels for :mod:`hyserve.kernels.gdn`: the gated delta rule, token by token, state read once.

Both kernels run one program per (row, value head, block of ``BV`` value channels). A program loads the ``(Dk, BV)``
float32 tile of the slot's state into registers and advances it over the row's tokens (one for decode) with
``_delta_rule_step``, the one definition of the recurrence that both kernels share. An empty row loads and stores
nothing. Distinct non-empty rows have distinct slots, so no two programs touch the same tile; the tile is loaded and
stored with one layout, so each element is read and written by the same thread.

* ``_gdn_recurrent_kernel`` (:func:`hyserve.kernels.gdn.gdn_recurrent_triton`) writes the tile back in place after
  the row's last token.
* ``_gdn_verify_kernel`` (:mod:`hyserve.kernels.gdn.verify`) never writes the live state: it stores the tile after
  each token ``i`` of row ``r`` in the row-indexed scratch (``scratch[r, i]``, for ``i < P``).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_gdn_recurrent_kernel", "_gdn_verify_kernel"]


@triton.jit
def _delta_rule_step(
    S, t, h, hk, ok, ov, kmask, vmask,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h, so_t, so_h,
    scale,
):  # fmt: skip
    """Token ``t``, value head ``h`` (key head ``hk``): q, k l2-normalised (eps 1e-6), q *= scale; S *= exp(g);
    S += k (beta (v - S^T k))^T; o = S^T q, stored to ``out[t, h]``. Returns the advanced state tile."""
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
    return S


@triton.jit
def _gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, qsl_ptr, out_ptr,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h,
    ss_s, ss_h, ss_k, ss_v, so_t, so_h,
    scale,
    DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """The row's tokens through ``_delta_rule_step``; the slot's state tile read once and written back once."""
    r = tl.program_id(0)
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
    smask = kmask[:, None] & vmask[None, :] & (n > 0)
    s_ptrs = state_ptr + slot * ss_s + h * ss_h + ok[:, None] * ss_k + ov[None, :] * ss_v
    S = tl.load(s_ptrs, mask=smask, other=0.0).to(tl.float32)

    for i in range(0, n):
        S = _delta_rule_step(
            S, start + i, h, hk, ok, ov, kmask, vmask,
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
            sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h, so_t, so_h,
            scale,
        )  # fmt: skip

    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=smask)


@triton.jit
def _gdn_verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, qsl_ptr, out_ptr, scr_ptr,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h,
    ss_s, ss_h, ss_k, ss_v, so_t, so_h,
    sc_r, sc_p, sc_h, sc_k, sc_v,
    P, scale,
    DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """The row's tokens through ``_delta_rule_step``; scratch[r, i] = S after token i (for i < P). The live state is
    only loaded."""
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
        S = _delta_rule_step(
            S, start + i, h, hk, ok, ov, kmask, vmask,
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
            sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h, so_t, so_h,
            scale,
        )  # fmt: skip
        tl.store(c_ptrs + i * sc_p, S.to(scr_ptr.dtype.element_ty), mask=tile & (i < P))
