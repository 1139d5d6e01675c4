"""The flat varlen layout every kernel of :mod:`hyserve.kernels` takes, and the row helpers its references share.

* A step's tokens from ``R`` rows (requests) are concatenated: ``T`` tokens in all.
* ``query_start_loc`` (``qsl``) is an int tensor of shape ``(R + 1,)``, non-decreasing, ``qsl[0] == 0`` and
  ``qsl[R] == T``: row ``r`` owns tokens ``[qsl[r], qsl[r + 1])``. A row may be empty (padding).
* Recurrent state lives in pools indexed by *slot*, never by row: ``state_slots[r]`` is the slot that row ``r``
  reads and writes. Slots of non-empty rows must be distinct. Empty rows never write their slot (whatever it is),
  and pool entries whose slot no non-empty row names are left bit-identical.
* ``max_query_len`` / ``max_seq_len`` are host ints supplied by the caller (upper bounds, so that no device-to-host
  synchronisation is needed to size loops or padded tensors).

The plain-torch references (each op's ``reference.py``: the CPU path and the yardstick for the fast paths) do all
arithmetic in float32 and return outputs in the model dtype given by the documented input. They are written for
clarity and vectorised across rows; they need no GPU and no Triton.

Cost follows tokens. A step may mix one long prefill chunk with many one-token decode rows; padding every row to the
longest (rows x chunk x context attention scores, rows x chunk recurrent steps) made such a step cost, in memory and
time, rows times what its tokens cost. So the attention and the gated delta rule references group rows by query
length (:func:`length_groups`: a power of two bucket, so padding within a group at most doubles its work), pad each
group only to its own bounds, and the attention tiles its queries so that a score tensor stays under
``ATTENTION_SCORE_ELEMENTS``. Grouping reads the row lengths on the host (free on the CPU, the path these run on in
production; a sync on CUDA, where they are yardsticks).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from hyserve.utils import host_to_device

__all__ = ["ChunkedRows", "group_tokens", "length_groups", "nonempty_rows", "row_index"]


def row_index(query_start_loc: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token row id and position within its row, computed on device without a host sync.

    Returns ``(rows, pos)`` (both int64, shape ``(num_tokens,)``) with ``qsl[rows[t]] <= t < qsl[rows[t] + 1]`` and
    ``pos[t] = t - qsl[rows[t]]``. Empty rows own no token, so they never appear in ``rows``.
    """
    qsl = query_start_loc.to(torch.int64)
    t = torch.arange(num_tokens, device=qsl.device, dtype=torch.int64)
    rows = torch.searchsorted(qsl[1:], t, right=True)
    pos = t - qsl[rows]
    return rows, pos


def length_groups(query_start_loc: torch.Tensor) -> list[list[int]]:
    """The non-empty rows grouped by query length (same power-of-two bucket), each group in row order."""
    qsl = query_start_loc.tolist()
    groups: defaultdict[int, list[int]] = defaultdict(list)
    for r in range(len(qsl) - 1):
        n = qsl[r + 1] - qsl[r]
        if n > 0:
            groups[(n - 1).bit_length()].append(r)
    return [groups[b] for b in sorted(groups)]


def group_tokens(qsl: list[int], rows: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token indices of ``rows`` (in row order) and their own query_start_loc over those tokens."""
    idx: list[int] = []
    sub = [0]
    for r in rows:
        idx.extend(range(qsl[r], qsl[r + 1]))
        sub.append(len(idx))
    return (torch.tensor(idx, dtype=torch.int64, device=device),
            torch.tensor(sub, dtype=torch.int64, device=device))


def nonempty_rows(state_slots: torch.Tensor, query_start_loc: torch.Tensor, query_start_loc_cpu: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The rows with tokens, as a chunked kernel over ``cu_seqlens`` takes them (fla's): their slots (int64, on the
    device), their offsets ``cu_seqlens`` (int64, on the device) and the host's copy of those offsets (None without
    ``query_start_loc_cpu``). Given the host's copy nothing waits for the device; without it, picking the rows does."""
    slots = state_slots.to(torch.int64)
    if query_start_loc_cpu is None:
        qsl = query_start_loc.to(torch.int64)
        keep = torch.nonzero(qsl[1:] > qsl[:-1]).squeeze(1)  # host sync
        return slots[keep], torch.cat([qsl[:1], qsl[1:][keep]]), None
    qsl_cpu = query_start_loc_cpu.to(torch.int64)
    nonempty = qsl_cpu[1:] > qsl_cpu[:-1]
    if bool(nonempty.all()):
        return slots, query_start_loc.to(torch.int64), qsl_cpu
    keep_cpu = torch.nonzero(nonempty).squeeze(1)
    qsl_cpu = torch.cat([qsl_cpu[:1], qsl_cpu[1:][keep_cpu]])
    device = query_start_loc.device
    # Through pinned memory: a copy from pageable memory waits for the stream to drain.
    return slots[host_to_device(keep_cpu, device)], host_to_device(qsl_cpu, device), qsl_cpu


@dataclass(slots=True)
class ChunkedRows:
    """A step's rows as its chunked (prefill) kernels take them, worked out once a step and shared by every
    recurrent layer: the non-empty rows' slots and their offsets ``cu_seqlens`` on the device and on the host (see
    :func:`nonempty_rows`). The same tensor objects reach every layer, so fla-core's memo of what it derives from
    them (its chunk indices and offsets, kept by the arguments' identity) serves every layer after the first, where
    fresh offsets a layer made its work (host work, small launches and a copy to the device) again. Built per step
    (``StepMetadata``), never reused across steps, whose rows differ."""

    slots: torch.Tensor  # (N,) int64, device
    cu_seqlens: torch.Tensor  # (N + 1,) int64, device
    cu_seqlens_cpu: torch.Tensor | None  # (N + 1,) int64, host
    _chunk_indices: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, state_slots: torch.Tensor, query_start_loc: torch.Tensor,
           query_start_loc_cpu: torch.Tensor | None) -> ChunkedRows:
        return cls(*nonempty_rows(state_slots, query_start_loc, query_start_loc_cpu))

    def chunk_indices(self, chunk: int) -> torch.Tensor | None:
        """The rows' chunks of ``chunk`` tokens as fla-core's ``prepare_chunk_indices`` lays them out (``(NT, 2)``
        int64 on the device: row ``n``'s chunk ``j`` as ``[n, j]``, rows in order), made once from the host's offsets
        and copied through pinned memory, so no layer waits for the device (fla's own, given the host's offsets,
        copies them from pageable memory: a wait for the stream to drain, per call); None without the host's
        offsets."""
        if self.cu_seqlens_cpu is None:
            return None
        got = self._chunk_indices.get(chunk)
        if got is None:
            lens = self.cu_seqlens_cpu[1:] - self.cu_seqlens_cpu[:-1]
            counts = (lens + chunk - 1) // chunk
            seg = torch.repeat_interleave(torch.arange(counts.numel(), dtype=torch.int64), counts)
            first = torch.cumsum(counts, 0) - counts  # each row's first chunk among all
            intra = torch.arange(seg.numel(), dtype=torch.int64) - first[seg]
            got = host_to_device(torch.stack([seg, intra], 1), self.cu_seqlens.device)
            self._chunk_indices[chunk] = got
        return got

    def num_chunks(self, chunk: int) -> int | None:
        """The rows' chunks of ``chunk`` tokens in all (``sum(ceil(len / chunk))``): the chunk indices' length, known
        on the host (None without the host's offsets)."""
        indices = self.chunk_indices(chunk)
        return None if indices is None else int(indices.shape[0])
