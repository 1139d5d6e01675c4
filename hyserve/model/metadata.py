"""Per-step metadata that the model's layers read.

One step runs R rows (requests) whose new tokens are concatenated into T tokens (the "varlen" layout):

    tokens:   | row 0: n_0 tokens | row 1: n_1 tokens | ... |
    query_start_loc = [0, n_0, n_0 + n_1, ..., T]

Every tensor here is a view into a persistent device buffer owned by the model runner (docs/design.md invariant 7:
a captured graph reads these buffers, refilled each step, never a per-step temporary). Recurrent state is addressed
through ``state_slots[r]``, the slot the scheduler assigned to row r's request at admission; nothing infers a slot from
a row's position (invariant 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class VerifyMetadata:
    """Speculative decoding: the first ``num_rows`` rows (``num_tokens`` tokens) are verify rows, [last token +
    drafts]. Their recurrent layers only read the live state and write per-position candidates into scratch (invariant
    2); the remaining rows ("rest": prefill chunks) update their slots as usual."""

    num_rows: int
    num_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # (Rv+1,) int32
    state_slots: torch.Tensor  # (Rv,)
    rest_query_start_loc: torch.Tensor  # (R-Rv+1,) int32, offsets relative to token num_tokens
    rest_state_slots: torch.Tensor  # (R-Rv,)
    rest_max_query_len: int
    # The host's copy of rest_query_start_loc (prefill kernels read it instead of waiting for the device); None in
    # captured graphs.
    rest_query_start_loc_cpu: torch.Tensor | None = None


@dataclass(slots=True)
class StepMetadata:
    positions: torch.Tensor  # (T,) int64 absolute position of each token
    query_start_loc: torch.Tensor  # (R+1,) int32 row offsets into the T tokens
    seq_lens: torch.Tensor  # (R,) int32 context length of each row after this step
    state_slots: torch.Tensor  # (R,) int64 recurrent-state slot of each row
    block_tables: torch.Tensor  # (R, max_blocks) int32 KV block ids of each row
    slot_mapping: torch.Tensor  # (T,) int64 flat KV cache slot of each token (-1: skip)
    max_query_len: int  # host copies so that kernels need no device->host sync
    max_seq_len: int
    verify: VerifyMetadata | None = None
    # The host's copy of query_start_loc (prefill kernels read it instead of waiting for the device; valid while the
    # step is being enqueued); None in captured graphs.
    query_start_loc_cpu: torch.Tensor | None = None
    # Image input (eager steps only): the (3, T) M-RoPE positions of a step with a chunk before a prompt's last
    # image ends (the rotary reads them instead of ``positions``), and (token indices, embeddings) of the image
    # placeholder tokens this step feeds (they replace the placeholders' token embeddings).
    mrope_positions: torch.Tensor | None = None
    image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def rotary_positions(self) -> torch.Tensor:
        """What the rotary embedding reads: the (3, T) M-RoPE positions where the step has them, else ``positions``."""
        return self.mrope_positions if self.mrope_positions is not None else self.positions

    @property
    def num_rows(self) -> int:
        return int(self.state_slots.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])
