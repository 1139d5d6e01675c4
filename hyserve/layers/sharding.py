"""Which part of a checkpoint tensor a tensor-parallel rank holds.

A sharded parameter (or a part of a merged projection) carries a ``Shard``: the checkpoint tensor's full shape and
the row or column ranges of it this rank keeps, in order (a projection whose output is [q | k | v] keeps its heads'
rows of each of the three). The loader checks the checkpoint tensor against ``full_shape`` and copies ``take(t)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SHARD_ATTR = "hyserve_shard"


@dataclass(frozen=True, slots=True)
class Shard:
    full_shape: tuple[int, ...]
    dim: int
    ranges: tuple[tuple[int, int], ...]

    def take(self, full: torch.Tensor) -> torch.Tensor:
        pieces = [full.narrow(self.dim, start, end - start) for start, end in self.ranges]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)

    @property
    def size(self) -> int:
        return sum(end - start for start, end in self.ranges)


def set_shard(tensor: torch.Tensor, shard: Shard) -> None:
    expected = list(shard.full_shape)
    expected[shard.dim] = shard.size
    if list(tensor.shape) != expected:
        raise AssertionError(f"a shard of {list(shard.full_shape)} along dim {shard.dim} is {expected}, "
                             f"the tensor is {list(tensor.shape)}")
    setattr(tensor, SHARD_ATTR, shard)


def shard_of(tensor: torch.Tensor) -> Shard | None:
    return getattr(tensor, SHARD_ATTR, None)
