"""Triton kernels for :mod:`hyserve.kernels.mamba2`: Mamba2's scan token by token, the state tile read once, and the
chunked (fla) path's input and output passes.

Every kernel reads ``A_log`` and computes ``A = -exp(A_log)`` itself (no per-step launch, and a reloaded weight is
read at the next launch), and the time step with ``_dt_step``, one definition for all of them.

The scan kernels run one program per (row, head, block of ``BP`` head channels). A program loads the ``(BP, N)``
float32 tile of the slot's state into registers and advances it over the row's tokens with ``_ssd_step``, the one
definition of the recurrence both kernels share. An empty row loads and stores nothing. Distinct non-empty rows have
distinct slots, so no two programs touch the same tile; the tile is loaded and stored with one layout, so each element
is read and written by the same thread.

* ``_mamba2_recurrent_kernel`` (:func:`hyserve.kernels.mamba2.mamba2_recurrent_triton`) writes the tile back in place
  after the row's last token.
* ``_mamba2_verify_kernel`` (:mod:`hyserve.kernels.mamba2.verify`) never writes the live state: it stores each
  token's float32 inputs to the update (x, B, dt) in the row-indexed stash (``[r, i]``, for ``i < NPOS``).
* ``_mamba2_replay_kernel`` rebuilds a state from a slot's and the stash (a verify step's commit, or a candidate
  snapshot into a pool entry), with the same ``_ssd_update``.
* ``_mamba2_chunked_inputs_kernel`` and ``_mamba2_chunked_output_kernel`` (:mod:`hyserve.kernels.mamba2.chunked`):
  the elementwise work before and after fla's chunked scan, each one launch whose programs past the token blocks
  gather (before) or scatter (after) the rows' states.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hyserve.kernels.commit._triton import copy_window_piece

__all__ = ["_mamba2_chunked_inputs_kernel", "_mamba2_chunked_output_kernel", "_mamba2_recurrent_kernel",
           "_mamba2_replay_kernel", "_mamba2_verify_kernel"]


@triton.jit
def _dt_step(v, dt_lo, dt_hi):
    """``clamp(softplus(v), dt_lo, dt_hi)`` for ``v = dt + dt_bias`` (float32, any shape): the time step of every
    path, token by token and the chunked path's inputs alike."""
    # softplus = log1p(exp(v)) (torch: v itself above 20). log1p(y) as log(u) * y / (u - 1), u = 1 + y: exact to a
    # few ulps where 1 + y rounds (large negative v), as hyserve.kernels.gating computes it.
    y = tl.exp(tl.minimum(v, 20.0))
    u = 1.0 + y
    sp = tl.where(v > 20.0, v, tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0))))
    return tl.minimum(tl.maximum(sp, dt_lo), dt_hi)


@triton.jit
def _ssd_update(S, step, a, xv, bv):
    """One token of the recurrence on a ``(BP, N)`` float32 tile: ``exp(step a) S + (step x) B^T``. The scan, the
    verify and the replay share it, so a replayed state is the verify's bit for bit."""
    return tl.exp(step * a) * S + (step * xv)[:, None] * bv[None, :]


@triton.jit
def _ssd_step(
    S, t, h, g, op, on, pmask, nmask,
    x_ptr, dt_ptr, b_ptr, c_ptr, out_ptr,
    sx_t, sx_h, sdt_t, sdt_h, sb_t, sb_g, sc_t, sc_g, so_t, so_h,
    a, dt_bias, d_skip, dt_lo, dt_hi,
):  # fmt: skip
    """Token ``t``, head ``h`` (group ``g``): dt = clamp(softplus(dt + dt_bias), lo, hi); S = exp(dt a) S +
    (dt x) B^T; y = S C + D x, stored to ``out[t, h]``. Returns the advanced state tile and the token's float32
    inputs to the update (x, B, dt: what a verify step stashes)."""
    xv = tl.load(x_ptr + t * sx_t + h * sx_h + op, mask=pmask, other=0.0).to(tl.float32)
    bv = tl.load(b_ptr + t * sb_t + g * sb_g + on, mask=nmask, other=0.0).to(tl.float32)
    cv = tl.load(c_ptr + t * sc_t + g * sc_g + on, mask=nmask, other=0.0).to(tl.float32)
    step = _dt_step(tl.load(dt_ptr + t * sdt_t + h * sdt_h).to(tl.float32) + dt_bias, dt_lo, dt_hi)
    S = _ssd_update(S, step, a, xv, bv)
    o = tl.sum(S * cv[None, :], axis=1) + d_skip * xv
    tl.store(out_ptr + t * so_t + h * so_h + op, o.to(out_ptr.dtype.element_ty), mask=pmask)
    return S, xv, bv, step


@triton.jit
def _mamba2_recurrent_kernel(
    x_ptr, dt_ptr, alog_ptr, b_ptr, c_ptr, d_ptr, dtb_ptr, state_ptr, slots_ptr, qsl_ptr, out_ptr,
    sx_t, sx_h, sdt_t, sdt_h, sb_t, sb_g, sc_t, sc_g,
    ss_s, ss_h, ss_p, ss_n, so_t, so_h,
    dt_lo, dt_hi,
    P: tl.constexpr, N: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """The row's tokens through ``_ssd_step``; the slot's state tile read once and written back once."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    start = tl.load(qsl_ptr + r).to(tl.int64)
    n = tl.load(qsl_ptr + r + 1).to(tl.int64) - start
    slot = tl.load(slots_ptr + r).to(tl.int64)
    g = h // HEADS_PER_GROUP
    a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))  # A = -exp(A_log), read from the weight at every launch
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    d_skip = tl.load(d_ptr + h).to(tl.float32)

    op = pb * BP + tl.arange(0, BP)
    on = tl.arange(0, BN)
    pmask = op < P
    nmask = on < N
    smask = pmask[:, None] & nmask[None, :] & (n > 0)
    s_ptrs = state_ptr + slot * ss_s + h * ss_h + op[:, None] * ss_p + on[None, :] * ss_n
    S = tl.load(s_ptrs, mask=smask, other=0.0).to(tl.float32)

    for i in range(0, n):
        S, _x, _b, _dt = _ssd_step(
            S, start + i, h, g, op, on, pmask, nmask,
            x_ptr, dt_ptr, b_ptr, c_ptr, out_ptr,
            sx_t, sx_h, sdt_t, sdt_h, sb_t, sb_g, sc_t, sc_g, so_t, so_h,
            a, dt_bias, d_skip, dt_lo, dt_hi,
        )  # fmt: skip

    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=smask)


@triton.jit
def _mamba2_verify_kernel(
    x_ptr, dt_ptr, alog_ptr, b_ptr, c_ptr, d_ptr, dtb_ptr, state_ptr, slots_ptr, qsl_ptr, out_ptr,
    stx_ptr, stb_ptr, std_ptr,
    sx_t, sx_h, sdt_t, sdt_h, sb_t, sb_g, sc_t, sc_g,
    ss_s, ss_h, ss_p, ss_n, so_t, so_h,
    stx_r, stx_j, stx_h, stb_r, stb_j, stb_g, std_r, std_j,
    NPOS, dt_lo, dt_hi,
    P: tl.constexpr, N: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """The row's tokens through ``_ssd_step``; for token i < NPOS the stash takes its float32 inputs to the update:
    x[r, i, h] (each program its channels), B[r, i, g] (the group's first head's first program), dt[r, i, h] (the
    head's first program). The live state is only loaded."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    start = tl.load(qsl_ptr + r).to(tl.int64)
    n = tl.load(qsl_ptr + r + 1).to(tl.int64) - start
    slot = tl.load(slots_ptr + r).to(tl.int64)
    g = h // HEADS_PER_GROUP
    a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))  # A = -exp(A_log), read from the weight at every launch
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    d_skip = tl.load(d_ptr + h).to(tl.float32)

    op = pb * BP + tl.arange(0, BP)
    on = tl.arange(0, BN)
    pmask = op < P
    nmask = on < N
    tile = pmask[:, None] & nmask[None, :]
    s_ptrs = state_ptr + slot * ss_s + h * ss_h + op[:, None] * ss_p + on[None, :] * ss_n
    S = tl.load(s_ptrs, mask=tile & (n > 0), other=0.0).to(tl.float32)
    writes_b = (h % HEADS_PER_GROUP == 0) & (pb == 0)

    for i in range(0, n):
        S, xv, bv, step = _ssd_step(
            S, start + i, h, g, op, on, pmask, nmask,
            x_ptr, dt_ptr, b_ptr, c_ptr, out_ptr,
            sx_t, sx_h, sdt_t, sdt_h, sb_t, sb_g, sc_t, sc_g, so_t, so_h,
            a, dt_bias, d_skip, dt_lo, dt_hi,
        )  # fmt: skip
        kept = i < NPOS
        tl.store(stx_ptr + r * stx_r + i * stx_j + h * stx_h + op, xv, mask=pmask & kept)
        tl.store(stb_ptr + r * stb_r + i * stb_j + g * stb_g + on, bv, mask=nmask & kept & writes_b)
        tl.store(std_ptr + r * std_r + i * std_j + h, step, mask=kept & (pb == 0))


@triton.jit
def _mamba2_replay_kernel(
    state_ptr, alog_ptr, stx_ptr, stb_ptr, std_ptr, rows_ptr, src_ptr, dst_ptr, count_ptr,
    conv_ptr, cscr_ptr,
    ss_s, ss_h, ss_p, ss_n,
    stx_r, stx_j, stx_h, stb_r, stb_j, stb_g, std_r, std_j,
    sc_s, scr_r, scr_p, E,
    NPOS,
    P: tl.constexpr, N: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    ROWS: tl.constexpr, CONV: tl.constexpr = False, CBLOCK: tl.constexpr = 256,
):  # fmt: skip
    """Grid (entries, H, P / BP). Entry i: count c = count[i] (< 0: nothing); the state tile of slot src[i] advanced
    with ``_ssd_update`` over stash row r's tokens 0 .. min(c, NPOS - 1) (r = rows[i], or i without ``ROWS``),
    stored to slot dst[i]: read once, written once. ``CONV``: the candidate conv window ``conv_scratch[r, c]`` (``E``
    contiguous elements) copied to ``conv_state[dst[i]]`` too, in ``H`` pieces by the first block's programs."""
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    c = tl.load(count_ptr + i).to(tl.int64)
    if c < 0:
        return
    r = i
    if ROWS:
        r = tl.load(rows_ptr + i).to(tl.int64)
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    if CONV:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if pb == 0:
            copy_window_piece(conv_ptr, cscr_ptr, r, c, dst, sc_s, scr_r, scr_p, E, h, tl.num_programs(1), CBLOCK)
    g = h // HEADS_PER_GROUP
    a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    op = pb * BP + tl.arange(0, BP)
    on = tl.arange(0, BN)
    pmask = op < P
    nmask = on < N
    tile = pmask[:, None] & nmask[None, :]
    head = h * ss_h + op[:, None] * ss_p + on[None, :] * ss_n
    S = tl.load(state_ptr + src * ss_s + head, mask=tile, other=0.0).to(tl.float32)
    for j in range(0, tl.minimum(c + 1, NPOS)):
        xv = tl.load(stx_ptr + r * stx_r + j * stx_j + h * stx_h + op, mask=pmask, other=0.0)
        bv = tl.load(stb_ptr + r * stb_r + j * stb_j + g * stb_g + on, mask=nmask, other=0.0)
        step = tl.load(std_ptr + r * std_r + j * std_j + h)
        S = _ssd_update(S, step, a, xv, bv)
    tl.store(state_ptr + dst * ss_s + head, S.to(state_ptr.dtype.element_ty), mask=tile)


@triton.jit
def _mamba2_chunked_inputs_kernel(
    x_ptr, dt_ptr, alog_ptr, dtb_ptr, b_ptr, c_ptr, state_ptr, slots_ptr,
    q_ptr, k_ptr, v_ptr, g_ptr, h0_ptr,
    T, sx_t, sx_h, sdt_t, sdt_h, sb_t, sb_g, sc_t, sc_g,
    ss_s, ss_h, ss_p, ss_n,
    dt_lo, dt_hi,
    H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, HEADS_PER_GROUP: tl.constexpr,
    BT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, SP: tl.constexpr,
):  # fmt: skip
    """fla's inputs for head ``h`` (program axis 1). Programs ``i < cdiv(T, BT)`` of axis 0 take tokens
    ``[i BT, i BT + BT)``: ``step = clamp(softplus(dt + dt_bias))``, ``g = step * A`` (float32),
    ``v = x * step``, ``k = B``, ``q = C`` of the head's group (rounded to ``v`` / ``k`` / ``q``'s dtype); the
    programs after them take row ``r = i - cdiv(T, BT)``: ``h0[r, h] = ssm_state[slots[r], h]`` (a copy, ``SP``
    head channels at a time). Outputs contiguous: q / k ``(T, H, N)``, v ``(T, H, P)``, g ``(T, H)``, h0
    ``(R, H, P, N)``."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    token_blocks = tl.cdiv(T, BT)
    on = tl.arange(0, BN)
    nmask = on < N
    if i < token_blocks:
        ot = i.to(tl.int64) * BT + tl.arange(0, BT)
        tmask = ot < T
        op = tl.arange(0, BP)
        pmask = op < P
        a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
        v = tl.load(dt_ptr + ot * sdt_t + h * sdt_h, mask=tmask, other=0.0).to(tl.float32)
        step = _dt_step(v + tl.load(dtb_ptr + h).to(tl.float32), dt_lo, dt_hi)
        tl.store(g_ptr + ot * H + h, step * a, mask=tmask)
        xmask = tmask[:, None] & pmask[None, :]
        xv = tl.load(x_ptr + ot[:, None] * sx_t + h * sx_h + op[None, :], mask=xmask, other=0.0).to(tl.float32)
        tl.store(v_ptr + (ot[:, None] * H + h) * P + op[None, :], (xv * step[:, None]).to(v_ptr.dtype.element_ty),
                 mask=xmask)
        g = h // HEADS_PER_GROUP
        bmask = tmask[:, None] & nmask[None, :]
        out = (ot[:, None] * H + h) * N + on[None, :]
        bv = tl.load(b_ptr + ot[:, None] * sb_t + g * sb_g + on[None, :], mask=bmask, other=0.0)
        tl.store(k_ptr + out, bv.to(k_ptr.dtype.element_ty), mask=bmask)
        cv = tl.load(c_ptr + ot[:, None] * sc_t + g * sc_g + on[None, :], mask=bmask, other=0.0)
        tl.store(q_ptr + out, cv.to(q_ptr.dtype.element_ty), mask=bmask)
    else:
        r = (i - token_blocks).to(tl.int64)
        slot = tl.load(slots_ptr + r).to(tl.int64)
        for p0 in range(0, P, SP):
            op = p0 + tl.arange(0, SP)
            tile = (op < P)[:, None] & nmask[None, :]
            s = tl.load(state_ptr + slot * ss_s + h * ss_h + op[:, None] * ss_p + on[None, :] * ss_n, mask=tile)
            tl.store(h0_ptr + ((r * H + h) * P + op[:, None]) * N + on[None, :], s, mask=tile)


@triton.jit
def _mamba2_chunked_output_kernel(
    o_ptr, x_ptr, d_ptr, ht_ptr, state_ptr, slots_ptr, y_ptr,
    T, sx_t, sx_h, ss_s, ss_h, ss_p, ss_n,
    H: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, SP: tl.constexpr,
):  # fmt: skip
    """After fla, head ``h`` (program axis 1). Programs ``i < cdiv(T, BT)``: ``y = o + D x`` over tokens
    ``[i BT, i BT + BT)`` (float32; ``o`` and ``y`` contiguous ``(T, H, P)``); the programs after them, row
    ``r = i - cdiv(T, BT)``: ``ssm_state[slots[r], h] = ht[r, h]`` rounded to the pool's dtype (``ht`` contiguous
    float32 ``(R, H, P, N)``)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    token_blocks = tl.cdiv(T, BT)
    if i < token_blocks:
        ot = i.to(tl.int64) * BT + tl.arange(0, BT)
        op = tl.arange(0, BP)
        mask = (ot < T)[:, None] & (op < P)[None, :]
        xv = tl.load(x_ptr + ot[:, None] * sx_t + h * sx_h + op[None, :], mask=mask, other=0.0).to(tl.float32)
        at = (ot[:, None] * H + h) * P + op[None, :]
        ov = tl.load(o_ptr + at, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + at, ov + tl.load(d_ptr + h).to(tl.float32) * xv, mask=mask)
    else:
        r = (i - token_blocks).to(tl.int64)
        slot = tl.load(slots_ptr + r).to(tl.int64)
        on = tl.arange(0, BN)
        for p0 in range(0, P, SP):
            op = p0 + tl.arange(0, SP)
            tile = (op < P)[:, None] & (on < N)[None, :]
            s = tl.load(ht_ptr + ((r * H + h) * P + op[:, None]) * N + on[None, :], mask=tile)
            tl.store(state_ptr + slot * ss_s + h * ss_h + op[:, None] * ss_p + on[None, :] * ss_n,
                     s.to(state_ptr.dtype.element_ty), mask=tile)
