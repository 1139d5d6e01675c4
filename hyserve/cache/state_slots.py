"""Which recurrent-state entry belongs to whom: the scheduler's side of the state pool (ints only).

The worker holds the tensors (``state_pool.StatePool``); the scheduler hands out and takes back their entries here
and sends the worker entry numbers. Entries, as ``StatePool`` lays them out (docs/design.md invariants 1, 11, 12):

    | request slots 0 .. num_slots-1 | pad slot (= num_slots) | snapshots 0 .. num_snapshots-1 |

Slots are handed out from the top down and freed slots are reused last-in first-out, so ``row == slot`` is the
exception, never an accident that hides a bug (invariant 1).
"""

from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int, num_snapshots: int = 0, bytes_per_entry: int = 0,
                 has_state: bool = True) -> None:
        if num_slots < 1:
            raise ValueError(f"the recurrent state pool needs at least 1 slot (got {num_slots})")
        self.num_slots = num_slots
        self.pad_slot = num_slots
        self.num_snapshots = num_snapshots
        self.bytes_per_entry = bytes_per_entry
        self.has_state = has_state  # False: the model has no recurrent layer (slots are bookkeeping only)
        self._free: list[int] = list(range(num_slots))  # popped from the end: highest slot first
        self._in_use: set[int] = set()

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("recurrent state pool out of slots")
        slot = self._free.pop()
        self._in_use.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._in_use:
            raise RuntimeError(f"double free of state slot {slot}")
        self._in_use.remove(slot)
        self._free.append(slot)

    def snapshot_entry(self, i: int) -> int:
        """Pool entry of snapshot ``i`` (0 <= i < num_snapshots)."""
        return self.num_slots + 1 + i
