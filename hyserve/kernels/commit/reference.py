"""Plain-torch reference of :mod:`hyserve.kernels.commit` (the CPU path and the yardstick for the Triton kernel)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["commit_verified_ref", "replay_ref"]

# make_update(stash rows (N,), positions) -> update(state (N, ...) float32, position j) -> the state after j
UpdateFactory = Callable[[torch.Tensor, int], Callable[[torch.Tensor, int], torch.Tensor]]


def replay_ref(ssm_state: torch.Tensor, rows: torch.Tensor | None, src_slots: torch.Tensor, dst_slots: torch.Tensor,
               counts: torch.Tensor, max_positions: int, make_update: UpdateFactory) -> None:
    """The CPU path of a recurrent layer's replay from its verify stash (``gdn_replay``, ``mamba2_replay``): entry
    ``i`` with ``c = counts[i] >= 0`` stores into ``ssm_state[dst_slots[i]]`` the state of ``src_slots[i]`` advanced
    in float32 over stash row ``rows[i]``'s positions ``0 .. c`` (``rows`` None: row ``i``), the entries in lockstep,
    each left as it was past its count. ``make_update(rows, positions)`` gathers the stash once and returns the
    layer's one-position update; ``max_positions`` bounds the positions (the stash's)."""
    n = counts.shape[0]
    if n == 0:
        return
    counts = counts.to(torch.int64)
    steps = min(int(counts.max()) + 1, max_positions)  # (the CPU path: a host read costs nothing here)
    if steps <= 0:
        return
    update = make_update(torch.arange(n, device=counts.device) if rows is None else rows.to(torch.int64), steps)
    state = ssm_state[src_slots.to(torch.int64)].float().contiguous()  # the same sums whatever the pool's layout
    keep = [1] * (state.dim() - 1)
    for j in range(steps):
        state = torch.where((counts >= j).view(-1, *keep), update(state, j), state)
    live = torch.nonzero(counts >= 0).squeeze(1)
    ssm_state[dst_slots.to(torch.int64)[live]] = state[live].to(ssm_state.dtype)


def commit_verified_ref(
    pools: Sequence[torch.Tensor],
    scratches: Sequence[torch.Tensor],
    state_slots: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Reference :func:`commit_verified`: one advanced-index gather + scatter per pool (a host sync on CUDA)."""
    acc = num_accepted.to(torch.int64)
    keep = torch.nonzero(acc >= 0).squeeze(1)
    a = acc[keep]
    dst = state_slots.to(torch.int64)[keep]
    for pool, scratch in zip(pools, scratches, strict=True):
        pool[dst] = scratch[keep, a]
