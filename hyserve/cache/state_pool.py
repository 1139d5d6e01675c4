"""Recurrent state of the model's recurrent layers: the worker's tensors (the scheduler's entry allocator is
``state_slots.StateSlots``; the worker only applies the copies and resets it is sent).

This module is where four of the state-ownership invariants of docs/design.md live (numbered as there):

1. Slot, not row. A request is given a slot at admission and keeps it until it finishes, is aborted or is preempted.
   Every kernel reads and writes state through the per-row ``state_slots`` of the step's metadata; nothing infers a
   slot from a row's position in the batch. Slots are handed out by ``state_slots.StateSlots`` from the top of the
   pool down, and freed slots are reused last-in first-out, so ``row == slot`` is the exception, never an accident
   that hides a bug.
10. A slot's state is exactly the state after the request's ``num_computed_tokens`` tokens: zeroed before the first
    chunk of a fresh request (``reset``), advanced only by that request's own verified tokens.
11. Entry ``pad_slot`` (= num_slots) belongs to nobody: padded rows of a captured graph read and write it, and
    nothing ever reads it back.
12. Entries after it are prefix-cache snapshots (``snapshot_entry(i)``), owned by ``prefix_cache.PrefixCache``. A
    snapshot is only ever written by one copy from a request slot, right after the step that brought that slot to
    the snapshot's position, or (a point inside a prefill row) by the recurrent layers during that step's forward
    from the state they compute there (``StepMetadata.row_snapshots``); it is only read by copies into request
    slots; no kernel reads it.

12b. The prefix cache's host tier, ``host_rows`` (``num_host_snapshots`` rows of the same bytes, pinned host memory
    on CUDA): a row is written only by ``offload`` from a snapshot entry the budget evicted, in the step that reuses
    that entry, before anything of that step writes it (on a stage before the last, after the earlier steps' verify
    commits the step carries: they write candidate snapshots the scheduler published already); it is only read by
    ``load_host`` into request slots. Both are copies in stream order, so a row is read only after the offload that
    filled it.

Layout: one ``(num_slots + 1 + num_snapshots, bytes_per_entry)`` uint8 tensor, ``rows``: row ``e`` is entry ``e``,
every recurrent layer's state of one request (``specs.entry_layout`` places the tensors in it). Per recurrent layer
``i``, one view per ``StateTensorSpec`` the layer declared (``hyserve.cache.specs``), ``(num_slots + 1 +
num_snapshots, *spec.shape)`` in the spec's dtype and memory order, its entries ``bytes_per_entry`` apart;
``layers[i][name]``. Every kernel takes the views' strides. The pool never interprets a tensor: copy and reset act
on whole rows, one operation for every tensor of every layer (a snapshot or a prefix hit is one row copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hyserve.cache.specs import RecurrentStateSpec, entry_layout, recurrent_bytes
from hyserve.utils import device_tensor

if TYPE_CHECKING:
    from hyserve.config import ModelConfig


def state_bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one pool entry of the model ``cfg`` describes (the state specs its layers declare)."""
    from hyserve.model.registry import cache_specs_for  # the model layer sits above the cache

    return recurrent_bytes(cache_specs_for(cfg, dtype).recurrent)


class StatePool:
    def __init__(self, specs: Sequence[RecurrentStateSpec], num_slots: int, device: torch.device,
                 num_snapshots: int = 0, num_host_snapshots: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"the recurrent state pool needs at least 1 slot (got {num_slots})")
        self.num_slots = num_slots
        self.pad_slot = num_slots
        self.num_snapshots = num_snapshots
        self.specs = tuple(specs)
        offsets, self.bytes_per_entry = entry_layout(self.specs)
        total = num_slots + 1 + num_snapshots
        # One row of bytes per entry holds every layer's tensors (entry_layout); the layers' tensors are views.
        self.rows = torch.zeros(total, self.bytes_per_entry, dtype=torch.uint8, device=device)
        self.layers: list[dict[str, torch.Tensor]] = [
            {t.name: t.carve(self.rows, offsets[i][t.name]) for t in spec.tensors} for i, spec in enumerate(self.specs)]
        # Copies and fills move the rows as the widest words that divide them (a stage without recurrent layers has
        # empty rows: nothing to move).
        word = next(d for d in (torch.int64, torch.int32, torch.int16, torch.uint8)
                    if self.bytes_per_entry % d.itemsize == 0)
        self._words = self.rows.view(word) if self.bytes_per_entry else self.rows
        # Pinned on CUDA: copies to and from it are asynchronous, in stream order with the step's kernels.
        self.num_host_snapshots = num_host_snapshots if self.bytes_per_entry else 0
        try:
            self.host_rows = torch.empty(self.num_host_snapshots, self.bytes_per_entry, dtype=torch.uint8,
                                         pin_memory=device.type == "cuda" and self.num_host_snapshots > 0)
        except RuntimeError as e:
            gib = self.num_host_snapshots * self.bytes_per_entry / 2**30
            raise RuntimeError(f"the prefix cache's host tier could not take {gib:.1f} GiB of pinned host memory "
                               f"({e}); lower --snapshot-host-memory-gb (0 turns it off)") from e

    def tensors(self, name: str) -> list[torch.Tensor]:
        """Tensor ``name`` of every layer that declares one, in layer order."""
        return [layer[name] for layer in self.layers if name in layer]

    def __getattr__(self, attr: str) -> list[torch.Tensor]:
        # ``pool.<name>s``: the per-layer list of tensor ``<name>`` (``tensors``), for callers that index by name.
        layers = self.__dict__.get("layers")
        if layers is not None and attr.endswith("s") and any(attr[:-1] in layer for layer in layers):
            return self.tensors(attr[:-1])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {attr!r}")

    def snapshot_entry(self, i: int) -> int:
        """Pool entry of snapshot ``i`` (0 <= i < num_snapshots)."""
        return self.num_slots + 1 + i

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Copy whole states entry to entry (every tensor of every recurrent layer: one row each), in stream order;
        every source is read before any destination is written."""
        if not src or not self.bytes_per_entry:
            return
        device = self.rows.device
        s = device_tensor(src, device, torch.long)
        d = device_tensor(dst, device, torch.long)
        self._words.index_copy_(0, d, self._words.index_select(0, s))

    def offload(self, moves: list[tuple[int, int]]) -> None:
        """Copy snapshot entries to host rows, (entry, host row) in order (a later move to the same host row wins)."""
        if not self.num_host_snapshots:
            return
        for entry, host in moves:
            self.host_rows[host].copy_(self.rows[entry], non_blocking=True)

    def load_host(self, loads: list[tuple[int, int]]) -> None:
        """Copy host rows into entries (request slots), (host row, entry) pairs."""
        if not self.num_host_snapshots:  # a stage without recurrent layers: nothing to copy
            return
        for host, entry in loads:
            self.rows[entry].copy_(self.host_rows[host], non_blocking=True)

    def reset(self, slots: list[int]) -> None:
        """Zero the state of ``slots`` (requests about to consume their first token)."""
        if not slots or not self.bytes_per_entry:
            return
        self._words.index_fill_(0, device_tensor(slots, self.rows.device, torch.long), 0)
