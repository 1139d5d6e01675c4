# mypy: disable-error-code="misc"
"""The engine's speculative-decoding step (a mixin of ``LLMEngine``, kept apart so the plain step stays short).

A decoding request is one verify row [last token + drafts] in an ordinary batch beside prefill chunks. Its GDN
layers compute per-position candidates into scratch; after acceptance of ``a`` drafts the live slot takes candidate
``a`` (docs/design.md invariant 2) through the row's slot index, ``num_computed_tokens`` advances by ``a + 1``, KV
blocks holding only rejected positions are freed, and only verified positions are published (invariant 3). Proposals
for the next step come from the n-gram proposer or the MTP head (``_mtp_consume`` / ``_mtp_propose``).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from hyserve.engine.model_runner import MTPRow
from hyserve.engine.output_processor import NewTokens
from hyserve.engine.request import Request
from hyserve.engine.scheduler import ScheduledRow
from hyserve.layers.rejection_sampler import SpecRow
from hyserve.outputs import RequestOutput

if TYPE_CHECKING:
    from hyserve.engine.llm_engine import LLMEngine

logger = logging.getLogger("hyserve")


def token_seed(seed: int, output_index: int) -> int:
    """A per-token seed that depends only on the request's seed and the token's index in the output."""
    x = (seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + 1) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


class SpeculativeStepMixin:
    """Methods of ``LLMEngine`` (their ``self`` is the engine)."""

    def _step_speculative(self: LLMEngine, rows: list[ScheduledRow]) -> list[RequestOutput]:
        """One step with verify rows ([last token + drafts]) and prefill chunks together.

        Verify rows compute their GDN candidates into scratch; after acceptance of ``a`` drafts the live slot takes
        candidate ``a`` (invariant 2), ``num_computed_tokens`` advances by ``a + 1``, and KV blocks that only hold
        rejected positions are freed. Only verified positions are published to the prefix cache (invariant 3).
        """
        assert self.rejection_sampler is not None
        t0 = time.perf_counter()
        rows = sorted(rows, key=lambda r: not r.is_verify)  # stable: verify rows first, as the runner needs
        # Every row's sampling inputs are built before the forward: a request whose inputs fail leaves the step alone.
        spec_rows = {id(r): self._guard(r.request, "building its verify row", functools.partial(self._spec_row, r))
                     for r in rows if r.is_verify}
        sampling_rows, sampled = self._sampling_rows([r for r in rows if not r.is_verify and r.samples])
        failed_outputs: list[RequestOutput] = []
        rows = self._drop_failed(rows, failed_outputs)
        if not rows:
            return failed_outputs
        vrows = [r for r in rows if r.is_verify]
        logits = self.runner.execute_spec(rows)
        n_verify = sum(r.num_new_tokens for r in vrows)
        spec_out = None
        if vrows:
            spec_out = self.rejection_sampler(logits[:n_verify], [spec_rows[id(r)] for r in vrows])
        samp_out = self.runner.sampler(logits[n_verify:], sampling_rows) if sampling_rows else None
        accepted: list[int] = []
        if spec_out is not None:
            errors = set(spec_out.error_rows)
            accepted = [-1 if i in errors else spec_out.num_accepted[i] for i in range(len(vrows))]
            self.runner.commit_verified(accepted)
            self.metrics.on_verify([len(r.draft_token_ids) for r in vrows], accepted)
            if self.metrics.num_steps % 200 == 0 and self.metrics.spec_num_drafts:
                logger.info("speculative decoding: mean acceptance length %.2f over %d drafts",
                            self.metrics.mean_acceptance_length, self.metrics.spec_num_drafts)
        for row in rows:
            if not row.is_verify:
                row.request.num_computed_tokens = row.end
        for row, a in zip(vrows, accepted, strict=True):
            row.request.num_computed_tokens = row.start + max(a, 0) + 1
        # Tokens are appended before publishing (block keys need them); requests that finish here release their
        # memory only after their verified blocks and snapshots are published.
        deferred: list[Request] = []
        self._deferred_finish = deferred
        try:
            if samp_out is not None:
                self._apply_samples(sampled, samp_out)
            if spec_out is not None:
                self._apply_verified(vrows, spec_out)
            if self.use_mtp:
                self._mtp_consume(rows, vrows, accepted)
            if self.prefix_cache is not None:
                self._publish(rows, vrows, accepted)
        finally:
            self._deferred_finish = None
            for req in deferred:
                self.scheduler.finish(req)
        self._rollback_and_propose(rows)
        outputs = failed_outputs
        for row in rows:
            self._emit(row.request, outputs)
        for row in rows:
            if row.request.is_finished:
                self.requests.pop(row.request.request_id, None)
        n_emitted = sum(len(t) for t in spec_out.token_ids) if spec_out is not None else 0
        self.metrics.on_step(sum(r.num_new_tokens for r in rows), len(sampled) + n_emitted,
                             time.perf_counter() - t0)
        return outputs

    def _spec_row(self: LLMEngine, row: ScheduledRow) -> SpecRow:
        req = row.request
        p = req.sampling_params
        k = len(row.draft_token_ids)
        n_out = req.num_output_tokens
        seeds: list[int | None] | None = None
        if p.seed is not None:
            seeds = [token_seed(p.seed, n_out + j) for j in range(k + 1)]
        banned = [self._banned(req, n_out + j) for j in range(k + 1)]
        return SpecRow(params=p, draft_token_ids=list(row.draft_token_ids), seeds=seeds,
                       banned_token_ids=banned if any(banned) else None)

    def _banned(self: LLMEngine, req: Request, output_index: int) -> list[int]:
        """Token ids banned at output ``output_index`` (min_tokens); ValueError for an id outside the vocabulary,
        which would fail the sampler for every row of the step."""
        p = req.sampling_params
        if output_index >= p.min_tokens:
            return []
        banned = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids))
        vocab = self.model_config.vocab_size
        if banned and not (banned[0] >= 0 and banned[-1] < vocab):
            raise ValueError(f"stop_token_ids / EOS ids {banned[:5]} reach outside the vocabulary [0, {vocab})")
        return banned

    def _apply_verified(self: LLMEngine, vrows: list[ScheduledRow], out: Any) -> None:
        errors = set(out.error_rows)
        for i, row in enumerate(vrows):
            req = row.request
            if i in errors:
                req.error = "non-finite logits"
                logger.error("request %s: logits contain NaN/inf while verifying drafts; finishing it with an error",
                             req.request_id)
                self._finish(req, "error")
                continue
            self._guard(req, "taking its verified tokens", functools.partial(self._apply_verified_row, req, i, out))

    def _apply_verified_row(self: LLMEngine, req: Request, i: int, out: Any) -> None:
        """Hand verify row ``i``'s emitted tokens to the output processor (which drops any after a stop)."""
        new = NewTokens([int(t) for t in out.token_ids[i]])
        if out.logprobs is not None:
            new.logprobs = [float(x) for x in out.logprobs[i]]
            new.ranks = list(out.ranks[i]) if out.ranks is not None else None
            new.top_logprobs = list(out.top_logprobs[i]) if out.top_logprobs is not None else None
        self._append_tokens(req, new)

    def _row_offsets(self: LLMEngine, rows: list[ScheduledRow]) -> list[int]:
        offsets, t = [], 0
        for r in rows:
            offsets.append(t)
            t += r.num_new_tokens
        return offsets

    def _mtp_consume(self: LLMEngine, rows: list[ScheduledRow], vrows: list[ScheduledRow], accepted: list[int]) -> None:
        """Run the MTP layer over every position this step verified whose next token is now known.

        Position p takes (token p+1, the target's hidden state at p); this writes the MTP KV entries of those
        positions before their blocks can be published, and its output at the last position proposes the first
        draft. After it, the entries of every position before the request's last known token are written, which is
        what publishing relies on. A prefix hit needs nothing here: with MTP a cached block's key covers the token
        after it, so its entries are the hitting request's own (``prefix_cache``, lookahead).
        """
        runner = self.runner
        assert runner.last_hidden is not None
        offsets = self._row_offsets(rows)
        verify_accepted = {id(r): a for r, a in zip(vrows, accepted, strict=True)}
        mrows: list[MTPRow] = []
        owners: list[Request] = []
        for idx, row in enumerate(rows):
            req = row.request
            consumed = verify_accepted[id(row)] + 1 if row.is_verify else row.num_new_tokens
            end = min(row.start + consumed, req.num_tokens - 1)
            if consumed <= 0 or end <= row.start:
                continue
            start = row.start
            hidden_index = [offsets[idx] + j for j in range(end - start)]
            mrows.append(MTPRow(start, req.token_ids(start + 1, end + 1), hidden_index, list(req.block_table)))
            owners.append(req)
        if not mrows:
            return
        out, tokens = runner.mtp_draft(mrows, runner.last_hidden)
        for i, (req, mrow) in enumerate(zip(owners, mrows, strict=True)):
            self._mtp_next[req.request_id] = (out[i], tokens[i], mrow.start + len(mrow.input_ids))

    def _mtp_propose(self: LLMEngine, todo: list[Request], ks: list[int]) -> None:
        """Greedy MTP drafts: the first from ``_mtp_consume``, the rest by feeding the layer its own output."""
        runner = self.runner
        bs = self.config.block_size
        live = []
        for req, k in zip(todo, ks, strict=True):
            entry = self._mtp_next.get(req.request_id)
            # The consumed positions must end right before the request's last token, or the draft is stale.
            if entry is None or entry[2] != req.num_tokens - 1:
                continue
            req.draft_token_ids = [entry[1]]
            live.append((req, k, entry[0]))
        hidden = torch.stack([h for _, _, h in live]) if live else None
        j = 1
        while live and hidden is not None:
            keep = []
            for i, (req, k, _) in enumerate(live):
                pos = req.num_tokens - 2 + j
                if len(req.draft_token_ids) >= k:
                    continue
                if pos // bs >= len(req.block_table):
                    if runner.block_pool.num_free_blocks == 0:
                        continue
                    req.block_table.extend(runner.block_pool.allocate(1))
                keep.append(i)
            if not keep:
                break
            mrows = [MTPRow(live[i][0].num_tokens - 2 + j, [live[i][0].draft_token_ids[-1]], [n],
                            list(live[i][0].block_table)) for n, i in enumerate(keep)]
            out, tokens = runner.mtp_draft(mrows, hidden[keep])
            for n, tok in enumerate(tokens):
                live[keep[n]][0].draft_token_ids.append(tok)
            live = [live[i] for i in keep]
            hidden = out
            j += 1

    def _rollback_and_propose(self: LLMEngine, rows: list[ScheduledRow]) -> None:
        """Free KV blocks that hold only rejected positions; propose drafts for requests that decode next."""
        assert self.spec_config is not None
        pool = self.runner.block_pool
        bs = self.config.block_size
        todo: list[Request] = []
        ks: list[int] = []
        for row in rows:
            req = row.request
            if req.is_finished:
                continue
            keep = max(-(-req.num_tokens // bs), req.num_published_blocks)
            if len(req.block_table) > keep:
                pool.free(req.block_table[keep:])
                del req.block_table[keep:]
            req.draft_token_ids = []
            if req.is_decoding:
                p = req.sampling_params
                max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len
                # At most k + 1 tokens are emitted per verify step; positions stay below max_model_len.
                k = min(self.spec_config.num_speculative_tokens, max_tokens - req.num_output_tokens - 1,
                        self.max_model_len - req.num_tokens)
                if k > 0:
                    todo.append(req)
                    ks.append(k)
        if self.proposer is not None:
            for req, drafts, k in zip(todo, self.proposer.propose(todo, ks), ks, strict=True):
                req.draft_token_ids = [int(t) for t in drafts[:k]]
        elif self.use_mtp:
            self._mtp_propose(todo, ks)
        self._mtp_next.clear()
