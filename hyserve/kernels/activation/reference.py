"""The plain-torch ``relu2`` (the CPU path of :func:`hyserve.kernels.activation.relu_squared` and the yardstick of
its kernel): transformers' ``ReLUSquaredActivation`` formula."""

from __future__ import annotations

import torch
from torch.nn import functional as F

__all__ = ["relu_squared_ref"]


def relu_squared_ref(x: torch.Tensor) -> torch.Tensor:
    """``torch.square(F.relu(x))`` in ``x``'s dtype."""
    return torch.square(F.relu(x))
