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

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hyserve.kernels.varlen import ChunkedRows
from hyserve.utils import device_tensor

if TYPE_CHECKING:
    from hyserve.kernels.attention.sdpa import RowPlan


@dataclass(slots=True)
class VerifyMetadata:
    """Speculative decoding: the first ``num_rows`` rows (``num_tokens`` tokens) are verify rows, [last token +
    drafts]. Their recurrent layers only read the live state and write per position, into scratch, the candidate or
    what it is rebuilt from (invariant 2); the remaining rows ("rest": prefill chunks) update their slots as usual."""

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
    # The rest rows as the chunked kernels take them, once for every layer (steps whose rest rows hold a prefill
    # chunk; None: each layer works them out).
    rest_chunked_rows: ChunkedRows | None = None


@dataclass(slots=True)
class SnapshotTails:
    """The tokens a snapshot inside a row is advanced over from the nearest state a chunked kernel kept (see
    ``RowSnapshots.tails``): snapshot i's tokens are ``tokens[query_start_loc[i] : query_start_loc[i + 1]]``."""

    tokens: torch.Tensor  # (m,) int64 indices into the prefill rows' tokens
    query_start_loc: torch.Tensor  # (n + 1,) int32
    max_len: int
    # Per snapshot, the index of its starting state among a chunked kernel's per-chunk states (fla's ``h``: the
    # rows' chunks back to back, chunk j of a row holding the state before its token j * chunk).
    chunk_index: torch.Tensor  # (n,) int64


@dataclass(slots=True)
class ConvWindowIndex:
    """Where each snapshot's conv window of ``w`` inputs comes from (see ``snapshot_conv_windows``), the same for
    every recurrent layer of a step: built once per step and window width (``RowSnapshots.conv_windows``)."""

    x_rows: torch.Tensor  # (n * w,) int64 the step's token each window input would come from (clamped at 0)
    old_cols: torch.Tensor  # (n, 1, w) int64 the column of the slot's window before the row it would come from
    take_x: torch.Tensor  # (n, 1, w) bool: the input is the row's own (else the slot's window before the row)

    @staticmethod
    def of(ends: torch.Tensor, offsets: torch.Tensor, w: int) -> ConvWindowIndex:
        j = torch.arange(w, device=ends.device)
        rel = offsets[:, None] - w + j  # (n, w) each input's position relative to the row's first token
        return ConvWindowIndex((ends[:, None] - w + j).clamp(min=0).flatten(), (rel + w).clamp(max=w - 1)[:, None, :],
                               (rel >= 0)[:, None, :])


@dataclass(slots=True)
class RowSnapshots:
    """Prefix-cache snapshots taken inside prefill rows (docs/design.md invariant 12): snapshot i is the state of
    prefill row ``rows[i]`` after its first ``offsets[i]`` tokens (0 < offset < the row's length), written by every
    recurrent layer into pool entry ``entries[i]`` during its forward: the conv window of the ``K - 1`` inputs
    before that position (part from the slot's window before the row where the offset is short) and the SSM state
    there. Rows and token indices count the step's prefill rows only (the rows after its verify rows, those whose
    state is advanced in place). The row's own slot still ends at the row's end."""

    rows: list[int]
    offsets: list[int]
    row_lens: list[int]  # every prefill row's token count (the chunk layout of a chunked kernel)
    entries: torch.Tensor  # (n,) int64 pool entries
    slots: torch.Tensor  # (n,) int64 the row's state slot
    ends: torch.Tensor  # (n,) int64 index of the row's token at ``offset`` (one past the snapshot's last token)
    offsets_t: torch.Tensor  # (n,) int64 ``offsets`` on the device
    _tails: dict[int, SnapshotTails] = field(default_factory=dict)
    _windows: dict[int, ConvWindowIndex] = field(default_factory=dict)
    _numbered: torch.Tensor | None = None

    @staticmethod
    def build(rows: list[int], offsets: list[int], entries: list[int], slots: list[int], row_lens: list[int],
              device: torch.device) -> RowSnapshots:
        starts = [0]
        for n in row_lens:
            starts.append(starts[-1] + n)
        assert all(0 < o < row_lens[r] for r, o in zip(rows, offsets, strict=True)), "a snapshot not inside its row"
        packed = device_tensor([*entries, *slots, *[starts[r] + o for r, o in zip(rows, offsets, strict=True)],
                                *offsets], device, torch.long).view(4, -1)
        return RowSnapshots(rows, offsets, row_lens, packed[0], packed[1], packed[2], packed[3])

    @property
    def num(self) -> int:
        return len(self.rows)

    @property
    def numbered(self) -> torch.Tensor:
        """``arange(num)`` on the device, built once per step (the snapshots' own rows of a kernel over their
        states)."""
        if self._numbered is None:
            self._numbered = torch.arange(self.num, device=self.entries.device)
        return self._numbered

    def conv_windows(self, w: int) -> ConvWindowIndex:
        """The gather indices of the snapshots' conv windows of ``w`` inputs, built once per step and width: every
        recurrent layer of the step takes the same (a few small launches each, 48 times in a 27B prompt step)."""
        got = self._windows.get(w)
        if got is None:
            got = self._windows[w] = ConvWindowIndex.of(self.ends, self.offsets_t, w)
        return got

    def tails(self, chunk: int) -> SnapshotTails:
        """Where each snapshot's state is advanced from when a kernel kept the states at every ``chunk`` tokens of
        each row (chunk 0: only the row's starting state): the tokens from the last such boundary up to the
        snapshot's position (none when the position is on a boundary). Built once per step and chunk size."""
        got = self._tails.get(chunk)
        if got is not None:
            return got
        starts, chunk_base = [0], [0]
        for n in self.row_lens:
            starts.append(starts[-1] + n)
            chunk_base.append(chunk_base[-1] + ((-(-n // chunk)) if chunk and n else 0))
        tokens: list[int] = []
        qsl, index = [0], []
        for r, o in zip(self.rows, self.offsets, strict=True):
            base = (o // chunk) * chunk if chunk else 0
            tokens.extend(range(starts[r] + base, starts[r] + o))
            qsl.append(len(tokens))
            index.append(chunk_base[r] + (o // chunk if chunk else 0))
        device = self.entries.device
        got = SnapshotTails(device_tensor(tokens, device, torch.long), device_tensor(qsl, device, torch.int32),
                            max((b - a for a, b in itertools.pairwise(qsl)), default=0),
                            device_tensor(index, device, torch.long))
        self._tails[chunk] = got
        return got


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
    # The host's copy of seq_lens, alike (the attention layers split a step's rows by length with both).
    seq_lens_cpu: torch.Tensor | None = None
    # Image input (eager steps only): the (3, T) M-RoPE positions of a step with a chunk before a prompt's last
    # image ends (the rotary reads them instead of ``positions``), and (token indices, embeddings) of the image
    # placeholder tokens this step feeds (they replace the placeholders' token embeddings).
    mrope_positions: torch.Tensor | None = None
    image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # Prefix-cache snapshots inside this step's prefill rows (eager steps only; None: none).
    row_snapshots: RowSnapshots | None = None
    # How the attention layers split this step's rows between SDPA and the paged kernels (eager steps with long
    # rows), by (query heads to a KV head, SDPA's threshold): worked out by the step's first attention layer.
    attention_plans: dict[tuple[int, int], RowPlan] = field(default_factory=dict)
    # The rows as the chunked (prefill) kernels take them, worked out once for every recurrent layer (eager steps
    # with a prefill chunk and no verify rows; None: each layer works them out).
    chunked_rows: ChunkedRows | None = None

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
