"""One GEMM for several projections of the same input that checkpoints store as separate tensors."""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """``parts``: each projection's checkpoint name relative to the parent module (e.g. ``in_proj_z``) and its
    output size, in output order. The loader fills each part's rows (:meth:`part_views`); :meth:`split` cuts the
    output into the parts (views, no copy)."""

    def __init__(self, in_features: int, parts: list[tuple[str, int]]) -> None:
        super().__init__(in_features, sum(n for _, n in parts), bias=False)
        self.parts = list(parts)
        self.sizes = [n for _, n in parts]

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(y.split(self.sizes, dim=-1))

    def part_views(self) -> dict[str, torch.Tensor]:
        """``{part name: rows of the weight}``, views of the one weight."""
        out, off = {}, 0
        for name, n in self.parts:
            out[name] = self.weight[off : off + n]
            off += n
        return out
