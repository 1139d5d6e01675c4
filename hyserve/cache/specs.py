"""What each layer needs cached per request, declared by the layer itself.

The memory planner, the state pool, prefix-cache snapshots and the verify scratch are built from these specs alone:
none of them knows which layer family a tensor belongs to or what it means. A family with other state (another
recurrent mixer, another window) declares other tensors and gets them allocated, copied, reset and snapshotted
without any change here.

* ``AttentionSpec``: one paged K and one paged V cache of (num_blocks, block_size, num_kv_heads, head_dim), and
  for an indexed-attention layer a paged index-key cache of (num_blocks, block_size, index_dim) beside them.
* ``RecurrentStateSpec``: the fixed-size tensors one request's state consists of, each (name, shape, dtype) without
  the leading entry axis. The pool stores tensor ``t`` of layer ``i`` as (entries, *t.shape). The verify scratch
  stores the tensors of the layer's scratch spec (its state's by default) as (rows, positions, *t.shape). Names are
  unique within a spec and mean something only to the layer that declared it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

INDEX_POSITION_AXES = 3  # an M-RoPE position: time, height, width


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """Paged K and V of ``(num_blocks, block_size, num_kv_heads, head_dim)`` in ``dtype`` (the KV cache dtype: FP8
    where ``kv_cache_dtype`` says so). ``index_dim > 0``: the layer also keeps one ``index_dim``-wide key per token
    in ``index_dtype`` (an indexed-attention layer's raw indexer keys, in the model dtype whatever the KV dtype), in a
    ``(num_blocks, block_size, index_dim)`` cache of the same blocks and slots as the KV. ``index_positions``: and
    each token's three M-RoPE positions (int32, ``(num_blocks, block_size, 3)``), where the model has images."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    index_dim: int = 0
    index_dtype: torch.dtype | None = None
    index_positions: bool = False

    def __post_init__(self) -> None:
        if self.index_dim < 0:
            raise ValueError(f"index_dim must be >= 0, got {self.index_dim}")
        if self.index_dim and self.index_dtype is None:
            raise ValueError("an AttentionSpec with index_dim > 0 needs its index_dtype")

    def bytes_per_block(self, block_size: int) -> int:
        """K and V of ``block_size`` tokens, and their index keys where the layer keeps them."""
        kv = 2 * block_size * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype)
        if self.index_dim and self.index_dtype is not None:
            kv += block_size * self.index_dim * dtype_bytes(self.index_dtype)
            if self.index_positions:
                kv += block_size * INDEX_POSITION_AXES * dtype_bytes(torch.int32)
        return kv


@dataclass(frozen=True, slots=True)
class StateTensorSpec:
    """One tensor of a layer's recurrent state: ``shape`` is the view every kernel and copy indexes; ``order``, when
    given, the memory order of its dims, outermost first (``(0, 2, 1)``: a ``(H, K, V)`` view stored as ``(H, V,
    K)``, each head's matrix transposed in memory; the kernels take every stride, so only the access pattern
    changes)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    order: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.order is not None and sorted(self.order) != list(range(len(self.shape))):
            raise ValueError(f"{self.name}: order {self.order} is not a permutation of the dims of {self.shape}")

    def zeros(self, leading: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A zeroed ``(*leading, *shape)`` tensor stored in ``order`` (the leading dims outermost)."""
        if self.order is None:
            return torch.zeros(*leading, *self.shape, dtype=self.dtype, device=device)
        stored = torch.zeros(*leading, *(self.shape[i] for i in self.order), dtype=self.dtype, device=device)
        return self._as_view(stored, len(leading))

    def carve(self, rows: torch.Tensor, offset: int) -> torch.Tensor:
        """The ``(E, *shape)`` view, stored in ``order``, of bytes ``[offset, offset + nbytes)`` of each row of
        ``rows`` (an ``(E, row_bytes)`` uint8 tensor; ``offset`` and ``row_bytes`` multiples of the element size):
        entry ``e``'s tensor is one dense block inside row ``e``."""
        typed = rows[:, offset:offset + self.nbytes].view(self.dtype)
        stored = typed.view(rows.shape[0], *(self.shape if self.order is None else
                                              (self.shape[i] for i in self.order)))
        return stored if self.order is None else self._as_view(stored, 1)

    def _as_view(self, stored: torch.Tensor, n: int) -> torch.Tensor:
        assert self.order is not None
        return stored.permute(*range(n), *(n + self.order.index(i) for i in range(len(self.shape))))

    @property
    def nbytes(self) -> int:
        n = dtype_bytes(self.dtype)
        for d in self.shape:
            n *= d
        return n


def entry_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (entries first, each entry one dense block of memory in any order of its dims, as
    :meth:`StateTensorSpec.zeros` stores it) as an ``(entries, numel)`` view whose row ``i`` is entry ``i``'s memory
    in storage order. Entry-to-entry copies and fills through it run at unit stride whatever the view's order: on a
    value-major GDN pool, torch's ``index_select`` / ``index_copy_`` of the transposed view take their strided
    element-wise kernels (measured on an H100: several times the time of a dense row copy). Refuses a tensor whose
    entries are not dense."""
    numel = 1
    for d in t.shape[1:]:
        numel *= d
    expected = 1
    for stride, size in sorted((s, d) for s, d in zip(t.stride()[1:], t.shape[1:]) if d != 1):
        if stride != expected:
            raise ValueError(f"entries of a {tuple(t.shape)} tensor with strides {t.stride()} are not dense")
        expected *= size
    if t.shape[0] > 1 and t.stride(0) < numel:
        raise ValueError(f"entries of a {tuple(t.shape)} tensor with strides {t.stride()} overlap")
    return t.as_strided((t.shape[0], numel), (t.stride(0), 1), t.storage_offset())


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
        """Zeroed tensors of (*leading, *t.shape), one per declared tensor, each stored in its ``order`` (contiguous
        where it has none)."""
        return {t.name: t.zeros(leading, device) for t in self.tensors}


@dataclass(frozen=True, slots=True)
class CacheSpecs:
    """A model's cache needs: one entry per KV-caching layer and per recurrent layer, in binding order."""

    attention: tuple[AttentionSpec, ...]
    recurrent: tuple[RecurrentStateSpec, ...]
    # Per recurrent layer, what a verify row keeps per position (RecurrentLayer.verify_scratch_spec); empty: a
    # candidate state each (the ``recurrent`` specs).
    verify_scratch: tuple[RecurrentStateSpec, ...] = ()

    def kv_bytes_per_block(self, block_size: int) -> int:
        return sum(s.bytes_per_block(block_size) for s in self.attention)

    @property
    def state_bytes_per_slot(self) -> int:
        return recurrent_bytes(self.recurrent)

    @property
    def scratch_specs(self) -> tuple[RecurrentStateSpec, ...]:
        return self.verify_scratch or self.recurrent

    @property
    def scratch_bytes_per_position(self) -> int:
        """Bytes of one verify position of one row in the verify scratch, every recurrent layer's."""
        return recurrent_bytes(self.scratch_specs)


def recurrent_bytes(specs: Sequence[RecurrentStateSpec]) -> int:
    """Bytes of one pool entry: every recurrent layer's state of one request (:func:`entry_layout`'s row)."""
    return entry_layout(specs)[1]


def entry_layout(specs: Sequence[RecurrentStateSpec]) -> tuple[list[dict[str, int]], int]:
    """Where each tensor of each layer sits in one pool entry's row of bytes, and the row's length: the state pool
    stores an entry as one row (``hyserve.cache.state_pool``), so that copying or zeroing entries is one operation
    over all layers. Tensors of wider elements come first, so every tensor starts at a multiple of its element size;
    the row is padded to a multiple of the widest (a few bytes at most; none for the shapes served)."""
    placed = sorted(((i, t) for i, spec in enumerate(specs) for t in spec.tensors),
                    key=lambda it: -dtype_bytes(it[1].dtype))
    offsets: list[dict[str, int]] = [{} for _ in specs]
    end = 0
    for i, t in placed:
        offsets[i][t.name] = end
        end += t.nbytes
    widest = max((dtype_bytes(t.dtype) for _, t in placed), default=1)
    return offsets, -(-end // widest) * widest
