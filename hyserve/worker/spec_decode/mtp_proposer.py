"""The MTP head as a proposer, on the worker side: it runs over the target's hidden states of the step just taken.

Position p of the MTP layer takes (token p+1, the target's hidden state at p). After a step, every position it
computed whose next token is now known is consumed: a prefill chunk's positions (the token after the chunk is sent
as ``next_token_id``, or is the token just sampled), a verify row's accepted positions (their next tokens are the
accepted drafts and the correction). This writes the MTP KV entries of those positions before their blocks can be
published (prefix caching relies on it: docs/design.md invariant 5), and the layer's output at the last position
gives the first draft; further drafts feed the layer its own output, one greedy token per pass. The KV blocks those
passes write were allocated by the scheduler with the step (its lookahead); the scheduler trims the drafts to what
each request may still produce.
"""

from __future__ import annotations

import torch

from hyserve.scheduler.output import RunnerOutput, ScheduledRow
from hyserve.utils import device_tensor
from hyserve.worker.spec_decode.mtp_drafter import ChainRow, MTPDrafter, MTPRow


class MTPProposer:
    def __init__(self, num_speculative_tokens: int, drafter: MTPDrafter) -> None:
        self.k = num_speculative_tokens
        self.drafter = drafter
        # The layer's output that proposed each request's first draft in the last step (tests compare them).
        self.first_hidden: dict[str, torch.Tensor] = {}

    def propose(self, rows: list[ScheduledRow], out: RunnerOutput, last_hidden: torch.Tensor,
                draft_slots: torch.Tensor | None, num_drafts: int | None = None) -> list[list[int]]:
        """Consume the step's positions (see the module docstring; ``last_hidden``: the target's hidden states of
        the step); up to ``num_drafts`` (k by default) drafts for every row that sampled (placeholders for those
        left in ``draft_slots``)."""
        self.first_hidden = {}
        k_max = self.k if num_drafts is None else min(num_drafts, self.k)
        chained = self._propose_in_one_graph(rows, out, last_hidden, draft_slots, k_max)
        if chained is not None:
            return chained
        drafts: list[list[int]] = [[] for _ in rows]
        mrows: list[MTPRow] = []
        owners: list[int] = []
        offset = 0
        for i, row in enumerate(rows):
            start, t0 = row.start, offset
            offset += row.num_new_tokens
            if i in out.errors:
                continue
            if row.is_verify:
                if out.num_accepted[i] < 0:
                    continue
                inputs = out.token_ids[i]  # the accepted drafts and the correction: tokens start+1 .. start+a+1
            elif row.samples:
                inputs = [*row.token_ids[1:], out.token_ids[i][0]]
            else:
                if row.next_token_id is None:
                    continue
                inputs = [*row.token_ids[1:], row.next_token_id]
            mrows.append(MTPRow(start, inputs, list(range(t0, t0 + len(inputs))), row.block_table, row.req_id))
            owners.append(i)
        if not mrows:
            return drafts
        if k_max == 0:  # no drafts wanted: the MTP KV entries of the step's positions only, no LM head
            self.drafter.mtp_forward(mrows, last_hidden)
            return drafts
        hidden, first = self.drafter.mtp_draft(mrows, last_hidden)
        live: list[tuple[int, int, int, int]] = []  # (row, drafts wanted, index into hidden, last consumed position)
        for n, (i, mrow) in enumerate(zip(owners, mrows, strict=True)):
            row = rows[i]
            if not row.samples:
                continue
            num_tokens = mrow.start + len(mrow.input_ids) + 1  # known tokens after the step
            k = min(k_max, row.draft_limit - num_tokens)
            if k > 0:
                drafts[i] = [first[n]]
                self.first_hidden[row.req_id] = hidden[n]
                live.append((i, k, n, num_tokens - 2))
        if not live:
            return drafts
        h = hidden[device_tensor([n for _, _, n, _ in live], hidden.device, torch.long)]
        j = 1
        while True:
            keep = [m for m, (i, k, _, _) in enumerate(live) if len(drafts[i]) < k]
            if not keep:
                break
            passes: list[MTPRow] = []
            for m in keep:
                i, _, _, last = live[m]
                passes.append(MTPRow(last + j, [drafts[i][-1]], [len(passes)], rows[i].block_table, rows[i].req_id))
            h, tokens = self.drafter.mtp_draft(passes, h[keep] if len(keep) < len(live) else h)
            for m, tok in zip(keep, tokens, strict=True):
                drafts[live[m][0]].append(tok)
            live = [live[m] for m in keep]
            j += 1
        return drafts

    def _propose_in_one_graph(self, rows: list[ScheduledRow], out: RunnerOutput, last_hidden: torch.Tensor,
                              draft_slots: torch.Tensor | None, k_max: int) -> list[list[int]] | None:
        """A step of verify rows only: the whole drafting in one replay of the ``draft`` graph (first pass over
        each row's accepted positions, then the chained passes on the device) and one copy of the tokens to the
        host; None where no graph fits (then the passes run one by one)."""
        q = self.k + 1
        if not all(r.is_verify and r.start + q <= self.drafter.max_model_len for r in rows):
            return None
        graph = self.drafter.draft_chain_graph(len(rows), k_max)
        if graph is None:
            return None
        chain: list[ChainRow] = []
        owners: list[int] = []
        offset = 0
        for i, row in enumerate(rows):
            t0 = offset
            offset += row.num_new_tokens
            if i in out.errors or out.num_accepted[i] < 0:
                continue
            inputs = out.token_ids[i]  # the accepted drafts and the correction: tokens start+1 .. start+a+1
            num_tokens = row.start + len(inputs) + 1  # known tokens after the step
            chain.append(ChainRow(row.start, inputs, list(range(t0, t0 + len(inputs))), row.block_table,
                                  max(0, min(k_max, row.draft_limit - num_tokens)), row.state_slot,
                                  self.drafter.mm.position_shift(row.req_id, row.start)))
            owners.append(i)
        drafts: list[list[int]] = [[] for _ in rows]
        if not chain:
            return drafts
        hidden, tokens = self.drafter.mtp_draft_chain(chain, last_hidden, *graph, draft_slots)
        for n, (i, crow) in enumerate(zip(owners, chain, strict=True)):
            if crow.num_drafts:
                drafts[i] = tokens[n]
                self.first_hidden[rows[i].req_id] = hidden[n]
        return drafts
