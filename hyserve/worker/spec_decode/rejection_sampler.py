"""The rejection sampler: the acceptance step of speculative decoding.

A proposer (n-gram lookup, a draft head, an MTP head) guesses ``k_r`` tokens for row ``r``; the target model then
scores the context followed by those drafts in one forward pass, giving ``k_r + 1`` logits rows: position ``j``
holds the target's logits for the token after ``context + drafts[:j]``. This module decides how many drafts to
keep (``a_r``) and emits one more token after them, so each row advances by ``a_r + 1`` tokens per target pass.

**Layout.** ``target_logits`` is ``(sum_r (k_r + 1), V)``; row ``r``'s positions are contiguous and in order.
``draft_probs`` is, per row, ``None`` (a deterministic proposer: the proposal ``q`` is one-hot on the draft) or a
``(k_r, V)`` tensor of the distributions the drafts were *sampled* from; a single tensor means
``(sum_r k_r, V)``, all rows' proposals stacked in row order (the entries of greedy rows are ignored).

**Adjusted logits** (``adjusted``: penalties, bias and masks, made by the caller from the tokens before each
position, drafts included) replace the target's logits in everything below but errors and logprobs.

**Per position, before anything else** (exactly as the Sampler, for each position separately):
bans (``banned_token_ids[j]``, e.g. EOS below ``min_tokens``) are set to -inf, and a position whose raw logits
hold NaN/+inf or have nothing finite left after the bans is *non-finite*.

**Greedy rows** (``params.is_greedy``): draft ``j`` is accepted iff it equals the argmax of position ``j`` (ties to
the lowest id, as the Sampler), stopping at the first mismatch; the extra token is the argmax of the stopping
position (a correction, or the bonus token at position ``k_r``). The result is token for token what plain greedy
decoding would produce. Proposal distributions are irrelevant (and ignored): speculative sampling with a one-hot
target reduces to exactly this rule whatever ``q`` is.

**Sampled rows**: standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023) on the *processed*
target distribution ``p_j`` (temperature -> top-k -> top-p -> min-p, exactly the Sampler's processing, see
``process_logits``): draft ``x_j`` is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))`` (``u * q < p``
with ``u ~ U[0, 1)``); at the first rejection the extra token is drawn from the residual
``norm(max(0, p_j - q_j))``, and if all ``k_r`` drafts are accepted from ``p_{k_r}`` (the bonus token). Each
emitted token is then distributed as the target's own processed distribution given the tokens before it. With a
one-hot ``q`` this is: accept with probability ``p_j(x_j)``; the residual is ``p_j`` with ``x_j`` removed
(computed exactly, as the processed logits with ``x_j`` masked). Draws are Gumbel-max with exponential noise, as
the Sampler. If a residual is empty (``p_j <= q_j`` everywhere, which exact arithmetic makes unreachable after a
rejection) the token is drawn from ``p_j``.

**Randomness.** Every target position of a sampled row consumes ``V`` exponentials (its correction/bonus noise)
then one uniform (its acceptance test), whether or not the position ends up being used. With
``seeds[j]`` set, both come from a generator re-seeded with that seed, so a row's result is a function of its own
logits, params, drafts, proposals and seeds alone (not of the batch); the noise is the very values the Sampler
draws for that seed, so a row with no drafts emits what the Sampler emits for the same logits and seed. Unseeded
positions share the sampler's own generator (seeded at construction): reproducible for a fixed sequence of
batches, not batch-independent. Greedy rows draw nothing.

**Errors.** A row is an error row iff the walk reaches a non-finite position: a non-finite position rejects its
draft, and the row fails if that stopping position is non-finite. Positions after the first rejection are not
needed (plain decoding would never have computed them), so garbage there does not fail the row. An error row
emits nothing (``num_accepted`` 0, ``token_ids`` ``[]``), and nothing about it leaks into other rows.

**Logprobs** (only when some row asks, ``params.logprobs is not None``) are those of the raw ``log_softmax`` of
the position each emitted token came from (vLLM's ``raw_logprobs``), as the Sampler's.

Cost: one host sync for the results (logprobs add a few when asked). An all-greedy batch costs one ``max`` over
the logits, a comparison with the drafts and a cumprod over a ``(rows, k_max + 1)`` matrix; no sort, no draws.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hyserve.layers.sampler import Sampler, apply_grammar_masks
from hyserve.sampling_params import SamplingParams
from hyserve.utils import device_tensor

_SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF  # torch generators take seeds in [0, 2**64)


@dataclass(slots=True)
class SpecRow:
    """One row's drafts and how to judge them.

    - ``draft_token_ids``: the ``k_r >= 0`` proposed tokens, ids in ``[0, V)``.
    - ``seeds``: ``None`` (unseeded: the sampler's generator) or ``k_r + 1`` per-position seeds (one per target
      position, each ``None`` or an int): the engine derives them from (request seed, output index).
    - ``banned_token_ids``: ``None`` or ``k_r + 1`` lists, the tokens banned at each target position.
    - ``grammar_masks``: structured output: ``None`` or the packed bitmasks of the ``k_r + 1`` target positions
      (``hyserve.structured_output.bitmask``), each position's allowed tokens given the drafts before it.
    """

    params: SamplingParams
    draft_token_ids: list[int]
    seeds: list[int | None] | None = None
    banned_token_ids: list[list[int]] | None = None
    grammar_masks: bytes | None = None


@dataclass(slots=True)
class SpecOutput:
    """Per-row results, in the order of the input rows.

    - ``num_accepted[r]``: ``a_r`` in ``0..k_r``, the number of drafts kept (0 for an error row).
    - ``token_ids[r]``: the ``a_r`` accepted drafts followed by the correction (or the bonus token when
      ``a_r == k_r``): ``a_r + 1`` tokens; ``[]`` for an error row.
    - ``logprobs``: ``None`` if no row asked; otherwise, per row, the raw logprob of each emitted token for rows
      that asked, ``[]`` for the others and for error rows.
    - ``top_logprobs``: ``None`` if no row asked; otherwise, per row and emitted token, the top
      ``params.logprobs`` (id, logprob) pairs of that position, by descending logprob (``[]`` for other rows).
    - ``ranks``: ``None`` if no row asked; otherwise, per row and emitted token, its 1-based rank in the raw
      distribution of its position (``[]`` for other rows).
    - ``error_rows``: ascending, the rows whose walk reached non-finite logits; they emit nothing.
    """

    num_accepted: list[int]
    token_ids: list[list[int]]
    logprobs: list[list[float]] | None
    error_rows: list[int]
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    ranks: list[list[int]] | None = None


def process_logits(x: torch.Tensor, row_max: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The Sampler's processing of sampled rows: temperature -> top-k -> top-p -> min-p, in logit space.

    ``x`` (owned; modified in place and possibly returned) holds one row per entry of ``params``, bans already
    at -inf; ``row_max`` is each row's maximum (finite). Returns the processed logits, masked entries at -inf;
    ``softmax`` of a row is its processed distribution. This is the body of ``Sampler._sample`` before the draw
    (the Sampler keeps its own inline copy; it could call this function instead) and reuses its static
    top-k/top-p helpers, so the two cannot disagree on what a truncation keeps.
    """
    vocab = x.shape[1]
    temperature = device_tensor([p.temperature for p in params], x.device)
    x.sub_(row_max.unsqueeze(1)).div_(temperature.unsqueeze(1))

    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(p.top_p < 1.0 for p in params):
        x = Sampler._apply_top_k_top_p(x, top_k, [p.top_p for p in params])
    elif any(top_k):
        Sampler._apply_top_k(x, top_k)
    if any(p.min_p > 0.0 for p in params):
        log_min_p = device_tensor([math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in params], x.device)
        x.masked_fill_(x < log_min_p.unsqueeze(1), -math.inf)
    return x


class RejectionSampler:
    """Accepts or rejects each row's drafts against the target logits; owns the generator of unseeded rows."""

    def __init__(self, device: torch.device | str, seed: int = 0,
                 synthetic_rates: Sequence[float] | None = None) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed & _SEED_MASK)
        # Re-seeded for every seeded position: after manual_seed its stream depends on the seed alone.
        self._row_generator = torch.Generator(device=self.device)
        # speculative_config's rejection_sample_method "synthetic" (vLLM's, for benchmarks): each draft's verdict
        # drawn, position j kept with probability synthetic[j] given that the positions before it were (the
        # conditional of synthetic_acceptance_rates), for every row; the token after the kept drafts is the target's
        # greedy one. The outputs are then not the model's; the timing is the engine's at that acceptance.
        self.synthetic: torch.Tensor | None = None
        if synthetic_rates is not None:
            from hyserve.speculative.config import conditional_rates

            self.synthetic = torch.tensor(conditional_rates(tuple(synthetic_rates)), dtype=torch.float32,
                                          device=self.device)

    def verdicts(self, target_tokens: torch.Tensor, drafts: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Whether each draft is kept if the walk gets there: the greedy rule (``greedy_accepts``), or under the
        synthetic method a draw at its position's rate (``positions``: each draft's 0-based position in its row,
        broadcastable to ``drafts``; inside the verify graphs the draw is part of the graph)."""
        if self.synthetic is None:
            return greedy_accepts(target_tokens, drafts)
        return torch.rand(drafts.shape, device=drafts.device) < self.synthetic[positions]

    def __call__(
        self,
        target_logits: torch.Tensor,
        rows: list[SpecRow],
        draft_probs: torch.Tensor | list[torch.Tensor | None] | None = None,
        draft_ids: torch.Tensor | None = None,
    ) -> SpecOutput:
        """``draft_ids``: the drafts as a ``(sum_r k_r,)`` device tensor in row order, which then stand for the rows'
        ``draft_token_ids`` (those are placeholders, or the same values): drafts that never went to the host."""
        return self.launch(target_logits, rows, draft_probs, draft_ids).result()

    def launch(
        self,
        target_logits: torch.Tensor,
        rows: list[SpecRow],
        draft_probs: torch.Tensor | list[torch.Tensor | None] | None = None,
        draft_ids: torch.Tensor | None = None,
        adjusted: torch.Tensor | None = None,
    ) -> PendingSpec:
        """Enqueue the acceptance on the device; its ``PendingSpec`` has the results on the device at once
        (``accepted``, ``emitted``) and on the host at ``result()``, one copy. Rows that ask for logprobs read
        ``target_logits`` in ``result()``: nothing may overwrite them before. ``adjusted`` (float32, the shape of
        ``target_logits``): each position's logits after penalties, bias and masks, which acceptance judges by
        (the target distribution); errors and logprobs read the raw ``target_logits``."""
        num_rows = len(rows)
        counts = [len(r.draft_token_ids) for r in rows]
        num_pos = sum(counts) + num_rows
        if target_logits.dim() != 2 or target_logits.shape[0] != num_pos:
            raise ValueError(
                f"target_logits must have shape (sum of (num drafts + 1) = {num_pos}, V), "
                f"got {tuple(target_logits.shape)}"
            )
        if num_rows == 0:
            return PendingSpec.empty(self.device)
        vocab = target_logits.shape[1]
        logits = target_logits.to(device=self.device, dtype=torch.float32)
        starts = [0] * num_rows
        for r in range(1, num_rows):
            starts[r] = starts[r - 1] + counts[r - 1] + 1
        self._validate(rows, counts, vocab, host_drafts=draft_ids is None)
        if draft_ids is not None and tuple(draft_ids.shape) != (sum(counts),):
            raise ValueError(f"draft_ids must have shape (sum of num drafts = {sum(counts)},), "
                             f"got {tuple(draft_ids.shape)}")
        proposals = self._split_draft_probs(draft_probs, counts, vocab)
        if draft_ids is not None:
            drafts_t = draft_ids.to(self.device, torch.long)
        else:
            drafts_t = device_tensor([t for r in rows for t in r.draft_token_ids], self.device, torch.long)

        if adjusted is not None and adjusted.shape != logits.shape:
            raise ValueError(f"adjusted must have the shape of target_logits {tuple(logits.shape)}, "
                             f"got {tuple(adjusted.shape)}")
        masked = self._apply_bans(logits if adjusted is None else adjusted, rows, starts)
        # One pass: the greedy token of every position (first maximum = lowest id) and its maximum. max()
        # propagates NaN, so a non-finite maximum flags NaN, +inf and "nothing left" alike.
        best_val, final_tok = masked.max(dim=1)
        finite = torch.isfinite(best_val)
        if masked is not logits:  # a NaN on a banned position is still garbage from the model
            finite &= torch.isfinite(logits.amax(dim=1))

        # accept[i]: the draft at position i is kept (if the walk gets there); bonus positions stay False.
        # final_tok[i]: the token emitted if the walk stops at position i. Greedy rule first, for every position.
        accept = torch.zeros(num_pos, dtype=torch.bool, device=self.device)
        draft_pos = [starts[r] + j for r in range(num_rows) for j in range(counts[r])]
        if draft_pos:
            pos_t = device_tensor(draft_pos, self.device)
            j_t = device_tensor([j for r in range(num_rows) for j in range(counts[r])], self.device, torch.long)
            accept[pos_t] = self.verdicts(final_tok.index_select(0, pos_t), drafts_t, j_t)

        sampled = [r for r in range(num_rows) if not rows[r].params.is_greedy]
        if sampled and self.synthetic is None:
            self._speculate(masked, best_val, finite, rows, counts, starts, sampled, proposals, accept, final_tok,
                            drafts_t)

        # The walk over a (rows, k_max + 1) layout: ragged rows padded at their end, where nothing is accepted, so
        # no row's walk reaches past its own drafts.
        width = max(counts) + 1
        if all(c + 1 == width for c in counts):
            def pad(flat: torch.Tensor, cols: int = width) -> torch.Tensor:
                return flat.view(num_rows, cols)
        else:
            def pad(flat: torch.Tensor, cols: int = width) -> torch.Tensor:
                at = [r * cols + j for r in range(num_rows) for j in range(counts[r] + cols - width + 1)]
                out = torch.zeros(num_rows * cols, dtype=flat.dtype, device=self.device)
                out[device_tensor(at, self.device, torch.long)] = flat
                return out.view(num_rows, cols)
        emitted = torch.empty(num_rows, width, dtype=torch.long, device=self.device)
        accepted, _ = walk(pad(accept)[:, : width - 1], pad(final_tok), pad(finite), pad(drafts_t, width - 1),
                           emitted)
        # One copy to the host: (accepted, emitted) per row.
        summary = torch.cat([accepted.unsqueeze(1), emitted], dim=1)
        host = summary.to("cpu", non_blocking=True) if self.device.type == "cuda" else summary
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return PendingSpec(accepted, emitted, host, event, (self, logits, rows, starts))

    def accept_greedy(self, logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, out: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """``launch``'s decision for greedy rows without bans, over the fixed layout of a verify graph (the
        ``accept`` graph captures it): ``logits`` float32 ``(rows * (k + 1), V)``, ``drafts`` ``(rows, k)`` (columns
        past a row's ``num_drafts`` are never accepted), into ``out`` ``(rows, k + 2)``: the count (-1: an error
        row), then the emitted tokens, the last one at column count. Draws nothing (but the synthetic method's
        verdicts) and reads only its arguments; returns (accepted, emitted) of ``out``."""
        size, k = drafts.shape
        best, tok = logits.max(dim=1)  # first maximum, as in launch
        finite = torch.isfinite(best).view(size, k + 1)
        tok = tok.view(size, k + 1)
        j = torch.arange(k, device=logits.device)
        accept = self.verdicts(tok[:, :k], drafts, j) & (j.unsqueeze(0) < num_drafts.unsqueeze(1))
        accepted, emitted = walk(accept, tok, finite, drafts, out[:, 1:])
        out[:, 0].copy_(accepted)
        return accepted, emitted

    # ------------------------------------------------------------------------------------------------------------
    # Inputs

    @staticmethod
    def _validate(rows: list[SpecRow], counts: list[int], vocab: int, host_drafts: bool = True) -> None:
        for r, (row, k) in enumerate(zip(rows, counts, strict=True)):
            ids = row.draft_token_ids
            if host_drafts and ids and not (min(ids) >= 0 and max(ids) < vocab):
                raise ValueError(f"row {r}: draft token ids {row.draft_token_ids} outside the vocabulary [0, {vocab})")
            if row.seeds is not None and len(row.seeds) != k + 1:
                raise ValueError(f"row {r}: {k} drafts need {k + 1} seeds (one per target position), got {row.seeds}")
            if row.banned_token_ids is not None and len(row.banned_token_ids) != k + 1:
                raise ValueError(
                    f"row {r}: {k} drafts need {k + 1} banned-token lists (one per target position), "
                    f"got {len(row.banned_token_ids)}"
                )
            if row.grammar_masks is not None and len(row.grammar_masks) != (k + 1) * 4 * ((vocab + 31) // 32):
                raise ValueError(f"row {r}: {k} drafts need {k + 1} grammar masks of {(vocab + 31) // 32} words")

    def _split_draft_probs(
        self, draft_probs: torch.Tensor | list[torch.Tensor | None] | None, counts: list[int], vocab: int
    ) -> list[torch.Tensor | None]:
        if draft_probs is None:
            return [None] * len(counts)
        if isinstance(draft_probs, torch.Tensor):
            if draft_probs.shape != (sum(counts), vocab):
                raise ValueError(
                    f"draft_probs must have shape (sum of num drafts = {sum(counts)}, {vocab}), "
                    f"got {tuple(draft_probs.shape)}"
                )
            return list(draft_probs.to(device=self.device, dtype=torch.float32).split(counts))
        if len(draft_probs) != len(counts):
            raise ValueError(f"draft_probs must have one entry per row ({len(counts)}), got {len(draft_probs)}")
        out: list[torch.Tensor | None] = []
        for r, (q, k) in enumerate(zip(draft_probs, counts, strict=True)):
            if q is not None and q.shape != (k, vocab):
                raise ValueError(f"row {r}: draft_probs must have shape ({k}, {vocab}), got {tuple(q.shape)}")
            out.append(None if q is None else q.to(device=self.device, dtype=torch.float32))
        return out

    def _apply_bans(self, logits: torch.Tensor, rows: list[SpecRow], starts: list[int]) -> torch.Tensor:
        """Returns ``logits`` itself when nothing is banned, else a copy with the banned entries at -inf."""
        pos_ids: list[int] = []
        token_ids: list[int] = []
        vocab = logits.shape[1]
        for r, row in enumerate(rows):
            for j, banned in enumerate(row.banned_token_ids or ()):
                for t in banned:
                    if not 0 <= t < vocab:
                        raise ValueError(f"row {r}: banned token id {t} is outside the vocabulary [0, {vocab})")
                    pos_ids.append(starts[r] + j)
                    token_ids.append(t)
        constrained = [r for r, row in enumerate(rows) if row.grammar_masks is not None]
        if not pos_ids and not constrained:
            return logits
        masked = logits.clone()
        if pos_ids:
            masked[device_tensor(pos_ids, self.device), device_tensor(token_ids, self.device)] = -math.inf
        if constrained:
            apply_grammar_masks(masked, [starts[r] for r in constrained], [rows[r].grammar_masks for r in constrained],
                                self.device)
        return masked

    # ------------------------------------------------------------------------------------------------------------
    # Sampled rows

    def _speculate(
        self,
        masked: torch.Tensor,
        best_val: torch.Tensor,
        finite: torch.Tensor,
        rows: list[SpecRow],
        counts: list[int],
        starts: list[int],
        sampled: list[int],
        proposals: list[torch.Tensor | None],
        accept: torch.Tensor,
        final_tok: torch.Tensor,
        drafts_t: torch.Tensor,
    ) -> None:
        """Overwrites ``accept`` and ``final_tok`` at the positions of the ``sampled`` rows (speculative sampling);
        ``drafts_t``: every row's drafts, flat in row order."""
        vocab = masked.shape[1]
        # Local index = index among the sampled rows' positions, in flat order.
        flat: list[int] = []
        params: list[SamplingParams] = []
        onehot_local: list[int] = []  # draft positions of rows without proposals
        onehot_tok: list[int] = []  # their drafts' indices into drafts_t
        q_local: list[int] = []  # draft positions of rows with proposals
        q_tok: list[int] = []  # their drafts' indices into drafts_t
        first_draft = [0] * len(rows)  # row r's first draft in drafts_t
        for r in range(1, len(rows)):
            first_draft[r] = first_draft[r - 1] + counts[r - 1]
        q_rows: list[torch.Tensor] = []
        seeded: list[tuple[int, int]] = []
        unseeded: list[int] = []
        for r in sampled:
            row, k, base, proposal = rows[r], counts[r], len(flat), proposals[r]
            flat.extend(range(starts[r], starts[r] + k + 1))
            params.extend([row.params] * (k + 1))
            drafts = range(first_draft[r], first_draft[r] + k)
            if proposal is None:
                onehot_local.extend(range(base, base + k))
                onehot_tok.extend(drafts)
            elif k:
                q_local.extend(range(base, base + k))
                q_tok.extend(drafts)
                q_rows.append(proposal)
            for j in range(k + 1):
                seed = None if row.seeds is None else row.seeds[j]
                if seed is None:
                    unseeded.append(base + j)
                else:
                    seeded.append((base + j, seed))
        n = len(flat)
        dev = self.device
        pos = device_tensor(flat, dev)

        ok = finite.index_select(0, pos)
        # Non-finite positions are processed as all-zero logits: their result is discarded (the walk fails there),
        # and this keeps NaN out of the arithmetic.
        x = torch.where(ok.unsqueeze(1), masked.index_select(0, pos), 0.0)
        row_max = torch.where(ok, best_val.index_select(0, pos), 0.0)
        x = process_logits(x, row_max, params)
        p = torch.softmax(x, dim=1)

        noise, u = self._draw(n, vocab, unseeded, seeded)

        # Acceptance at draft positions: u * q(x) < p(x), i.e. probability min(1, p/q).
        draft_local = onehot_local + q_local
        q = torch.cat(q_rows) if q_rows else None
        onehot_ids = drafts_t[device_tensor(onehot_tok, dev)] if onehot_tok else None
        q_ids = drafts_t[device_tensor(q_tok, dev)] if q_tok else None
        if draft_local:
            dl = device_tensor(draft_local, dev)
            dt = torch.cat([t for t in (onehot_ids, q_ids) if t is not None])
            p_draft = p[dl, dt]
            q_draft = torch.ones(len(draft_local), device=dev)
            if q is not None and q_ids is not None:
                q_draft[len(onehot_local) :] = q.gather(1, q_ids.unsqueeze(1)).squeeze(1)
            accept.index_copy_(0, pos.index_select(0, dl), self._accept(u.index_select(0, dl), p_draft, q_draft))

        res = self._residual_logits(x, p, onehot_local, onehot_ids, q_local, q)
        tokens = (res - noise).argmax(dim=1)
        final_tok.index_copy_(0, pos, tokens)

    def _draw(
        self, n: int, vocab: int, unseeded: list[int], seeded: list[tuple[int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per position: log of ``V`` exponentials (Gumbel-max noise, clamped) and one uniform in [0, 1)."""
        dev = self.device
        noise = torch.empty((n, vocab), device=dev)
        u = torch.empty(n, device=dev)
        if len(unseeded) == n:
            noise.exponential_(generator=self.generator)
            u.uniform_(generator=self.generator)
        elif unseeded:
            idx = device_tensor(unseeded, dev)
            block = torch.empty((len(unseeded), vocab), device=dev).exponential_(generator=self.generator)
            noise.index_copy_(0, idx, block)
            u.index_copy_(0, idx, torch.empty(len(unseeded), device=dev).uniform_(generator=self.generator))
        for i, seed in seeded:
            self._row_generator.manual_seed(seed & _SEED_MASK)
            noise[i].exponential_(generator=self._row_generator)  # the Sampler's draw for this seed, exactly
            u[i : i + 1].uniform_(generator=self._row_generator)
        # E == 0 would make -log(E) = +inf and turn a masked -inf into NaN (which argmax picks): clamp it.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny).log_(), u

    @staticmethod
    def _accept(u: torch.Tensor, p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
        """Keeps a draft with probability ``min(1, p/q)`` (``u`` in [0, 1); ``p == 0`` never keeps)."""
        return u * q_draft < p_draft

    @staticmethod
    def _residual_logits(
        x: torch.Tensor,
        p: torch.Tensor,
        onehot_local: list[int],
        onehot_tok: torch.Tensor | None,
        q_local: list[int],
        q: torch.Tensor | None,
    ) -> torch.Tensor:
        """Unnormalized log of each position's correction distribution ``max(0, p - q)``; ``x`` at bonus positions.

        One-hot proposals: the processed logits with the draft masked (exact). Others: ``log(max(0, p - q))``. An
        empty residual (unreachable after a rejection in exact arithmetic) falls back to ``x``, i.e. to ``p``.
        """
        res = x.clone()
        dev = x.device
        if onehot_local and onehot_tok is not None:
            res[device_tensor(onehot_local, dev), onehot_tok] = -math.inf
        if q is not None:
            ql = device_tensor(q_local, dev)
            res.index_copy_(0, ql, (p.index_select(0, ql) - q).clamp_min_(0.0).log_())
            empty = ~torch.isfinite(res.amax(dim=1, keepdim=True))
            res = torch.where(empty, x, res)
        return res

    # ------------------------------------------------------------------------------------------------------------
    # Logprobs

    def _fill_logprobs(self, out: SpecOutput, logits: torch.Tensor, rows: list[SpecRow], starts: list[int]) -> None:
        errors = set(out.error_rows)
        asking = [r for r, row in enumerate(rows) if row.params.logprobs is not None]
        if not asking:
            return
        num_rows, vocab = len(rows), logits.shape[1]
        out.logprobs = [[] for _ in range(num_rows)]
        out.top_logprobs = [[] for _ in range(num_rows)]
        out.ranks = [[] for _ in range(num_rows)]
        asking = [r for r in asking if r not in errors]
        if not asking:
            return
        pos = [starts[r] + j for r in asking for j in range(len(out.token_ids[r]))]
        toks = [t for r in asking for t in out.token_ids[r]]
        n_top = [min(rows[r].params.logprobs or 0, vocab) for r in asking for _ in out.token_ids[r]]
        logprobs = torch.log_softmax(logits.index_select(0, device_tensor(pos, self.device)), dim=1)
        chosen = logprobs.gather(1, device_tensor(toks, self.device).unsqueeze(1))
        ranks = (logprobs > chosen).sum(dim=1).add_(1).tolist()
        chosen_list = chosen.squeeze(1).tolist()
        top_vals: list[list[float]] = [[] for _ in pos]
        top_ids: list[list[int]] = [[] for _ in pos]
        if max(n_top) > 0:
            top = torch.topk(logprobs, max(n_top), dim=1, sorted=True)
            top_vals, top_ids = top.values.tolist(), top.indices.tolist()
        i = 0
        for r in asking:
            for _ in out.token_ids[r]:
                out.logprobs[r].append(chosen_list[i])
                out.ranks[r].append(ranks[i])
                out.top_logprobs[r].append(list(zip(top_ids[i][: n_top[i]], top_vals[i][: n_top[i]], strict=True)))
                i += 1


def greedy_accepts(target_tokens: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """The greedy rule, the one place it is written: a draft is kept iff it is the target's greedy token at its
    position (the first maximum: ties to the lowest id, as the Sampler)."""
    return target_tokens == drafts


def walk(accept: torch.Tensor, final_tok: torch.Tensor, finite: torch.Tensor, drafts: torch.Tensor,
         emitted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance decided from the per-position verdicts, for every row at once (``launch`` and the graphed
    ``accept_greedy`` both end here). ``accept`` ``(rows, k)``: draft j is kept if the walk gets there (already
    False past a row's drafts); ``final_tok`` / ``finite`` ``(rows, k + 1)``: the token emitted if the walk stops at
    position j, and whether that position's logits were usable; ``drafts`` ``(rows, k)``. The count is the number
    of leading accepted drafts (a position with unusable logits accepts nothing), or -1 where the stopping position's
    logits were unusable (an error row). Into ``emitted`` ``(rows, k + 1)``: the drafts, then the stopping token at
    column count. Returns (accepted, emitted)."""
    num_acc = (accept & finite[:, : accept.shape[1]]).to(torch.int32).cumprod(dim=1).sum(dim=1, keepdim=True).long()
    bad = ~finite.gather(1, num_acc).squeeze(1)
    emitted[:, : drafts.shape[1]].copy_(drafts)
    emitted.scatter_(1, num_acc, final_tok.gather(1, num_acc))
    return torch.where(bad, -1, num_acc.squeeze(1)), emitted


class PendingSpec:
    """An acceptance enqueued on the device (``RejectionSampler.launch``): ``accepted`` ``(rows,)`` (-1: an error
    row) and ``emitted`` ``(rows, k_max + 1)`` on the device now; ``result()`` is the ``SpecOutput``."""

    def __init__(self, accepted: torch.Tensor, emitted: torch.Tensor, host: torch.Tensor,
                 event: torch.cuda.Event | None, logprob_inputs: tuple[Any, ...] | None) -> None:
        self.accepted = accepted
        self.emitted = emitted
        self._host = host
        self._event = event
        self._logprob_inputs = logprob_inputs
        self._out: SpecOutput | None = None

    @staticmethod
    def empty(device: torch.device) -> PendingSpec:
        none = torch.zeros(0, dtype=torch.long, device=device)
        return PendingSpec(none, none.view(0, 1), torch.zeros(0, 1, dtype=torch.long), None, None)

    def result(self) -> SpecOutput:
        if self._out is not None:
            return self._out
        if self._event is not None:
            self._event.synchronize()
        out = SpecOutput([0] * self._host.shape[0], [[] for _ in range(self._host.shape[0])], None, [])
        for r, (a, *tokens) in enumerate(self._host.tolist()):
            if a < 0:
                out.error_rows.append(r)
            else:
                out.num_accepted[r] = a
                out.token_ids[r] = tokens[: a + 1]
        if self._logprob_inputs is not None:
            sampler, logits, rows, starts = self._logprob_inputs
            sampler._fill_logprobs(out, logits, rows, starts)
        self._out = out
        return out
