"""Recurrent state of the Gated DeltaNet layers, owned by request slots.

This module is where the state-ownership invariants live (DESIGN.md section 2):

1. Slot, not row. A request is given a slot at admission and keeps it until it finishes, is aborted or is preempted.
   Every kernel reads and writes state through the per-row ``state_slots`` of the step's metadata; nothing infers a
   slot from a row's position in the batch. Slots are handed out from the top of the pool down, and freed slots are
   reused last-in first-out, so ``row == slot`` is the exception, never an accident that hides a bug.
2. A slot's state is exactly the state after the request's ``num_computed_tokens`` tokens: zeroed before the first
   chunk of a fresh request (``reset``), advanced only by that request's own verified tokens.
3. Entry ``pad_slot`` (= num_slots) belongs to nobody: padded rows of a captured graph read and write it, and
   nothing ever reads it back.
4. Entries after it are prefix-cache snapshots (``snapshot_entry(i)``), owned by ``prefix_cache.PrefixCache``. A
   snapshot is only ever written by one copy from a request slot, right after the step that brought that slot to
   the snapshot's position, and only read by copies into request slots; no kernel addresses it.

Layouts: ``conv_states[i]`` is (num_slots + 1 + num_snapshots, conv_dim, K - 1) in the model dtype, oldest input
first; ``ssm_states[i]`` is (num_slots + 1 + num_snapshots, Hv, Dk, Dv) in float32, for the i-th GDN layer.
"""

from __future__ import annotations

import torch

from hyserve.config import ModelConfig


def state_bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype) -> int:
    n_gdn = len(cfg.linear_layer_ids)
    conv = cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * torch.finfo(dtype).bits // 8
    ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return n_gdn * (conv + ssm)


class StatePool:
    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device,
                 num_snapshots: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"the recurrent state pool needs at least 1 slot (got {num_slots})")
        self.num_slots = num_slots
        self.pad_slot = num_slots
        self.num_snapshots = num_snapshots
        self.bytes_per_entry = state_bytes_per_slot(cfg, dtype)
        n_gdn = len(cfg.linear_layer_ids)
        k = cfg.linear_conv_kernel_dim
        total = num_slots + 1 + num_snapshots
        self.conv_states = [torch.zeros(total, cfg.conv_dim, k - 1, dtype=dtype, device=device)
                            for _ in range(n_gdn)]
        self.ssm_states = [
            torch.zeros(total, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                        dtype=torch.float32, device=device)
            for _ in range(n_gdn)
        ]
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

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Copy whole states entry to entry (every GDN layer's conv window and SSM state), in stream order."""
        if not src:
            return
        device = self.conv_states[0].device if self.conv_states else torch.device("cpu")
        s = torch.tensor(src, dtype=torch.long, device=device)
        d = torch.tensor(dst, dtype=torch.long, device=device)
        for conv, ssm in zip(self.conv_states, self.ssm_states, strict=True):
            conv.index_copy_(0, d, conv.index_select(0, s))
            ssm.index_copy_(0, d, ssm.index_select(0, s))

    def reset(self, slots: list[int]) -> None:
        """Zero the state of ``slots`` (requests about to consume their first token)."""
        if not slots:
            return
        device = self.conv_states[0].device if self.conv_states else torch.device("cpu")
        idx = torch.tensor(slots, dtype=torch.long, device=device)
        for conv, ssm in zip(self.conv_states, self.ssm_states, strict=True):
            conv.index_fill_(0, idx, 0)
            ssm.index_fill_(0, idx, 0)
