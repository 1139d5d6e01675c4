"""Speculative decoding on the scheduler side: how many drafts a request may take, and where they come from.

A decoding request is one verify row [last token + drafts] in an ordinary batch beside prefill chunks. Its
recurrent layers compute per-position candidates into scratch; after acceptance of ``a`` drafts the live slot takes
candidate ``a`` (docs/design.md invariant 2) through the row's slot index, the scheduler advances
``num_computed_tokens`` by ``a + 1``, frees KV blocks that hold only rejected positions, and publishes only verified
positions (invariant 3). The drafts of the next step come from the n-gram proposer (here, from the request's token
ids) or from the MTP head (on the worker, returned in ``RunnerOutput.next_draft_token_ids``); either way this trims them
so that a request never runs past ``max_tokens`` or ``max_model_len`` (at most k + 1 tokens are emitted per verify
step).
"""

from __future__ import annotations

from hyserve.request import Request
from hyserve.speculative.adaptive import SpecLengthPolicy
from hyserve.speculative.config import SpeculativeConfig
from hyserve.speculative.proposer import NgramProposer, Proposer


class DraftManager:
    def __init__(self, config: SpeculativeConfig, adaptive: bool = False) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        # How many drafts each step verifies (hyserve.speculative.adaptive); ``adaptive``: the resolved default.
        self.policy = SpecLengthPolicy(self.k, adaptive=adaptive,
                                       disable_by_batch_size=config.disable_by_batch_size)
        # Whether the MTP head drafts max(k_step, 1) tokens after a step at k_step (the worker has draft graphs of
        # those lengths where a step may be shorter than k), rather than k.
        self.short_drafting = config.method == "mtp" and (adaptive or config.disable_by_batch_size is not None)
        self.proposer: Proposer | None = None
        if config.method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def drafting_length(self, b: int, k_step: int) -> int:
        """The drafts the MTP head proposes in a step of ``b`` decoding requests at speculation length ``k_step``
        (before a request's end trims them): what a row behind that step's row can take. k where every step
        verifies k; else the policy's (``SpecLengthPolicy.drafting``: 0 in a run of steps at k = 0)."""
        return self.policy.drafting(b, k_step) if self.short_drafting else self.k

    @property
    def lookahead_tokens(self) -> int:
        """KV positions past a sampling row's end that the step may write: the MTP head's drafting passes."""
        return self.k if self.config.method == "mtp" else 0

    @staticmethod
    def draft_limit(req: Request, max_model_len: int) -> int:
        """Drafts may run up to this many tokens in all (the last draft is followed by the bonus token)."""
        p = req.sampling_params
        limit = max_model_len
        if p.max_tokens is not None:
            limit = min(limit, req.num_prompt_tokens + p.max_tokens - 1)
        return limit

    def num_drafts(self, req: Request, max_model_len: int) -> int:
        return max(0, min(self.k, self.draft_limit(req, max_model_len) - req.num_tokens))

    def propose(self, req: Request, proposal: list[int], max_model_len: int) -> list[int]:
        """The drafts for ``req``'s next verify row (``proposal``: the MTP head's, if that is the method)."""
        k = self.num_drafts(req, max_model_len)
        if k <= 0:
            return []
        if self.proposer is not None:
            proposal = self.proposer.propose([req], [k])[0]
        return [int(t) for t in proposal[:k]]
