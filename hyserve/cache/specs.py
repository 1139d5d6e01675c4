"""What each layer needs cached per request, declared by the layer itself.

The memory planner, the state pool, prefix-cache snapshots and the verify scratch are built from these specs alone:
none of them knows which layer family a tensor belongs to or what it means. A family with other state (another
recurrent mixer, another window) declares other tensors and gets them allocated, copied, reset and snapshotted
without any change here.

* ``AttentionSpec``: one paged K and one paged V cache of (num_blocks, block_size, num_kv_heads, head_dim).
* ``RecurrentStateSpec``: the fixed-size tensors one request's state consists of, each (name, shape, dtype) without
  the leading entry axis. The pool stores tensor ``t`` of layer ``i`` as (entries, *t.shape); the verify scratch as
  (rows, positions, *t.shape). Names are unique within a spec and mean something only to the layer that declared it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        """K and V of ``block_size`` tokens."""
        return 2 * block_size * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype)


@dataclass(frozen=True, slots=True)
class StateTensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = dtype_bytes(self.dtype)
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class RecurrentStateSpec:
    tensors: tuple[StateTensorSpec, ...]

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"recurrent state tensor names must be unique within a layer (got {names})")

    @property
    def nbytes(self) -> int:
        """Bytes of one request's state of this layer (one pool entry, or one verify candidate)."""
        return sum(t.nbytes for t in self.tensors)

    def allocate(self, leading: tuple[int, ...], device: torch.device) -> dict[str, torch.Tensor]:
        """Zeroed tensors of (*leading, *t.shape), one per declared tensor, contiguous each."""
        return {t.name: torch.zeros(*leading, *t.shape, dtype=t.dtype, device=device) for t in self.tensors}


@dataclass(frozen=True, slots=True)
class CacheSpecs:
    """A model's cache needs: one entry per KV-caching layer and per recurrent layer, in binding order."""

    attention: tuple[AttentionSpec, ...]
    recurrent: tuple[RecurrentStateSpec, ...]

    def kv_bytes_per_block(self, block_size: int) -> int:
        return sum(s.bytes_per_block(block_size) for s in self.attention)

    @property
    def state_bytes_per_slot(self) -> int:
        return recurrent_bytes(self.recurrent)


def recurrent_bytes(specs: Sequence[RecurrentStateSpec]) -> int:
    """Bytes of one pool entry: every recurrent layer's state of one request."""
    return sum(s.nbytes for s in specs)
