"""Plain-torch reference of :mod:`hyserve.kernels.commit` (the CPU path and the yardstick for the Triton kernel)."""

from __future__ import annotations

import torch

__all__ = ["commit_verified_ref"]


def commit_verified_ref(
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    conv_scratch: torch.Tensor,
    ssm_scratch: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Reference :func:`commit_verified`: one advanced-index gather + scatter per pool (a host sync on CUDA)."""
    acc = num_accepted.to(torch.int64)
    keep = torch.nonzero(acc >= 0).squeeze(1)
    a = acc[keep]
    dst = state_slots.to(torch.int64)[keep]
    conv_state[dst] = conv_scratch[keep, a]
    ssm_state[dst] = ssm_scratch[keep, a]
