"""How a parameter relates to its checkpoint tensor: which part of it a tensor-parallel rank holds, and what the
checkpoint stores when that is not simply the parameter's own dtype and shape.

A sharded parameter (or a part of a merged projection) carries a ``Shard``: the checkpoint tensor's full shape and
the row or column ranges of it this rank keeps, in order (a projection whose output is [q | k | v] keeps its heads'
rows of each of the three). The loader checks the checkpoint tensor against ``full_shape`` and copies ``take(t)``.

A parameter whose checkpoint tensor differs in kind carries a ``LoadSpec`` (quantized layers: a per-tensor scale
that fills a per-channel one, a bf16 weight quantized to FP8 as it loads).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

SHARD_ATTR = "hyserve_shard"
LOAD_SPEC_ATTR = "hyserve_load_spec"


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


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """What the checkpoint holds for a parameter: the safetensors dtypes accepted, the shapes accepted (``None``:
    the parameter's, or its ``Shard``'s full shape) and how the tensor is copied in (``load(target, checkpoint
    tensor)``; ``None``: the ``Shard``'s ``take``, reshaped to the target, and a converting copy)."""

    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...] | None = None
    load: Callable[[torch.Tensor, torch.Tensor], None] | None = None


def set_load_spec(tensor: torch.Tensor, spec: LoadSpec) -> None:
    setattr(tensor, LOAD_SPEC_ATTR, spec)


def load_spec_of(tensor: torch.Tensor) -> LoadSpec | None:
    return getattr(tensor, LOAD_SPEC_ATTR, None)
