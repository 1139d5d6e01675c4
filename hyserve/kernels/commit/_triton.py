"""Triton kernel for :mod:`hyserve.kernels.commit` (imported lazily: only the CUDA path and interpreter tests need it).

``_commit_kernel`` copies one candidate per accepted row from the row-indexed scratch into the row's slot; it is
launched once per pool (conv windows, SSM states), each entry ``N`` contiguous elements. ``copy_window_piece`` is the
same copy in pieces, for a replay kernel's programs to share (the Gated DeltaNet and Mamba2 commits: the accepted
conv window copied in the replay's launch).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_commit_kernel", "copy_window_piece"]


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


@triton.jit
def copy_window_piece(
    conv_ptr, cscr_ptr, r, c, dst,
    sc_s, scr_r, scr_p, E, piece_index, num_pieces,
    CBLOCK: tl.constexpr,
):  # fmt: skip
    """Piece ``piece_index`` of ``num_pieces`` of the candidate ``scratch[r, c]`` (``E`` contiguous elements) copied
    to ``conv[dst]``: the programs of a replay launch share a window's copy."""
    piece = tl.cdiv(E, num_pieces)
    lo = piece_index * piece
    hi = tl.minimum(lo + piece, E)
    for off in range(lo, hi, CBLOCK):
        o = off + tl.arange(0, CBLOCK)
        m = o < hi
        w = tl.load(cscr_ptr + r * scr_r + c * scr_p + o, mask=m)
        tl.store(conv_ptr + dst * sc_s + o, w, mask=m)
