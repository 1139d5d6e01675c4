"""Per-request sampling state on the device: token histories, and the logits adjustments built from them.

A request whose ``SamplingParams.adjusts_logits`` (penalties, ``logit_bias``, ``allowed_token_ids``, bad words) has
its adjustments applied to its logits rows before the Sampler or the rejection sampler sees them
(``hyserve.layers.logits_processors`` has the math and vLLM's order); both still read the raw logits for errors and
logprobs (vLLM's default ``raw_logprobs``).

**Histories.** A request with penalties or bad words (``needs_history``) holds one row of ``history``: its token at
every position (int32, ``max_model_len`` of them), on the device, and a row of ``prompt_mask`` (``V`` bools). The
prompt is written when the request is learned (``NewRequestData.prompt_token_ids``: a prefix-cache hit never feeds
those tokens), and every step writes each such row's input tokens as the forward read them (``record_inputs``), so
tokens the host has not seen yet (async scheduling's ``PREVIOUS_SAMPLED``, drafts left on the device, the starts
of rows behind rows in flight) are there without a host round trip. The logits row of position ``p`` then sees
tokens ``[0, p]``: the output tokens are ``[prompt_len, p]``. A verify row's position ``j`` thereby sees its
accepted prefix and its drafts before ``j``, exactly what plain decoding would have generated before that token.
Positions past the request's true length may hold rejected drafts or a discarded step's inputs: they are never read
before a later step writes them again.

**Cost**, only in steps with such rows: one scatter of their input ids; a float32 copy of the logits of the step's
rows of that kind (plain or verify), and with penalties a ``(rows, V)`` count matrix from a gather of the output so
far (vLLM builds the same each step); a greedy verify step with such rows runs the rejection sampler instead of the
``accept`` graph.
"""

from __future__ import annotations

import numpy as np
import torch

from hyserve.layers.logits_processors import (
    apply_allowed,
    apply_bias,
    apply_penalties,
    bad_word_hits,
)
from hyserve.sampling_params import SamplingParams
from hyserve.scheduler.output import ScheduledRow
from hyserve.utils import device_tensor, host_to_device


class SamplingState:
    """The histories and per-request adjustment tensors of the requests that adjust their logits."""

    def __init__(self, device: torch.device, vocab_size: int, max_model_len: int) -> None:
        self.device = device
        self.vocab = vocab_size
        self.max_len = max_model_len
        self.params: dict[str, SamplingParams] = {}
        self.slot: dict[str, int] = {}  # a history row, for requests that need one
        self.prompt_len: dict[str, int] = {}
        self.free: list[int] = []
        self.history = torch.zeros((0, max_model_len), dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        # Per request: bad words as (prefixes (W, M) right-aligned, which prefix columns are used, last tokens (W,)).
        self.bad_words: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def add_request(self, req_id: str, params: SamplingParams, prompt_token_ids: list[int] | None) -> None:
        if not params.adjusts_logits:
            return
        self.params[req_id] = params
        if not params.needs_history:
            return
        if prompt_token_ids is None:
            raise ValueError(f"request {req_id}: penalties or bad words need the prompt's token ids")
        slot = self._take_slot()
        self.slot[req_id] = slot
        self.prompt_len[req_id] = len(prompt_token_ids)
        ids = device_tensor(prompt_token_ids, self.device, torch.long)
        self.history[slot, : len(prompt_token_ids)] = ids.to(torch.int32)
        self.prompt_mask[slot] = False
        self.prompt_mask[slot, ids] = True
        words = params.bad_words_token_ids
        if words:
            m = max(len(w) for w in words) - 1
            prefixes = np.zeros((len(words), m), dtype=np.int64)
            used = np.zeros((len(words), m), dtype=bool)
            for i, w in enumerate(words):
                if len(w) > 1:
                    prefixes[i, m - len(w) + 1 :] = w[:-1]
                    used[i, m - len(w) + 1 :] = True
            self.bad_words[req_id] = (self._to_device(prefixes),
                                      self._to_device(used),
                                      device_tensor([w[-1] for w in words], self.device, torch.long))

    def remove_request(self, req_id: str) -> None:
        self.params.pop(req_id, None)
        self.prompt_len.pop(req_id, None)
        self.bad_words.pop(req_id, None)
        slot = self.slot.pop(req_id, None)
        if slot is not None:
            self.free.append(slot)

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        """A host array on the device without stalling the host (through pinned memory on CUDA)."""
        return host_to_device(torch.from_numpy(a), self.device)

    def _take_slot(self) -> int:
        if not self.free:
            n = self.history.shape[0]
            grow = max(4, n)
            self.history = torch.cat([self.history, self.history.new_zeros((grow, self.max_len))])
            self.prompt_mask = torch.cat([self.prompt_mask, self.prompt_mask.new_zeros((grow, self.vocab))])
            self.free.extend(range(n + grow - 1, n - 1, -1))
        return self.free.pop()

    def record_inputs(self, rows: list[ScheduledRow], input_ids: torch.Tensor, query_start_loc: np.ndarray,
                      verify_starts: torch.Tensor) -> None:
        """Write the step's input tokens of requests with a history at their positions (``input_ids``: the step's
        device input ids as the forward read them; ``query_start_loc``: each row's first token index, host;
        ``verify_starts``: each verify row's start on the device)."""
        if not self.slot:
            return
        src: list[np.ndarray] = []
        dest: list[np.ndarray] = []
        vrow: list[np.ndarray] = []
        for i, row in enumerate(rows):
            slot = self.slot.get(row.req_id)
            if slot is None:
                continue
            n, t = row.num_new_tokens, int(query_start_loc[i])
            offsets = np.arange(n, dtype=np.int64)
            src.append(t + offsets)
            dest.append(slot * self.max_len + offsets + (0 if row.is_verify else row.start))
            vrow.append(np.full(n, i if row.is_verify else -1, dtype=np.int64))
        if not src:
            return
        dest_t = self._with_verify_starts(np.concatenate(dest), np.concatenate(vrow), verify_starts)
        src_t = self._to_device(np.concatenate(src))
        self.history.view(-1).index_copy_(0, dest_t, input_ids.index_select(0, src_t).to(torch.int32))

    def _with_verify_starts(self, host: np.ndarray, vrow: np.ndarray, verify_starts: torch.Tensor | None
                            ) -> torch.Tensor:
        """``host`` on the device, plus ``verify_starts[vrow]`` where ``vrow >= 0``."""
        out = self._to_device(host)
        if (vrow >= 0).any():
            assert verify_starts is not None
            v = self._to_device(vrow)
            out = out + torch.where(v >= 0, verify_starts.index_select(0, v.clamp(min=0)), 0)
        return out

    def adjust(self, logits: torch.Tensor, rows: list[ScheduledRow], verify_starts: torch.Tensor | None = None
               ) -> torch.Tensor | None:
        """The adjusted float32 logits of ``rows`` (verify rows: ``num_new_tokens`` logits rows each, and they are
        the step's first rows, in order; other rows: one), or None when none of their requests adjusts."""
        if not any(r.req_id in self.params for r in rows):
            return None
        if logits.shape[1] != self.vocab:
            raise ValueError(f"logits have {logits.shape[1]} columns, the vocabulary {self.vocab}")
        req: list[str] = []
        pos: list[int] = []  # a plain row's last position; a verify row's offset from its start
        vrow: list[int] = []
        upper: list[int] = []  # a bound on the position known on the host
        for i, r in enumerate(rows):
            n = r.num_new_tokens if r.is_verify else 1
            base = 0 if r.is_verify else r.end - 1
            req.extend([r.req_id] * n)
            pos.extend(base + j for j in range(n))
            vrow.extend([i if r.is_verify else -1] * n)
            upper.extend((r.latest_start + j if r.is_verify else r.end - 1) for j in range(n))
        sel = [k for k, rid in enumerate(req) if rid in self.params]
        out = logits.to(dtype=torch.float32, copy=True)
        sel_t = device_tensor(sel, self.device, torch.long)
        x = out.index_select(0, sel_t)
        params = [self.params[req[k]] for k in sel]
        positions = self._with_verify_starts(np.asarray([pos[k] for k in sel], dtype=np.int64),
                                             np.asarray([vrow[k] for k in sel], dtype=np.int64), verify_starts)
        self._allowed_and_bias(x, params)
        hist = [j for j, k in enumerate(sel) if req[k] in self.slot]
        if hist:
            h = device_tensor(hist, self.device, torch.long)
            xh = x.index_select(0, h)
            self._history_adjust(xh, [req[sel[j]] for j in hist], positions.index_select(0, h),
                                 [upper[sel[j]] for j in hist])
            x.index_copy_(0, h, xh)
        out.index_copy_(0, sel_t, x)
        return out

    def _allowed_and_bias(self, x: torch.Tensor, params: list[SamplingParams]) -> None:
        allowed = [(j, p.allowed_token_ids) for j, p in enumerate(params) if p.allowed_token_ids is not None]
        if allowed:
            rows = device_tensor([j for j, ids in allowed for _ in ids], self.device, torch.long)
            tokens = device_tensor([t for _, ids in allowed for t in ids], self.device, torch.long)
            restricted = device_tensor([p.allowed_token_ids is not None for p in params], self.device, torch.bool)
            apply_allowed(x, rows, tokens, restricted)
        biased = [(j, p.logit_bias) for j, p in enumerate(params) if p.logit_bias]
        if biased:
            rows = device_tensor([j for j, b in biased for _ in b], self.device, torch.long)
            tokens = device_tensor([t for _, b in biased for t in b], self.device, torch.long)
            values = device_tensor([v for _, b in biased for v in b.values()], self.device, torch.float32)
            apply_bias(x, rows, tokens, values)

    def _history_adjust(self, x: torch.Tensor, req: list[str], positions: torch.Tensor, upper: list[int]) -> None:
        """Bad words, then penalties, on rows ``x`` of requests ``req`` at ``positions`` (device; ``upper``: host
        bounds), vLLM's order. The bias (before) has been added already; masks commute with it."""
        dev = self.device
        slots = device_tensor([self.slot[r] for r in req], dev, torch.long)
        plen_host = [self.prompt_len[r] for r in req]
        plen = device_tensor(plen_host, dev, torch.long)
        for rid in dict.fromkeys(r for r in req if r in self.bad_words):
            prefixes, used, last = self.bad_words[rid]
            rows = device_tensor([j for j, r in enumerate(req) if r == rid], dev, torch.long)
            m = prefixes.shape[1]
            idx = positions.index_select(0, rows).unsqueeze(1) - m + 1 + torch.arange(m, device=dev)
            valid = idx >= plen.index_select(0, rows).unsqueeze(1)
            tail = self.history[slots.index_select(0, rows).unsqueeze(1), idx.clamp(0, self.max_len - 1)].long()
            hits = bad_word_hits(tail, valid, prefixes, used)
            ban = torch.zeros((rows.numel(), self.vocab), dtype=torch.long, device=dev)
            ban.scatter_add_(1, last.unsqueeze(0).expand(rows.numel(), -1), hits.long())
            xr = x.index_select(0, rows).masked_fill_(ban > 0, float("-inf"))
            x.index_copy_(0, rows, xr)
        params = [self.params[r] for r in req]
        if all(p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0
               for p in params):
            return
        width = max(1, max(u + 1 - p for u, p in zip(upper, plen_host, strict=True)))
        idx = plen.unsqueeze(1) + torch.arange(width, device=dev)
        valid = idx <= positions.unsqueeze(1)
        tokens = self.history[slots.unsqueeze(1), idx.clamp(max=self.max_len - 1)].long()
        tokens = torch.where(valid, tokens, self.vocab)
        counts = torch.zeros((len(req), self.vocab + 1), dtype=torch.float32, device=dev)
        counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.float32))
        apply_penalties(x, self.prompt_mask.index_select(0, slots), counts[:, : self.vocab],
                        device_tensor([p.presence_penalty for p in params], dev, torch.float32),
                        device_tensor([p.frequency_penalty for p in params], dev, torch.float32),
                        device_tensor([p.repetition_penalty for p in params], dev, torch.float32))
