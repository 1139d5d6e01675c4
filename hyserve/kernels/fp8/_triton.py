"""Triton kernels for :mod:`hyserve.kernels.fp8` (imported lazily: only the CUDA path and interpreter tests need them).

* ``_quant_rows_kernel``: one pass over a ``(M, K)`` activation writing its float8_e4m3fn values and float32 scales,
  per token (``GROUP == 0``), per token and ``GROUP``-wide slice of K, or with one static scale; the arithmetic of
  :func:`hyserve.kernels.fp8.quantize_per_token` (``max(amax, eps) / 448``, a correctly rounded division, round to
  nearest even on the cast), in one launch where torch takes six.
* ``_fp8_gemm_kernel``: ``C = A B^T`` for FP8 ``A (M, K)`` and ``B (N, K)`` with float32 accumulation. Channel
  scaling (``BLOCKWISE`` false) multiplies the accumulator once by the token's and the channel's scales; block
  scaling takes one ``BLOCK_K = SCALE_K``-wide slice of K per iteration and scales each partial product by the
  token's group scale and the weight block's scale, as DeepSeek-V3's recipe does. ``SPLIT_K`` programs share one
  output tile over K slices (decode shapes have too few output tiles to fill the card): each writes its float32
  partial to a workspace and counts itself in on the tile's lock; the last to arrive adds the partials in split
  order, scales, casts and writes the tile, then sets the lock back to 0. One launch, no zeroed output, no cast
  launch after, and the same sum whichever program comes last (a float atomic add would not be).
  The GEMM can also quantize the activation itself (``A_MODE``), which saves the quantization's launch where a
  decode step's GEMMs are a few microseconds each.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["A_DYNAMIC_GROUP", "A_DYNAMIC_TOKEN", "A_PRECOMPUTED", "A_STATIC", "_fp8_gemm_kernel",
           "_quant_rows_kernel", "quantize_token_row"]


@triton.jit
def _quant_rows_kernel(
    x_ptr, q_ptr, s_ptr, M, K, sx, sq, ss, ssg, fp8_max, eps,
    GROUP: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Program ``(i, j)`` quantizes group ``j`` of rows ``i * ROWS ..`` (``GROUP > 0``: a ``(ROWS, GROUP)`` tile, one
    scale a row), or the whole of row ``i`` (``GROUP == 0``, ``ROWS`` 1: ``j`` is 0 and the row is read twice, for its
    amax and then for the values). ``STATIC``: ``s_ptr`` holds the one scale and nothing is written to it. Group
    ``j``'s scale of ``row`` goes to ``s_ptr + row * ss + j * ssg``."""
    if GROUP > 0:
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        lo = tl.program_id(1) * GROUP
        offs = lo + tl.arange(0, BLOCK)
        row_ok = rows < M
        mask = row_ok[:, None] & ((offs < K) & (offs < lo + GROUP))[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * sx + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), eps), fp8_max)
        q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -fp8_max, fp8_max)
        tl.store(q_ptr + rows64[:, None] * sq + offs[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + rows64 * ss + tl.program_id(1) * ssg, scale, mask=row_ok)
    else:
        row = tl.program_id(0).to(tl.int64)
        quantize_token_row(x_ptr + row * sx, q_ptr + row * sq, s_ptr + row * ss, K, fp8_max, eps, BLOCK, STATIC)


@triton.jit
def quantize_token_row(x_row, q_row, s_ptr, K, fp8_max, eps, BLOCK: tl.constexpr, STATIC: tl.constexpr = False):
    """The ``K`` values at ``x_row`` quantized per token into ``q_row``: their scale ``max(amax, eps) / fp8_max`` to
    ``s_ptr`` (a first pass over the row for its amax), then the values (a second pass); ``STATIC``: the scale is
    read from ``s_ptr`` instead. The arithmetic of :func:`hyserve.kernels.fp8.quantize_per_token`. Producers whose
    row is written by several programs call it from the last of them (``hyserve.kernels.gdn``)."""
    if STATIC:
        scale = tl.load(s_ptr)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for lo in range(0, K, BLOCK):
            offs = lo + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), eps), fp8_max)
        tl.store(s_ptr, scale)
    for lo in range(0, K, BLOCK):
        offs = lo + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -fp8_max, fp8_max)
        tl.store(q_row + offs, q.to(q_row.dtype.element_ty), mask=offs < K)


# How the GEMM gets A's FP8 values and scales (``A_MODE``): A is FP8 with its scales in ``as`` (precomputed), or A is
# the unquantized activation, quantized inside the GEMM: per token (each program first reads its rows' amax over the
# whole of K), per token and BLOCK_K-group (each K tile is one group: its amax is the tile's), or with the one
# static scale ``as[0]``. The quantized values are those of the torch reference, bit for bit.
A_PRECOMPUTED, A_DYNAMIC_TOKEN, A_DYNAMIC_GROUP, A_STATIC = 0, 1, 2, 3


@triton.jit
def _quantize_tile(a, scale, fp8_max, DT: tl.constexpr):
    return tl.clamp(tl.math.div_rn(a.to(tl.float32), scale), -fp8_max, fp8_max).to(DT)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, ws_ptr, lock_ptr, M, N, K,
    sa, sb, sc, sas_m, sas_k, sbs_n, sbs_k, fp8_max, eps,
    BLOCKWISE: tl.constexpr, SCALE_N: tl.constexpr, UPCAST: tl.constexpr, A_MODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """One ``BLOCK_M x BLOCK_N`` tile of ``C`` over K slice ``program_id(1)`` of ``SPLIT_K``. ``as``: the tokens'
    scales, ``(M,)`` (``sas_k`` 0) or one per ``BLOCK_K``-group of K (``A_MODE`` precomputed), or the static scale;
    ``bs``: the channels' scales ``(N,)`` (channel) or one per ``SCALE_N x BLOCK_K`` block (``BLOCKWISE``).
    ``UPCAST``: the dot in bf16 (the Triton interpreter has no FP8 dot; exact, FP8 values being bf16 values).
    ``SPLIT_K > 1``: ``ws`` is a float32 ``(SPLIT_K, M, N)`` workspace, ``lock`` one zeroed int32 per output tile."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped tile order: GROUP_M row tiles share the B tiles they read while those are in L2.
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt0 = tl.program_id(1) * per_split
    kt1 = tl.minimum(kt0 + per_split, k_tiles)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * sa
    b_rows = b_ptr + offs_n.to(tl.int64)[None, :] * sb
    fp8 = b_ptr.dtype.element_ty
    # The tokens' scale where one holds for the whole row (all modes but the per-group one).
    row_s = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if A_MODE == 1:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for kt in range(0, k_tiles):
            ks = kt * BLOCK_K + offs_k
            a = tl.load(a_rows + ks[None, :], mask=mask_m[:, None] & (ks < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(a.to(tl.float32)), axis=1))
        row_s = tl.math.div_rn(tl.maximum(amax, eps), fp8_max)
    elif A_MODE == 3:
        row_s = row_s * tl.load(as_ptr)
    elif A_MODE == 0 and not BLOCKWISE:
        row_s = tl.load(as_ptr + offs_m * sas_m, mask=mask_m, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(kt0, kt1):
        ks = kt * BLOCK_K + offs_k
        kmask = ks < K
        a = tl.load(a_rows + ks[None, :], mask=mask_m[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_rows + ks[:, None], mask=kmask[:, None] & mask_n[None, :], other=0.0)
        a_s = row_s
        if A_MODE == 2:
            a_s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(a.to(tl.float32)), axis=1), eps), fp8_max)
            a = _quantize_tile(a, a_s[:, None], fp8_max, fp8)
        elif A_MODE != 0:
            a = _quantize_tile(a, row_s[:, None], fp8_max, fp8)
        elif BLOCKWISE:
            a_s = tl.load(as_ptr + offs_m * sas_m + kt * sas_k, mask=mask_m, other=0.0)
        if UPCAST:
            a = a.to(tl.bfloat16)
            b = b.to(tl.bfloat16)
        part = tl.dot(a, b)
        if BLOCKWISE:
            b_s = tl.load(bs_ptr + (offs_n // SCALE_N) * sbs_n + kt * sbs_k, mask=mask_n, other=0.0)
            acc += part * (a_s[:, None] * b_s[None, :])
        else:
            acc += part
    cmask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        tile = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + tl.program_id(1).to(tl.int64) * M * N + tile, acc, mask=cmask)
        tl.debug_barrier()  # every thread's partial is written before the count says so (release below)
        arrived = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last of the tile's programs: the others' partials are visible (acquire)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, SPLIT_K):
                acc += tl.load(ws_ptr + s * M * N + tile, mask=cmask, other=0.0, cache_modifier=".cg")
            _store_tile(acc, row_s, bs_ptr, offs_n, mask_n, sbs_n, c_ptr, offs_m, sc, cmask, BLOCKWISE)
            tl.atomic_xchg(lock_ptr + pid, 0, sem="relaxed")  # the lock is zero again for the next launch
    else:
        _store_tile(acc, row_s, bs_ptr, offs_n, mask_n, sbs_n, c_ptr, offs_m, sc, cmask, BLOCKWISE)


@triton.jit
def _store_tile(acc, row_s, bs_ptr, offs_n, mask_n, sbs_n, c_ptr, offs_m, sc, cmask, BLOCKWISE: tl.constexpr):
    """Write a finished float32 tile: channel scaling applies the tokens' and channels' scales here (block scaling
    applied them per K slice), then the cast to ``C``'s dtype."""
    if not BLOCKWISE:
        b_s = tl.load(bs_ptr + offs_n * sbs_n, mask=mask_n, other=0.0)
        acc = acc * (row_s[:, None] * b_s[None, :])
    c = c_ptr + offs_m.to(tl.int64)[:, None] * sc + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=cmask)
