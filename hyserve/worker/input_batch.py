"""The step's persistent input buffers, and the scheduled rows laid out in them.

Per-step host work is a fill of preallocated host arrays and one copy per buffer to the device. The device buffers
(input ids, positions, row offsets, context lengths, state slots, block tables, KV slot mapping) are allocated once at
their maximum size and a step uses a prefix of each (docs/design.md invariant 7), so a CUDA graph captured over
them stays valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hyserve.cache.block_pool import BlockPool, cdiv
from hyserve.kernels.varlen import ChunkedRows
from hyserve.model.metadata import RowSnapshots, StepMetadata, VerifyMetadata
from hyserve.scheduler.output import PREVIOUS_DRAFT, PREVIOUS_SAMPLED, ScheduledRow
from hyserve.worker.mm_inputs import ImageRow, MMInputs


def fill_pad_rows(nb: dict[str, np.ndarray], copies: dict[str, int], t: int, r: int, pad_to: int, q: int,
                  pad_slot: int, block_size: int) -> None:
    """Rows ``[r, pad_to)`` become pad rows of ``q`` tokens from token ``t``: positions 0.., KV writes skipped,
    the null block for attention, the pad slot for recurrent state (``cuda_graphs``); ``copies`` grows to cover
    them."""
    n = pad_to - r
    nb["input_ids"][t : t + n * q] = 0
    nb["positions"][t : t + n * q] = np.tile(np.arange(q), n)
    nb["slot_mapping"][t : t + n * q] = -1
    nb["query_start_loc"][r + 1 : pad_to + 1] = t + q * np.arange(1, n + 1)
    nb["seq_lens"][r:pad_to] = q
    if "state_slots" in nb:
        nb["state_slots"][r:pad_to] = pad_slot
    nb["block_tables"][r:pad_to, : cdiv(q, block_size)] = BlockPool.NULL_BLOCK
    for name in ("input_ids", "positions", "slot_mapping"):
        copies[name] = t + n * q
    for name in ("seq_lens", "state_slots", "block_tables"):
        if name in copies:
            copies[name] = pad_to
    copies["query_start_loc"] = pad_to + 1


@dataclass(slots=True)
class FilledStep:
    """What ``InputBatch.fill`` laid out: views of the device buffers (a step's prefix of each), the figures of its
    metadata, and the inputs only the device can complete."""

    views: dict[str, torch.Tensor]
    num_rows: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    num_verify: int
    num_verify_tokens: int
    max_query_len_verify: int
    rest_max_query_len: int
    padded: bool
    prev: list[tuple[int, int]] = field(default_factory=list)  # (token index, previous step's row): PREVIOUS_SAMPLED
    draft_at: list[int] = field(default_factory=list)  # token index of every verify row's drafts, in row order
    drafts_fed: list[tuple[int, int]] = field(default_factory=list)  # (token index, flat draft_slots index)
    mm_rows: list[ImageRow] = field(default_factory=list)
    # (row, first token, slot, tokens): rows whose start is on the device
    behind: list[tuple[int, int, int, int]] = field(default_factory=list)
    # Snapshots inside prefill rows: (prefill row, i.e. row index after the verify rows, offset, entry, slot).
    row_snaps: list[tuple[int, int, int, int]] = field(default_factory=list)


class InputBatch:
    """The persistent host and device buffers of a step (``host_bufs``, ``dev_bufs``; ``np_bufs`` are numpy views
    of the host ones), the last step's sampled ids kept on the device, and the last prepared step's metadata."""

    def __init__(self, device: torch.device, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 block_size: int, num_speculative_tokens: int, pad_slot: int) -> None:
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        self.pad_slot = pad_slot
        t, r = max_num_batched_tokens, max_num_seqs
        self.max_blocks_per_seq = cdiv(max_model_len, block_size)
        names = {
            "input_ids": ((t,), torch.long), "positions": ((t,), torch.long), "slot_mapping": ((t,), torch.long),
            "query_start_loc": ((r + 1,), torch.int32), "seq_lens": ((r,), torch.int32),
            "state_slots": ((r,), torch.long), "block_tables": ((r, self.max_blocks_per_seq), torch.int32),
            "logits_indices": ((t,), torch.long), "rest_query_start_loc": ((r + 1,), torch.int32),
            "num_accepted": ((r,), torch.long), "prev_at": ((r,), torch.long), "prev_src": ((r,), torch.long),
            "verify_starts": ((r,), torch.long),  # each verify row's start (behind rows': set on the device)
            # the snapshot graph's inputs: verify rows, candidate positions, entries (one row each: contiguous)
            "snap": ((3, r), torch.long),
            "behind": ((r,), torch.long),  # 1: the verify row's start is on the device (the behind graph's input)
            "draft_count": ((r,), torch.long),  # the accept graph's input: each verify row's number of drafts
        }
        self.host_bufs = {k: self.host(s, d) for k, (s, d) in names.items()}
        self.dev_bufs = {k: self.dev(s, d) for k, (s, d) in names.items()}
        self.np_bufs = {k: v.numpy() for k, v in self.host_bufs.items()}
        self._h2d_fence: torch.cuda.Event | None = None  # recorded after a step's copies out of host_bufs
        self.last_meta: StepMetadata | None = None
        self.verify_graph_size: int | None = None  # the padded size of the last step's verify graph, if it ran
        self.verify_graph_q = num_speculative_tokens + 1  # and its tokens per row (k_step + 1)
        # The last step's sampled ids on the device, and each sampling request's row among them.
        self.prev_sampled: torch.Tensor | None = None
        self.prev_rows: dict[str, int] = {}

    def host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host buffer (pinned on CUDA: its copies to the device are asynchronous)."""
        return torch.zeros(shape, dtype=dtype, pin_memory=self.device.type == "cuda")

    def dev(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def fill(self, rows: list[ScheduledRow], pad_to: int | None, pad_len: int, row_len: int | None,
             mm: MMInputs) -> FilledStep:
        """Fill the host buffers for ``rows`` (plus pad rows) and copy them to the device (see
        ``ModelRunner.prepare``, which completes the step's inputs on the device)."""
        if self._h2d_fence is not None:
            # The pinned host buffers are one set: the previous step's copies out of them must have run before they
            # are written again (with steps in flight nothing else orders the two; the wait is almost always over).
            self._h2d_fence.synchronize()
        nb = self.np_bufs
        nb["query_start_loc"][0] = 0
        step = FilledStep({}, len(rows), 0, 0, 0, 0, 0, 0, 0, pad_to is not None)
        n_sample = self._fill_rows(rows, row_len, mm, step)
        t, r, num_verify = step.num_tokens, len(rows), step.num_verify
        rest = r - num_verify
        if num_verify:
            nb["rest_query_start_loc"][: rest + 1] = nb["query_start_loc"][num_verify : r + 1] - step.num_verify_tokens
            step.rest_max_query_len = max((row.num_new_tokens for row in rows[num_verify:]), default=0)
        sizes = {"input_ids": t, "positions": t, "slot_mapping": t, "query_start_loc": r + 1, "seq_lens": r,
                 "state_slots": r, "block_tables": r, "logits_indices": n_sample,
                 "rest_query_start_loc": rest + 1 if num_verify else 0, "verify_starts": num_verify,
                 "behind": num_verify, "draft_count": num_verify}
        copies = dict(sizes)
        if pad_to is not None and pad_to > r:
            assert num_verify in (0, r), "a padded step has verify rows only, or none"
            fill_pad_rows(nb, copies, t, r, pad_to, pad_len, self.pad_slot, self.block_size)
            if num_verify:
                nb["behind"][r:pad_to] = 0
                nb["draft_count"][r:pad_to] = 0
                copies["behind"] = copies["draft_count"] = pad_to
        for name, size in sizes.items():
            if copies[name]:  # (an empty copy launches nothing on CUDA either)
                self.dev_bufs[name][: copies[name]].copy_(self.host_bufs[name][: copies[name]], non_blocking=True)
            step.views[name] = self.dev_bufs[name][:size]
        return step

    def _fill_rows(self, rows: list[ScheduledRow], row_len: int | None, mm_inputs: MMInputs,
                   step: FilledStep) -> int:
        """The host side of every row (verify rows first); returns the number of logits rows."""
        nb = self.np_bufs
        bs = self.block_size
        t = n_sample = max_q = max_s = 0
        for i, row in enumerate(rows):
            n, start, end = row.num_new_tokens, row.start, row.end
            mm = mm_inputs.get(row.req_id)
            # A prompt with images: a 1-D position past its last image is the index + rope_delta (the KV slot stays
            # the index); a chunk before that end takes three-axis positions (``MMInputs.image_inputs``).
            shift = 0
            if mm is not None:
                shift = mm.position_shift(start)
                if mm.needs_axes(start):
                    step.mm_rows.append((t, start, n, mm))
            ids = row.token_ids
            if row.is_verify:
                assert i == step.num_verify, "verify rows must come first"
                nb["verify_starts"][i] = start
                nb["behind"][i] = row.start_on_device
                nb["draft_count"][i] = n - 1
                if row.start_on_device:  # its start-dependent inputs are set on the device (``Verifier``)
                    assert mm is None and n <= self.num_speculative_tokens + 1, "a row behind one has k_step drafts"
                    step.behind.append((i, t, row.state_slot, n))
                nb["input_ids"][t : t + n] = ids
                step.draft_at.extend(range(t + 1, t + n))
                if PREVIOUS_DRAFT in ids:
                    k = self.num_speculative_tokens
                    step.drafts_fed.extend((t + j, row.state_slot * k + j - 1) for j in range(1, n)
                                           if ids[j] == PREVIOUS_DRAFT)
                nb["logits_indices"][n_sample : n_sample + n] = np.arange(t, t + n)
                n_sample += n
                step.num_verify += 1
                step.num_verify_tokens += n if row_len is None else row_len
                step.max_query_len_verify = max(step.max_query_len_verify, n if row_len is None else row_len)
            elif n == 1:  # decode: scalar writes (per-row numpy temporaries cost more than the row itself)
                nb["input_ids"][t] = ids[0]
                if ids[0] == PREVIOUS_SAMPLED:
                    step.prev.append((t, self.prev_rows[row.req_id]))
            else:
                nb["input_ids"][t : t + n] = ids
            if row.interior_snapshots:
                assert not row.is_verify, "a verify row takes its snapshot from a candidate"
                step.row_snaps.extend((i - step.num_verify, p - start, entry, row.state_slot)
                                      for p, entry in row.interior_snapshots)
            table = row.block_table
            if row.start_on_device:
                pass  # positions, KV slots and context length: set from the start on the device
            elif n == 1:
                nb["positions"][t] = start + shift
                nb["slot_mapping"][t] = table[start // bs] * bs + start % bs
            else:
                pos = np.arange(start, end, dtype=np.int64)
                nb["positions"][t : t + n] = pos + shift
                nb["slot_mapping"][t : t + n] = np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs
            nb["block_tables"][i, : len(table)] = table
            nb["block_tables"][i, len(table) :] = BlockPool.NULL_BLOCK
            nb["seq_lens"][i] = end
            nb["state_slots"][i] = row.state_slot
            t += n
            if row_len is not None and n < row_len:
                assert row.is_verify and start + row_len <= self.max_model_len, "row_len is for verify rows"
                m = row_len - n
                nb["input_ids"][t : t + m] = 0
                nb["positions"][t : t + m] = np.arange(end, start + row_len) + shift
                nb["slot_mapping"][t : t + m] = -1
                nb["seq_lens"][i] = start + row_len
                t += m
            nb["query_start_loc"][i + 1] = t
            if row.samples and not row.is_verify:
                nb["logits_indices"][n_sample] = t - 1
                n_sample += 1
            max_q = max(max_q, n)
            max_s = max(max_s, row.latest_start + n)
        step.num_tokens, step.max_query_len, step.max_seq_len = t, max_q, max_s
        return n_sample

    def record_fence(self) -> None:
        """After the step's copies out of the host buffers are enqueued (see ``fill``)."""
        if self.device.type == "cuda":
            self._h2d_fence = torch.cuda.Event()
            self._h2d_fence.record()

    def metadata(self, step: FilledStep) -> StepMetadata:
        """The metadata of a filled step (of its real rows only, when padded)."""
        views, r, num_verify = step.views, step.num_rows, step.num_verify
        qsl_cpu = self.host_bufs["query_start_loc"][: r + 1] if not step.padded else None
        seq_cpu = self.host_bufs["seq_lens"][:r] if not step.padded else None
        meta = StepMetadata(
            positions=views["positions"], query_start_loc=views["query_start_loc"], seq_lens=views["seq_lens"],
            state_slots=views["state_slots"],
            block_tables=views["block_tables"][:, : cdiv(step.max_seq_len, self.block_size)],
            slot_mapping=views["slot_mapping"], max_query_len=step.max_query_len, max_seq_len=step.max_seq_len,
            query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_cpu,
        )
        if not num_verify and qsl_cpu is not None and step.max_query_len > 1:
            meta.chunked_rows = ChunkedRows.of(views["state_slots"], views["query_start_loc"], qsl_cpu)
        if num_verify:
            slots = views["state_slots"]
            rest_cpu = self.host_bufs["rest_query_start_loc"][: r - num_verify + 1] if not step.padded else None
            meta.verify = VerifyMetadata(
                num_rows=num_verify, num_tokens=step.num_verify_tokens, max_query_len=step.max_query_len_verify,
                query_start_loc=views["query_start_loc"][: num_verify + 1], state_slots=slots[:num_verify],
                rest_query_start_loc=views["rest_query_start_loc"], rest_state_slots=slots[num_verify:],
                rest_max_query_len=step.rest_max_query_len, rest_query_start_loc_cpu=rest_cpu,
            )
            if rest_cpu is not None and step.rest_max_query_len > 1:
                meta.verify.rest_chunked_rows = ChunkedRows.of(slots[num_verify:], views["rest_query_start_loc"],
                                                               rest_cpu)
        if step.row_snaps:
            assert not step.padded, "a step with snapshots inside its rows runs eagerly"
            snaps = step.row_snaps
            prefill_lens = np.diff(self.np_bufs["query_start_loc"][num_verify : r + 1]).tolist()
            meta.row_snapshots = RowSnapshots.build([x[0] for x in snaps], [x[1] for x in snaps],
                                                    [x[2] for x in snaps], [x[3] for x in snaps], prefill_lens,
                                                    self.device)
        return meta

    def static_meta(self, bufs: dict[str, torch.Tensor], rows: int, tokens: int, query_len: int) -> StepMetadata:
        """A captured graph's metadata: views of persistent buffers ``bufs`` at fixed sizes (invariant 7)."""
        slots = bufs["state_slots"] if "state_slots" in bufs else bufs["seq_lens"]
        return StepMetadata(
            positions=bufs["positions"][:tokens], query_start_loc=bufs["query_start_loc"][: rows + 1],
            seq_lens=bufs["seq_lens"][:rows], state_slots=slots[:rows], block_tables=bufs["block_tables"][:rows],
            slot_mapping=bufs["slot_mapping"][:tokens], max_query_len=query_len, max_seq_len=self.max_model_len,
        )

    def verify_static_meta(self, size: int, q: int | None = None) -> StepMetadata:
        """A verify graph's metadata: ``size`` rows of ``q`` tokens (k + 1 by default; a graph of a shorter
        speculation length k_step + 1)."""
        q = q or self.num_speculative_tokens + 1
        d = self.dev_bufs
        meta = self.static_meta(d, size, size * q, q)
        meta.verify = VerifyMetadata(
            num_rows=size, num_tokens=size * q, max_query_len=q, query_start_loc=meta.query_start_loc,
            state_slots=meta.state_slots, rest_query_start_loc=d["rest_query_start_loc"][:1],
            rest_state_slots=d["state_slots"][size:size], rest_max_query_len=0,
        )
        return meta

    def remember_samples(self, rows: list[ScheduledRow], idx: list[int], tokens: torch.Tensor) -> None:
        """Keep this step's sampled ids on the device for the next step's ``PREVIOUS_SAMPLED`` inputs, indexed by
        request id (the next step's rows are in another order: docs/design.md invariant 13)."""
        self.prev_rows = {rows[i].req_id: j for j, i in enumerate(idx)}
        self.prev_sampled = tokens

    def feed_previous_samples(self, prev: list[tuple[int, int]]) -> None:
        """Input tokens that the previous step sampled, taken on the device (the host may not know them yet):
        ``prev`` = (token index in this step, row of the previous step's samples)."""
        assert self.prev_sampled is not None, "PREVIOUS_SAMPLED without a previous step"
        n = len(prev)
        nb = self.np_bufs
        nb["prev_at"][:n] = [t for t, _ in prev]
        nb["prev_src"][:n] = [j for _, j in prev]
        at = self.dev_bufs["prev_at"][:n]
        src = self.dev_bufs["prev_src"][:n]
        at.copy_(self.host_bufs["prev_at"][:n], non_blocking=True)
        src.copy_(self.host_bufs["prev_src"][:n], non_blocking=True)
        self.dev_bufs["input_ids"].index_copy_(0, at, self.prev_sampled.index_select(0, src))
