"""Triton kernels for :mod:`hyserve.kernels.conv` (imported lazily: only the CUDA path and interpreter tests need them).

Each program owns one row ``r`` (its tokens ``[qsl[r], qsl[r+1])``, its slot ``state_slots[r]``) and a block of
channels. The old window of a row is read before any of its entries is overwritten: either by a separate launch
(``_conv1d_state_kernel`` runs after ``_conv1d_fwd_kernel``) or, when fused, by a block-wide barrier; within
``_roll_state`` a barrier separates the reads of the old window from the writes of the new one.

``_conv1d_verify_kernel`` (:mod:`hyserve.kernels.conv.verify`) mirrors ``_conv1d_fwd_kernel`` but never writes
``conv_state``: the window after token ``t`` is inputs ``t - K + 2 .. t``, i.e. exactly the taps ``1 .. K - 1`` the
output at ``t`` already loads, so each tap's tile is stored to the row-indexed scratch (``scratch[r, t]``, for
``t < min(n_r, P)``) as it is read.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_conv1d_fwd_kernel", "_conv1d_state_kernel", "_conv1d_verify_kernel"]


@triton.jit
def _roll_state(
    x_ptr, state_ptr, slot, start, n, offs_d, d_mask,
    sx_t, sx_d, ss_s, ss_d, ss_k,
    K: tl.constexpr, KM1_PAD: tl.constexpr,
):  # fmt: skip
    """New window = last K-1 entries of (old window ++ the row's n tokens); a no-op for an empty row."""
    p = tl.arange(0, KM1_PAD)
    rel = n - (K - 1) + p  # position of the new entry p relative to the row's first token
    from_x = rel >= 0
    base = (p < K - 1)[None, :] & d_mask[:, None] & (n > 0)
    xv = tl.load(
        x_ptr + (start + rel)[None, :] * sx_t + offs_d[:, None] * sx_d,
        mask=base & from_x[None, :],
        other=0.0,
    )
    srow = state_ptr + slot * ss_s + offs_d[:, None] * ss_d
    sv = tl.load(srow + (K - 1 + rel)[None, :] * ss_k, mask=base & (~from_x)[None, :], other=0.0)
    new = tl.where(from_x[None, :], xv.to(sv.dtype), sv)
    tl.debug_barrier()  # every read of the old window happens before any write of the new one
    tl.store(srow + p[None, :] * ss_k, new, mask=base)


@triton.jit
def _taps_inside_row(
    x_ptr, w_ptr, start, tb, offs_d, d_mask, t_mask,
    sx_t, sx_d, sw_d, sw_k,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The float32 sum ``sum_k w[:, k] * x[t - K + 1 + k]`` of a token block whose every tap lies inside its row (no
    window read): one pointer per block (64-bit), 32-bit offsets inside it, one mask."""
    base = x_ptr + (start + tb * BLOCK_T - (K - 1)) * sx_t
    rows = tl.arange(0, BLOCK_T)
    m = t_mask[:, None] & d_mask[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(K):
        xv = tl.load(base + (rows + k)[:, None] * sx_t + offs_d[None, :] * sx_d, mask=m, other=0.0)
        wk = tl.load(w_ptr + offs_d * sw_d + k * sw_k, mask=d_mask, other=0.0).to(tl.float32)
        acc += xv.to(tl.float32) * wk[None, :]
    return acc


@triton.jit
def _taps_at_row_start(
    x_ptr, w_ptr, srow, start, offs_t, offs_d, d_mask, t_mask,
    sx_t, sx_d, sw_d, sw_k, ss_k,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The same sum for the row's first token block, whose older taps come from the slot's window ``srow``."""
    m = t_mask[:, None] & d_mask[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(K):
        rel = offs_t - (K - 1) + k
        from_x = (rel >= 0)[:, None]
        xv = tl.load(x_ptr + (start + rel)[:, None] * sx_t + offs_d[None, :] * sx_d, mask=m & from_x, other=0.0)
        sv = tl.load(srow + (K - 1 + rel)[:, None] * ss_k, mask=m & (~from_x), other=0.0)
        wk = tl.load(w_ptr + offs_d * sw_d + k * sw_k, mask=d_mask, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * wk[None, :]
    return acc


@triton.jit
def _conv1d_fwd_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, slots_ptr, qsl_ptr, out_ptr, out2_ptr,
    D, SPLIT, PART,
    sx_t, sx_d, sw_d, sw_k, ss_s, ss_d, ss_k, so_t, so2_t, so_p,
    K: tl.constexpr, KM1_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    FUSE_STATE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_OUT: tl.constexpr = False,
    NORM_FIRST: tl.constexpr = False,
):  # fmt: skip
    """Grid (token blocks x channel blocks, R), channel blocks fastest (programs running together read whole rows
    of ``x``). out = silu(bias + sum_k w[:, k] * window[k]) in fp32 (``b_ptr`` is read only when ``HAS_BIAS``). A
    token block past its row's end returns at once; one whose taps all lie inside the row (every block but the
    first of a row, in a long prefill) reads no window (``_taps_inside_row``). ``SPLIT_OUT``: channels from ``SPLIT``
    on go to ``out2`` (row stride ``so2_t``, column ``c - SPLIT``), the others to ``out``; ``BLOCK_D`` divides
    ``SPLIT``, so a channel block lies on one side. ``NORM_FIRST`` (with ``SPLIT_OUT``; ``BLOCK_D`` one head):
    each token's head below ``SPLIT`` (GDN's q and k) is stored l2-normalised, as ``_l2_norm_heads_kernel`` norms
    the rounded output (float32, eps 1e-6). ``out`` is in parts of ``PART`` channels, ``so_p`` apart (channel ``c``
    of token ``t`` at ``(c // PART) * so_p + t * so_t + c % PART``; ``BLOCK_D`` divides ``PART``): GDN's q and k
    each contiguous, as fla's chunked kernel reads them; one part (``PART`` >= the channels) is a plain row."""
    n_db = tl.cdiv(D, BLOCK_D)
    db = tl.program_id(0) % n_db
    tb = tl.program_id(0) // n_db
    r = tl.program_id(1)
    start = tl.load(qsl_ptr + r).to(tl.int64)
    n = tl.load(qsl_ptr + r + 1).to(tl.int64) - start
    if tb * BLOCK_T >= n:  # nothing of this row here (an empty row's window, fused or not, is left alone)
        return
    slot = tl.load(slots_ptr + r).to(tl.int64)
    offs_d = db * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < n
    if tb * BLOCK_T >= K - 1:
        acc = _taps_inside_row(x_ptr, w_ptr, start, tb, offs_d, d_mask, t_mask, sx_t, sx_d, sw_d, sw_k,
                               K, BLOCK_T, BLOCK_D)
    else:
        srow = state_ptr + slot * ss_s + offs_d[None, :] * ss_d
        acc = _taps_at_row_start(x_ptr, w_ptr, srow, start, offs_t, offs_d, d_mask, t_mask, sx_t, sx_d, sw_d, sw_k,
                                 ss_k, K, BLOCK_T, BLOCK_D)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    m = t_mask[:, None] & d_mask[None, :]
    if SPLIT_OUT and db * BLOCK_D >= SPLIT:
        tl.store(out2_ptr + (start + offs_t)[:, None] * so2_t + (offs_d - SPLIT)[None, :],
                 y.to(out2_ptr.dtype.element_ty), mask=m)
    else:
        if NORM_FIRST:
            yr = tl.where(m, y.to(out_ptr.dtype.element_ty).to(tl.float32), 0.0)  # the output as rounded
            y = yr * (1.0 / tl.sqrt(tl.sum(yr * yr, axis=1) + 1e-6))[:, None]
        part = (db * BLOCK_D) // PART
        base = out_ptr + part.to(tl.int64) * so_p
        tl.store(base + (start + offs_t)[:, None] * so_t + (offs_d - part * PART)[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=m)

    if FUSE_STATE:
        _roll_state(x_ptr, state_ptr, slot, start, n, offs_d, d_mask, sx_t, sx_d, ss_s, ss_d, ss_k, K, KM1_PAD)


@triton.jit
def _conv1d_state_kernel(
    x_ptr, state_ptr, slots_ptr, qsl_ptr,
    D,
    sx_t, sx_d, ss_s, ss_d, ss_k,
    K: tl.constexpr, KM1_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid (R, channel blocks): roll each non-empty row's window (after the forward kernel has read it)."""
    r = tl.program_id(0)
    db = tl.program_id(1)
    start = tl.load(qsl_ptr + r).to(tl.int64)
    n = tl.load(qsl_ptr + r + 1).to(tl.int64) - start
    slot = tl.load(slots_ptr + r).to(tl.int64)
    offs_d = db * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    _roll_state(x_ptr, state_ptr, slot, start, n, offs_d, d_mask, sx_t, sx_d, ss_s, ss_d, ss_k, K, KM1_PAD)


@triton.jit
def _conv1d_verify_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, slots_ptr, qsl_ptr, out_ptr, scr_ptr,
    D, P,
    sx_t, sx_d, sw_d, sw_k, ss_s, ss_d, ss_k, so_t,
    sc_r, sc_p, sc_d, sc_k,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """Grid (token blocks, R, channel blocks). out = silu(bias + sum_k w[:, k] * window[k]) in fp32; scratch[r, t] =
    window after token t (taps 1..K-1), for t < min(n, P)."""
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
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + (start + offs_t)[:, None] * so_t + offs_d[None, :], y.to(out_ptr.dtype.element_ty), mask=m)
