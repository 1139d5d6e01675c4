"""Mamba2's scan in a verify step (speculative decoding): draft tokens through the scan without touching the live
SSM state.

docs/design.md invariant 2: drafts never touch live state. Verifying ``k`` draft tokens of a request is a row of
``n_r <= k + 1`` tokens; :func:`mamba2_verify` computes the outputs :func:`~hyserve.kernels.mamba2.mamba2_scan`
computes but only READS ``ssm_state``. It does not keep the state after each position (a candidate is the size of
the state: 4.2 MB a layer and row for Nemotron-H-8B's 128 float32 heads of 64 x 128); it keeps each position's
float32 inputs to the update in a row-indexed **stash** (``MAMBA2_STASH_NAMES``: x ``(H, P)``, B ``(G, N)``, the
time step dt after its bias, softplus and clamp ``(H,)``: 37 KB on that shape), and :func:`mamba2_replay` rebuilds
the one state that is wanted from the slot's state and those inputs: after acceptance the commit advances each row's
slot over its ``a + 1`` kept tokens in place; a prefix-cache candidate snapshot at position ``p`` advances the slot
over ``p + 1`` tokens into its entry (before the commit: it reads the slot's state before the step). A verify step
then reads each state twice and writes it once, where keeping every candidate wrote ``k + 1`` states and copied one
back.

Stash (``mamba2_stash_shapes``; allocate once for the largest verify batch ``R_max`` and ``P_max = k + 1``
positions), float32. Only entries ``(r, j)`` with ``j < n_r`` (and ``j < P_max``) are written; an empty row writes
nothing. Replay and verify share one update (``_ssd_update`` on CUDA, ``ssd_update`` on the CPU), so a replayed
state is the state the verify computed its outputs from.

Dispatch: CUDA tensors run ``_mamba2_verify_kernel`` / ``_mamba2_replay_kernel`` (``_triton.py``: no host sync,
fixed-shape launches: safe to capture in a CUDA graph); everything else runs the references
(:func:`~hyserve.kernels.mamba2.reference.mamba2_verify_ref`,
:func:`~hyserve.kernels.mamba2.reference.mamba2_replay_ref`).
"""

from __future__ import annotations

import torch

from hyserve.kernels.commit import check_index_vectors, copy_candidate_windows, window_args
from hyserve.kernels.mamba2.reference import MAMBA2_STASH_NAMES, mamba2_replay_ref, mamba2_verify_ref
from hyserve.utils import next_pow2

__all__ = ["MAMBA2_STASH_NAMES", "mamba2_replay", "mamba2_replay_triton", "mamba2_stash_shapes", "mamba2_verify",
           "mamba2_verify_triton", "state_tile"]


def state_tile(p: int, n: int) -> tuple[int, int]:
    """``(BP, BN)``: the float32 state tile a program keeps in registers, all of ``N`` and at most 4096 elements
    (at least 16 head channels)."""
    bn = next_pow2(n)
    return min(next_pow2(p), max(16, 4096 // bn)), bn


def mamba2_stash_shapes(num_heads: int, head_dim: int, n_groups: int, state_size: int) -> dict[str, tuple[int, ...]]:
    """Each stash tensor's shape per (row, position); every one is float32."""
    return {"x": (num_heads, head_dim), "B": (n_groups, state_size), "dt": (num_heads,)}


def _check_stash(x: torch.Tensor, B: torch.Tensor, rows: int, stash: dict[str, torch.Tensor]) -> None:
    assert set(stash) >= set(MAMBA2_STASH_NAMES), f"the stash needs {MAMBA2_STASH_NAMES}"
    sx, sb, sdt = (stash[n] for n in MAMBA2_STASH_NAMES)
    assert all(t.dtype == torch.float32 for t in (sx, sb, sdt)), "the stash is float32"
    assert sx.shape[2:] == x.shape[1:] and sb.shape[2:] == B.shape[1:], "stash x / B must be (R_max, P_max, ...)"
    assert sdt.shape == sx.shape[:3], "stash dt must be (R_max, P_max, H)"
    assert sx.shape[:2] == sb.shape[:2] and sx.shape[0] >= rows, "the stash has fewer rows than the batch"
    assert all(t.stride(-1) == 1 for t in (sx, sb, sdt))


def mamba2_verify(
    x: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    stash: dict[str, torch.Tensor],
) -> torch.Tensor:
    """:func:`~hyserve.kernels.mamba2.mamba2_scan` that leaves ``ssm_state`` alone and stashes every position's
    inputs (``stash[name][r, j]``: row ``r``'s token ``j``). Returns ``(T, H, P)`` float32."""
    _check_stash(x, B, state_slots.shape[0], stash)
    if x.is_cuda:
        return mamba2_verify_triton(x, dt, A_log, B, C, D, dt_bias, dt_limit, ssm_state, state_slots, query_start_loc,
                                    stash)
    return mamba2_verify_ref(x, dt, A_log, B, C, D, dt_bias, dt_limit, ssm_state, state_slots, query_start_loc,
                             max_query_len, stash)


def mamba2_verify_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    stash: dict[str, torch.Tensor],
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton :func:`mamba2_verify`: one program per (row, head, ``BP`` block of head channels), any row lengths,
    no host sync. Runs under ``TRITON_INTERPRET=1`` on CPU tensors too. ``out`` optionally supplies the
    ``(T, H, P)`` float32 output buffer (last dim contiguous)."""
    from hyserve.kernels.mamba2._triton import _mamba2_verify_kernel

    t, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    r = state_slots.shape[0]
    assert h % g == 0, "the head count must be a multiple of the group count"
    assert ssm_state.shape[1:] == (h, p, n), "ssm_state must be (S, H, P, N)"
    _check_stash(x, B, r, stash)
    x, B, C = (v if v.stride(-1) == 1 else v.contiguous() for v in (x, B, C))
    if out is None:
        out = torch.empty((t, h, p), dtype=torch.float32, device=x.device)
    assert out.shape == (t, h, p) and out.stride(2) == 1
    if r == 0 or t == 0:
        return out
    bp, bn = state_tile(p, n)
    ss = ssm_state
    sx, sb, sdt = (stash[name] for name in MAMBA2_STASH_NAMES)
    _mamba2_verify_kernel[(r, h, -(-p // bp))](
        x, dt, A_log, B, C, D, dt_bias, ss, state_slots, query_start_loc, out, sx, sb, sdt,
        x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        ss.stride(0), ss.stride(1), ss.stride(2), ss.stride(3), out.stride(0), out.stride(1),
        sx.stride(0), sx.stride(1), sx.stride(2), sb.stride(0), sb.stride(1), sb.stride(2), sdt.stride(0),
        sdt.stride(1),
        sx.shape[1], float(dt_limit[0]), float(dt_limit[1]),
        P=p, N=n, HEADS_PER_GROUP=h // g, BP=bp, BN=bn,
        num_warps=4,
    )  # fmt: skip
    return out


def mamba2_replay(
    ssm_state: torch.Tensor,
    A_log: torch.Tensor,
    stash: dict[str, torch.Tensor],
    rows: torch.Tensor | None,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    counts: torch.Tensor,
    conv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Entry ``i`` with ``c = counts[i] >= 0``: ``ssm_state[dst_slots[i]]`` = the state of ``src_slots[i]`` advanced
    over stash row ``rows[i]``'s tokens ``0 .. c`` (``rows`` None: row ``i``); entries with ``c < 0`` do nothing.
    ``conv`` = ``(conv_state, conv_scratch)``: the candidate window ``conv_scratch[row, c]`` copied to
    ``conv_state[dst_slots[i]]`` in the same launch (the whole commit, or candidate snapshot, of a layer).

    The commit of a verify step is ``mamba2_replay(pool, A_log, stash, None, slots, slots, num_accepted)``; a
    candidate snapshot ``mamba2_replay(pool, A_log, stash, rows, slots[rows], entries, positions)``, before the
    commit. ``c`` must name a stashed token (``c < min(n_r, P_max)``); destinations must be distinct and no entry's
    destination another's source. All index tensors are ``(N,)`` int on the pool's device; nothing here syncs with the
    host on CUDA."""
    assert src_slots.shape == dst_slots.shape == counts.shape and counts.dim() == 1
    assert rows is None or rows.shape == counts.shape
    if ssm_state.is_cuda:  # the Triton form checks the index vectors itself
        mamba2_replay_triton(ssm_state, A_log, stash, rows, src_slots, dst_slots, counts, conv)
        return
    check_index_vectors(rows, src_slots, dst_slots, counts)
    if conv is not None:
        copy_candidate_windows(conv, rows, dst_slots, counts)
    mamba2_replay_ref(ssm_state, A_log, stash, rows, src_slots, dst_slots, counts)


def mamba2_replay_triton(
    ssm_state: torch.Tensor,
    A_log: torch.Tensor,
    stash: dict[str, torch.Tensor],
    rows: torch.Tensor | None,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    counts: torch.Tensor,
    conv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Triton :func:`mamba2_replay`: one program per (entry, head, ``BP`` block), the tile read once and written
    once, the window copied in ``H`` pieces by the first block's programs (graph-capturable)."""
    from hyserve.kernels.mamba2._triton import _mamba2_replay_kernel

    check_index_vectors(rows, src_slots, dst_slots, counts)
    num = counts.shape[0]
    _, h, p, n = ssm_state.shape
    sx, sb, sdt = (stash[name] for name in MAMBA2_STASH_NAMES)
    assert sx.shape[2:] == (h, p) and sb.shape[3] == n and h % sb.shape[2] == 0
    if num == 0:
        return
    bp, bn = state_tile(p, n)
    ss = ssm_state
    pool, scratch, entry = window_args(conv, ss)
    _mamba2_replay_kernel[(num, h, -(-p // bp))](
        ss, A_log, sx, sb, sdt, counts if rows is None else rows, src_slots, dst_slots, counts,
        pool, scratch,
        ss.stride(0), ss.stride(1), ss.stride(2), ss.stride(3),
        sx.stride(0), sx.stride(1), sx.stride(2), sb.stride(0), sb.stride(1), sb.stride(2), sdt.stride(0),
        sdt.stride(1),
        pool.stride(0), scratch.stride(0), scratch.stride(1), entry,
        sx.shape[1],
        P=p, N=n, HEADS_PER_GROUP=h // sb.shape[2], BP=bp, BN=bn, ROWS=rows is not None, CONV=conv is not None,
        num_warps=4,
    )  # fmt: skip
