"""The sampler: one token per row of logits, with per-row sampling parameters.

Pipeline for one row (all rows of a kind are processed together, with per-row parameters as tensors):

0. **Adjustments** (``adjusted``, made by the caller): allowed_token_ids, bad words, logit_bias, penalties, in
   vLLM's order (``hyserve.layers.logits_processors``); the raw logits stay the ones errors and logprobs read.
1. **Bans.** ``banned_token_ids`` are set to -inf before anything else, for greedy rows too.
2. **Errors.** A row whose raw logits contain NaN or +inf, or that has no finite entry left after the bans, is
   an error row (docs/design.md invariant 8): it is reported in ``error_rows``, its token is -1, and nothing is
   drawn for it. A -inf entry on its own is legitimate (a masked vocabulary slot) and is not an error. Rows are
   independent, so garbage in an error row never leaks into another row's result.
3. **Greedy rows** (``params.is_greedy``): argmax; ties go to the lowest token id.
4. **Sampled rows**, in this order (documented because the order changes the result):
   temperature -> top-k -> top-p -> min-p -> draw.

   - temperature: ``x = (logits - max) / T``; the shift keeps the maximum at exactly 0, so nothing overflows.
   - top-k: keep tokens whose value is >= the k-th largest value (ties with the k-th are kept, as vLLM and HF).
   - top-p: over the top-k-truncated distribution, keep the smallest prefix of the (stable, descending) sort
     whose mass reaches p; the first token is always kept; among equal probabilities the lower id comes first.
   - min-p: keep tokens with ``p >= min_p * p_max``. Truncation and renormalization scale every kept
     probability by the same factor and never remove the argmax, so this is ``x >= log(min_p)`` in logit space.
     (vLLM v1 applies min-p before top-k/top-p; the two orders differ only in which distribution top-p sees.)
   - draw: Gumbel-max with exponential noise: ``argmax(x - log(E))``, ``E ~ Exp(1)`` i.i.d. per vocab entry,
     which samples exactly from ``softmax(x)`` and needs no normalization.

**Seeded rows are batch-independent.** A row with a seed draws its noise from a generator re-seeded with that
seed, for exactly ``V`` values, so its token is a function of (its logits row, its params, its seed) alone:
not of the batch size, its position in the batch, or the other rows. The engine derives one seed per output
token from (request seed, output index) with ``token_seed``, which computes modulo 2**64 and keeps 63 bits, and a
CPU generator reads only the low 32 bits of the seed it is given: request seeds ``s`` and ``s + 2**63`` (or
``-1`` and ``2**63 - 1``) would draw alike, so ``SamplingParams`` takes request seeds in [0, 2**63 - 1] only.
Unseeded rows share the sampler's own generator (seeded at construction), so a whole run is reproducible for a
fixed sequence of batches, but not batch-independent.

**Logprobs** are those of the raw (unprocessed: no bans, temperature or truncation) ``log_softmax``, vLLM's
default ``raw_logprobs`` mode, and are computed only for the rows that ask (``params.logprobs is not None``).

Host syncs: one for the tokens; the logprobs add a few, only when some row asks. An all-greedy batch without bans
costs one ``max`` over the logits and no sort.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hyserve.kernels.bitmask import apply_token_bitmask
from hyserve.sampling_params import SamplingParams
from hyserve.structured_output import bitmask
from hyserve.utils import device_tensor, host_to_device

ERROR_TOKEN_ID = -1
_SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF  # torch generators take seeds in [0, 2**64)


@dataclass(slots=True)
class SamplingRow:
    """One row of logits to sample from.

    ``seed`` is the per-token seed derived by the engine (``None`` = unseeded: the sampler's own generator);
    ``banned_token_ids`` are token ids in ``[0, V)`` that must not be produced (e.g. EOS below ``min_tokens``);
    ``grammar_mask`` the tokens structured output allows (one position's packed bitmask,
    ``hyserve.structured_output.bitmask``), None: all.
    """

    params: SamplingParams
    seed: int | None = None
    banned_token_ids: list[int] = field(default_factory=list)
    grammar_mask: bytes | None = None


@dataclass(slots=True)
class SamplerOutput:
    """Per-row results, in the order of the input rows.

    - ``token_ids[i]`` is the sampled token, or ``ERROR_TOKEN_ID`` (-1) for an error row.
    - ``logprobs`` is ``None`` if no row asked; otherwise ``logprobs[i]`` is the raw logprob of ``token_ids[i]``
      for rows that asked and NaN for rows that did not ask or are errors.
    - ``top_logprobs`` is ``None`` if no row asked; otherwise the top ``params.logprobs`` (id, logprob) pairs,
      sorted by descending logprob, for rows that asked, and ``[]`` for the others and for error rows.
    - ``ranks`` (``None`` if no row asked) is the 1-based rank of the sampled token in the raw distribution
      (1 + the number of tokens with a strictly larger logprob) for rows that asked, ``None`` for the others.
    - ``error_rows`` lists, ascending, the rows whose logits were non-finite; they were never sampled.
    """

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    error_rows: list[int]
    ranks: list[int | None] | None = None
    # The sampled ids on the sampler's device, a valid id in every row (async scheduling feeds them to the next step).
    token_ids_device: torch.Tensor | None = field(default=None, compare=False, repr=False)


def token_seed(seed: int, output_index: int) -> int:
    """A per-token seed in [0, 2**63) that depends only on the request's seed (in [0, 2**63): see the module
    docstring) and the token's index in the output."""
    x = (seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + 1) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


class Sampler:
    """Samples one token per row; owns the generator used by unseeded rows."""

    def __init__(self, device: torch.device | str, seed: int = 0) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed & _SEED_MASK)
        # Re-seeded for every seeded row: after manual_seed its stream depends on the seed alone.
        self._row_generator = torch.Generator(device=self.device)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], adjusted: torch.Tensor | None = None
                 ) -> SamplerOutput:
        return self.sample(logits, rows, adjusted).result()

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow], adjusted: torch.Tensor | None = None
               ) -> PendingSample:
        """Enqueue the whole sampling of ``rows`` on the device, and the copies of its results to the host; the
        host reads them with ``result()`` (which waits for those copies only, not for later work on the device).

        ``adjusted`` (float32, the shape of ``logits``): the logits after penalties, bias and masks
        (``hyserve.layers.logits_processors``), which the tokens are drawn from; errors and logprobs still read
        the raw ``logits`` (vLLM's ``raw_logprobs``)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must have shape (len(rows)={len(rows)}, V), got {tuple(logits.shape)}")
        num_rows = logits.shape[0]
        if num_rows == 0:
            return PendingSample(rows, torch.zeros(0, dtype=torch.long, device=self.device), {}, None, [], [])
        logits = logits.to(device=self.device, dtype=torch.float32)

        masked = self._apply_bans(logits if adjusted is None else adjusted, rows)
        # One pass gives both the greedy tokens (first maximum = lowest id) and the per-row maximum. max()
        # propagates NaN, so a non-finite maximum flags NaN, +inf and "nothing left" alike.
        best_val, tokens = masked.max(dim=1)
        is_error = ~torch.isfinite(best_val)
        if masked is not logits:  # a NaN on a banned position is still garbage from the model
            is_error |= ~torch.isfinite(logits.amax(dim=1))

        sampled_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if sampled_rows:
            idx = device_tensor(sampled_rows, self.device)
            drawn = self._sample(
                masked.index_select(0, idx), best_val.index_select(0, idx), [rows[i] for i in sampled_rows]
            )
            tokens = tokens.index_copy(0, idx, drawn)

        # ``tokens`` holds a valid id for every row (error rows included): needed to index logprobs safely, and
        # what a next step may feed on the device (an error row's request ends, so its token is never used).
        device_out = {"token_ids": torch.where(is_error, ERROR_TOKEN_ID, tokens)}
        asking, n_top = self._logprob_tensors(device_out, logits, tokens, rows)
        host = {name: t.to("cpu", non_blocking=True) for name, t in device_out.items()}
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return PendingSample(rows, tokens, host, event, asking, n_top)

    def _apply_bans(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Returns ``logits`` itself when nothing is banned, else a copy with the banned entries at -inf."""
        row_ids: list[int] = []
        token_ids: list[int] = []
        vocab = logits.shape[1]
        for i, r in enumerate(rows):
            for t in r.banned_token_ids:
                if not 0 <= t < vocab:
                    raise ValueError(f"row {i}: banned token id {t} is outside the vocabulary [0, {vocab})")
                row_ids.append(i)
                token_ids.append(t)
        constrained = [i for i, r in enumerate(rows) if r.grammar_mask is not None]
        if not row_ids and not constrained:
            return logits
        masked = logits.clone()
        if row_ids:
            masked[device_tensor(row_ids, self.device), device_tensor(token_ids, self.device)] = -math.inf
        if constrained:
            apply_grammar_masks(masked, constrained, [rows[i].grammar_mask for i in constrained], self.device)
        return masked

    def _sample(self, x: torch.Tensor, row_max: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Draws one token per row of ``x`` (owned, modified in place); ``row_max`` is each row's maximum."""
        num_rows, vocab = x.shape
        params = [r.params for r in rows]
        temperature = device_tensor([p.temperature for p in params], self.device)
        x.sub_(row_max.unsqueeze(1)).div_(temperature.unsqueeze(1))

        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        if any(p.top_p < 1.0 for p in params):
            x = self._apply_top_k_top_p(x, top_k, [p.top_p for p in params])
        elif any(top_k):
            self._apply_top_k(x, top_k)
        if any(p.min_p > 0.0 for p in params):
            log_min_p = torch.tensor(
                [math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in params], device=self.device
            )
            x.masked_fill_(x < log_min_p.unsqueeze(1), -math.inf)

        noise = torch.empty_like(x)
        unseeded = [j for j, r in enumerate(rows) if r.seed is None]
        if len(unseeded) == num_rows:
            noise.exponential_(generator=self.generator)
        elif unseeded:
            block = torch.empty((len(unseeded), vocab), device=self.device).exponential_(generator=self.generator)
            noise.index_copy_(0, device_tensor(unseeded, self.device), block)
        for j, r in enumerate(rows):
            if r.seed is not None:
                self._row_generator.manual_seed(r.seed & _SEED_MASK)
                noise[j].exponential_(generator=self._row_generator)
        # E == 0 would make -log(E) = +inf and turn a masked -inf into NaN (which argmax picks): clamp it.
        noise.clamp_min_(torch.finfo(torch.float32).tiny).log_()
        return (x - noise).argmax(dim=1)

    @staticmethod
    def _apply_top_k(x: torch.Tensor, top_k: list[int]) -> None:
        """Keeps, in rows with ``k > 0``, the entries >= the k-th largest (in place; 0 = off)."""
        k_max = max(top_k)
        kth = torch.topk(x, k_max, dim=1).values
        pos = device_tensor([max(k, 1) - 1 for k in top_k], x.device)
        threshold = kth.gather(1, pos.unsqueeze(1))
        off = device_tensor([k == 0 for k in top_k], x.device)
        threshold.masked_fill_(off.unsqueeze(1), -math.inf)
        x.masked_fill_(x < threshold, -math.inf)

    @staticmethod
    def _apply_top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        """Top-k then top-p on a single (stable, descending) sort; returns the masked rows in vocab order."""
        vocab = x.shape[1]
        values, order = x.sort(dim=1, descending=True, stable=True)
        if any(top_k):
            pos = device_tensor([(k if k else vocab) - 1 for k in top_k], x.device)
            values.masked_fill_(values < values.gather(1, pos.unsqueeze(1)), -math.inf)
        probs = values.softmax(dim=1)
        mass_before = probs.cumsum(dim=1).sub_(probs)  # exactly 0 at position 0, so the argmax is always kept
        # p == 1 must keep everything, even where float cumsum rounds the tail's mass_before up to 1.
        p = device_tensor([v if v < 1.0 else math.inf for v in top_p], x.device)
        values.masked_fill_(mass_before >= p.unsqueeze(1), -math.inf)
        return x.scatter_(1, order, values)

    def _logprob_tensors(self, out: dict[str, torch.Tensor], logits: torch.Tensor, tokens: torch.Tensor,
                         rows: list[SamplingRow]) -> tuple[list[int], list[int]]:
        """Enqueue the logprob results of the rows that ask (into ``out``); those rows and their top-N counts."""
        asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not asking:
            return [], []
        vocab = logits.shape[1]
        idx = device_tensor(asking, self.device)
        logprobs = torch.log_softmax(logits.index_select(0, idx), dim=1)
        chosen = logprobs.gather(1, tokens.index_select(0, idx).unsqueeze(1))
        out["chosen"] = chosen.squeeze(1)
        out["ranks"] = (logprobs > chosen).sum(dim=1).add_(1)
        n_top = [min(rows[i].params.logprobs or 0, vocab) for i in asking]
        if max(n_top) > 0:
            top = torch.topk(logprobs, max(n_top), dim=1, sorted=True)
            out["top_values"], out["top_ids"] = top.values, top.indices
        return asking, n_top


@dataclass(slots=True)
class PendingSample:
    """A sampling enqueued on the device (``Sampler.sample``); ``result()`` reads it on the host."""

    rows: list[SamplingRow]
    tokens: torch.Tensor  # (R,) on the device, a valid id in every row (error rows: their greedy id)
    host: dict[str, torch.Tensor]  # the results' copies on the host (being filled until ``event`` completes)
    event: torch.cuda.Event | None
    asking: list[int]
    n_top: list[int]
    _out: SamplerOutput | None = None

    def result(self) -> SamplerOutput:
        if self._out is not None:
            return self._out
        if self.event is not None:
            self.event.synchronize()
        if not self.host:
            self._out = SamplerOutput([], None, None, [], token_ids_device=self.tokens)
            return self._out
        token_ids = self.host["token_ids"].tolist()
        error_rows = [i for i, t in enumerate(token_ids) if t == ERROR_TOKEN_ID]
        out = SamplerOutput(token_ids, None, None, error_rows, token_ids_device=self.tokens)
        if self.asking:
            self._fill_logprobs(out)
        self._out = out
        return out

    def _fill_logprobs(self, out: SamplerOutput) -> None:
        num_rows = len(self.rows)
        asking, n_top = self.asking, self.n_top
        top_vals: list[list[float]] = [[] for _ in asking]
        top_ids: list[list[int]] = [[] for _ in asking]
        if "top_values" in self.host:
            top_vals, top_ids = self.host["top_values"].tolist(), self.host["top_ids"].tolist()
        errors = set(out.error_rows)
        out.logprobs = [math.nan] * num_rows
        out.top_logprobs = [[] for _ in range(num_rows)]
        out.ranks = [None] * num_rows
        chosen, ranks = self.host["chosen"].tolist(), self.host["ranks"].tolist()
        for j, (i, lp, rank) in enumerate(zip(asking, chosen, ranks, strict=True)):
            if i in errors:
                continue
            out.logprobs[i] = lp
            out.ranks[i] = rank
            out.top_logprobs[i] = list(zip(top_ids[j][: n_top[j]], top_vals[j][: n_top[j]], strict=True))


def apply_grammar_masks(logits: torch.Tensor, positions: list[int], packed: list[bytes | None],
                        device: torch.device) -> None:
    """Structured output: at each of ``positions`` (rows of ``logits``, in place), the tokens its packed bitmask
    (``hyserve.structured_output.bitmask``) does not allow become -inf. ``packed[i]`` holds the masks of
    consecutive positions from ``positions[i]`` on (a verify row's k + 1). One host-to-device copy of the words and
    one launch on CUDA (``hyserve.kernels.bitmask``); no pinned buffer is allocated per step."""
    vocab = logits.shape[1]
    index: list[int] = []
    words = []
    for start, mask in zip(positions, packed, strict=True):
        if mask is None:
            continue
        rows = bitmask.unpack(mask, vocab)
        index.extend(range(start, start + rows.shape[0]))
        words.append(rows)
    if not index:
        return
    apply_token_bitmask(logits, device_tensor(index, device), host_to_device(torch.cat(words), device))
