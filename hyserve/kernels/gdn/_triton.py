"""Triton kernels for :mod:`hyserve.kernels.gdn`: the gated delta rule, token by token, state read once.

The kernels run one program per (row, value head, block of ``BV`` value channels). A program loads the ``(Dk, BV)``
float32 tile of the slot's state into registers and advances it over the row's tokens (one for decode) with
``_delta_rule_step`` (its state update: ``_delta_rule_update``), the one definition of the recurrence they share. An
empty row loads and stores nothing. Distinct non-empty rows have distinct slots, so no two programs touch the same
tile; the tile is loaded and stored with one layout, so each element is read and written by the same thread.

* ``_gdn_recurrent_kernel`` (:func:`hyserve.kernels.gdn.gdn_recurrent_triton`) writes the tile back in place after
  the row's last token.
* ``_gdn_verify_kernel`` (:mod:`hyserve.kernels.gdn.verify`) never writes the live state: it stores each token
  ``i``'s inputs to the recurrence (raw k, v, g, beta, in float32) in the row-indexed stash (``stash[r, i]``, for
  ``i < P``), a few kilobytes a token against the state's megabytes.
* ``_gdn_replay_kernel`` (:func:`hyserve.kernels.gdn.verify.gdn_replay`) advances a slot's tile over the first
  ``count + 1`` stashed tokens of a row with ``_delta_rule_update`` (the step's state update, the same code) and
  stores it to a slot: the commit of ``count`` accepted drafts (back into the row's slot), or a candidate snapshot
  (into a pool entry).
* ``_gdn_decode_fused_kernel`` (:mod:`hyserve.kernels.gdn.decode`) runs one program per (row, value head) over the
  head's ``Dv / BV`` tiles in turn, with the conv, gates and gated norm around the step (the same arithmetic as
  ``_delta_rule_step``, inlined: its q, k, v come from registers, not memory); ``_gdn_decode_split_kernel`` runs
  the same step with one program per (row, value head, value block), the head's last program doing its norm.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hyserve.kernels.commit._triton import copy_window_piece
from hyserve.kernels.fp8._triton import quantize_token_row

__all__ = ["_gdn_decode_fused_kernel", "_gdn_recurrent_kernel", "_gdn_replay_kernel", "_gdn_verify_fused_kernel",
           "_gdn_verify_kernel"]


@triton.jit
def _delta_rule_step(
    S, t, h, hk, ok, ov, kmask, vmask,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h, so_t, so_h,
    scale, QK_NORMED: tl.constexpr = False,
):  # fmt: skip
    """Token ``t``, value head ``h`` (key head ``hk``): q, k l2-normalised (eps 1e-6; ``QK_NORMED``: they come
    normalised, as fla's chunked path reads them), q *= scale; S *= exp(g); S += k (beta (v - S^T k))^T;
    o = S^T q, stored to ``out[t, h]``. Returns the advanced state tile."""
    qv = tl.load(q_ptr + t * sq_t + hk * sq_h + ok, mask=kmask, other=0.0).to(tl.float32)
    kv = tl.load(k_ptr + t * sk_t + hk * sk_h + ok, mask=kmask, other=0.0).to(tl.float32)
    vv = tl.load(v_ptr + t * sv_t + h * sv_h + ov, mask=vmask, other=0.0).to(tl.float32)
    gt = tl.load(g_ptr + t * sg_t + h * sg_h).to(tl.float32)
    bt = tl.load(beta_ptr + t * sb_t + h * sb_h).to(tl.float32)
    if not QK_NORMED:
        qv = qv * (1.0 / tl.sqrt(tl.sum(qv * qv, axis=0) + 1e-6))
    qv = qv * scale
    S = _delta_rule_update(S, kv, vv, gt, bt, not QK_NORMED)
    o = tl.sum(S * qv[:, None], axis=0)
    tl.store(out_ptr + t * so_t + h * so_h + ov, o.to(out_ptr.dtype.element_ty), mask=vmask)
    return S


@triton.jit
def _delta_rule_update(S, kv, vv, gt, bt, NORM_K: tl.constexpr = True):
    """The state update of one token from its raw float32 k (l2-normalised here, eps 1e-6; not with ``NORM_K``
    false: it comes normalised), v, g and beta: S *= exp(g); S += k (beta (v - S^T k))^T. ``_delta_rule_step`` and
    ``_gdn_replay_kernel`` share it, so a replayed state is the verify kernel's own."""
    if NORM_K:
        kv = kv * (1.0 / tl.sqrt(tl.sum(kv * kv, axis=0) + 1e-6))
    S = S * tl.exp(gt)
    mem = tl.sum(S * kv[:, None], axis=0)  # (BV,) = S^T k
    delta = (vv - mem) * bt
    return S + kv[:, None] * delta[None, :]


@triton.jit
def _gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, qsl_ptr, out_ptr,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h,
    ss_s, ss_h, ss_k, ss_v, so_t, so_h,
    scale,
    DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    QK_NORMED: tl.constexpr = False,
):  # fmt: skip
    """The row's tokens through ``_delta_rule_step``; the slot's state tile read once and written back once.
    ``QK_NORMED``: q and k come l2-normalised (not normalised again)."""
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
            scale, QK_NORMED,
        )  # fmt: skip

    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=smask)


@triton.jit
def _gdn_verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, qsl_ptr, out_ptr,
    stk_ptr, stv_ptr, stg_ptr, stb_ptr,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h,
    ss_s, ss_h, ss_k, ss_v, so_t, so_h,
    stk_r, stk_p, stk_h, stv_r, stv_p, stv_h, stg_r, stg_p,
    P, scale,
    DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """The row's tokens through ``_delta_rule_step``; stash[r, i] = token i's raw k, v, g, beta in float32 (for
    i < P): v by every program for its block, k by the first program of its key head, g and beta by the first of
    the value head. The live state is only loaded."""
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
    writes_k = (h % GROUP == 0) & (vb == 0)

    for i in range(0, n):
        t = start + i
        kept = i < P
        kv = tl.load(k_ptr + t * sk_t + hk * sk_h + ok, mask=kmask, other=0.0).to(tl.float32)
        vv = tl.load(v_ptr + t * sv_t + h * sv_h + ov, mask=vmask, other=0.0).to(tl.float32)
        tl.store(stk_ptr + r * stk_r + i * stk_p + hk * stk_h + ok, kv, mask=kmask & kept & writes_k)
        tl.store(stv_ptr + r * stv_r + i * stv_p + h * stv_h + ov, vv, mask=vmask & kept)
        gt = tl.load(g_ptr + t * sg_t + h * sg_h).to(tl.float32)
        bt = tl.load(beta_ptr + t * sb_t + h * sb_h).to(tl.float32)
        tl.store(stg_ptr + r * stg_r + i * stg_p + h, gt, mask=kept & (vb == 0))
        tl.store(stb_ptr + r * stg_r + i * stg_p + h, bt, mask=kept & (vb == 0))
        S = _delta_rule_step(
            S, t, h, hk, ok, ov, kmask, vmask,
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
            sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h, so_t, so_h,
            scale,
        )  # fmt: skip


@triton.jit
def _gdn_replay_kernel(
    state_ptr, stk_ptr, stv_ptr, stg_ptr, stb_ptr, rows_ptr, src_ptr, dst_ptr, count_ptr,
    conv_ptr, cscr_ptr,
    ss_s, ss_h, ss_k, ss_v,
    stk_r, stk_p, stk_h, stv_r, stv_p, stv_h, stg_r, stg_p,
    sc_s, scr_r, scr_p, E,
    P,
    DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ROWS: tl.constexpr, CONV: tl.constexpr = False, CBLOCK: tl.constexpr = 256,
):  # fmt: skip
    """Grid (N, Hv, Dv / BV). Entry i: count c = count[i] (< 0: nothing); the state tile of slot src[i] advanced
    over stash row r's tokens 0 .. min(c, P - 1) (r = rows[i], or i without ``ROWS``), stored to slot dst[i].
    ``CONV``: the candidate conv window ``conv_scratch[r, c]`` (``E`` contiguous elements) copied to
    ``conv_state[dst[i]]`` too, in ``Hv`` pieces by the programs of the first value block."""
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    c = tl.load(count_ptr + i).to(tl.int64)
    if c < 0:
        return
    r = i
    if ROWS:
        r = tl.load(rows_ptr + i).to(tl.int64)
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    if CONV:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if vb == 0:
            copy_window_piece(conv_ptr, cscr_ptr, r, c, dst, sc_s, scr_r, scr_p, E, h, tl.num_programs(1), CBLOCK)
    hk = h // GROUP
    ok = tl.arange(0, BK)
    ov = vb * BV + tl.arange(0, BV)
    kmask = ok < DK
    vmask = ov < DV
    tile = kmask[:, None] & vmask[None, :]
    head = h * ss_h + ok[:, None] * ss_k + ov[None, :] * ss_v
    S = tl.load(state_ptr + src * ss_s + head, mask=tile, other=0.0).to(tl.float32)
    for j in range(0, tl.minimum(c + 1, P)):
        kv = tl.load(stk_ptr + r * stk_r + j * stk_p + hk * stk_h + ok, mask=kmask, other=0.0)
        vv = tl.load(stv_ptr + r * stv_r + j * stv_p + h * stv_h + ov, mask=vmask, other=0.0)
        gt = tl.load(stg_ptr + r * stg_r + j * stg_p + h)
        bt = tl.load(stb_ptr + r * stg_r + j * stg_p + h)
        S = _delta_rule_update(S, kv, vv, gt, bt)
    tl.store(state_ptr + dst * ss_s + head, S.to(state_ptr.dtype.element_ty), mask=tile)


@triton.jit
def _gdn_gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, t, h, sa_t, sb_t):
    """Token ``t``'s gates of value head ``h`` (as ``_gdn_gating_kernel``): g = -exp(A_log) * softplus(a + dt_bias),
    beta = sigmoid(b), both float32."""
    av = tl.load(a_ptr + t * sa_t + h).to(tl.float32)
    bv = tl.load(b_ptr + t * sb_t + h).to(tl.float32)
    xg = av + tl.load(dtb_ptr + h).to(tl.float32)
    y = tl.exp(tl.minimum(xg, 20.0))
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))
    sp = tl.where(xg > 20.0, xg, log1p)
    gt = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * sp
    return gt, tl.sigmoid(bv)


@triton.jit
def _conv_row_taps(
    x_ptr, conv_ptr, cw_ptr, start, i, slot, ch, cmask,
    sx_t, sc_s, sc_d, sc_k, scw_d, scw_k,
    K: tl.constexpr,
):  # fmt: skip
    """The depthwise conv + SiLU of channels ``ch`` for the row's token ``i`` (``start + i``), as
    ``_conv1d_verify_kernel`` adds it up: tap ``k`` is the row's input ``i - K + 1 + k`` where that lies in the row,
    else the slot's window entry before it; float32 in tap order, SiLU, rounded to the input's dtype."""
    acc = tl.zeros(ch.shape, dtype=tl.float32)
    for k in tl.static_range(K):
        rel = i - (K - 1) + k
        in_row = rel >= 0
        xv = tl.load(x_ptr + (start + rel) * sx_t + ch, mask=cmask & in_row, other=0.0)
        sv = tl.load(conv_ptr + slot * sc_s + ch * sc_d + (K - 1 + rel) * sc_k, mask=cmask & (rel < 0), other=0.0)
        wk = tl.load(cw_ptr + ch * scw_d + k * scw_k, mask=cmask, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * wk
    y = acc / (1.0 + tl.exp(-acc))
    return y.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _store_row_window(
    x_ptr, conv_ptr, scr_ptr, start, i, slot, ch, cmask,
    sx_t, sc_s, sc_d, sc_k, scr_base, scr_d, scr_k,
    K: tl.constexpr, KM1_PAD: tl.constexpr,
):  # fmt: skip
    """The channels' window after the row's token ``i`` (inputs ``i - K + 2 .. i``, oldest first; those before the
    row from the slot's window), stored at ``scr_ptr + scr_base`` (a candidate: the live window is only read)."""
    p = tl.arange(0, KM1_PAD)
    rel = i - (K - 2) + p
    m = cmask[:, None] & (p < K - 1)[None, :]
    xv = tl.load(x_ptr + (start + rel)[None, :] * sx_t + ch[:, None], mask=m & (rel >= 0)[None, :], other=0.0)
    sv = tl.load(conv_ptr + slot * sc_s + ch[:, None] * sc_d + (K - 1 + rel)[None, :] * sc_k,
                 mask=m & (rel < 0)[None, :], other=0.0)
    win = tl.where((rel >= 0)[None, :], xv.to(sv.dtype), sv)
    tl.store(scr_ptr + scr_base + ch[:, None] * scr_d + p[None, :] * scr_k, win, mask=m)


@triton.jit
def _conv_tap_sum(
    x_ptr, conv_ptr, cw_ptr, t, slot, ch, cmask,
    sc_s, sc_d, sc_k, scw_d, scw_k,
    K: tl.constexpr,
):  # fmt: skip
    """The depthwise conv + SiLU of channels ``ch`` for token ``t`` (one token a row), as ``_conv1d_fwd_kernel``
    adds it up: taps ``0 .. K-2`` from the slot's window (oldest first), tap ``K-1`` the new input, accumulated in
    float32 in tap order, ``y = acc / (1 + exp(-acc))``, rounded to the input's dtype."""
    acc = tl.zeros(ch.shape, dtype=tl.float32)
    for k in tl.static_range(K):
        if k < K - 1:
            xv = tl.load(conv_ptr + slot * sc_s + ch * sc_d + k * sc_k, mask=cmask, other=0.0)
        else:
            xv = tl.load(x_ptr + t + ch, mask=cmask, other=0.0)
        wk = tl.load(cw_ptr + ch * scw_d + k * scw_k, mask=cmask, other=0.0).to(tl.float32)
        acc += xv.to(tl.float32) * wk
    y = acc / (1.0 + tl.exp(-acc))
    return y.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _conv_new_window(
    x_ptr, conv_ptr, t, slot, ch, cmask,
    sc_s, sc_d, sc_k,
    K: tl.constexpr, KM1_PAD: tl.constexpr,
):  # fmt: skip
    """The channels' next window ``(C, KM1_PAD)``: entries ``1 .. K-2`` of the old one, then the new input; and the
    pointers and mask to store it (after a barrier: other threads may still read the old window)."""
    p = tl.arange(0, KM1_PAD)
    from_x = (p == K - 2)[None, :]
    m = cmask[:, None] & (p < K - 1)[None, :]
    srow = conv_ptr + slot * sc_s + ch[:, None] * sc_d
    sv = tl.load(srow + (p + 1)[None, :] * sc_k, mask=m & ~from_x, other=0.0)
    xv = tl.load(x_ptr + t + ch[:, None] + p[None, :] * 0, mask=m & from_x, other=0.0)
    new = tl.where(from_x, xv.to(sv.dtype), sv)
    return new, srow + p[None, :] * sc_k, m


@triton.jit
def _decode_qk(
    x_ptr, conv_ptr, cw_ptr, xt, slot, hk, live, scale,
    sc_s, sc_d, sc_k, scw_d, scw_k,
    HK: tl.constexpr, DK: tl.constexpr, K: tl.constexpr, KM1_PAD: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """Key head ``hk``'s q and k for a decode token (offset ``xt`` in x): conv + SiLU (rounded to the model dtype),
    l2-normed in float32, q scaled; their next windows with the pointers and mask to store them (after a barrier).
    Returns ``(ok, kmask, q, k, nq, pq, mq, nk, pk, mk)``."""
    ok = tl.arange(0, BK)
    kmask = (ok < DK) & live
    cq = hk * DK + ok
    ck = HK * DK + hk * DK + ok
    qv = _conv_tap_sum(x_ptr, conv_ptr, cw_ptr, xt, slot, cq, kmask, sc_s, sc_d, sc_k, scw_d, scw_k, K)
    kv = _conv_tap_sum(x_ptr, conv_ptr, cw_ptr, xt, slot, ck, kmask, sc_s, sc_d, sc_k, scw_d, scw_k, K)
    qv = qv * (1.0 / tl.sqrt(tl.sum(qv * qv, axis=0) + 1e-6)) * scale
    kv = kv * (1.0 / tl.sqrt(tl.sum(kv * kv, axis=0) + 1e-6))
    nq, pq, mq = _conv_new_window(x_ptr, conv_ptr, xt, slot, cq, kmask, sc_s, sc_d, sc_k, K, KM1_PAD)
    nk, pk, mk = _conv_new_window(x_ptr, conv_ptr, xt, slot, ck, kmask, sc_s, sc_d, sc_k, K, KM1_PAD)
    return ok, kmask, qv, kv, nq, pq, mq, nk, pk, mk


@triton.jit
def _gdn_decode_head(
    x_ptr, z_ptr, b_ptr, a_ptr, cw_ptr, alog_ptr, dtb_ptr, nw_ptr,
    conv_ptr, state_ptr, slots_ptr, qsl_ptr, arr_ptr, out_ptr, r, h,
    sx_t, sz_t, sb_t, sa_t, scw_d, scw_k,
    sc_s, sc_d, sc_k,
    ss_s, ss_h, ss_k, ss_v,
    sarr_s, so_t,
    scale, eps,
    HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr,
    KM1_PAD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DVP: tl.constexpr, UPFRONT: tl.constexpr,
    ROLL: tl.constexpr = True,
):  # fmt: skip
    """Row ``r``'s decode token through value head ``h`` (:func:`_gdn_decode_fused_kernel`'s program, and each
    iteration of :func:`_gdn_decode_persist_kernel`'s): returns the row's ``(start, live)``. ``ROLL``: the conv
    windows rolled here (after a barrier); without it they are only read, and :func:`_conv_roll_kernel` rolls them
    after the launch."""
    start = tl.load(qsl_ptr + r).to(tl.int64)
    live = (tl.load(qsl_ptr + r + 1).to(tl.int64) - start) > 0
    slot = tl.load(slots_ptr + r).to(tl.int64)
    hk = h // GROUP
    xt = start * sx_t  # the token's offset in x (unit channel stride)
    dt = out_ptr.dtype.element_ty
    WALK: tl.constexpr = 0 if UPFRONT else DV  # the walk's value channels (none when UPFRONT took them)
    if UPFRONT:  # the loads that wait on nothing but the slot, issued before the prologue's first reduction
        uv = tl.arange(0, BV)
        umask = (uv < DV) & live
        uk = tl.arange(0, BK)
        u_tile = ((uk < DK) & live)[:, None] & umask[None, :]
        u_ptrs = state_ptr + slot * ss_s + h * ss_h + uk[:, None] * ss_k + uv[None, :] * ss_v
        u_state = tl.load(u_ptrs, mask=u_tile, other=0.0)
        u_gate = tl.load(z_ptr + start * sz_t + h * DV + uv, mask=umask, other=0.0).to(tl.float32)
        u_w = tl.load(nw_ptr + uv, mask=umask, other=0.0).to(tl.float32)
        u_v = _conv_tap_sum(x_ptr, conv_ptr, cw_ptr, xt, slot, 2 * HK * DK + h * DV + uv, umask, sc_s, sc_d, sc_k,
                            scw_d, scw_k, K)
        gt, bt = _gdn_gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, start, h, sa_t, sb_t)

    # q and k: conv + SiLU (rounded to the model dtype), l2-normed in float32, q scaled; their next windows.
    ok, kmask, qv, kv, nq, pq, mq, nk, pk, mk = _decode_qk(x_ptr, conv_ptr, cw_ptr, xt, slot, hk, live, scale,
                                                           sc_s, sc_d, sc_k, scw_d, scw_k, HK, DK, K, KM1_PAD, BK)

    if not UPFRONT:
        gt, bt = _gdn_gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, start, h, sa_t, sb_t)
    decay = tl.exp(gt)

    # The value channels' next windows, all ``DV`` at once (stored after the barrier below, after every read).
    oall = tl.arange(0, DVP)
    nv, pv, mv = _conv_new_window(x_ptr, conv_ptr, xt, slot, 2 * HK * DK + h * DV + oall, (oall < DV) & live,
                                  sc_s, sc_d, sc_k, K, KM1_PAD)

    # The delta rule over the head's value channels, BV at a time (no barrier inside: the tiles' loads may overlap).
    o_row = out_ptr + start * so_t + h * DV
    s_head = state_ptr + slot * ss_s + h * ss_h
    ssq = tl.zeros((BV,), dtype=tl.float32)
    if UPFRONT:  # one tile, the norm from registers: the output stored once
        US = u_state.to(tl.float32) * decay
        u_delta = (u_v - tl.sum(US * kv[:, None], axis=0)) * bt
        US = US + kv[:, None] * u_delta[None, :]
        u_o = tl.sum(US * qv[:, None], axis=0).to(dt).to(tl.float32)
        tl.store(u_ptrs, US.to(state_ptr.dtype.element_ty), mask=u_tile)
        u_rstd = 1.0 / tl.sqrt(tl.sum(tl.where(umask, u_o * u_o, 0.0), axis=0) / DV + eps)
        u_n = (u_w * (u_o * u_rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        tl.store(o_row + uv, (u_n * (u_gate * tl.sigmoid(u_gate))).to(dt), mask=umask)
    for vb in tl.static_range(0, WALK, BV):
        ov = vb + tl.arange(0, BV)
        vmask = (ov < DV) & live
        cv = 2 * HK * DK + h * DV + ov
        vv = _conv_tap_sum(x_ptr, conv_ptr, cw_ptr, xt, slot, cv, vmask, sc_s, sc_d, sc_k, scw_d, scw_k, K)
        smask = kmask[:, None] & vmask[None, :]
        s_ptrs = s_head + ok[:, None] * ss_k + ov[None, :] * ss_v
        S = tl.load(s_ptrs, mask=smask, other=0.0).to(tl.float32)
        S = S * decay
        mem = tl.sum(S * kv[:, None], axis=0)  # (BV,) = S^T k
        delta = (vv - mem) * bt
        S = S + kv[:, None] * delta[None, :]
        o = tl.sum(S * qv[:, None], axis=0).to(dt)
        tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=smask)
        tl.store(o_row + ov, o, mask=vmask)
        of = o.to(tl.float32)
        ssq += tl.where(vmask, of * of, 0.0)

    if ROLL:
        tl.debug_barrier()  # every conv window read, and every store of the head's output, before what follows
        tl.store(pv, nv, mask=mv)
        if GROUP == 1:
            tl.store(pq, nq, mask=mq)
            tl.store(pk, nk, mask=mk)
        else:
            arr = arr_ptr + slot * sarr_s + hk
            seen = tl.atomic_add(arr, 1, mask=live)
            last = live & (seen % GROUP == GROUP - 1)
            tl.store(pq, nq, mask=mq & last)
            tl.store(pk, nk, mask=mk & last)
            tl.atomic_add(arr, -GROUP, mask=last)

    # The gated RMSNorm (as _gated_rms_norm_kernel): n = norm(o) in the model dtype, (w * n) rounded, times silu(z).
    rstd = 1.0 / tl.sqrt(tl.sum(ssq, axis=0) / DV + eps)
    z_row = z_ptr + start * sz_t + h * DV
    for vb in tl.static_range(0, WALK, BV):
        ov = vb + tl.arange(0, BV)
        vmask = (ov < DV) & live
        of = tl.load(o_row + ov, mask=vmask, other=0.0).to(tl.float32)
        nrm = (of * rstd).to(dt).to(tl.float32)
        w = tl.load(nw_ptr + ov, mask=vmask, other=0.0).to(tl.float32)
        on = (w * nrm).to(dt).to(tl.float32)
        zz = tl.load(z_row + ov, mask=vmask, other=0.0).to(tl.float32)
        tl.store(o_row + ov, (on * (zz * tl.sigmoid(zz))).to(dt), mask=vmask)
    return start, live


@triton.jit
def _gdn_decode_fused_kernel(
    x_ptr, z_ptr, b_ptr, a_ptr, cw_ptr, alog_ptr, dtb_ptr, nw_ptr,
    conv_ptr, state_ptr, slots_ptr, qsl_ptr, arr_ptr, out_ptr, q_ptr, qs_ptr, cnt_ptr,
    sx_t, sz_t, sb_t, sa_t, scw_d, scw_k,
    sc_s, sc_d, sc_k,
    ss_s, ss_h, ss_k, ss_v,
    sarr_s, so_t, sq_t,
    scale, eps, fp8_max, amax_eps,
    HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr,
    KM1_PAD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DVP: tl.constexpr,
    QUANT: tl.constexpr = False, QBLOCK: tl.constexpr = 1024, UPFRONT: tl.constexpr = False,
):  # fmt: skip
    """One decode token of row ``r`` (grid axis 0), value head ``h`` (axis 1), key head ``hk = h // GROUP``: the
    conv of its q / k / v channels (q, k recomputed by each of the key head's ``GROUP`` value heads), the gates,
    the l2-normed delta rule on ``state[slot, h]`` (``(BK, BV)`` tiles, ``DV / BV`` of them in turn), and the gated
    RMSNorm of the head's output; the same rounding points as the unfused kernels (conv output, delta-rule output
    and the norm's two roundings in the model dtype, the state in its own).

    Conv windows: the value channels' are rolled by their head's program alone (after a barrier: other threads of
    the program may still read the old window). The key head's q / k channels are read by ``GROUP`` programs, so
    the last of them to arrive rolls them: each program counts itself in ``arrivals[slot, hk]`` (an atomic add,
    after its reads) and the one that sees ``GROUP - 1`` modulo ``GROUP`` writes and takes ``GROUP`` off again (the
    counter is back to 0 after every launch; pad rows, which share one slot, keep it a multiple of ``GROUP``).
    ``GROUP == 1`` needs no counter. The output ``out[t, h]`` holds the delta rule's output (model dtype) between
    the two passes; the norm pass reads it back after a barrier.

    ``QUANT``: the token's whole output row (its ``Hv`` heads) is also quantized per token for an FP8 ``out_proj``
    (``q``, ``qs``) by the last of the row's programs to finish (:func:`_quantize_when_last`).

    ``UPFRONT`` (the head's whole state one tile: ``BV >= DV``): every load the program needs that does not depend
    on another (the state tile, the value channels' conv taps, the gates, the norm's gate and weight) is issued
    right after the slot, before the q / k prologue's reductions, and the gated norm is taken from the output in
    registers, so the output is stored once and never read back. A program then waits on memory twice (the slot,
    then everything at once) where the walk waits after the slot, after the conv, for the state and again for the
    output it reads back. The same values, bit for bit, as the walk with one tile."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    start, live = _gdn_decode_head(x_ptr, z_ptr, b_ptr, a_ptr, cw_ptr, alog_ptr, dtb_ptr, nw_ptr, conv_ptr, state_ptr,
                                   slots_ptr, qsl_ptr, arr_ptr, out_ptr, r, h, sx_t, sz_t, sb_t, sa_t, scw_d, scw_k,
                                   sc_s, sc_d, sc_k, ss_s, ss_h, ss_k, ss_v, sarr_s, so_t, scale, eps,
                                   HK, DK, DV, GROUP, K, KM1_PAD, BK, BV, DVP, UPFRONT)
    if QUANT:
        _quantize_when_last(out_ptr, q_ptr, qs_ptr, cnt_ptr + r, live, start, 1, so_t, sq_t, HK * GROUP, DV,
                            fp8_max, amax_eps, QBLOCK)


@triton.jit
def _gdn_decode_persist_kernel(
    x_ptr, z_ptr, b_ptr, a_ptr, cw_ptr, alog_ptr, dtb_ptr, nw_ptr,
    conv_ptr, state_ptr, slots_ptr, qsl_ptr, arr_ptr, out_ptr, rows,
    sx_t, sz_t, sb_t, sa_t, scw_d, scw_k,
    sc_s, sc_d, sc_k,
    ss_s, ss_h, ss_k, ss_v,
    sarr_s, so_t,
    scale, eps,
    HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr,
    KM1_PAD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DVP: tl.constexpr, STAGES: tl.constexpr,
    ROLL: tl.constexpr = False,
):  # fmt: skip
    """The walk's UPFRONT form on a fixed grid: program ``p`` of ``P`` takes the (row, value head) pairs ``p, p + P,
    ...`` of the launch's ``rows * Hv`` (pair ``i`` is row ``i // Hv``, head ``i % Hv``) in one loop, which Triton
    pipelines over ``STAGES`` stages: the next pairs' slots and state tiles are copied into shared memory while the
    program computes the current one, so a program has its next tile in flight instead of waiting for it. Each
    iteration is :func:`_gdn_decode_head` without its window roll: Triton does not pipeline a loop with a barrier
    in it, and the roll needs one (a thread may store a window entry another thread has yet to read), so the windows
    are only read here and :func:`_conv_roll_kernel` rolls them after the launch. No two live pairs share a state
    tile or write anything another pair reads, so prefetching a later pair's loads before an earlier pair's stores
    reads nothing those stores write. The same values, bit for bit, as the UPFRONT launch with one program a pair.

    ``ROLL`` (one stage: nothing is pipelined for the barrier to stop): each iteration rolls its windows as the
    UPFRONT launch's program does, the key head's q / k windows by the last of its value heads to arrive
    (``arrivals``; a pair counts itself after its reads, so in any order of pairs over programs every reader has
    read before the last writes), and no second launch is needed."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    HV: tl.constexpr = HK * GROUP
    for i in tl.range(pid, rows * HV, nprog, num_stages=STAGES):
        _gdn_decode_head(x_ptr, z_ptr, b_ptr, a_ptr, cw_ptr, alog_ptr, dtb_ptr, nw_ptr, conv_ptr, state_ptr,
                         slots_ptr, qsl_ptr, arr_ptr, out_ptr, i // HV, i % HV, sx_t, sz_t, sb_t, sa_t, scw_d, scw_k,
                         sc_s, sc_d, sc_k, ss_s, ss_h, ss_k, ss_v, sarr_s, so_t, scale, eps,
                         HK, DK, DV, GROUP, K, KM1_PAD, BK, BV, DVP, True, ROLL)


@triton.jit
def _conv_roll_kernel(
    x_ptr, conv_ptr, slots_ptr, qsl_ptr, C,
    sx_t, sc_s, sc_d, sc_k,
    K: tl.constexpr, KM1_PAD: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """The conv windows of a decode step's rows rolled by their token: channels ``BC * j ..`` (grid axis 1) of row
    ``r``'s slot (axis 0) become entries ``1 .. K-2`` of the old window, then the token's input from ``x`` (what
    the fused decode's roll writes). Empty rows (a graph's pad rows among them) are left alone. Every read before the
    barrier, every store after it."""
    r = tl.program_id(0)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    start = tl.load(qsl_ptr + r).to(tl.int64)
    live = (tl.load(qsl_ptr + r + 1).to(tl.int64) - start) > 0
    slot = tl.load(slots_ptr + r).to(tl.int64)
    new, ptrs, m = _conv_new_window(x_ptr, conv_ptr, start * sx_t, slot, ch, (ch < C) & live, sc_s, sc_d, sc_k, K,
                                    KM1_PAD)
    tl.debug_barrier()  # a thread stores entry p of a window another thread reads as entry p + 1
    tl.store(ptrs, new, mask=m)


@triton.jit
def _gdn_decode_split_kernel(
    x_ptr, z_ptr, b_ptr, a_ptr, cw_ptr, alog_ptr, dtb_ptr, nw_ptr,
    conv_ptr, state_ptr, slots_ptr, qsl_ptr, arr_ptr, hcnt_ptr, out_ptr, q_ptr, qs_ptr, cnt_ptr,
    sx_t, sz_t, sb_t, sa_t, scw_d, scw_k,
    sc_s, sc_d, sc_k,
    ss_s, ss_h, ss_k, ss_v,
    sarr_s, shc_r, so_t, sq_t,
    scale, eps, fp8_max, amax_eps,
    HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr,
    KM1_PAD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DVP: tl.constexpr,
    QUANT: tl.constexpr = False, QBLOCK: tl.constexpr = 1024, EARLY: tl.constexpr = False,
    ONEPASS: tl.constexpr = False,
):  # fmt: skip
    """``_gdn_decode_fused_kernel`` with each value head split over ``NVB = cdiv(DV, BV)`` programs: program
    ``(r, h * NVB + j)`` (grid axes 0 and 1) computes row ``r``'s q / k and gates of head ``h`` and the delta rule
    of its value block ``j`` alone (one ``(BK, BV)`` tile of the state), so a launch has ``NVB`` times the programs,
    each one tile in flight (the batch-1 launch of a 32-head model: 128 programs for 132 SMs, not 32).

    Conv windows: a program rolls its own ``BV`` value channels' windows (no other program reads them), after a
    barrier. The key head's q / k windows are read by ``GROUP * NVB`` programs: the last to arrive rolls them
    (``arrivals[slot, hk]`` as in the unsplit kernel, counted modulo ``GROUP * NVB``).

    The gated RMSNorm needs the whole head's output: each program stores its block's delta-rule output in ``out``
    and counts itself in on ``head_counts[r, h]`` (after a barrier, release); the last of the head's ``NVB`` to
    arrive (acquire) reads the head's ``DV`` outputs back, normalizes them in one reduction (as
    ``_gated_rms_norm_kernel`` does), and sets the counter back to 0. ``QUANT``: those ``Hv`` head-last programs are
    the ones that count themselves in on the row's counter (:func:`_quantize_when_last`).

    ``EARLY``: the program's state tile is loaded right after its slot, before the q / k prologue (its latency under
    the conv's instead of after it; the tile's registers held through the prologue). The same values either way.
    ``ONEPASS``: the output from the decayed state read before the update, ``o = (gS)^T q + (k . q) delta``, so its
    reduction does not wait for the update (the state bit for bit the same; the output equal in exact arithmetic,
    not bit for bit)."""
    r = tl.program_id(0)
    hj = tl.program_id(1)
    NVB: tl.constexpr = (DV + BV - 1) // BV
    h = hj // NVB
    vb = (hj % NVB) * BV
    start = tl.load(qsl_ptr + r).to(tl.int64)
    live = (tl.load(qsl_ptr + r + 1).to(tl.int64) - start) > 0
    slot = tl.load(slots_ptr + r).to(tl.int64)
    xt = start * sx_t
    hk = h // GROUP
    dt = out_ptr.dtype.element_ty
    ov = vb + tl.arange(0, BV)
    vmask = (ov < DV) & live
    tile_k = tl.arange(0, BK)
    smask = ((tile_k < DK) & live)[:, None] & vmask[None, :]
    s_ptrs = state_ptr + slot * ss_s + h * ss_h + tile_k[:, None] * ss_k + ov[None, :] * ss_v
    if EARLY:
        tile = tl.load(s_ptrs, smask, 0.0)

    _ok, _km, qv, kv, nq, pq, mq, nk, pk, mk = _decode_qk(x_ptr, conv_ptr, cw_ptr, xt, slot, hk, live, scale,
                                                          sc_s, sc_d, sc_k, scw_d, scw_k, HK, DK, K, KM1_PAD, BK)
    gt, bt = _gdn_gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, start, h, sa_t, sb_t)

    cv = 2 * HK * DK + h * DV + ov
    vv = _conv_tap_sum(x_ptr, conv_ptr, cw_ptr, xt, slot, cv, vmask, sc_s, sc_d, sc_k, scw_d, scw_k, K)
    nv, pv, mv = _conv_new_window(x_ptr, conv_ptr, xt, slot, cv, vmask, sc_s, sc_d, sc_k, K, KM1_PAD)
    if not EARLY:
        tile = tl.load(s_ptrs, mask=smask, other=0.0)
    S = tile.to(tl.float32) * tl.exp(gt)
    mem = tl.sum(S * kv[:, None], axis=0)
    delta = (vv - mem) * bt
    if ONEPASS:
        o = (tl.sum(qv[:, None] * S, axis=0) + tl.sum(kv * qv, axis=0) * delta).to(dt)
        S = S + kv[:, None] * delta[None, :]
    else:
        S = S + kv[:, None] * delta[None, :]
        o = tl.sum(qv[:, None] * S, axis=0).to(dt)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=smask)
    o_row = out_ptr + start * so_t + h * DV
    tl.store(o_row + ov, o, mask=vmask)

    tl.debug_barrier()  # every conv window read, and every store of the block's output, before what follows
    tl.store(pv, nv, mask=mv)
    arr = arr_ptr + slot * sarr_s + hk
    seen = tl.atomic_add(arr, 1, mask=live)
    last = live & (seen % (GROUP * NVB) == GROUP * NVB - 1)
    tl.store(pq, nq, mask=mq & last)
    tl.store(pk, nk, mask=mk & last)
    tl.atomic_add(arr, -(GROUP * NVB), mask=last)

    # The head's gated RMSNorm, by the last of its NVB programs (as _gated_rms_norm_kernel, the head in one row).
    if live:
        hc = hcnt_ptr + r * shc_r + h
        arrived = tl.atomic_add(hc, 1, sem="acq_rel", scope="gpu")
        if arrived == NVB - 1:
            oall = tl.arange(0, DVP)
            amask = oall < DV
            of = tl.load(o_row + oall, mask=amask, other=0.0).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(of * of, axis=0) / DV + eps)
            nrm = (of * rstd).to(dt).to(tl.float32)
            w = tl.load(nw_ptr + oall, mask=amask, other=0.0).to(tl.float32)
            on = (w * nrm).to(dt).to(tl.float32)
            zz = tl.load(z_ptr + start * sz_t + h * DV + oall, mask=amask, other=0.0).to(tl.float32)
            tl.store(o_row + oall, (on * (zz * tl.sigmoid(zz))).to(dt), mask=amask)
            tl.atomic_xchg(hc, 0, sem="relaxed")
            if QUANT:
                _quantize_when_last(out_ptr, q_ptr, qs_ptr, cnt_ptr + r, live, start, 1, so_t, sq_t, HK * GROUP, DV,
                                    fp8_max, amax_eps, QBLOCK)


@triton.jit
def _quantize_when_last(out_ptr, q_ptr, qs_ptr, cnt, live, start, n, so_t, sq_t, HV: tl.constexpr, DV: tl.constexpr,
                        fp8_max, amax_eps, QBLOCK: tl.constexpr):
    """Called by each of a row's ``HV`` programs (one a value head) once its head's outputs of the row's ``n``
    tokens (from ``start``) are stored in ``out``: the program counts itself in on the row's counter ``cnt``
    (after a barrier, with release semantics: its threads' stores come first) and the last to arrive (acquire: it
    sees every head's stores) quantizes each token's ``HV * DV`` outputs per token into ``q`` and its scale into
    ``qs`` (:func:`quantize_token_row`), then sets the counter back to 0 for the next launch. No program waits for
    another. The counters are per row of the launch (pad rows included), so no two rows share one."""
    tl.debug_barrier()  # every thread's stores of the head's outputs before the count says so (release below)
    if live:
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == HV - 1:
            for i in range(0, n):
                quantize_token_row(out_ptr + (start + i) * so_t, q_ptr + (start + i) * sq_t, qs_ptr + start + i,
                                   HV * DV, fp8_max, amax_eps, QBLOCK)
            tl.atomic_xchg(cnt, 0, sem="relaxed")


@triton.jit
def _verify_gated_norm(out_ptr, z_ptr, nw_ptr, start, n, h, so_t, sz_t, eps, DV: tl.constexpr, DVP: tl.constexpr):
    """The gated RMSNorm of value head ``h``'s outputs of tokens ``start .. start + n`` (each read back whole from
    ``out``, normalized in one reduction as ``_gated_rms_norm_kernel`` does, stored in place)."""
    dt = out_ptr.dtype.element_ty
    oall = tl.arange(0, DVP)
    amask = oall < DV
    w = tl.load(nw_ptr + oall, mask=amask, other=0.0).to(tl.float32)
    for i in range(0, n):
        o_row = out_ptr + (start + i) * so_t + h * DV
        of = tl.load(o_row + oall, mask=amask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(of * of, axis=0) / DV + eps)
        nrm = (of * rstd).to(dt).to(tl.float32)
        on = (w * nrm).to(dt).to(tl.float32)
        zz = tl.load(z_ptr + (start + i) * sz_t + h * DV + oall, mask=amask, other=0.0).to(tl.float32)
        tl.store(o_row + oall, (on * (zz * tl.sigmoid(zz))).to(dt), mask=amask)


@triton.jit
def _gdn_verify_fused_kernel(
    x_ptr, z_ptr, b_ptr, a_ptr, cw_ptr, alog_ptr, dtb_ptr, nw_ptr,
    conv_ptr, state_ptr, slots_ptr, qsl_ptr, out_ptr, scr_ptr,
    stk_ptr, stv_ptr, stg_ptr, stb_ptr, q_ptr, qs_ptr, cnt_ptr, hcnt_ptr,
    sx_t, sz_t, sb_t, sa_t, scw_d, scw_k,
    sc_s, sc_d, sc_k,
    ss_s, ss_h, ss_k, ss_v,
    so_t, scr_r, scr_p, scr_d, scr_k,
    stk_r, stk_p, stk_h, stv_r, stv_p, stv_h, stg_r, stg_p, sq_t, shc_r,
    P, scale, eps, fp8_max, amax_eps,
    HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr,
    KM1_PAD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DVP: tl.constexpr,
    QUANT: tl.constexpr = False, QBLOCK: tl.constexpr = 1024, SPLIT: tl.constexpr = False,
):  # fmt: skip
    """A verify row ``r`` (grid axis 0) of ``n`` tokens, value head ``h`` (axis 1), key head ``hk = h // GROUP``:
    what ``_conv1d_verify_kernel``, ``_gdn_gating_kernel``, ``_gdn_verify_kernel`` and ``_gated_rms_norm_kernel``
    compute in turn, with their rounding points. The live conv window and SSM state are only read.

    1. For each token ``i < P``: the candidate conv windows after it (q / k channels by the key head's first value
       head, v channels by their own head) into the scratch, and the stash (raw k by the key head's first value
       head; v, g and beta by the head).
    2. The delta rule over the head's value channels, ``BV`` at a time: the tile loaded once from the live state and
       advanced over the row's tokens (the conv of q / k recomputed per tile), each token's output stored.
    3. After a barrier, the gated RMSNorm of each token's head output, read back whole.
    4. ``QUANT``: the last of the row's programs to finish quantizes each token's output row per token for an FP8
       ``out_proj`` (:func:`_quantize_when_last`).

    ``SPLIT``: each value head over ``NVB = cdiv(DV, BV)`` programs, program ``(r, h * NVB + j)`` doing steps 1 and 2
    for its value block ``j`` alone (the q / k windows, raw k, g and beta by block 0 of the key head's first value
    head; the v windows and stash of its own channels), so a launch has ``NVB`` times the programs and each one tile
    of work. Step 3 needs the head's whole output: each program counts itself in on ``head_counts[r, h]`` (after a
    barrier, release) and the last of the head's ``NVB`` to arrive (acquire) normalizes the head's outputs, sets the
    counter back to 0 and, with ``QUANT``, counts the head in on the row's counter. The same values either way: the
    same tiles, the same arithmetic."""
    r = tl.program_id(0).to(tl.int64)
    NVB: tl.constexpr = (DV + BV - 1) // BV
    if SPLIT:
        h = tl.program_id(1) // NVB
        vj = tl.program_id(1) % NVB
    else:
        h = tl.program_id(1)
        vj = 0
    start = tl.load(qsl_ptr + r).to(tl.int64)
    n = tl.load(qsl_ptr + r + 1).to(tl.int64) - start
    slot = tl.load(slots_ptr + r).to(tl.int64)
    hk = h // GROUP
    first = h % GROUP == 0
    dt = out_ptr.dtype.element_ty

    ok = tl.arange(0, BK)
    kmask = ok < DK
    cq = hk * DK + ok
    ck = HK * DK + hk * DK + ok
    if SPLIT:  # step 1's value channels: the program's block; the key head's and the gates' by block 0
        oall = vj * BV + tl.arange(0, BV)
        first = first & (vj == 0)
        own = vj == 0
    else:
        oall = tl.arange(0, DVP)
        own = h >= 0
    amask = oall < DV
    cva = 2 * HK * DK + h * DV + oall

    for i in range(0, tl.minimum(n, P)):
        base = r * scr_r + i * scr_p
        _store_row_window(x_ptr, conv_ptr, scr_ptr, start, i, slot, cq, kmask & first,
                          sx_t, sc_s, sc_d, sc_k, base, scr_d, scr_k, K, KM1_PAD)
        _store_row_window(x_ptr, conv_ptr, scr_ptr, start, i, slot, ck, kmask & first,
                          sx_t, sc_s, sc_d, sc_k, base, scr_d, scr_k, K, KM1_PAD)
        _store_row_window(x_ptr, conv_ptr, scr_ptr, start, i, slot, cva, amask,
                          sx_t, sc_s, sc_d, sc_k, base, scr_d, scr_k, K, KM1_PAD)
        kv = _conv_row_taps(x_ptr, conv_ptr, cw_ptr, start, i, slot, ck, kmask, sx_t, sc_s, sc_d, sc_k, scw_d,
                            scw_k, K)
        tl.store(stk_ptr + r * stk_r + i * stk_p + hk * stk_h + ok, kv, mask=kmask & first)
        vv = _conv_row_taps(x_ptr, conv_ptr, cw_ptr, start, i, slot, cva, amask, sx_t, sc_s, sc_d, sc_k, scw_d,
                            scw_k, K)
        tl.store(stv_ptr + r * stv_r + i * stv_p + h * stv_h + oall, vv, mask=amask)
        gt, bt = _gdn_gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, start + i, h, sa_t, sb_t)
        tl.store(stg_ptr + r * stg_r + i * stg_p + h, gt, mask=own)
        tl.store(stb_ptr + r * stg_r + i * stg_p + h, bt, mask=own)

    s_head = state_ptr + slot * ss_s + h * ss_h
    for blk in tl.static_range(0, 1 if SPLIT else NVB):
        vb = (vj + blk) * BV
        ov = vb + tl.arange(0, BV)
        vmask = ov < DV
        cv = 2 * HK * DK + h * DV + ov
        tile = kmask[:, None] & vmask[None, :]
        S = tl.load(s_head + ok[:, None] * ss_k + ov[None, :] * ss_v, mask=tile & (n > 0), other=0.0).to(tl.float32)
        for i in range(0, n):
            qv = _conv_row_taps(x_ptr, conv_ptr, cw_ptr, start, i, slot, cq, kmask, sx_t, sc_s, sc_d, sc_k, scw_d,
                                scw_k, K)
            kv = _conv_row_taps(x_ptr, conv_ptr, cw_ptr, start, i, slot, ck, kmask, sx_t, sc_s, sc_d, sc_k, scw_d,
                                scw_k, K)
            vv = _conv_row_taps(x_ptr, conv_ptr, cw_ptr, start, i, slot, cv, vmask, sx_t, sc_s, sc_d, sc_k, scw_d,
                                scw_k, K)
            gt, bt = _gdn_gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, start + i, h, sa_t, sb_t)
            qv = qv * (1.0 / tl.sqrt(tl.sum(qv * qv, axis=0) + 1e-6))
            qv = qv * scale
            S = _delta_rule_update(S, kv, vv, gt, bt)
            o = tl.sum(S * qv[:, None], axis=0)
            tl.store(out_ptr + (start + i) * so_t + h * DV + ov, o.to(dt), mask=vmask)

    tl.debug_barrier()  # every store of the head's outputs before they are read back (or counted in, release)
    if SPLIT:
        if n > 0:
            hc = hcnt_ptr + r * shc_r + h
            arrived = tl.atomic_add(hc, 1, sem="acq_rel", scope="gpu")
            if arrived == NVB - 1:
                _verify_gated_norm(out_ptr, z_ptr, nw_ptr, start, n, h, so_t, sz_t, eps, DV, DVP)
                tl.atomic_xchg(hc, 0, sem="relaxed")
                if QUANT:
                    _quantize_when_last(out_ptr, q_ptr, qs_ptr, cnt_ptr + r, n > 0, start, n, so_t, sq_t,
                                        HK * GROUP, DV, fp8_max, amax_eps, QBLOCK)
    else:
        _verify_gated_norm(out_ptr, z_ptr, nw_ptr, start, n, h, so_t, sz_t, eps, DV, DVP)
        if QUANT:
            _quantize_when_last(out_ptr, q_ptr, qs_ptr, cnt_ptr + r, n > 0, start, n, so_t, sq_t, HK * GROUP, DV,
                                fp8_max, amax_eps, QBLOCK)
