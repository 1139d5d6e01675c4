"""The decode GEMM: ``C = A W^T`` for a few rows of A (a decode step's tokens) and a bf16 / fp16 weight, K split over
programs, the last program of each output tile adding the partials in split order (one launch: no reduce launch, no
zeroed output, the same bits on every run), with A computed in the prologue from what the previous kernel would have
written (``PROLOGUE``):

* 0: A as it is;
* 1: ``rms_norm(x) * (1 + w)`` (a first pass over the row for its ``rsqrt(mean(x^2) + eps)``);
* 2: the same of ``r = x + d``, rounded to the dtype, with ``r`` (the residual stream) written by the programs of
  the first column of tiles, each its K slice;
* 3: ``silu(g) * u``, each op rounded to the dtype as the SwiGLU kernel rounds it.

The normalised value is rounded to the dtype before the dot, as the norm kernel writes it: A is the unfused path's
activation up to the order of the first pass's sum of squares.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_decode_gemm_kernel"]


@triton.jit
def _decode_gemm_kernel(
    a_ptr, d_ptr, nw_ptr, r_ptr, b_ptr, c_ptr, ws_ptr, lock_ptr, M, N, K, sa, sd, sr, sb, sc, eps,
    PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Output tile ``program_id(0)`` (``BLOCK_N`` columns, all ``M <= BLOCK_M`` rows) over K slice
    ``program_id(1)`` of ``SPLIT_K``. ``SPLIT_K > 1``: ``ws`` a float32 ``(SPLIT_K, M, N)`` workspace, ``lock``
    one zeroed int32 per output tile."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    dt = c_ptr.dtype.element_ty
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * sa
    d_rows = d_ptr + offs_m.to(tl.int64)[:, None] * sd
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1 or PROLOGUE == 2:
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            amask = mask_m[:, None] & (ks < K)[None, :]
            x = tl.load(a_rows + ks[None, :], mask=amask, other=0.0).to(tl.float32)
            if PROLOGUE == 2:
                x = (x + tl.load(d_rows + ks[None, :], mask=amask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
            ss += tl.sum(x * x, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt0 = split * per_split
    kt1 = tl.minimum(kt0 + per_split, k_tiles)
    b_rows = b_ptr + offs_n.to(tl.int64)[None, :] * sb
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(kt0, kt1):
        ks = kt * BLOCK_K + offs_k
        kmask = ks < K
        amask = mask_m[:, None] & kmask[None, :]
        if PROLOGUE == 0:
            a = tl.load(a_rows + ks[None, :], mask=amask, other=0.0)
        elif PROLOGUE == 3:
            g = tl.load(a_rows + ks[None, :], mask=amask, other=0.0).to(tl.float32)
            u = tl.load(d_rows + ks[None, :], mask=amask, other=0.0).to(tl.float32)
            a = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt)
        else:
            x = tl.load(a_rows + ks[None, :], mask=amask, other=0.0).to(tl.float32)
            if PROLOGUE == 2:
                r = (x + tl.load(d_rows + ks[None, :], mask=amask, other=0.0).to(tl.float32)).to(dt)
                if pid_n == 0:
                    tl.store(r_ptr + offs_m.to(tl.int64)[:, None] * sr + ks[None, :], r, mask=amask)
                x = r.to(tl.float32)
            w = tl.load(nw_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
            a = ((x * rstd[:, None]) * (1.0 + w)[None, :]).to(dt)
        b = tl.load(b_rows + ks[:, None], mask=kmask[:, None] & mask_n[None, :], other=0.0)
        acc += tl.dot(a, b)
    cmask = mask_m[:, None] & mask_n[None, :]
    c = c_ptr + offs_m.to(tl.int64)[:, None] * sc + offs_n[None, :]
    if SPLIT_K > 1:
        tile = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + split.to(tl.int64) * M * N + tile, acc, mask=cmask)
        tl.debug_barrier()  # every thread's partial is written before the count says so (release below)
        arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last of the tile's programs: the others' partials are visible (acquire)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, SPLIT_K):
                acc += tl.load(ws_ptr + s * M * N + tile, mask=cmask, other=0.0, cache_modifier=".cg")
            tl.store(c, acc.to(dt), mask=cmask)
            tl.atomic_xchg(lock_ptr + pid_n, 0, sem="relaxed")  # the lock is zero again for the next launch
    else:
        tl.store(c, acc.to(dt), mask=cmask)
