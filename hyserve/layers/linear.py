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

from hyserve.distributed.parallel_state import all_gather_last, all_reduce, shard_range, tp_size
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


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows [vocab_start, vocab_end) of the embedding; other ids give zeros here, and the sum over the
    group is the whole lookup."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        v0, v1 = shard_range(num_embeddings)
        super().__init__(v1 - v0, embedding_dim)
        self.vocab_start, self.vocab_end = v0, v1
        self.sharded = tp_size() > 1
        if self.sharded:
            set_shard(self.weight, Shard((num_embeddings, embedding_dim), 0, ((v0, v1),)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return super().forward(ids)
        inside = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = F.embedding(torch.where(inside, ids - self.vocab_start, 0), self.weight)
        return all_reduce(local.masked_fill(~inside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Linear):
    """This rank's vocabulary rows of the LM head; ``gather`` puts the ranks' logits side by side (every rank gets
    the whole vocabulary, so every rank samples the same token)."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        v0, v1 = shard_range(vocab_size)
        super().__init__(hidden_size, v1 - v0, bias=False)
        self.sharded = tp_size() > 1
        if self.sharded:
            set_shard(self.weight, Shard((vocab_size, hidden_size), 0, ((v0, v1),)))

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        return all_gather_last(local) if self.sharded else local
