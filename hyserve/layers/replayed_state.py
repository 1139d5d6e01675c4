"""A recurrent layer whose verify step keeps each position's inputs to its SSM update instead of the candidate state
(the state is megabytes a request): Gated DeltaNet (``hyserve.kernels.gdn.verify``) and Mamba2
(``hyserve.kernels.mamba2.verify``). Its verify scratch holds the candidate conv window (``conv_state``, small) and
the stash; the commit copies the accepted window and replays the accepted positions into the slot, a candidate
snapshot copies the window and replays into the entry, before the commit (it reads the slot's state from before the
step). The layer supplies ``replay_state``: the window's copy and the replay, one launch on CUDA
(``gdn_replay`` / ``mamba2_replay`` with ``conv=``).
"""

from __future__ import annotations

import torch

from hyserve.model.base import RecurrentLayer


class ReplayedStateLayer(RecurrentLayer):
    """``commit_verified`` and ``snapshot_candidates`` of a layer with a ``conv_state`` kept as candidates and an
    ``ssm_state`` rebuilt by ``replay_state``."""

    def replay_state(self, rows: torch.Tensor | None, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                     counts: torch.Tensor) -> None:
        """Entry ``i`` with ``c = counts[i] >= 0``: ``conv_state[dst_slots[i]]`` = the candidate window after stash
        row ``rows[i]``'s (None: row ``i``'s) position ``c``, and ``ssm_state[dst_slots[i]]`` = the state of
        ``src_slots[i]`` advanced over that row's positions ``0 .. c``; entries with ``c < 0`` do nothing."""
        raise NotImplementedError

    def commit_verified(self, state_slots: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """The conv window's candidate copied; the SSM state advanced in its slot over the accepted positions."""
        self.replay_state(None, state_slots, state_slots, num_accepted)

    def snapshot_candidates(self, rows: torch.Tensor, positions: torch.Tensor, entries: torch.Tensor,
                            state_slots: torch.Tensor) -> None:
        """The conv window's candidate copied; the SSM state of the row's slot advanced into the entry over the
        positions up to ``positions[i]`` (before the commit, which advances the slot itself)."""
        self.replay_state(rows, state_slots.index_select(0, rows), entries, positions)
