"""Triton kernels for :mod:`hyserve.kernels.attention`: KV-cache writes and paged causal attention.

Cache layout: ``(num_blocks, block_size, Hkv, D)``; position ``p`` of row ``r`` lives in block
``block_tables[r, p // block_size]`` at offset ``p % block_size``. Every kernel looks pages up per key position, so any
``block_size`` works and a key tile may straddle pages.

Softmax is online (flash-attention style) in float32, base 2 (the launcher passes ``qk_scale = scale * log2(e)``; the
decode partials' running maxima are base-2 too), with a finite running-max floor (``_NEG``), so fully masked tiles
contribute exactly zero instead of NaN. Products ``q k^T`` and ``p v`` use ``tl.dot`` with float32 accumulation.

* ``_store_kv_kernel``: one program per token; a negative slot skips the token.
* FP8 caches (``FP8``): entries are value / scale (per kv head, float32), clamped to +-448; the attention kernels
  widen tiles to the query's dtype and fold K's scale into the logits' scale, V's into the accumulator.
* ``_paged_decode_kernel``: rows of at most ``QMAX`` tokens (decode: one; verify rows: k + 1). One program per (row, kv
  head, context split) handles every token of the row for the whole GQA group (lanes padded to >= 16 for ``tl.dot``),
  so each key tile is read once a kv head, not once a query head and token. With one split it writes the normalised
  output directly; otherwise it writes unnormalised partial sums plus (max, sum) and ``_paged_decode_reduce_kernel``
  combines them.
  Each row's context is divided over the splits (whole key tiles); a split past it writes its (max, sum) alone.
* ``_paged_prefill_kernel``: any row lengths. One program per (block of ``BLOCK_M`` query tokens, row, query head);
  keys beyond the block's last query position are never visited.
* ``_qsa_scores_kernel`` and ``_qsa_attend_kernel``: Qwen4-Exp's indexed (QSA) attention (``hyserve.layers.qsa``):
  each token's block scores against its row's pooled block keys, then attention over a per-token list of positions
  (its selection), with the decode kernel's splits and reduction.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_paged_decode_kernel", "_paged_decode_reduce_kernel", "_paged_prefill_kernel", "_qsa_attend_kernel",
           "_qsa_pool_scores_kernel", "_qsa_positions_kernel", "_qsa_scores_kernel", "_store_index_keys_kernel",
           "_store_kv_kernel"]

_NEG = tl.constexpr(-1.0e30)  # finite floor of the running max (a global must be a constexpr in @jit code)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
    sk_t, sk_h, sv_t, sv_h,
    skc_b, skc_o, skc_h, svc_b, svc_o, svc_h,
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BS
    off = slot % BS
    oh = tl.arange(0, BLOCK_H)
    od = tl.arange(0, BLOCK_D)
    mask = (oh < HKV)[:, None] & (od < D)[None, :] & (slot >= 0)
    kv = tl.load(k_ptr + t * sk_t + oh[:, None] * sk_h + od[None, :], mask=mask)
    vv = tl.load(v_ptr + t * sv_t + oh[:, None] * sv_h + od[None, :], mask=mask)
    if FP8:  # entries are value / scale, rounded to nearest, clamped to the finite range
        ks = tl.load(ks_ptr + oh, mask=oh < HKV, other=1.0)
        vs = tl.load(vs_ptr + oh, mask=oh < HKV, other=1.0)
        kv = tl.clamp(kv.to(tl.float32) / ks[:, None], -FP8_MAX, FP8_MAX)
        vv = tl.clamp(vv.to(tl.float32) / vs[:, None], -FP8_MAX, FP8_MAX)
    tl.store(kc_ptr + blk * skc_b + off * skc_o + oh[:, None] * skc_h + od[None, :],
             kv.to(kc_ptr.dtype.element_ty), mask=mask)  # fmt: skip
    tl.store(vc_ptr + blk * svc_b + off * svc_o + oh[:, None] * svc_h + od[None, :],
             vv.to(vc_ptr.dtype.element_ty), mask=mask)  # fmt: skip


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, pos, pmask, allowed, r, hkv, od, dmask,
    kc_ptr, vc_ptr, bt_ptr, sbt_r, skc_b, skc_o, skc_h, svc_b, svc_o, svc_h, qk_scale,
    BS: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """One online-softmax step (base 2: ``qk_scale`` includes log2(e)) over the key positions ``pos`` (BLOCK_N,).

    ``pmask`` (BLOCK_N,) marks the positions to load; ``allowed`` (M, BLOCK_N) the (query, key) pairs to keep.
    FP8 tiles are widened to the query's dtype (exactly); their scales are applied by the caller: K's in
    ``qk_scale``, V's to the accumulator.
    """
    blk = tl.load(bt_ptr + r * sbt_r + pos // BS, mask=pmask, other=0).to(tl.int64)
    off = (pos % BS).to(tl.int64)
    lmask = pmask[:, None] & dmask[None, :]
    kt = tl.load(kc_ptr + blk[:, None] * skc_b + off[:, None] * skc_o + hkv * skc_h + od[None, :], mask=lmask,
                 other=0.0)  # fmt: skip
    if FP8:
        kt = kt.to(q.dtype)
    qk = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * qk_scale
    qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    vt = tl.load(vc_ptr + blk[:, None] * svc_b + off[:, None] * svc_o + hkv * svc_h + od[None, :], mask=lmask,
                 other=0.0)  # fmt: skip
    if FP8:
        vt = vt.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _write_split(
    acc, m_i, l_i, out_ptr, po_ptr, pml_ptr, tok, row, sp, hq, od, qmask, gmask,
    so_t, so_h, spo_r, spo_h, spo_s, spml_r, spml_h, spml_s, SINGLE: tl.constexpr,
):  # fmt: skip
    """A split-context program's result: with one split the normalised output at token ``tok``; otherwise the
    unnormalised partial sums (where ``qmask``) and (max, sum) (where ``gmask``) of split ``sp`` at partial row
    ``row``, for ``_paged_decode_reduce_kernel``. ``tok`` and ``row``: one for the program, or one per lane (as
    ``hq``)."""
    if SINGLE:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (tok * so_t + hq * so_h)[:, None] + od[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=qmask)  # fmt: skip
    else:
        tl.store(po_ptr + (row * spo_r + hq * spo_h + sp * spo_s)[:, None] + od[None, :], acc, mask=qmask)
        ml = pml_ptr + row * spml_r + hq * spml_h + sp * spml_s
        tl.store(ml, m_i, mask=gmask)
        tl.store(ml + 1, l_i, mask=gmask)


@triton.jit
def _paged_decode_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, qsl_ptr, seqlen_ptr, out_ptr, po_ptr, pml_ptr, ks_ptr, vs_ptr,
    sq_t, sq_h, so_t, so_h, sbt_r,
    skc_b, skc_o, skc_h, svc_b, svc_o, svc_h,
    spo_r, spo_h, spo_s, spml_r, spml_h, spml_s,
    qk_scale,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, QMAX: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, PART: tl.constexpr, SINGLE: tl.constexpr, PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    """Grid (R, Hkv, splits). Row r's tokens (at most ``QMAX``) attend to positions [0, seq_len), query i of the row
    causally to [0, seq_len - n + i]; split s covers [s * part, (s + 1) * part): ``PART`` positions (tests), or with
    ``PART == 0`` the row's context divided over the launch's splits in whole key tiles. The program's ``G_PAD``
    lanes are the row's (token, query head) pairs of kv head ``hkv``: lane m is token m // GROUP, query head
    hkv * GROUP + m % GROUP, so each key tile is read once for every token and head that needs it. Partial rows:
    the row (``QMAX`` 1: every row writes its (max, sum)), else the token (a row writes only its own tokens')."""
    r = tl.program_id(0)
    hkv = tl.program_id(1)
    sp = tl.program_id(2)
    start = tl.load(qsl_ptr + r).to(tl.int64)
    n = tl.load(qsl_ptr + r + 1).to(tl.int64) - start
    seq_len = tl.load(seqlen_ptr + r).to(tl.int64)
    kv_len = tl.where(n > 0, seq_len, 0)
    if PART == 0:
        part = tl.cdiv(tl.cdiv(kv_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    else:
        part = PART
    lo = sp.to(tl.int64) * part
    hi = tl.minimum(lo + part, kv_len)

    om = tl.arange(0, G_PAD)
    od = tl.arange(0, BLOCK_D)
    oi = om // GROUP  # the lane's token in the row
    hq = hkv * GROUP + om % GROUP
    dmask = od < D
    if QMAX == 1:
        gmask = om < GROUP
        tok = start
        prow = r
    else:
        gmask = (om < QMAX * GROUP) & (oi < n)
        tok = start + oi
        prow = tok
    # A split past the row's context (most of them in a graph sized for the model's length) or of an empty row reads
    # nothing and writes only its (max, sum) = (floor, 0): the reduction reads no partial sums of a split whose sum
    # is 0.
    qmask = gmask[:, None] & dmask[None, :] & (lo < kv_len)
    q = tl.load(q_ptr + (tok * sq_t + hq * sq_h)[:, None] + od[None, :], mask=qmask, other=0.0)
    qpos = seq_len - n + oi  # the lane's query position (QMAX > 1: the causal limit inside the row)

    if FP8:
        qk_scale = qk_scale * tl.load(ks_ptr + hkv)
    m_i = tl.full((G_PAD,), _NEG, dtype=tl.float32)
    l_i = tl.zeros((G_PAD,), dtype=tl.float32)
    acc = tl.zeros((G_PAD, BLOCK_D), dtype=tl.float32)
    for s in range(lo, hi, BLOCK_N):
        pos = s + tl.arange(0, BLOCK_N)
        pmask = pos < hi
        if QMAX == 1:
            allowed = gmask[:, None] & pmask[None, :]
        else:
            allowed = gmask[:, None] & pmask[None, :] & (pos[None, :] <= qpos[:, None])
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, pos, pmask, allowed, r, hkv, od, dmask,
            kc_ptr, vc_ptr, bt_ptr, sbt_r, skc_b, skc_o, skc_h, svc_b, svc_o, svc_h, qk_scale,
            BS, PRECISION, FP8,
        )  # fmt: skip
    if FP8:  # the partial sums combine linearly, so scaling each split's is scaling the result
        acc = acc * tl.load(vs_ptr + hkv)
    _write_split(acc, m_i, l_i, out_ptr, po_ptr, pml_ptr, tok, prow, sp, hq, od, qmask, gmask,
                 so_t, so_h, spo_r, spo_h, spo_s, spml_r, spml_h, spml_s, SINGLE)  # fmt: skip


@triton.jit
def _paged_decode_reduce_kernel(
    po_ptr, pml_ptr, qsl_ptr, out_ptr,
    so_t, so_h, spo_r, spo_h, spo_s, spml_r, spml_h, spml_s,
    NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BY_TOKEN: tl.constexpr,
):  # fmt: skip
    """Grid (R, Hq): combine the splits' partial (unnormalised) outputs of a decode row (``BY_TOKEN``: of token r,
    ``qsl_ptr`` unread). A split whose sum is 0 saw no position (past the row's context): its partial sums are
    neither read nor, by the decode kernel, written."""
    r = tl.program_id(0)
    hq = tl.program_id(1)
    if BY_TOKEN:
        start = r.to(tl.int64)
        n = 1
    else:
        start = tl.load(qsl_ptr + r).to(tl.int64)
        n = tl.load(qsl_ptr + r + 1).to(tl.int64) - start
    osp = tl.arange(0, S_PAD)
    od = tl.arange(0, BLOCK_D)
    smask = osp < NUM_SPLITS
    dmask = od < D
    ml = pml_ptr + r * spml_r + hq * spml_h + osp * spml_s
    m_s = tl.load(ml, mask=smask, other=_NEG)
    l_s = tl.load(ml + 1, mask=smask, other=0.0)
    m = tl.max(m_s, axis=0)
    w = tl.exp2(m_s - m)
    denom = tl.sum(l_s * w, axis=0)
    po = tl.load(po_ptr + r * spo_r + hq * spo_h + osp[:, None] * spo_s + od[None, :],
                 mask=(smask & (l_s > 0))[:, None] & dmask[None, :], other=0.0)  # fmt: skip
    o = tl.sum(po * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + start * so_t + hq * so_h + od, o.to(out_ptr.dtype.element_ty), mask=dmask & (n > 0))


@triton.jit
def _paged_prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, qsl_ptr, seqlen_ptr, out_ptr, ks_ptr, vs_ptr,
    sq_t, sq_h, so_t, so_h, sbt_r,
    skc_b, skc_o, skc_h, svc_b, svc_o, svc_h,
    qk_scale,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """Grid (query blocks, R, Hq). Query i of row r sits at seq_len - n + i and attends to [0, that position]."""
    mb = tl.program_id(0)
    r = tl.program_id(1)
    hq = tl.program_id(2)
    hkv = hq // GROUP
    start = tl.load(qsl_ptr + r).to(tl.int64)
    n = tl.load(qsl_ptr + r + 1).to(tl.int64) - start
    seq_len = tl.load(seqlen_ptr + r).to(tl.int64)
    ctx = seq_len - n  # tokens before this step's first query

    om = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    od = tl.arange(0, BLOCK_D)
    mmask = om < n
    dmask = od < D
    qmask = mmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + (start + om)[:, None] * sq_t + hq * sq_h + od[None, :], mask=qmask, other=0.0)
    qpos = ctx + om
    # Keys past the block's last valid query position are never needed; an empty block visits none.
    kv_end = tl.where(mb * BLOCK_M < n, tl.minimum(seq_len, ctx + (mb + 1) * BLOCK_M), 0)

    if FP8:
        qk_scale = qk_scale * tl.load(ks_ptr + hkv)
    m_i = tl.full((BLOCK_M,), _NEG, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for s in range(0, kv_end, BLOCK_N):
        pos = s + tl.arange(0, BLOCK_N)
        pmask = pos < kv_end
        allowed = mmask[:, None] & (pos[None, :] <= qpos[:, None]) & pmask[None, :]
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, pos, pmask, allowed, r, hkv, od, dmask,
            kc_ptr, vc_ptr, bt_ptr, sbt_r, skc_b, skc_o, skc_h, svc_b, svc_o, svc_h, qk_scale,
            BS, PRECISION, FP8,
        )  # fmt: skip
    if FP8:
        acc = acc * tl.load(vs_ptr + hkv)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (start + om)[:, None] * so_t + hq * so_h + od[None, :], o.to(out_ptr.dtype.element_ty),
             mask=qmask)  # fmt: skip


@triton.jit
def _qsa_scores_kernel(
    iq_ptr, bk_ptr, rows_ptr, vis_ptr, out_ptr,
    siq_t, siq_h, sbk_r, sbk_j, so_t, sqrt_d,
    NBK, HI: tl.constexpr, HI_PAD: tl.constexpr, DI: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_J: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (T, cdiv(NBK, BLOCK_J)). Token t's score of its row's block j: ``sum_h relu(iq[t, h] . bk[row, j]) /
    sqrt_d`` (float32 products and sums), ``-inf`` for the blocks it does not see completely (``j >= vis[t]``)."""
    t = tl.program_id(0).to(tl.int64)  # t x a row stride passes 2**31 at long contexts
    jb = tl.program_id(1)
    r = tl.load(rows_ptr + t).to(tl.int64)
    vis = tl.load(vis_ptr + t)
    oh = tl.arange(0, HI_PAD)
    od = tl.arange(0, BLOCK_DI)
    oj = jb * BLOCK_J + tl.arange(0, BLOCK_J)
    dmask = od < DI
    q = tl.load(iq_ptr + t * siq_t + oh[:, None] * siq_h + od[None, :], mask=(oh < HI)[:, None] & dmask[None, :],
                other=0.0)  # fmt: skip
    k = tl.load(bk_ptr + r * sbk_r + oj[:, None].to(tl.int64) * sbk_j + od[None, :],
                mask=(oj < NBK)[:, None] & dmask[None, :], other=0.0)  # fmt: skip
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (HI_PAD, BLOCK_J), padded heads give 0
    tot = tl.sum(tl.maximum(s, 0.0), axis=0) / sqrt_d
    tot = tl.where(oj < vis, tot, float("-inf"))
    tl.store(out_ptr + t * so_t + oj, tot, mask=oj < NBK)


@triton.jit
def _qsa_attend_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, rows_ptr, pos_ptr, out_ptr, po_ptr, pml_ptr, ks_ptr, vs_ptr,
    sq_t, sq_h, so_t, so_h, sp_t, sbt_r,
    skc_b, skc_o, skc_h, svc_b, svc_o, svc_h,
    spo_r, spo_h, spo_s, spml_r, spml_h, spml_s,
    qk_scale, S,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr,
    BLOCK_N: tl.constexpr, PART: tl.constexpr, SINGLE: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """Grid (T, Hkv, splits). Token t (of block-table row ``rows[t]``) attends to the positions ``pos[t, :S]``
    (``-1``: an unused lane); split ``s`` covers lanes ``[s * PART, (s + 1) * PART)``. One split: the normalised
    output; several: partial sums and (max, sum) per split, combined by ``_paged_decode_reduce_kernel`` (its rows
    are the tokens)."""
    t = tl.program_id(0).to(tl.int64)  # t x a row stride passes 2**31 at long contexts
    hkv = tl.program_id(1)
    sp = tl.program_id(2)
    r = tl.load(rows_ptr + t).to(tl.int64)
    lo = sp * PART
    hi = tl.minimum(lo + PART, S)
    og = tl.arange(0, G_PAD)
    od = tl.arange(0, BLOCK_D)
    gmask = og < GROUP
    dmask = od < D
    hq = hkv * GROUP + og
    qmask = gmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + t * sq_t + hq[:, None] * sq_h + od[None, :], mask=qmask, other=0.0)
    if FP8:
        qk_scale = qk_scale * tl.load(ks_ptr + hkv)
    m_i = tl.full((G_PAD,), _NEG, dtype=tl.float32)
    l_i = tl.zeros((G_PAD,), dtype=tl.float32)
    acc = tl.zeros((G_PAD, BLOCK_D), dtype=tl.float32)
    for s in range(lo, hi, BLOCK_N):
        lane = s + tl.arange(0, BLOCK_N)
        pos = tl.load(pos_ptr + t * sp_t + lane, mask=lane < hi, other=-1)
        pmask = pos >= 0
        allowed = gmask[:, None] & pmask[None, :]
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, tl.maximum(pos, 0), pmask, allowed, r, hkv, od, dmask,
            kc_ptr, vc_ptr, bt_ptr, sbt_r, skc_b, skc_o, skc_h, svc_b, svc_o, svc_h, qk_scale,
            BS, PRECISION, FP8,
        )  # fmt: skip
    if FP8:
        acc = acc * tl.load(vs_ptr + hkv)
    _write_split(acc, m_i, l_i, out_ptr, po_ptr, pml_ptr, t, t, sp, hq, od, qmask, gmask,
                 so_t, so_h, spo_r, spo_h, spo_s, spml_r, spml_h, spml_s, SINGLE)  # fmt: skip


@triton.jit
def _qsa_pool_scores_kernel(
    iq_ptr, ic_ptr, bt_ptr, rows_ptr, vis_ptr, kw_ptr, invf_ptr, out_ptr, pc_ptr, ax_ptr,
    siq_t, siq_h, sic_b, sic_o, sbt_r, so_t, spc_b, spc_o, sqrt_d, eps,
    NBK, HI: tl.constexpr, HI_PAD: tl.constexpr, DI: tl.constexpr, BLOCK_DI: tl.constexpr, R2: tl.constexpr,
    C: tl.constexpr, BS: tl.constexpr, BLOCK_J: tl.constexpr, MROPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``_qsa_scores_kernel`` with the block keys made on the fly from the raw index keys in the paged cache (for
    steps of few tokens a row: decode and verify): block ``j`` of token t's row is ``RoPE(k_norm(mean_fp32(raw keys
    j*C .. j*C + C - 1).to(dtype)), j*C)`` (zero-centred RMSNorm with ``kw``, NeoX halves over the first ``2 * R2``
    channels with ``invf``), rounded where the torch formulation rounds. Only the blocks the token sees completely
    are read, so the work follows the row's context, not the bound the launch was sized for. ``MROPE``: block ``j``
    turns at its first token's three positions in the paged ``pc`` (frequency ``i`` with axis ``ax[i]``), not at
    ``j*C``."""
    t = tl.program_id(0).to(tl.int64)  # t x a row stride passes 2**31 at long contexts
    jb = tl.program_id(1)
    r = tl.load(rows_ptr + t).to(tl.int64)
    vis = tl.load(vis_ptr + t)
    oj = jb * BLOCK_J + tl.arange(0, BLOCK_J)
    od = tl.arange(0, BLOCK_DI)
    dmask = od < DI
    rot = od < 2 * R2
    part = tl.where(od < R2, od + R2, od - R2)
    jm = (oj < vis) & (oj < NBK)
    lmask = jm[:, None] & dmask[None, :]
    pmask = jm[:, None] & (rot & dmask)[None, :]
    acc = tl.zeros((BLOCK_J, BLOCK_DI), dtype=tl.float32)
    accp = tl.zeros((BLOCK_J, BLOCK_DI), dtype=tl.float32)
    for i in tl.static_range(C):
        p = oj.to(tl.int64) * C + i
        blk = tl.load(bt_ptr + r * sbt_r + p // BS, mask=jm, other=0).to(tl.int64)
        base = blk * sic_b + (p % BS) * sic_o
        acc += tl.load(ic_ptr + base[:, None] + od[None, :], mask=lmask, other=0.0).to(tl.float32)
        accp += tl.load(ic_ptr + base[:, None] + part[None, :], mask=pmask, other=0.0).to(tl.float32)
    dt = ic_ptr.dtype.element_ty
    pooled = (acc / C).to(dt).to(tl.float32)
    pooledp = (accp / C).to(dt).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(pooled * pooled, axis=1) / DI + eps)
    w = tl.load(kw_ptr + od, mask=dmask, other=0.0).to(tl.float32)
    wp = tl.load(kw_ptr + part, mask=rot & dmask, other=0.0).to(tl.float32)
    kn = (pooled * inv[:, None] * (1.0 + w[None, :])).to(dt).to(tl.float32)
    knp = (pooledp * inv[:, None] * (1.0 + wp[None, :])).to(dt).to(tl.float32)
    fi = tl.where(od < R2, od, od - R2)  # the frequency of each rotated channel
    f = tl.load(invf_ptr + fi, mask=rot & dmask, other=0.0)
    if MROPE:
        p0 = oj.to(tl.int64) * C
        blk0 = tl.load(bt_ptr + r * sbt_r + p0 // BS, mask=jm, other=0).to(tl.int64)
        axis = tl.load(ax_ptr + fi, mask=rot & dmask, other=0)
        start = tl.load(pc_ptr + (blk0 * spc_b + (p0 % BS) * spc_o)[:, None] + axis[None, :], mask=pmask, other=0)
        ang = start.to(tl.float32) * f[None, :]
    else:
        ang = (oj * C).to(tl.float32)[:, None] * f[None, :]
    cs = tl.cos(ang).to(dt).to(tl.float32)
    sn = tl.sin(ang).to(dt).to(tl.float32)
    partner = tl.where((od < R2)[None, :], -knp, knp)
    rotated = ((kn * cs).to(dt).to(tl.float32) + (partner * sn).to(dt).to(tl.float32)).to(dt)
    key = tl.where(rot[None, :], rotated, kn.to(dt))
    oh = tl.arange(0, HI_PAD)
    q = tl.load(iq_ptr + t * siq_t + oh[:, None] * siq_h + od[None, :], mask=(oh < HI)[:, None] & dmask[None, :],
                other=0.0)  # fmt: skip
    s = tl.dot(q.to(dt), tl.trans(key), input_precision=PRECISION)
    tot = tl.sum(tl.maximum(s, 0.0), axis=0) / sqrt_d
    tot = tl.where(oj < vis, tot, float("-inf"))
    tl.store(out_ptr + t * so_t + oj, tot, mask=oj < NBK)


@triton.jit
def _qsa_positions_kernel(
    best_ptr, qpos_ptr, vis_ptr, pos_ptr,
    sb_t, sp_t, S,
    TOP: tl.constexpr, C: tl.constexpr, SPARSE: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Grid (T, cdiv(S, BLOCK_S)). Token t's attention lanes: where it sees more than ``TOP`` complete blocks
    (``vis > TOP``, only when ``SPARSE``), lane ``l < TOP * C`` is position ``best[t, l // C] * C + l % C`` (its
    chosen blocks, in the order given) and lane ``TOP * C + i`` the tail position ``vis * C + i`` if ``<= qpos``;
    otherwise lane ``l`` is position ``l`` if ``<= qpos``. ``-1`` marks an unused lane."""
    t = tl.program_id(0).to(tl.int64)
    lane = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    qp = tl.load(qpos_ptr + t)
    dense = tl.where(lane <= qp, lane, -1)
    if SPARSE:
        vis = tl.load(vis_ptr + t)
        in_chosen = lane < TOP * C
        blk = tl.load(best_ptr + t * sb_t + lane // C, mask=in_chosen & (lane < S), other=0)
        tail = vis * C + (lane - TOP * C)
        sparse = tl.where(in_chosen, blk * C + lane % C, tl.where(tail <= qp, tail, -1))
        dense = tl.where(vis > TOP, sparse, dense)
    tl.store(pos_ptr + t * sp_t + lane, dense.to(tl.int32), mask=lane < S)


@triton.jit
def _store_index_keys_kernel(
    k_ptr, c_ptr, slot_ptr, sk_t, sc_b, sc_o,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr,
):  # fmt: skip
    """One program per token: its raw index key into the paged index cache at its slot (a negative slot: skipped)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    od = tl.arange(0, BLOCK_D)
    m = (od < D) & (slot >= 0)
    v = tl.load(k_ptr + t * sk_t + od, mask=m)
    tl.store(c_ptr + (slot // BS) * sc_b + (slot % BS) * sc_o + od, v.to(c_ptr.dtype.element_ty), mask=m)
