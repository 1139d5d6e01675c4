"""The MTP head as a drafter: its passes over the target's hidden states, laid out in buffers of its own.

Position p of the MTP layer takes (token p + 1, the target's hidden state at p) and writes the MTP KV entry of p
(docs/design.md invariant 5). Three ways to run it: ``mtp_forward`` / ``mtp_draft`` (one pass, eager or the ``mtp``
graph when every row has one token), ``mtp_draft_chain`` (a verify step's whole drafting in one replay of the
``draft`` graph, its inputs filled by the host) and ``fill_draft_on_device`` (the same graph's inputs laid out on the
device from the accepted counts there, by the ``draft_fill`` graph: the verify step enqueued whole). The passes'
buffers are their own, so drafting never clobbers the step's metadata.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import nn

from hyserve.cache.block_pool import BlockPool, cdiv
from hyserve.layers.linear import ParallelLMHead
from hyserve.model.base import CausalLM
from hyserve.model.metadata import StepMetadata
from hyserve.scheduler.output import PREVIOUS_DRAFT, ScheduledRow
from hyserve.utils import device_tensor
from hyserve.worker.cuda_graphs import GraphBody, GraphLogits, GraphSet, StepGraphs, spec_kind, weak_forward
from hyserve.worker.input_batch import InputBatch, fill_pad_rows
from hyserve.worker.mm_inputs import ImageRow, MMInputs

# The draft fill's per-row host inputs (``fill_draft_on_device``), packed as the rows of one tensor.
DRAFT_ROW_INPUTS = ("row_first", "row_limit", "row_slot", "row_shift")


@dataclass(slots=True)
class MTPRow:
    """Positions [start, start + len(input_ids)) of one request for the MTP layer (see ``mtp_forward``)."""

    start: int
    input_ids: list[int]
    hidden_index: list[int]
    block_table: list[int]
    req_id: str | None = None  # a prompt with images: its positions and image rows (``MMInputs``)


@dataclass(slots=True)
class ChainRow:
    """One verify row's drafting in the ``draft`` graph (``mtp_draft_chain``): the MTP layer over positions
    [start, start + len(input_ids)) (the accepted drafts and the correction; hidden states ``hidden_index``), then
    ``num_drafts`` - 1 more passes at the positions after; 0 drafts: the first pass only (its KV entries)."""

    start: int
    input_ids: list[int]
    hidden_index: list[int]
    block_table: list[int]
    num_drafts: int
    state_slot: int = -1  # the request's: its drafts row in ``Verifier.draft_slots``
    shift: int = 0  # what the rotary position adds to the index (a prompt's rope_delta past its last image)


class HeadOwnInput:
    """The target's LM head over what a draft head's own ``head_input`` makes of the head's output rows, in place of
    the target's ``head_input``: for a head whose output is residual streams mixed by a mixer of its own
    (Qwen4-Exp's, ``hyserve.model.qwen4_exp_mtp``). Duck-types the two attributes ``GraphLogits`` reads."""

    def __init__(self, model: CausalLM, mtp: nn.Module) -> None:
        self.lm_head = model.lm_head
        self.head_input = cast(Callable[[torch.Tensor], torch.Tensor], mtp.head_input)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """As the target's ``compute_logits`` (float32, every rank the whole vocabulary)."""
        head = self.lm_head
        logits = head(self.head_input(hidden))
        return (head.gather(logits) if isinstance(head, ParallelLMHead) else logits).float()


class MTPDrafter:
    """The MTP head (``mtp``) over the target ``model``'s embedding and LM head, and its pass buffers: ``mtp_*`` for
    one pass, ``draft_*`` for the ``draft`` graph (and its ``draft_fill`` inputs)."""

    def __init__(self, mtp: nn.Module, model: CausalLM, batch: InputBatch, mm: MMInputs, graphs: StepGraphs,
                 num_speculative_tokens: int, hidden_size: int, dtype: torch.dtype, max_num_batched_tokens: int,
                 max_num_seqs: int, pad_slot: int) -> None:
        self.mtp = mtp
        self.model = model
        # The draft logits: the target's LM head over its own head_input of the draft head's output, or, for a head
        # with a head_input of its own, over that one's.
        self.own_head_input = HeadOwnInput(model, mtp) if callable(getattr(mtp, "head_input", None)) else None
        self.batch = batch
        self.mm = mm
        self.graphs = graphs
        self._logits: GraphLogits | None = None  # the graphs' logits buffers (``graph_bodies``)
        self.num_speculative_tokens = num_speculative_tokens
        self.device = batch.device
        self.block_size = batch.block_size
        self.max_model_len = batch.max_model_len
        self.pad_slot = pad_slot
        self._draft_fence: torch.cuda.Event | None = None  # recorded after a fill's copies out of draft_host
        self._allocate(max_num_batched_tokens, max_num_seqs, hidden_size, dtype)

    def _allocate(self, t: int, r: int, h: int, dtype: torch.dtype) -> None:
        host, dev = self.batch.host, self.batch.dev
        blocks = self.batch.max_blocks_per_seq
        mt = t + r
        mtp_names = {"input_ids": (mt,), "positions": (mt,), "slot_mapping": (mt,), "hidden_index": (mt,),
                     "query_start_loc": (r + 1,), "seq_lens": (r,), "last_index": (r,), "block_tables": (r, blocks)}
        dtypes = {"query_start_loc": torch.int32, "seq_lens": torch.int32, "block_tables": torch.int32}
        self.mtp_host = {k: host(sh, dtypes.get(k, torch.long)) for k, sh in mtp_names.items()}
        self.mtp_dev = {k: dev(sh, dtypes.get(k, torch.long)) for k, sh in mtp_names.items()}
        self.mtp_np = {k: v.numpy() for k, v in self.mtp_host.items()}
        if not self.num_speculative_tokens:
            return
        # The draft graph's own set.
        k = self.num_speculative_tokens
        q, c = k + 1, max(k - 1, 1)
        draft_names = {"input_ids": (r * q,), "positions": (r * q,), "slot_mapping": (r * q,),
                       "hidden_index": (r * q,), "query_start_loc": (r + 1,), "seq_lens": (r,),
                       "last_index": (r,), "block_tables": (r, blocks),
                       "chain_positions": (c, r), "chain_slot_mapping": (c, r), "chain_seq_lens": (c, r),
                       "chain_query_start_loc": (r + 1,),
                       # the count-independent inputs of fill_draft_on_device
                       "slot_table": (r, 2 * k), "row_start": (r,), "row_first": (r,), "row_limit": (r,),
                       "row_slot": (r,), "row_shift": (r,),
                       # the draft_fill graph's inputs from the device: counts, emitted tokens
                       "acc": (r,), "emitted": (r, q)}
        dtypes.update(chain_seq_lens=torch.int32, chain_query_start_loc=torch.int32)
        self.draft_host = {k: host(sh, dtypes.get(k, torch.long)) for k, sh in draft_names.items()}
        self.draft_dev = {k: dev(sh, dtypes.get(k, torch.long)) for k, sh in draft_names.items()}
        # The draft fill's per-row inputs, as rows of one tensor each side: one copy per step.
        self.draft_rows_host = host((len(DRAFT_ROW_INPUTS), r), torch.long)
        self.draft_rows_dev = dev((len(DRAFT_ROW_INPUTS), r), torch.long)
        for j, name in enumerate(DRAFT_ROW_INPUTS):
            self.draft_host[name], self.draft_dev[name] = self.draft_rows_host[j], self.draft_rows_dev[j]
        self.draft_np = {k: v.numpy() for k, v in self.draft_host.items()}
        # Fixed layouts: the first pass k + 1 tokens per row, the chained passes one.
        self.draft_np["query_start_loc"][:] = np.arange(r + 1) * q
        self.draft_np["chain_query_start_loc"][:] = np.arange(r + 1)
        for name in ("query_start_loc", "chain_query_start_loc"):
            self.draft_dev[name].copy_(self.draft_host[name])
        self.draft_hidden_in = dev((r * q, h), dtype)
        self.draft_last_hidden = dev((r * q, h), dtype)  # the verify step's hidden states, copied
        self.draft_first_hidden = dev((r, h), dtype)
        self.draft_tokens = dev((r, k), torch.long)
        self.draft_slots_index = dev((r,), torch.long)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over ``hidden`` into the graphs' logits buffers (graph bodies only)."""
        assert self._logits is not None
        return self._logits(hidden)

    def graph_bodies(self, logits: GraphLogits, max_num_seqs: int, hidden_size: int,
                     dtype: torch.dtype, draft_lengths: tuple[int, ...] = ()) -> dict[str, GraphBody]:
        """The ``mtp``, ``draft`` and ``draft_fill`` graphs, writing their logits into ``logits``; ``draft@j`` for
        each shorter drafting length j in ``draft_lengths`` (j passes: the first and j - 1 chained)."""
        if self.own_head_input is not None:  # the same buffers, the draft head's head_input
            logits = copy.copy(logits)
            logits.model = cast(CausalLM, self.own_head_input)
        self._logits = logits
        self.mtp_hidden_in = self.batch.dev((max_num_seqs, hidden_size), dtype)
        k = self.num_speculative_tokens
        bodies = {"mtp": GraphBody(weak_forward(self._graph_mtp), lambda n: self.fill_mtp([], pad_to=n)),
                  "draft_fill": GraphBody(weak_forward(self._graph_draft_fill), self.draft_fill_pads)}
        for j in (k, *draft_lengths):
            bodies[spec_kind("draft", j, k)] = GraphBody(weak_forward(self._graph_draft, j),
                                                         lambda n: self._fill_draft([], pad_to=n))
        return bodies

    def fill_mtp(self, rows: list[MTPRow], pad_to: int | None = None) -> tuple[StepMetadata, dict[str, torch.Tensor]]:
        """Fill the MTP pass's persistent buffers for ``rows`` (plus pad rows up to ``pad_to``); metadata and views."""
        nb = self.mtp_np
        bs = self.block_size
        t = 0
        max_q = max_s = 0
        nb["query_start_loc"][0] = 0
        mm_rows: list[ImageRow] = []
        for i, row in enumerate(rows):
            n = len(row.input_ids)
            table = row.block_table
            mm = self.mm.get(row.req_id)
            shift = 0
            if mm is not None:
                shift = mm.position_shift(row.start)
                if mm.reaches(row.start, n, lookahead=1):
                    mm_rows.append((t, row.start, n, mm))
            if n == 1:  # drafting passes: scalar writes
                nb["input_ids"][t] = row.input_ids[0]
                nb["hidden_index"][t] = row.hidden_index[0]
                nb["positions"][t] = row.start + shift
                nb["slot_mapping"][t] = table[row.start // bs] * bs + row.start % bs
            else:
                nb["input_ids"][t : t + n] = row.input_ids
                nb["hidden_index"][t : t + n] = row.hidden_index
                pos = np.arange(row.start, row.start + n, dtype=np.int64)
                nb["positions"][t : t + n] = pos + shift
                nb["slot_mapping"][t : t + n] = np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs
            nb["block_tables"][i, : len(table)] = table
            nb["block_tables"][i, len(table) :] = BlockPool.NULL_BLOCK
            nb["seq_lens"][i] = row.start + n
            t += n
            nb["query_start_loc"][i + 1] = t
            nb["last_index"][i] = t - 1
            max_q, max_s = max(max_q, n), max(max_s, row.start + n)
        r = len(rows)
        sizes = {"input_ids": t, "positions": t, "slot_mapping": t, "hidden_index": t, "query_start_loc": r + 1,
                 "seq_lens": r, "last_index": r, "block_tables": r}
        copies = dict(sizes)
        if pad_to is not None and pad_to > r:
            fill_pad_rows(nb, copies, t, r, pad_to, 1, self.pad_slot, self.block_size)
        v = {}
        for name, size in sizes.items():
            self.mtp_dev[name][: copies[name]].copy_(self.mtp_host[name][: copies[name]], non_blocking=True)
            v[name] = self.mtp_dev[name][:size]
        # An eager pass (not padded for a graph) carries the host's row offsets and lengths, as the target's eager
        # steps do: its long rows (a prompt chunk's positions) then take SDPA (``layers.attention.attend_paged``)
        # where the paged kernel would take about twice as long.
        eager = pad_to is None
        meta = StepMetadata(positions=v["positions"], query_start_loc=v["query_start_loc"], seq_lens=v["seq_lens"],
                            state_slots=v["seq_lens"], block_tables=v["block_tables"][:, : cdiv(max_s, bs)],
                            slot_mapping=v["slot_mapping"], max_query_len=max_q, max_seq_len=max_s,
                            query_start_loc_cpu=self.mtp_host["query_start_loc"][: r + 1] if eager else None,
                            seq_lens_cpu=self.mtp_host["seq_lens"][:r] if eager else None)
        if mm_rows:
            assert pad_to is None, "an MTP pass reaching an image runs eagerly"
            meta.mrope_positions, meta.image_embeds = self.mm.image_inputs(self.mtp_host["positions"][:t], mm_rows,
                                                                         lookahead=1)
        return meta, v

    @torch.inference_mode()
    def mtp_forward(self, rows: list[MTPRow], hidden_src: torch.Tensor) -> torch.Tensor:
        """Run the MTP layer over each row's positions; returns its output at each row's last position (R, h).

        Row i covers positions [start, start + n): input token ``input_ids[j]`` is the token at position
        start + j + 1 and its hidden state is ``hidden_src[hidden_index[j]]``. The MTP KV entries of those
        positions are (re)written in the request's blocks.
        """
        meta, v = self.fill_mtp(rows)
        out = self.mtp(v["input_ids"], hidden_src[v["hidden_index"]], meta, self.model.input_embeddings())
        return out[v["last_index"]]

    @torch.inference_mode()
    def mtp_greedy_tokens(self, mtp_hidden: torch.Tensor) -> list[int]:
        return self.draft_logits(mtp_hidden).argmax(dim=-1).tolist()

    def draft_logits(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        """The float32 logits of rows of the head's output (eagerly)."""
        if self.own_head_input is not None:
            return self.own_head_input.compute_logits(mtp_hidden)
        return self.model.compute_logits(mtp_hidden)

    @torch.inference_mode()
    def mtp_draft(self, rows: list[MTPRow], hidden_src: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """``mtp_forward`` and the greedy draft token of each row; a captured graph when every row has one token."""
        graph = self.graphs.fitting("mtp", len(rows), lambda: all(
            len(r.input_ids) == 1 and not self.mm.mtp_reaches_image(r.req_id, r.start, 1) for r in rows))
        if graph is None:
            out = self.mtp_forward(rows, hidden_src)
            return out, self.mtp_greedy_tokens(out)
        graphs, size = graph
        _, v = self.fill_mtp(rows, pad_to=size)
        torch.index_select(hidden_src, 0, v["hidden_index"], out=self.mtp_hidden_in[: len(rows)])
        out, tokens = graphs.run(size)
        # A copy: the next replay overwrites the graph's output, and callers keep rows of it across passes.
        return out[: len(rows)].clone(), tokens[: len(rows)].tolist()

    def draft_chain_graph(self, num_rows: int, passes: int | None = None) -> tuple[GraphSet, int] | None:
        """The ``draft`` graphs (``passes`` drafts per row, k by default: ``draft@passes``) and padded size for a
        verify step of ``num_rows`` rows, if captured for it."""
        k = self.num_speculative_tokens
        return self.graphs.fitting(spec_kind("draft", k if passes is None else passes, k), num_rows, lambda: True)

    def _fill_draft(self, rows: list[ChainRow], pad_to: int) -> torch.Tensor:
        """Fill the draft graph's buffers for ``rows`` plus pad rows up to ``pad_to``; the hidden-state indices.

        Row i's first pass is laid out in k + 1 tokens from token i * (k + 1) (tail masked: no KV write, its
        context length counting it, as verify rows are); chained pass j runs at position start + n - 1 + j for a
        row of n first-pass tokens, masked (no KV write, position 0) where the row wants fewer than j + 1 drafts.
        Pad rows are masked everywhere and read the null block.
        """
        k = self.num_speculative_tokens
        q = k + 1
        if self._draft_fence is not None:  # see fill_draft_on_device
            self._draft_fence.synchronize()
        nb = self.draft_np
        bs = self.block_size
        null = BlockPool.NULL_BLOCK
        for i in range(pad_to):
            t = i * q
            row = rows[i] if i < len(rows) else None
            n = len(row.input_ids) if row is not None else 0
            if row is None:
                nb["input_ids"][t : t + q] = 0
                nb["hidden_index"][t : t + q] = 0
                nb["positions"][t : t + q] = np.arange(q)
                nb["slot_mapping"][t : t + q] = -1
                nb["block_tables"][i, : cdiv(q, bs)] = null
                nb["seq_lens"][i] = q
                nb["last_index"][i] = t
                nb["chain_positions"][:, i] = 0
                nb["chain_slot_mapping"][:, i] = -1
                nb["chain_seq_lens"][:, i] = 1
                continue
            table = np.asarray(row.block_table, dtype=np.int64)
            pos = np.arange(row.start, row.start + q, dtype=np.int64)
            nb["input_ids"][t : t + n] = row.input_ids
            nb["input_ids"][t + n : t + q] = 0
            nb["hidden_index"][t : t + n] = row.hidden_index
            nb["hidden_index"][t + n : t + q] = row.hidden_index[-1]
            nb["positions"][t : t + q] = pos + row.shift
            nb["slot_mapping"][t : t + n] = table[pos[:n] // bs] * bs + pos[:n] % bs
            nb["slot_mapping"][t + n : t + q] = -1
            nb["block_tables"][i, : len(table)] = table
            nb["block_tables"][i, len(table) :] = null
            nb["seq_lens"][i] = row.start + q
            nb["last_index"][i] = t + n - 1
            last = row.start + n - 1
            for j in range(1, k):
                p = last + j
                if j < row.num_drafts:
                    nb["chain_positions"][j - 1, i] = p + row.shift
                    nb["chain_slot_mapping"][j - 1, i] = table[p // bs] * bs + p % bs
                    nb["chain_seq_lens"][j - 1, i] = p + 1
                else:
                    nb["chain_positions"][j - 1, i] = 0
                    nb["chain_slot_mapping"][j - 1, i] = -1
                    nb["chain_seq_lens"][j - 1, i] = 1
        for name in ("input_ids", "hidden_index", "positions", "slot_mapping"):
            self.draft_dev[name][: pad_to * q].copy_(self.draft_host[name][: pad_to * q], non_blocking=True)
        for name in ("seq_lens", "last_index", "block_tables"):
            self.draft_dev[name][:pad_to].copy_(self.draft_host[name][:pad_to], non_blocking=True)
        for name in ("chain_positions", "chain_slot_mapping", "chain_seq_lens"):
            self.draft_dev[name][:, :pad_to].copy_(self.draft_host[name][:, :pad_to], non_blocking=True)
        if self.device.type == "cuda":
            self._draft_fence = torch.cuda.Event()
            self._draft_fence.record()
        return self.draft_dev["hidden_index"][: pad_to * q]

    @torch.inference_mode()
    def mtp_draft_chain(self, rows: list[ChainRow], hidden_src: torch.Tensor, graphs: GraphSet, size: int,
                        draft_slots: torch.Tensor | None) -> tuple[torch.Tensor, list[list[int]]]:
        """The drafting of a verify step in one replay of the ``draft`` graph (``size`` padded rows): the first
        pass's output at each row's last position (R, h) and each row's ``num_drafts`` greedy tokens (one
        device-to-host copy)."""
        index = self._fill_draft(rows, size)
        torch.index_select(hidden_src, 0, index, out=self.draft_hidden_in[: size * (self.num_speculative_tokens + 1)])
        tokens, first = graphs.run(size)
        n = len(rows)
        if draft_slots is not None:  # they stay on the device, in each request's drafts row: no host sync
            slots = device_tensor([r.state_slot for r in rows], self.device, torch.long)
            draft_slots.index_copy_(0, slots, tokens[:n])
            return first[:n].clone(), [[PREVIOUS_DRAFT] * r.num_drafts for r in rows]
        drafts = tokens[:n].tolist()
        return first[:n].clone(), [d[: r.num_drafts] for d, r in zip(drafts, rows, strict=True)]

    def fill_draft_on_device(self, rows: list[ScheduledRow], accepted: torch.Tensor, emitted: torch.Tensor,
                             failed: torch.Tensor | None, pad_to: int, last_hidden: torch.Tensor) -> None:
        """The ``draft`` graph's inputs for the verify rows of this step, with their accepted counts on the device.
        The host fills what depends on neither the counts nor the starts (block tables, each row's first hidden
        state, drafts row, position shift and draft limit); the counts, the emitted tokens and the step's hidden
        states are copied into the ``draft_fill`` graph's inputs, whose one replay lays out the rest
        (``_graph_draft_fill``). A row that drafts nothing (an error) is masked like a pad row."""
        n = len(rows)
        if self._draft_fence is not None:
            # The last fill's copies out of these pinned buffers were enqueued after a wait the host no longer makes:
            # they must have run before the buffers are written again.
            self._draft_fence.synchronize()
        nb = self.draft_np
        null = BlockPool.NULL_BLOCK
        first = 0
        for i, row in enumerate(rows):
            table = row.block_table
            nb["row_shift"][i] = self.mm.position_shift(row.req_id, row.start)  # 0 for a row behind: text only
            nb["block_tables"][i, : len(table)] = table
            nb["block_tables"][i, len(table) :] = null
            nb["row_first"][i] = first  # the row's first token in the step's hidden states
            nb["row_limit"][i] = row.draft_limit - 1  # less the start, on the device
            nb["row_slot"][i] = row.state_slot
            first += row.num_new_tokens
        self._draft_pad_rows(n, pad_to)
        d = self.draft_dev
        d["block_tables"][:pad_to].copy_(self.draft_host["block_tables"][:pad_to], non_blocking=True)
        self.draft_rows_dev.copy_(self.draft_rows_host, non_blocking=True)  # all rows: one contiguous copy
        if self.device.type == "cuda":
            self._draft_fence = torch.cuda.Event()
            self._draft_fence.record()
        acc = accepted if failed is None else torch.where(failed, -1, accepted)
        d["acc"][:n].copy_(acc)
        d["acc"][n:pad_to].fill_(-1)  # pad rows draft nothing
        d["emitted"][:n, : emitted.shape[1]].copy_(emitted)  # columns past a row's tokens are masked anyway
        self.draft_last_hidden[: last_hidden.shape[0]].copy_(last_hidden)
        graphs = self.graphs.get("draft_fill")
        if graphs is not None and pad_to in graphs.sizes:
            graphs.run(pad_to)
        else:
            self._graph_draft_fill(pad_to)

    def draft_fill_pads(self, size: int) -> None:
        """The draft_fill graph's inputs as pad rows only (capture)."""
        self._draft_pad_rows(0, size)
        self.draft_dev["block_tables"][:size].copy_(self.draft_host["block_tables"][:size])
        self.draft_rows_dev.copy_(self.draft_rows_host)
        self.draft_dev["acc"][:size].fill_(-1)

    def _draft_pad_rows(self, n: int, pad_to: int) -> None:
        """Rows ``[n, pad_to)`` of the draft fill's host inputs as pad rows: the null block, no shift."""
        nb = self.draft_np
        nb["block_tables"][n:pad_to, : cdiv(self.num_speculative_tokens + 1, self.block_size)] = BlockPool.NULL_BLOCK
        nb["row_shift"][n:pad_to] = 0
        nb["row_first"][n:pad_to] = 0
        nb["row_limit"][n:pad_to] = 0
        nb["row_slot"][n:pad_to] = self.pad_slot

    def _graph_draft_fill(self, size: int) -> tuple[torch.Tensor, ...]:
        """``draft_fill`` graph: the ``draft`` graph's inputs for ``size`` rows from the persistent buffers: the
        accepted counts (``acc``, -1 for rows that draft nothing, pads included), the emitted tokens, the starts
        (``verify_starts``), the host's per-row inputs and the step's hidden states. A row that drafts nothing
        starts at 0 with no KV writes; every one of them is laid out like a pad row."""
        k = self.num_speculative_tokens
        q, bs = k + 1, self.block_size
        d = self.draft_dev
        acc = d["acc"][:size]
        valid = acc >= 0
        start = torch.where(valid, self.batch.dev_bufs["verify_starts"][:size], 0)
        d["row_start"][:size].copy_(start)
        d["row_limit"][:size].sub_(start)
        d["seq_lens"][:size].copy_(start + q)
        span = torch.arange(2 * k, device=self.device)
        pos = start.unsqueeze(1) + span  # (rows, 2k): the row's next 2k positions
        d["positions"][: size * q].copy_((pos[:, :q] + d["row_shift"][:size].unsqueeze(1)).view(-1))
        tables = d["block_tables"][:size].long()
        col = pos // bs
        blk = tables.gather(1, col.clamp(max=tables.shape[1] - 1))
        inside = (col < tables.shape[1]) & (blk != BlockPool.NULL_BLOCK)  # past the request's blocks: no slot
        slot_table = torch.where(inside, blk * bs + pos % bs, -1)
        d["slot_table"][:size].copy_(slot_table)
        m = torch.where(valid, acc + 1, 0)  # first-pass tokens per row: the accepted drafts and the last token
        last = (m - 1).clamp(min=0)
        o = torch.arange(q, device=self.device)
        real = o.unsqueeze(0) < m.unsqueeze(1)
        d["input_ids"][: size * q].copy_(torch.where(real, d["emitted"][:size], 0).view(-1))
        index = torch.where(valid.unsqueeze(1), d["row_first"][:size].unsqueeze(1)
                            + torch.minimum(o.unsqueeze(0), last.unsqueeze(1)), 0).view(-1)
        d["hidden_index"][: size * q].copy_(index)
        d["slot_mapping"][: size * q].copy_(torch.where(real, slot_table[:, :q], -1).view(-1))
        d["last_index"][:size].copy_(torch.arange(size, device=self.device) * q + last)
        num_drafts = torch.where(valid, (d["row_limit"][:size] - m).clamp(0, k), 0)
        if k > 1:
            j = torch.arange(1, k, device=self.device).unsqueeze(1)  # (k - 1, 1)
            p = d["row_start"][:size].unsqueeze(0) + last.unsqueeze(0) + j  # (k - 1, rows)
            active = j < num_drafts.unsqueeze(0)
            chain_slots = slot_table.gather(1, (last.unsqueeze(0) + j).clamp(max=2 * k - 1).t()).t()
            d["chain_positions"][:, :size].copy_(torch.where(active, p + d["row_shift"][:size].unsqueeze(0), 0))
            d["chain_slot_mapping"][:, :size].copy_(torch.where(active, chain_slots, -1))
            d["chain_seq_lens"][:, :size].copy_(torch.where(active, p + 1, 1).to(d["chain_seq_lens"].dtype))
        self.draft_slots_index[:size].copy_(torch.where(valid, d["row_slot"][:size], self.pad_slot))
        torch.index_select(self.draft_last_hidden, 0, d["hidden_index"][: size * q],
                           out=self.draft_hidden_in[: size * q])
        return ()

    def _graph_mtp(self, size: int) -> tuple[torch.Tensor, ...]:
        meta = self.batch.static_meta(self.mtp_dev, size, size, 1)
        out = self.mtp(self.mtp_dev["input_ids"][:size], self.mtp_hidden_in[:size], meta,
                       self.model.input_embeddings())
        return out, self.logits(out).argmax(dim=-1)

    def _graph_draft(self, passes: int, size: int) -> tuple[torch.Tensor, ...]:
        """``draft`` graph (``passes`` = k; ``draft@j``: j): the MTP layer over ``size`` rows of k + 1 positions
        (masked tails), each row's output at its last real position (``draft@0``: nothing more), then its greedy
        token and ``passes`` - 1 one-token passes, each fed
        the previous pass's greedy token and output; the tokens of every row (the first ``passes`` columns) and the
        first pass's outputs land in persistent buffers."""
        q = self.num_speculative_tokens + 1
        d = self.draft_dev
        embed = self.model.input_embeddings()
        meta = StepMetadata(positions=d["positions"][: size * q], query_start_loc=d["query_start_loc"][: size + 1],
                            seq_lens=d["seq_lens"][:size], state_slots=d["seq_lens"][:size],
                            block_tables=d["block_tables"][:size], slot_mapping=d["slot_mapping"][: size * q],
                            max_query_len=q, max_seq_len=self.max_model_len)
        out = self.mtp(d["input_ids"][: size * q], self.draft_hidden_in[: size * q], meta, embed)
        h = out.index_select(0, d["last_index"][:size])
        self.draft_first_hidden[:size].copy_(h)
        if not passes:  # ``draft@0``: the first pass's KV entries only, no draft (no LM head)
            return self.draft_tokens[:size], self.draft_first_hidden[:size]
        tok = self.logits(h).argmax(dim=-1)
        self.draft_tokens[:size, 0].copy_(tok)
        for j in range(1, passes):
            meta = StepMetadata(positions=d["chain_positions"][j - 1, :size],
                                query_start_loc=d["chain_query_start_loc"][: size + 1],
                                seq_lens=d["chain_seq_lens"][j - 1, :size], state_slots=d["seq_lens"][:size],
                                block_tables=d["block_tables"][:size],
                                slot_mapping=d["chain_slot_mapping"][j - 1, :size], max_query_len=1,
                                max_seq_len=self.max_model_len)
            h = self.mtp(tok, h, meta, embed)
            tok = self.logits(h).argmax(dim=-1)
            self.draft_tokens[:size, j].copy_(tok)
        return self.draft_tokens[:size], self.draft_first_hidden[:size]
