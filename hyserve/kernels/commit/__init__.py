"""Commit of verified speculative-decoding state: each accepted row's chosen candidate copied into its live slot.

docs/design.md invariant 2: drafts never touch live state. The verify variants (:mod:`hyserve.kernels.conv.verify`,
Mamba2's) only read the live pools and write the candidate state after each position ``j`` of row ``r`` into
row-indexed scratch (``scratch[r, j]``). After acceptance, :func:`commit_verified` copies one
candidate per row into the row's slot, for each pool it is given (Gated DeltaNet's conv window; its SSM state is
rebuilt from the stashed inputs instead, :func:`hyserve.kernels.gdn.verify.gdn_replay`). Scratch entries
not chosen, rows with nothing accepted and every other slot are left bit-identical.

Dispatch: CUDA tensors run the Triton kernel of ``_triton.py`` (one masked copy launch per pool, no host sync:
safe to capture in a CUDA graph); everything else runs :func:`~hyserve.kernels.commit.reference.commit_verified_ref`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hyserve.kernels.commit.reference import commit_verified_ref

__all__ = ["check_index_vectors", "commit_verified", "commit_verified_ref", "commit_verified_triton",
           "copy_candidate_windows", "window_args"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def commit_verified(
    pools: Sequence[torch.Tensor],
    scratches: Sequence[torch.Tensor],
    state_slots: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Row ``r`` with ``a = num_accepted[r] >= 0`` commits candidate ``a`` to its slot; rows with ``a < 0`` do nothing.

    ``pool[state_slots[r]] = scratch[r, a]`` for each (pool, scratch) pair. ``a`` counts the accepted tokens of the
    row minus one (the live slot takes the state after position ``a``), so it must name a written candidate:
    ``a < min(n_r, P_max)``. Slots of committing rows must be distinct. ``num_accepted`` is an int tensor ``(R,)``
    on the pools' device; nothing here syncs with the host on CUDA.
    """
    assert num_accepted.shape == state_slots.shape, "num_accepted must be (R,) like state_slots"
    assert len(pools) == len(scratches)
    for pool, scratch in zip(pools, scratches, strict=True):
        assert scratch.dtype == pool.dtype and scratch.shape[2:] == pool.shape[1:]
    if state_slots.is_cuda:
        commit_verified_triton(pools, scratches, state_slots, num_accepted)
    else:
        commit_verified_ref(pools, scratches, state_slots, num_accepted)


def _entries_contiguous(t: torch.Tensor, lead: int) -> bool:
    """Whether each entry ``t[i_0, ..., i_{lead-1}]`` is one contiguous block (row-major)."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape[lead:], t.stride()[lead:]))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


_COMMIT_BLOCK = 1024


def commit_verified_triton(
    pools: Sequence[torch.Tensor],
    scratches: Sequence[torch.Tensor],
    state_slots: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Triton :func:`commit_verified`: one masked copy launch per pool, no host sync (graph-capturable).

    Pool and scratch entries must each be contiguous (as ``StatePool`` and ``torch.empty`` allocate them)."""
    from hyserve.kernels.commit._triton import _commit_kernel

    R = state_slots.shape[0]
    if R == 0:
        return
    for pool, scratch in zip(pools, scratches, strict=True):
        assert _entries_contiguous(pool, 1) and _entries_contiguous(scratch, 2), "entries must be contiguous"
        n = pool[0].numel() if pool.shape[0] > 0 else 0
        if n == 0:
            continue
        _commit_kernel[(R, _cdiv(n, _COMMIT_BLOCK))](
            scratch, pool, state_slots, num_accepted,
            n, scratch.stride(0), scratch.stride(1), pool.stride(0),
            BLOCK=_COMMIT_BLOCK,
            num_warps=4,
        )  # fmt: skip


def copy_candidate_windows(conv: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor | None,
                           dst_slots: torch.Tensor, counts: torch.Tensor) -> None:
    """The plain-torch window copy of a replay with ``conv = (conv_state, conv_scratch)``: entry ``i`` with
    ``c = counts[i] >= 0`` takes ``conv_scratch[rows[i], c]`` (``rows`` None: row ``i``) into
    ``conv_state[dst_slots[i]]``."""
    pool, scratch = conv
    commit_verified_ref([pool], [scratch if rows is None else scratch.index_select(0, rows)], dst_slots, counts)


def check_index_vectors(*vectors: torch.Tensor | None) -> None:
    """A replay's index vectors (rows, source and destination slots, counts) must be 1-D at unit stride: its kernels
    read entry ``i`` at ``ptr + i``, so a strided view (a column of a ``(N, 3)`` buffer) would name other slots.
    Checked on every device, so that the CPU path holds callers to what the CUDA path needs."""
    for v in vectors:
        if v is not None:
            assert v.dim() == 1 and (v.shape[0] <= 1 or v.stride(0) == 1), \
                f"index vectors must be 1-D and contiguous (shape {tuple(v.shape)}, stride {v.stride()})"


def window_args(conv: tuple[torch.Tensor, torch.Tensor] | None,
                like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A replay kernel's window arguments: the conv pool, its scratch and an entry's element count (``like`` and
    0 when there is no window to copy). Each entry must be contiguous."""
    if conv is None:
        return like, like[None], 0
    pool, scratch = conv
    assert scratch.shape[2:] == pool.shape[1:] and scratch.dtype == pool.dtype, \
        "conv_scratch must be (R_max, P_max, *conv_state's entry)"
    assert _entries_contiguous(pool, 1) and _entries_contiguous(scratch, 2), "conv entries must be contiguous"
    return pool, scratch, pool[0].numel()
