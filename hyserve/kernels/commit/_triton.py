"""Triton kernel for :mod:`hyserve.kernels.commit` (imported lazily: only the CUDA path and interpreter tests need it).

``_commit_kernel`` copies one candidate per accepted row from the row-indexed scratch into the row's slot; it is
launched once per pool (conv windows, SSM states), each entry ``N`` contiguous elements.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_commit_kernel"]


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
