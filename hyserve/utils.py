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


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device`` without stalling the host, as :func:`device_tensor` (pinned, non-blocking); a
    tensor already on a device goes as ``Tensor.to`` takes it."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``): Triton block sizes."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
