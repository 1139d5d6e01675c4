"""The verify side of speculative decoding: acceptance, and what it leaves on the device for the steps behind.

Acceptance is the rejection sampler's (``RejectionSampler``): its ``launch`` for every verify step, or, for a
greedy step that the verify graph ran, its greedy rule in one replay of the ``accept`` graph. With the MTP head on
one rank, each state slot keeps on the device its request's drafts (``draft_slots``, read by the next verify row's
``PREVIOUS_DRAFT`` inputs) and what its last verify row's acceptance found (``verify_next_start``,
``verify_next_token``, read by a row scheduled behind that row while it was in flight: ``ScheduledRow.
start_on_device``); a whole verify step (acceptance, commit, snapshots, drafting) can then be enqueued before its
result comes to the host (``verify_and_draft_on_device``). docs/design.md invariants 2 and 13.
"""

from __future__ import annotations

import dataclasses

import torch

from hyserve.scheduler.output import PREVIOUS_DRAFT, RunnerOutput, ScheduledRow, candidate_point
from hyserve.utils import device_tensor
from hyserve.worker.cuda_graphs import GraphBody, GraphLogits, GraphSet, StepGraphs, spec_kind, weak_forward
from hyserve.worker.input_batch import FilledStep, InputBatch
from hyserve.worker.spec_decode.mtp_drafter import MTPDrafter
from hyserve.worker.spec_decode.mtp_proposer import MTPProposer
from hyserve.worker.spec_decode.rejection_sampler import PendingSpec, RejectionSampler, SpecOutput, SpecRow
from hyserve.worker.state_ops import StateOps
from hyserve.worker.step_result import StepResult


def take_verified(out: RunnerOutput, idx: list[int], spec: SpecOutput) -> None:
    """Verify rows ``idx`` of the step take their accepted count and emitted tokens."""
    errors = set(spec.error_rows)
    for j, i in enumerate(idx):
        if j in errors:
            out.errors.setdefault(i, "non-finite logits (NaN/inf) while verifying drafts")
            continue  # the live state is left as it was (-1)
        out.num_accepted[i] = spec.num_accepted[j]
        if i in out.errors:
            continue  # its state advances (the batch ran), its tokens are dropped
        tokens = out.token_ids[i] = [int(t) for t in spec.token_ids[j]]
        if spec.logprobs is not None:
            lps, ranks, tops = out.logprob_lists()
            lps[i] = [float(x) for x in spec.logprobs[j]]
            ranks[i] = list(spec.ranks[j]) if spec.ranks is not None else [None] * len(tokens)
            tops[i] = list(spec.top_logprobs[j]) if spec.top_logprobs is not None else [[] for _ in tokens]


class Verifier:
    """Acceptance of verify rows and the per-slot device entries around it (see the module docstring)."""

    def __init__(self, batch: InputBatch, graphs: StepGraphs, state_ops: StateOps, drafter: MTPDrafter | None,
                 proposer: MTPProposer | None, num_speculative_tokens: int, seed: int, num_state_slots: int,
                 max_num_seqs: int, single_rank: bool, synthetic_rates: tuple[float, ...] | None = None) -> None:
        self.batch = batch
        self.graphs = graphs
        self.state_ops = state_ops
        self.drafter = drafter
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.device = batch.device
        self.block_size = batch.block_size
        self.max_model_len = batch.max_model_len
        self.rejection_sampler = RejectionSampler(self.device, seed=seed, synthetic_rates=synthetic_rates)
        self.logits: GraphLogits | None = None  # the verify graph's logits (``graph_bodies``)
        # Whether verify steps are enqueued whole (``device_chain``): about 45 more launches per step, all while
        # the verify forward runs, against a host wait and a device idle gap; benchmarks compare both.
        self.use_device_chain = True
        # The last prepared step's verify drafts as fed (on the device), when some were PREVIOUS_DRAFT inputs.
        self.verify_draft_ids: torch.Tensor | None = None
        # The drafts the MTP head's draft graph leaves on the device: row s holds the drafts of the request in state
        # slot s (the pad slot's row takes the pad rows'), read by its next verify row's PREVIOUS_DRAFT inputs. On a
        # single rank only: a pipeline's first stage, or another tensor-parallel rank, could not read this rank's.
        self.draft_slots: torch.Tensor | None = None
        # Beside them, per slot, what its last verify row's acceptance found: the next start (start + accepted + 1)
        # and the last token (the correction or the bonus). A verify row scheduled behind that row while it was in
        # flight (ScheduledRow.start_on_device) starts from these.
        self.verify_next_start: torch.Tensor | None = None
        self.verify_next_token: torch.Tensor | None = None
        if drafter is not None and single_rank:
            self.draft_slots = torch.zeros((num_state_slots + 1, num_speculative_tokens), dtype=torch.long,
                                           device=self.device)
            self.verify_next_start = torch.zeros(num_state_slots + 1, dtype=torch.long, device=self.device)
            self.verify_next_token = torch.zeros(num_state_slots + 1, dtype=torch.long, device=self.device)
        if drafter is not None:  # the accept graph's (count, emitted) per row
            self.accept_summary = batch.dev((max_num_seqs, num_speculative_tokens + 2), torch.long)

    def graph_bodies(self, logits: GraphLogits, spec_lengths: tuple[int, ...] = ()) -> dict[str, GraphBody]:
        """The ``behind`` and ``accept`` graphs (over the verify graph's buffers: their pads are the step's), for k
        drafts per row and for each shorter speculation length in ``spec_lengths`` (``spec_kind``)."""
        self.logits = logits
        k = self.num_speculative_tokens
        bodies = {}
        for j in (k, *spec_lengths):
            bodies[spec_kind("behind", j, k)] = GraphBody(weak_forward(self._graph_behind, j + 1))
            bodies[spec_kind("accept", j, k)] = GraphBody(weak_forward(self._graph_accept, j + 1))
        return bodies

    def complete_inputs(self, step: FilledStep, pad_to: int | None, row_len: int | None) -> None:
        """The verify rows' inputs that only the device knows, after the host's copies: the starts of rows behind
        rows in flight (the ``behind`` graph when the verify graph's layout is used), and drafts fed from
        ``draft_slots``."""
        if step.behind:
            k = self.num_speculative_tokens
            graphs = self.graphs.get(spec_kind("behind", row_len - 1, k)) if row_len is not None else None
            if graphs is not None and pad_to in graphs.sizes:  # the verify graph's layout: row i at i * row_len
                graphs.run(pad_to)  # type: ignore[arg-type]
            else:
                self.start_behind(step.behind)
        self.verify_draft_ids = None
        if step.drafts_fed:
            self.feed_device_drafts(step.drafts_fed)
            # The drafts as the forward reads them: what acceptance compares with (the host has placeholders).
            self.verify_draft_ids = self.batch.dev_bufs["input_ids"][device_tensor(step.draft_at, self.device,
                                                                                   torch.long)]

    def accept(self, logits: torch.Tensor, spec_rows: list[SpecRow], adjusted: torch.Tensor | None = None
               ) -> PendingSpec:
        """The acceptance of a step's verify rows (``logits``: theirs; ``adjusted``: after penalties, bias and
        masks, see ``SamplingState``), with each slot's next start and token."""
        pending = self.rejection_sampler.launch(logits, spec_rows, draft_ids=self.verify_draft_ids,
                                                adjusted=adjusted)
        self.advance_verified(pending.accepted, pending.emitted)
        return pending

    def device_chain(self, rows: list[ScheduledRow], spec_rows: list[SpecRow],
                     num_drafts: int | None = None) -> tuple[GraphSet, int] | None:
        """The ``draft`` graphs and size if this step's acceptance, commit, snapshots and drafting can all be
        enqueued before its result comes to the host: one rank (drafts kept in ``draft_slots``), every row a verify
        row the draft graph takes, no row asking for logprobs (those read logits the draft graph overwrites), no row
        under structured output (the host computes its next masks from its drafts)."""
        if not self.use_device_chain or self.draft_slots is None or self.drafter is None or not rows:
            return None
        q = self.num_speculative_tokens + 1
        if not all(r.is_verify and r.latest_start + q <= self.max_model_len for r in rows):
            return None
        if any(s.params.logprobs is not None for s in spec_rows):
            return None
        if any(r.grammar_bitmask is not None for r in rows):  # its next masks need its drafts on the host
            return None
        return self.drafter.draft_chain_graph(len(rows), num_drafts)

    def verify_and_draft_on_device(self, rows: list[ScheduledRow], spec_rows: list[SpecRow], logits: torch.Tensor,
                                   last_hidden: torch.Tensor, out: RunnerOutput, graphs: GraphSet,
                                   size: int, adjusted: torch.Tensor | None = None,
                                   num_drafts: int | None = None) -> StepResult:
        """Acceptance, candidate snapshots, commit of the accepted candidates and the whole drafting, enqueued on
        the device in that order, each reading the accepted counts there. The result waits for the acceptance's
        copy to the host: the commit and drafting run on, and the next step can be enqueued behind them, while
        the host applies this one."""
        assert self.proposer is not None and self.drafter is not None
        pending = self.accept_in_graph(rows, spec_rows, size) if adjusted is None else None
        if pending is None:
            pending = self.accept(logits, spec_rows, adjusted)
        accepted = pending.accepted
        if out.errors:  # rows whose sampling inputs failed: their state advances, their drafting is skipped
            failed = device_tensor([i in out.errors for i in range(len(rows))], self.device, torch.bool)
        else:
            failed = None
        self.state_ops.save_snapshots(rows, accepted)  # before the commit (RecurrentLayer.snapshot_candidates)
        self.state_ops.commit_verified(accepted)
        self.drafter.fill_draft_on_device(rows, accepted, pending.emitted, failed, size, last_hidden)
        tokens, first = graphs.run(size)
        n = len(rows)
        assert self.draft_slots is not None
        slots = self.drafter.draft_slots_index[:n]
        self.draft_slots.index_copy_(0, slots, tokens[:n])
        first = first[:n].clone()  # the next replay overwrites the graph's output; tests read it after
        proposer = self.proposer
        k = min(num_drafts or self.num_speculative_tokens, self.num_speculative_tokens)  # the graph's passes
        # What the host learns, once the acceptance's copy is in (StepResult.result). A row behind another has
        # its start on the device: it is reported with k drafts, which the scheduler trims as the device did
        # (DraftManager.num_drafts is the device's count).
        starts = [None if r.start_on_device else r.start for r in rows]
        limits = [r.draft_limit for r in rows]
        ids = [r.req_id for r in rows]

        def finish() -> None:
            take_verified(out, list(range(n)), pending.result())
            proposer.first_hidden = {}
            drafts: list[list[int]] = [[] for _ in range(n)]
            for i in range(n):
                if i in out.errors or out.num_accepted[i] < 0:
                    continue
                start = starts[i]
                num = k if start is None else max(0, min(k, limits[i] - (start + out.num_accepted[i] + 2)))
                if num:
                    drafts[i] = [PREVIOUS_DRAFT] * num
                    proposer.first_hidden[ids[i]] = first[i]
            out.next_draft_token_ids = drafts

        return StepResult(out, finish=finish)

    def accept_in_graph(self, rows: list[ScheduledRow], spec_rows: list[SpecRow], size: int) -> PendingSpec | None:
        """The greedy acceptance of a verify graph's step and ``advance_verified`` in one replay of the ``accept``
        graph (``_graph_accept``), with one copy of the counts and tokens to the host; None where it does not
        apply (a row that samples or has banned tokens, or the verify graph did not run at ``size``): then the
        rejection sampler decides, as it does everywhere else."""
        graphs = self.graphs.get(spec_kind("accept", self.batch.verify_graph_q - 1, self.num_speculative_tokens))
        if graphs is None or self.batch.verify_graph_size != size or size not in graphs.sizes:
            return None
        if not all(r.params.is_greedy and r.banned_token_ids is None and r.grammar_masks is None
                   and not r.params.adjusts_logits for r in spec_rows):
            return None
        n = len(rows)
        graphs.run(size)  # each row's number of drafts: from prepare
        summary = self.accept_summary[:n]
        host = summary.to("cpu", non_blocking=True) if self.device.type == "cuda" else summary.clone()
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return PendingSpec(summary[:, 0], summary[:, 1:], host, event, None)

    def _graph_accept(self, q: int, size: int) -> tuple[torch.Tensor, ...]:
        """``accept`` graph: the rejection sampler's greedy acceptance (``RejectionSampler.accept_greedy``) of
        ``size`` verify rows of ``q`` positions (k + 1, or k_step + 1 for ``accept@k_step``) from the verify graph's
        logits and fed tokens into ``accept_summary`` (per row: the count, then the emitted tokens, the last one at
        column count; the columns past q + 1 left as they were); then each row's next start and last token into its
        slot's entries (``advance_verified``)."""
        assert self.logits is not None
        drafts = self.batch.dev_bufs["input_ids"][: size * q].view(size, q)[:, 1:]
        accepted, emitted = self.rejection_sampler.accept_greedy(
            self.logits.f32[: size * q], drafts, self.batch.dev_bufs["draft_count"][:size],
            self.accept_summary[:size, : q + 1])
        self.advance_verified(accepted, emitted)
        return ()

    def feed_device_drafts(self, fed: list[tuple[int, int]]) -> None:
        """Verify-row inputs that the MTP head left on the device (``PREVIOUS_DRAFT``): ``fed`` = (token index in
        this step, flat index into ``draft_slots``: state slot * k + draft number)."""
        assert self.draft_slots is not None, "PREVIOUS_DRAFT inputs without device drafts"
        at = device_tensor([t for t, _ in fed], self.device, torch.long)
        src = device_tensor([j for _, j in fed], self.device, torch.long)
        self.batch.dev_bufs["input_ids"].index_copy_(0, at, self.draft_slots.view(-1).index_select(0, src))

    def start_behind(self, behind: list[tuple[int, int, int, int]]) -> None:
        """Verify rows scheduled behind their request's verify row in flight (``behind``: row, first token index,
        state slot, tokens: the step's k_step + 1): their start and first token are what that row's acceptance left
        in the slot's entries; their positions, KV slots and context lengths follow from the start, through their
        block tables on the device."""
        assert self.verify_next_start is not None and self.verify_next_token is not None
        bs = self.block_size
        d = self.batch.dev_bufs
        head = [x for b in behind for x in b[:3]]
        row, at, slot = device_tensor(head, self.device, torch.long).view(-1, 3).unbind(1)
        start = self.verify_next_start.index_select(0, slot)
        d["verify_starts"].index_copy_(0, row, start)  # verify rows come first: row i is verify row i
        d["input_ids"].index_copy_(0, at, self.verify_next_token.index_select(0, slot))
        # Every token of every such row: (its row among them, its offset in the row, its index in the step).
        flat = [(m, j, t + j) for m, (_, t, _, n) in enumerate(behind) for j in range(n)]
        which, off, tok = device_tensor([x for f in flat for x in f], self.device, torch.long).view(-1, 3).unbind(1)
        pos = start.index_select(0, which) + off
        d["positions"].index_copy_(0, tok, pos)
        tables = d["block_tables"].index_select(0, row.index_select(0, which)).long()
        kv = tables.gather(1, (pos // bs).unsqueeze(1)).squeeze(1) * bs + pos % bs
        d["slot_mapping"].index_copy_(0, tok, kv)
        lens = device_tensor([n for *_, n in behind], self.device, torch.long)
        d["seq_lens"].index_copy_(0, row, (start + lens).to(d["seq_lens"].dtype))

    def _graph_behind(self, q: int, size: int) -> tuple[torch.Tensor, ...]:
        """``behind`` graph: ``start_behind`` for a verify graph's ``size`` rows (row i's tokens at i * q, q = k + 1
        or k_step + 1 for ``behind@k_step``, the tail past its ``draft_count`` drafts masked), the rows behind
        flagged in the persistent ``behind`` buffer; the others, pads included, are left as the host laid them
        out."""
        assert self.verify_next_start is not None and self.verify_next_token is not None
        bs = self.block_size
        d = self.batch.dev_bufs
        flag = d["behind"][:size] > 0
        slots = d["state_slots"][:size]
        start = torch.where(flag, self.verify_next_start.index_select(0, slots), d["verify_starts"][:size])
        d["verify_starts"][:size].copy_(start)
        pos = start.unsqueeze(1) + torch.arange(q, device=self.device)  # (rows, q)
        moved = flag.unsqueeze(1)
        positions = d["positions"][: size * q].view(size, q)
        positions.copy_(torch.where(moved, pos, positions))
        tables = d["block_tables"][:size].long()
        slots_kv = tables.gather(1, (pos // bs).clamp(max=tables.shape[1] - 1)) * bs + pos % bs
        # A row with fewer than k drafts (the step's k_step) keeps its masked tail: no KV write there.
        real = torch.arange(q, device=self.device).unsqueeze(0) <= d["draft_count"][:size].unsqueeze(1)
        mapping = d["slot_mapping"][: size * q].view(size, q)
        mapping.copy_(torch.where(moved, torch.where(real, slots_kv, -1), mapping))
        seq_lens = d["seq_lens"][:size]
        seq_lens.copy_(torch.where(flag, start + q, seq_lens.long()).to(seq_lens.dtype))
        first = d["input_ids"][: size * q].view(size, q)[:, 0]
        first.copy_(torch.where(flag, self.verify_next_token.index_select(0, slots), first))
        return ()

    def resolve_starts(self, rows: list[ScheduledRow]) -> list[ScheduledRow]:
        """``rows`` with each row behind a verify row in flight replaced by a copy that has its start and first
        token, read from the device (a wait for the step before): for a step whose drafting comes to the host,
        which then needs the starts (rows that are not verify rows, no draft graph of its size). The step then
        runs as if they had been scheduled with them."""
        assert self.verify_next_start is not None and self.verify_next_token is not None
        behind = [i for i, r in enumerate(rows) if r.start_on_device]
        slots = device_tensor([rows[i].state_slot for i in behind], self.device, torch.long)
        starts = self.verify_next_start.index_select(0, slots).tolist()
        tokens = self.verify_next_token.index_select(0, slots).tolist()
        out = list(rows)
        for i, start, token in zip(behind, starts, tokens, strict=True):
            row = rows[i]
            cand = row.candidate_snapshot
            if cand is not None:  # as the scheduler will place it (Scheduler._place)
                point = candidate_point(start, row.num_new_tokens, self.block_size)
                cand = (point, cand[1]) if point is not None else None
            out[i] = dataclasses.replace(row, start=start, max_start=start, start_on_device=False,
                                         token_ids=[token, *row.token_ids[1:]], candidate_snapshot=cand)
        return out

    def advance_verified(self, accepted: torch.Tensor, emitted: torch.Tensor) -> None:
        """Each verify row's next start and last token into its slot's entries, from the accepted counts on the
        device (``emitted``: each row's tokens, the last one at column accepted): what a row behind it reads."""
        if self.verify_next_start is None or self.verify_next_token is None or not accepted.numel():
            return
        n = accepted.shape[0]
        slots = self.batch.dev_bufs["state_slots"][:n]
        a = accepted.clamp(min=0)  # an error row's request ends: what it leaves is never read
        self.verify_next_start.index_copy_(0, slots, self.batch.dev_bufs["verify_starts"][:n] + a + 1)
        self.verify_next_token.index_copy_(0, slots, emitted.gather(1, a.unsqueeze(1)).squeeze(1))

    def keep_drafts(self, rows: list[ScheduledRow], drafts: list[list[int]]) -> None:
        """Drafts that came to the host (the drafting passes ran one by one) also go to their rows of
        ``draft_slots``, where a verify row scheduled behind this step reads them."""
        if self.draft_slots is None:
            return
        k = self.num_speculative_tokens
        fill = [(r.state_slot, d) for r, d in zip(rows, drafts, strict=True) if d and PREVIOUS_DRAFT not in d]
        if fill:
            slots = device_tensor([s for s, _ in fill], self.device, torch.long)
            values = [t for _, d in fill for t in (*d, *[0] * (k - len(d)))]
            self.draft_slots.index_copy_(0, slots, device_tensor(values, self.device, torch.long).view(-1, k))

