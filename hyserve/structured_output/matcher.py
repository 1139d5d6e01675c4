"""One request's grammar state on the host: an llguidance matcher advanced by the request's accepted tokens only,
and the bitmasks of a row's sampled positions (a verify row's drafts consumed tentatively, then rolled back)."""

from __future__ import annotations

import numpy as np

from hyserve.structured_output.bitmask import num_words
from hyserve.structured_output.grammar import GrammarCompiler


class GrammarMatcher:
    def __init__(self, compiler: GrammarCompiler, grammar: str) -> None:
        from llguidance import LLMatcher

        self.vocab_size = compiler.vocab_size
        self._matcher = LLMatcher(compiler.ll_tokenizer, grammar, log_level=0)
        self.num_consumed = 0
        self._check("the grammar")

    def _check(self, what: str) -> None:
        if self._matcher.is_error():
            raise ValueError(f"structured outputs: {what} put the grammar in an error state: "
                             f"{self._matcher.get_error()}")

    @property
    def is_terminated(self) -> bool:
        """The grammar admits nothing more (the output is complete)."""
        return bool(self._matcher.is_stopped())

    def consume(self, tokens: list[int]) -> None:
        """Advance by tokens the request accepted (in order). A token the grammar forbids is a bug upstream (every
        sampled position is masked): ValueError."""
        for t in tokens:
            if self._matcher.is_stopped():
                break  # tokens after the grammar's end (its EOS) do not move it
            if not self._matcher.consume_token(t):
                raise ValueError(f"structured outputs: token {t} violates the grammar after {self.num_consumed} "
                                 f"tokens: {self._matcher.get_error()}")
            self.num_consumed += 1

    def masks(self, drafts: list[int]) -> bytes:
        """The packed masks of ``len(drafts) + 1`` positions: position j with drafts[:j] consumed. Once a draft is
        not allowed, the walk of the verify stops there, so the positions after it allow every token (a mask
        that allowed none would read as "nothing left to sample"). The matcher ends where it began."""
        words = num_words(self.vocab_size)
        out = np.full((len(drafts) + 1, words), -1, dtype=np.int32)
        taken = 0
        for j in range(len(drafts) + 1):
            out[j] = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.int32)[:words]
            if j == len(drafts) or self._matcher.is_stopped():
                break
            t = drafts[j]
            if not (0 <= t < self.vocab_size and (out[j, t // 32] >> (t % 32)) & 1) \
                    or not self._matcher.consume_token(t):
                break
            taken += 1
        if taken and not self._matcher.rollback(taken):
            raise RuntimeError("structured outputs: the grammar could not roll back its tentative drafts")
        self._check("a tentative draft")
        return out.tobytes()
