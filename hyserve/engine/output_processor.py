"""The one place where sampled tokens become request outputs: detokenization, stop checks, ``RequestOutput``s.

Both step paths (plain sampling and speculative verification) hand each request's new tokens of a step to
``OutputProcessor.append`` and build outputs with ``make_output``. Invariants:

- ``append`` takes the tokens in order and stops at the first one that ends the request (EOS, a stop token, a stop
  string, ``max_tokens``, ``max_model_len``; none before ``min_tokens``): tokens after it are dropped, and the
  finish reason is returned for the engine to finish the request with.
- ``req.output_token_ids`` / ``output_logprobs`` / ``output_text`` stay cumulative; what a DELTA output has sent so
  far is ``req.sent`` (``OutputCursor``), so the delta of a step is the suffix after it.
- A DELTA output never sends text that a stop string could later remove: until the request finishes, the last
  ``max(len(stop)) - 1`` characters are held back (a stop string that completes later starts no earlier than
  that), so the concatenated deltas equal the cumulative text at every finished output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from hyserve.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from hyserve.request import Request
from hyserve.sampling_params import RequestOutputKind, SamplingParams
from hyserve.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(slots=True)
class NewTokens:
    """One request's tokens of one step; the logprob lists (when given) are parallel to ``token_ids``."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    ranks: list[int | None] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: the top-N (id, logprob) pairs


def stop_holdback(params: SamplingParams) -> int:
    """Characters a DELTA output holds back until the end, so that a stop string cut from the text is never sent."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens)

    # ------------------------------------------------------------------ tokens in

    def append(self, req: Request, new: NewTokens) -> str | None:
        """Append ``new`` to ``req`` (logprobs, text, token times) up to the first token that ends it; returns that
        token's finish reason (``req.stop_reason`` is set), or None while the request goes on."""
        lps, ranks, tops = new.logprobs, new.ranks, new.top_logprobs
        want_logprobs = req.sampling_params.logprobs is not None
        for j, token in enumerate(new.token_ids):
            req.output_token_ids.append(token)
            if req.grammar is not None:
                req.grammar.consume([token])
            if want_logprobs and lps is not None and j < len(lps):
                req.sampled_logprobs.append(float(lps[j]))
                req.output_ranks.append(ranks[j] if ranks is not None and j < len(ranks) else None)
                entry = dict(tops[j]) if tops is not None and j < len(tops) else {}
                entry.setdefault(token, float(lps[j]))
                req.output_logprobs.append(entry)
            if req.detokenizer is not None:
                req.detokenizer.append([token])
                req.output_text = req.detokenizer.text
            reason = self._check_stop(req, token)
            if reason is not None:
                if req.detokenizer is not None and not isinstance(req.stop_reason, str):
                    # The end: text held back for an incomplete character is emitted (as U+FFFD), so the final
                    # text is the decode of the output ids. (A stop string has already cut the text.)
                    req.detokenizer.flush()
                    req.output_text = req.detokenizer.text
                return reason
        return None

    def _check_stop(self, req: Request, token: int) -> str | None:
        # Called once for every output token appended: the token times live here.
        req.last_token_time = time.time()
        if req.first_token_time is None:
            req.first_token_time = req.last_token_time
        p = req.sampling_params
        n_out = req.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                req.stop_reason = token
                return "stop"
            if p.stop and req.detokenizer is not None:
                for s in p.stop:
                    idx = req.output_text.find(s)
                    if idx >= 0:
                        req.output_text = req.output_text[: idx + (len(s) if p.include_stop_str_in_output else 0)]
                        req.stop_reason = s
                        return "stop"
        max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len
        if n_out >= max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    # ------------------------------------------------------------------ outputs out

    def make_output(self, req: Request) -> RequestOutput | None:
        """The request's output after a step, by its ``output_kind``: everything so far (CUMULATIVE), what is new
        since the last output (DELTA), or nothing until it finishes (FINAL_ONLY, then cumulative)."""
        kind = req.sampling_params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not req.is_finished:
            return None
        if kind is not RequestOutputKind.DELTA:
            return self._output(req, req.output_text, list(req.output_token_ids), 0)
        sent = req.sent
        text = req.output_text
        end = len(text) if req.is_finished else max(sent.num_chars, len(text) - stop_holdback(req.sampling_params))
        delta_text = text[sent.num_chars:end]
        first_logprob = sent.num_logprobs
        ids = req.output_token_ids[sent.num_ids:]
        sent.num_chars = max(sent.num_chars, end)
        sent.num_ids = req.num_output_tokens
        sent.num_logprobs = len(req.output_logprobs)
        return self._output(req, delta_text, ids, first_logprob)

    def _output(self, req: Request, text: str, token_ids: list[int], first_logprob: int) -> RequestOutput:
        """A RequestOutput holding ``text``, ``token_ids`` and the logprobs from position ``first_logprob`` on."""
        logprobs: SampleLogprobs | None = None
        if req.sampling_params.logprobs is not None:
            logprobs = [self._logprob_entry(req.output_logprobs[j], req.output_token_ids[j], req.output_ranks[j])
                        for j in range(first_logprob, len(req.output_logprobs))]
        cum = sum(req.sampled_logprobs) if req.sampled_logprobs else None
        completion = CompletionOutput(
            index=0, text=text, token_ids=token_ids, cumulative_logprob=cum, logprobs=logprobs,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
        )
        metrics = RequestMetrics(
            arrival_time=req.arrival_time, last_token_time=req.last_token_time,
            first_scheduled_time=req.first_scheduled_time, first_token_time=req.first_token_time,
            time_in_queue=None if req.first_scheduled_time is None else req.first_scheduled_time - req.arrival_time,
            finished_time=req.finished_time)
        return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                             outputs=[completion], finished=req.is_finished, metrics=metrics,
                             prompt_logprobs=self._prompt_logprobs(req), num_cached_tokens=req.num_cached_tokens)

    def _prompt_logprobs(self, req: Request) -> PromptLogprobs | None:
        """vLLM's ``PromptLogprobs`` once every prompt position is in: ``None`` for the first token, then per token
        its own logprob and the top-N. A DELTA output carries them once, in its first output that has them."""
        rows = req.prompt_logprob_rows
        if rows is None or any(r is None for r in rows):
            return None
        if req.sampling_params.output_kind is RequestOutputKind.DELTA:
            if req.sent.prompt_logprobs_sent:
                return None
            req.sent.prompt_logprobs_sent = True
        out: PromptLogprobs = [None]
        for p, row in enumerate(rows):
            assert row is not None
            lp, rank, top = row
            entry = {req.prompt_token_ids[p + 1]: Logprob(lp, rank, self._decode_one(req.prompt_token_ids[p + 1]))}
            for k, (tid, tlp) in enumerate(top):
                if tid not in entry:
                    entry[tid] = Logprob(tlp, k + 1, self._decode_one(tid))
            out.append(entry)
        return out

    def _logprob_entry(self, entry: dict[int, float], sampled: int, sampled_rank: int | None) -> dict[int, Logprob]:
        """Logprobs of one position with their vocabulary ranks. ``entry`` holds the top-N (every token with a
        larger logprob than a top-N token is itself in the top-N) plus the sampled token, whose rank the sampler
        counted over the whole vocabulary; a rank is 1 + the number of strictly larger logprobs."""
        out: dict[int, Logprob] = {}
        for tid, lp in entry.items():
            rank = sampled_rank if tid == sampled else 1 + sum(v > lp for v in entry.values())
            out[tid] = Logprob(lp, rank, self._decode_one(tid))
        return out

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id], skip_special_tokens=False)
