"""Triton kernel for :mod:`hyserve.kernels.ple`: Qwen4-Exp's n-gram hash and table gather in one launch.

``_ngram_embed_kernel``: one program per token. It applies the segment rule to the token's ``N`` history ids (an eos
among ``t_1 .. t_{k-1}`` makes ``t_k`` read eos), forms the XOR of ``t_k * mult[k]`` order by order in int64 (wrapping
as torch does), and for each of the order's ``HPN`` heads copies table row ``(x mod size[g]) + offset[g]`` (a
non-negative remainder, as ``torch.remainder``) into the output's ``g``-th ``D``-wide slice.

``_ple_gate_kernel``: grid (T, S): the gate of each stream from the normed key and query, times the value.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_ngram_embed_kernel", "_ple_gate_kernel"]


@triton.jit
def _ngram_embed_kernel(
    tok_ptr, mult_ptr, size_ptr, off_ptr, table_ptr, out_ptr,
    stok_t, stab_r, sout_t, eos,
    N: tl.constexpr, HPN: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    od = tl.arange(0, BLOCK_D)
    dm = od < D
    cut = False
    acc = tl.load(tok_ptr + t * stok_t).to(tl.int64) * tl.load(mult_ptr).to(tl.int64)
    for k in tl.static_range(1, N):
        tk = tl.load(tok_ptr + t * stok_t + k).to(tl.int64)
        tk = tl.where(cut, eos, tk)
        acc = acc ^ (tk * tl.load(mult_ptr + k).to(tl.int64))
        for h in tl.static_range(HPN):
            g = (k - 1) * HPN + h
            size = tl.load(size_ptr + g).to(tl.int64)
            r = acc % size
            r = tl.where(r < 0, r + size, r)
            row = r + tl.load(off_ptr + g).to(tl.int64)
            v = tl.load(table_ptr + row * stab_r + od, mask=dm, other=0.0)
            tl.store(out_ptr + t * sout_t + g * D + od, v, mask=dm)
        if k < N - 1:  # the segment rule: an eos at t_k cuts every older position
            cut = cut | (tk == eos)


@triton.jit
def _ple_gate_kernel(
    k_ptr, q_ptr, v_ptr, out_ptr,
    sk_t, sq_t, sv_t, so_t, sqrt_h, clamp,
    H: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Grid (T, S). Stream s of token t: ``g = sum_H(kn * qn) / sqrt(H)``, its signed square root (``|g|`` floored at
    ``clamp``), then ``sigmoid(g) * v`` into the stream's H outputs; rounded to the activation dtype where the torch
    formulation rounds (the product, the sum, the quotient, the root, the sigmoid, the output)."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    oh = tl.arange(0, BLOCK_H)
    m = oh < H
    kn = tl.load(k_ptr + t * sk_t + s * H + oh, mask=m, other=0.0)
    dt = kn.dtype
    qn = tl.load(q_ptr + t * sq_t + s * H + oh, mask=m, other=0.0)
    prod = (kn.to(tl.float32) * qn.to(tl.float32)).to(dt).to(tl.float32)
    g = (tl.sum(prod, axis=0).to(dt).to(tl.float32) / sqrt_h).to(dt).to(tl.float32)
    root = tl.sqrt(tl.maximum(tl.abs(g), clamp)).to(dt).to(tl.float32)
    sign = tl.where(g > 0, 1.0, tl.where(g < 0, -1.0, 0.0))
    gate = tl.sigmoid(sign * root).to(dt).to(tl.float32)
    v = tl.load(v_ptr + t * sv_t + oh, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * so_t + s * H + oh, (gate * v).to(out_ptr.dtype.element_ty), mask=m)
