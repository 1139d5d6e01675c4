"""Proposers: guess the next tokens of running requests, verified by the target in the next step.

A proposer never touches model state; it returns token ids only. The engine trims each proposal so that a request
never runs past ``max_tokens`` or ``max_model_len`` (at most ``k + 1`` tokens are emitted per verify step).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from hyserve.request import Request


class Proposer(ABC):
    @abstractmethod
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Up to ``num_tokens[i]`` draft tokens to follow ``requests[i]``'s known tokens."""


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n from max down to min) in the
    request's own tokens and propose what followed it."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        return [self._one(r, k) for r, k in zip(requests, num_tokens, strict=True)]

    def _one(self, req: Request, k: int) -> list[int]:
        if k <= 0:
            return []
        tokens = np.asarray(req.prompt_token_ids + req.output_token_ids, dtype=np.int64)
        n_tok = len(tokens)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            pattern = tokens[n_tok - n :]
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: n_tok - 1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []
