"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the LM head over a prefill row's positions.

A row whose ``prompt_logprob_targets`` is not empty asks, for each of its first ``len(targets)`` positions, the
``log_softmax`` of the logits there (the raw distribution, as the sampler's logprobs): the logprob of the target
(the prompt's next token), its 1-based rank in the vocabulary and the request's top-N. Each chunk of a chunked
prefill returns its own positions. The step's hidden states are laid out row after row (an eager forward, no
padding), so a row's positions are a contiguous slice of them.

The results go to the host at once (a synchronization of the step, paid only by steps that hold such a row) and
into the ``RunnerOutput`` as plain lists. The logits are computed ``CHUNK`` positions at a time, so a long prompt
never holds a [tokens, vocabulary] tensor whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hyserve.sampling_params import SamplingParams
from hyserve.scheduler.output import PromptLogprobRows, ScheduledRow

CHUNK = 256  # positions whose logits are held at once


def wants_prompt_logprobs(rows: list[ScheduledRow]) -> bool:
    return any(r.prompt_logprob_targets for r in rows)


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    rows: list[ScheduledRow], requests: dict[str, SamplingParams]) -> dict[int, PromptLogprobRows]:
    """Row index -> (logprobs, ranks, top-N lists) of the targets of each row that asks; ``hidden`` holds the step's
    positions row after row."""
    out: dict[int, PromptLogprobRows] = {}
    offset = 0
    for i, row in enumerate(rows):
        targets = row.prompt_logprob_targets
        if targets:
            top_n = requests[row.req_id].prompt_logprobs or 0
            lps: list[float] = []
            ranks: list[int] = []
            tops: list[list[tuple[int, float]]] = []
            for lo in range(0, len(targets), CHUNK):
                hi = min(lo + CHUNK, len(targets))
                logprobs = torch.log_softmax(compute_logits(hidden[offset + lo: offset + hi]).float(), dim=-1)
                target = torch.tensor(targets[lo:hi], device=logprobs.device, dtype=torch.long)
                chosen = logprobs.gather(1, target[:, None])
                lps += chosen[:, 0].tolist()
                ranks += (logprobs > chosen).sum(dim=1).add_(1).tolist()
                if top_n:
                    values, ids = logprobs.topk(min(top_n, logprobs.shape[1]), dim=1)
                    tops += [list(zip(r_ids, r_vals, strict=True))
                             for r_ids, r_vals in zip(ids.tolist(), values.tolist(), strict=True)]
                else:
                    tops += [[] for _ in range(hi - lo)]
            out[i] = (lps, ranks, tops)
        offset += row.num_new_tokens
    return out
