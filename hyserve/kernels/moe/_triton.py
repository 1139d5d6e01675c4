"""Triton kernels for :mod:`hyserve.kernels.moe` (imported lazily: only the CUDA path and interpreter tests need them).

Both GEMMs walk the (token, choice) pairs sorted by expert and padded so that each ``BLOCK_M`` rows belong to one
expert (``sorted_pairs``, ``block_expert``: -1 for the blocks past the last expert's pairs, which return at once).
A program computes one ``BLOCK_M x BLOCK_N`` output tile of one expert, so a block's weights are read once for all of
its rows. ``DIRECT`` (a few tokens, decode): no sorted order; program ``m`` computes pair ``m`` alone, its expert read
from ``topk_ids``: at batch-1 decode each chosen expert's weights are read once, and nothing is launched to sort.

* ``_moe_gate_up_kernel``: ``act = silu(x W_gate^T) * (x W_up^T)`` (``ACT="silu_glu"``): the gate and up tiles of
  the same columns in two accumulators, the activation applied in float32, one [P, I] store; row ``p`` of ``act`` is
  padded position ``p``. ``ACT="relu2"`` (ungated experts, Nemotron 3): ``act = relu(x W_up^T)^2``, the weight the
  up projection alone ``[E, I, H]`` (one tile, one accumulator; FP8 scales ``[E, I]`` or its blocks).
* ``_moe_down_kernel``: ``out[pair] = w_pair * (act W2^T)`` for each padded position's pair.

FP8 (``QUANT``): 1, channel-scaled weights and per-token activation scales, applied to the accumulator once;
2, block-scaled weights (``GROUP_N x GROUP_K`` blocks) and per-token, ``GROUP_K``-wide activation groups, applied to
each ``BLOCK_K`` slice's partial product (``BLOCK_K`` divides ``GROUP_K``). ``PRECISION``: ``"ieee"`` for float32
experts (no TF32 rounding: a float32 model on CUDA matches its CPU reference), else the default. ``UPCAST``: the
interpreter multiplies float32 copies of the FP8 tiles (it has no FP8 dot).

The pair and row counts change with every step's token count and are not specialized on (``do_not_specialize``):
Triton would otherwise compile a kernel again for each class of them (equal to 1, a multiple of 16, neither), at the
first prefill chunk of each class; they only bound masks.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_moe_down_kernel", "_moe_gate_up_kernel"]


@triton.jit
def _block_rows(ids_ptr, sorted_ptr, block_expert_ptr, pid_m, num_pairs, expert_start, num_local,
                DIRECT: tl.constexpr, BLOCK_M: tl.constexpr):
    """Block ``pid_m``'s local expert (-1: nothing to do), its rows (positions in the padded order), their pairs
    and which rows hold one. ``DIRECT``: block ``pid_m`` is pair ``pid_m`` alone (row 0), its expert read from
    ``topk_ids`` (-1 when another rank holds it)."""
    if DIRECT:
        e = tl.load(ids_ptr + pid_m).to(tl.int64) - expert_start
        e = tl.where((e < 0) | (e >= num_local), -1, e)
        offs_m = pid_m + tl.zeros((BLOCK_M,), dtype=tl.int32)
        pair = offs_m
        row_ok = tl.arange(0, BLOCK_M) == 0
    else:
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + offs_m)
        row_ok = pair < num_pairs
    return e, offs_m, pair, row_ok


@triton.jit
def _relu2(x):
    """``relu(x)^2`` (the ungated experts' activation), in the accumulator's float32."""
    r = tl.maximum(x, 0.0)
    return r * r


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gate_up_kernel(
    x_ptr, w_ptr, act_ptr, xs_ptr, ws_ptr, sorted_ptr, block_expert_ptr, ids_ptr,
    num_pairs, top_k, H, INTER, expert_start, num_local,
    sxm, swe, swn, swk, sam, sxsm, sxsk, swse, swsn, swsk,
    QUANT: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    DIRECT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACT: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, offs_m, pair, row_ok = _block_rows(ids_ptr, sorted_ptr, block_expert_ptr, pid_m, num_pairs, expert_start,
                                          num_local, DIRECT, BLOCK_M)
    if e < 0:
        return
    # The up rows' offset in the expert's weight: after the gate's ``INTER`` rows (``silu_glu``), or the whole
    # weight (``relu2``: ``[I, H]``, no gate tile read, one accumulator).
    GATED: tl.constexpr = ACT == "silu_glu"
    up_rows = INTER if GATED else 0
    tok = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * sxm + offs_k[None, :]
    w_e = w_ptr + e * swe
    g_ptrs = w_e + offs_n[None, :].to(tl.int64) * swn + offs_k[:, None] * swk
    u_ptrs = g_ptrs + up_rows * swn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = offs_k < H - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        bu = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a, bu = a.to(tl.float32), bu.to(tl.float32)
        if QUANT == 2:
            kb = k0 // GROUP_K
            a_s = tl.load(xs_ptr + tok * sxsm + kb * sxsk, mask=row_ok, other=0.0)
            u_s = tl.load(ws_ptr + e * swse + ((offs_n + up_rows) // GROUP_N) * swsn + kb * swsk, mask=n_ok,
                          other=0.0)
            acc_u += tl.dot(a, bu) * a_s[:, None] * u_s[None, :]
        else:
            acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
        if GATED:
            bg = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:
                bg = bg.to(tl.float32)
            if QUANT == 2:
                g_s = tl.load(ws_ptr + e * swse + (offs_n // GROUP_N) * swsn + kb * swsk, mask=n_ok, other=0.0)
                acc_g += tl.dot(a, bg) * a_s[:, None] * g_s[None, :]
            else:
                acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * swk
        u_ptrs += BLOCK_K * swk
    if QUANT == 1:
        a_s = tl.load(xs_ptr + tok * sxsm, mask=row_ok, other=0.0)
        u_s = tl.load(ws_ptr + e * swse + (offs_n + up_rows) * swsn, mask=n_ok, other=0.0)
        acc_u = acc_u * a_s[:, None] * u_s[None, :]
        if GATED:
            g_s = tl.load(ws_ptr + e * swse + offs_n * swsn, mask=n_ok, other=0.0)
            acc_g = acc_g * a_s[:, None] * g_s[None, :]
    if GATED:
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    else:
        act = _relu2(acc_u)
    out_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * sam + offs_n[None, :]
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(
    a_ptr, w_ptr, out_ptr, as_ptr, ws_ptr, sorted_ptr, block_expert_ptr, ids_ptr, topk_w_ptr,
    num_pairs, N, K, expert_start, num_local,
    sam, swe, swn, swk, som, sasm, sask, swse, swsn, swsk,
    QUANT: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    DIRECT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, offs_m, pair, row_ok = _block_rows(ids_ptr, sorted_ptr, block_expert_ptr, pid_m, num_pairs, expert_start,
                                          num_local, DIRECT, BLOCK_M)
    if e < 0:
        return
    rows = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * sam + offs_k[None, :]
    b_ptrs = w_ptr + e * swe + offs_n[None, :].to(tl.int64) * swn + offs_k[:, None] * swk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if QUANT == 2:
            kb = k0 // GROUP_K
            a_s = tl.load(as_ptr + rows * sasm + kb * sask, mask=row_ok, other=0.0)
            b_s = tl.load(ws_ptr + e * swse + (offs_n // GROUP_N) * swsn + kb * swsk, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * swk
    if QUANT == 1:
        a_s = tl.load(as_ptr + rows * sasm, mask=row_ok, other=0.0)
        b_s = tl.load(ws_ptr + e * swse + offs_n * swsn, mask=n_ok, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    w = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)
    acc = acc * w[:, None]
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * som + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "rows"])
def _moe_align_kernel(
    ids_ptr, cursor_ptr, sorted_ptr, block_expert_ptr, num_pairs, rows, expert_start, num_local,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """One program: each local expert's pair count (foreign and out-of-range lanes are counted into bin 0, then taken
    out), its run padded to whole ``BLOCK_M`` blocks, the runs' starts into ``cursor`` (where ``_moe_scatter_kernel``
    places the pairs), the padded order filled with ``num_pairs`` (no pair), and each block's expert (-1 past the
    last run)."""
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    stray = 0
    for lo in range(0, num_pairs, BLOCK):
        offs = lo + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=0).to(tl.int32) - expert_start
        ok = (offs < num_pairs) & (e >= 0) & (e < num_local)
        counts += tl.histogram(tl.where(ok, e, 0), E_PAD)
        stray += tl.sum((~ok).to(tl.int32), axis=0)
    experts = tl.arange(0, E_PAD)
    counts = tl.where(experts == 0, counts - stray, counts)
    padded = tl.where(experts < num_local, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    run_end = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + experts, run_end - padded)
    total = tl.sum(padded, axis=0)
    for lo in range(0, rows, BLOCK):
        offs = lo + tl.arange(0, BLOCK)
        tl.store(sorted_ptr + offs, tl.full((BLOCK,), 0, tl.int32) + num_pairs, mask=offs < rows)
    for lo in range(0, rows // BLOCK_M, BLOCK_B):
        b = lo + tl.arange(0, BLOCK_B)
        start = b * BLOCK_M
        ended = (run_end[None, :] <= start[:, None]) & (experts[None, :] < num_local)
        e = tl.sum(ended.to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(start < total, e, -1), mask=b < rows // BLOCK_M)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, num_pairs, expert_start, num_local, BLOCK: tl.constexpr):
    """Each local pair takes the next place of its expert's run (an atomic on the run's cursor: the order within a
    run is arbitrary, which no output depends on: each row of a tile is computed on its own)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=0).to(tl.int32) - expert_start
    ok = (offs < num_pairs) & (e >= 0) & (e < num_local)
    slot = tl.atomic_add(cursor_ptr + tl.where(ok, e, 0), tl.full((BLOCK,), 1, tl.int32), mask=ok)
    tl.store(sorted_ptr + slot, offs.to(tl.int32), mask=ok)


@triton.jit
def _moe_route_kernel(
    logits_ptr, w_ptr, ids_ptr, gate_ptr, E, sl, slot,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr, SHARED_GATE: tl.constexpr, E_PAD: tl.constexpr,
    SHARED_SLOT: tl.constexpr,
):  # fmt: skip
    """One program per token: softmax over its ``E`` router logits in float32, the ``TOP_K`` largest in descending
    order (the lower index on a tie), divided by their sum when ``RENORM``; with ``SHARED_GATE`` the logit after the
    experts' is the shared expert's gate, written as its sigmoid: to ``gate_ptr``, or with ``SHARED_SLOT`` as one
    more choice of the token (rows of ``TOP_K + 1``: expert ``slot``, the sigmoid its weight)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    logits = tl.load(logits_ptr + t * sl + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    ks = tl.arange(0, K_PAD)
    vals = tl.zeros((K_PAD,), dtype=tl.float32)
    idx = tl.zeros((K_PAD,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        at = tl.argmax(p, axis=0)
        vals = tl.where(ks == j, best, vals)
        idx = tl.where(ks == j, at, idx)
        p = tl.where(offs == at, -1.0, p)
    if RENORM:
        vals = vals / tl.sum(vals, axis=0)
    width: tl.constexpr = TOP_K + 1 if SHARED_SLOT else TOP_K
    tl.store(w_ptr + t * width + ks, vals, mask=ks < TOP_K)
    tl.store(ids_ptr + t * width + ks, idx, mask=ks < TOP_K)
    if SHARED_GATE:
        g = tl.load(logits_ptr + t * sl + E).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        if SHARED_SLOT:
            tl.store(w_ptr + t * width + TOP_K, sig)
            tl.store(ids_ptr + t * width + TOP_K, slot.to(tl.int32))
        else:
            tl.store(gate_ptr + t, sig)


@triton.jit
def _group_top2_sum(c, S_PAD: tl.constexpr):
    """Each group's (row's) two largest values summed, [G_PAD, S_PAD] -> [G_PAD] (a group's top two, as
    ``topk(2).values.sum()``: a tied maximum counts twice)."""
    cols = tl.arange(0, S_PAD)[None, :]
    first = tl.max(c, axis=1)
    at = tl.min(tl.where(c == first[:, None], cols, S_PAD), axis=1)
    rest = tl.where(cols == at[:, None], float("-inf"), c)
    return first + tl.max(rest, axis=1)


@triton.jit
def _moe_sigmoid_route_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr, S, sl, scaling,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, G_PAD: tl.constexpr,
    S_PAD: tl.constexpr, RENORM: tl.constexpr,
):  # fmt: skip
    """One program per token, its ``N_GROUP * S`` experts held as [groups, experts of a group] (expert ``g S + j``):
    ``s = sigmoid(logit)`` and the choice scores ``c = s + bias`` in float32; with ``N_GROUP > 1`` the ``TOPK_GROUP``
    groups of the largest ``_group_top2_sum(c)`` kept (the others' ``c`` to -inf); then the ``TOP_K`` largest ``c``
    in descending order, each weighted by its ``s`` (divided by their sum + 1e-20 when ``RENORM``) times
    ``scaling``. Exact ties go to the lower group, then the lower expert id."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, G_PAD)[:, None]
    e = g * S + tl.arange(0, S_PAD)[None, :]
    ok = (g < N_GROUP) & (tl.arange(0, S_PAD)[None, :] < S)
    s = tl.sigmoid(tl.load(logits_ptr + t * sl + e, mask=ok, other=0.0).to(tl.float32))
    c = tl.where(ok, s + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32), float("-inf"))
    if N_GROUP > 1:
        gid = tl.arange(0, G_PAD)
        score = tl.where(gid < N_GROUP, _group_top2_sum(c, S_PAD), float("-inf"))
        keep = gid < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(score, axis=0)
            at = tl.min(tl.where(score == best, gid, G_PAD), axis=0)
            keep = keep | (gid == at)
            score = tl.where(gid == at, float("-inf"), score)
        c = tl.where(keep[:, None], c, float("-inf"))
    ks = tl.arange(0, K_PAD)
    vals = tl.zeros((K_PAD,), dtype=tl.float32)
    idx = tl.zeros((K_PAD,), dtype=tl.int32)
    big = G_PAD * S_PAD + S  # above every expert id
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.max(c, axis=1), axis=0)
        at = tl.min(tl.min(tl.where(ok & (c == best), e, big), axis=1), axis=0)
        picked = ok & (e == at)
        vals = tl.where(ks == j, tl.sum(tl.sum(tl.where(picked, s, 0.0), axis=1), axis=0), vals)
        idx = tl.where(ks == j, at.to(tl.int32), idx)
        c = tl.where(picked, float("-inf"), c)
    if RENORM:
        vals = vals / (tl.sum(vals, axis=0) + 1e-20)
    vals = vals * scaling
    tl.store(w_ptr + t * TOP_K + ks, vals, mask=ks < TOP_K)
    tl.store(ids_ptr + t * TOP_K + ks, idx, mask=ks < TOP_K)


@triton.jit
def _moe_combine_kernel(pair_ptr, shared_ptr, gate_ptr, out_ptr, H, TOP_K: tl.constexpr, SHARED: tl.constexpr,
                        BLOCK: tl.constexpr):
    """``out[t] = sum_j pair_out[t k + j] + gate[t] * shared[t]`` in float32, one store in the output dtype."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(pair_ptr + (t * TOP_K + j) * H + offs, mask=ok, other=0.0).to(tl.float32)
    if SHARED:
        acc += tl.load(shared_ptr + t * H + offs, mask=ok, other=0.0).to(tl.float32) * tl.load(gate_ptr + t)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)
