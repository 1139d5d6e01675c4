"""Linear layers: one GEMM for several projections of the same input (checkpoints store them as separate tensors),
and the tensor-parallel forms (``hyserve.distributed.parallel_state``).

Column-parallel projections need no class of their own: a rank's output rows are a ``Shard`` of the checkpoint
tensor (``hyserve.layers.sharding``) and the layer's output is that rank's heads or channels. A row-parallel
projection takes the rank's input columns and sums its output over the group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyserve.distributed.parallel_state import all_reduce
from hyserve.layers.sharding import Shard, set_shard


class MergedLinear(nn.Linear):
    """``parts``: each projection's checkpoint name relative to the parent module (e.g. ``in_proj_z``) and its
    output size (this rank's), in output order. The loader fills each part's rows (:meth:`part_views`, each view
    carrying the part's ``Shard`` when tensor-parallel); :meth:`split` cuts the output into the parts (views)."""

    def __init__(self, in_features: int, parts: list[tuple[str, int]],
                 shards: dict[str, Shard] | None = None) -> None:
        super().__init__(in_features, sum(n for _, n in parts), bias=False)
        self.parts = list(parts)
        self.sizes = [n for _, n in parts]
        self.shards = dict(shards or {})

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(y.split(self.sizes, dim=-1))

    def part_views(self) -> dict[str, torch.Tensor]:
        """``{part name: rows of the weight}``, views of the one weight."""
        out, off = {}, 0
        for name, n in self.parts:
            view = self.weight[off : off + n]
            if name in self.shards:
                set_shard(view, self.shards[name])
            out[name] = view
            off += n
        return out


class RowParallelLinear(nn.Linear):
    """``in_range`` of the full ``in_features_full`` inputs on this rank; the outputs are summed over the group,
    then the (whole) bias is added once."""

    def __init__(self, in_features_full: int, out_features: int, in_range: tuple[int, int], bias: bool = False,
                 sharded: bool = True) -> None:
        super().__init__(in_range[1] - in_range[0], out_features, bias=bias)
        self.sharded = sharded
        if sharded:
            set_shard(self.weight, Shard((out_features, in_features_full), 1, (in_range,)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return super().forward(x)
        y = all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias
