"""Small helpers shared by the worker side."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def device_tensor(values: Sequence[int] | Sequence[float] | Sequence[bool], device: torch.device | str,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device`` without stalling the host: on CUDA through pinned memory and a
    non-blocking copy (a copy from pageable memory waits for the stream to drain, which undoes async scheduling)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
