"""Plain-torch reference of :mod:`hyserve.kernels.commit` (the CPU path and the yardstick for the Triton kernel)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["commit_verified_ref"]


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
