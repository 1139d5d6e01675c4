"""The logits adjustments of vLLM's sampler that come before temperature, batched over rows (plain torch).

In vLLM's order, each on the float32 logits of the rows that have it:

1. ``allowed_token_ids``: every other token to -inf.
2. bad words: a word's last token to -inf where the word's other tokens end the output so far.
3. (min_tokens: stop token ids and EOS to -inf; the samplers' bans, applied after these: -inf stays -inf through
   everything below, so the order of the masks does not matter.)
4. ``logit_bias``: added.
5. penalties (vLLM's ``apply_penalties``): ``repetition_penalty`` over the prompt and output tokens (a positive
   logit is multiplied by ``1 / r``, any other by ``r``), then ``frequency_penalty * count`` and
   ``presence_penalty * (count > 0)`` subtracted, counts over the output tokens only.

The bias comes before the repetition penalty, so a biased logit's sign decides which way it is scaled. The
functions work in place on ``x`` (float32, one row per logits row); ``ModelRunner`` builds their inputs through
``hyserve.worker.sampling_state.SamplingState``.
"""

from __future__ import annotations

import math

import torch


def apply_allowed(x: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, restricted: torch.Tensor) -> None:
    """Rows with ``restricted`` keep only the tokens ``tokens`` listed for them (``rows[i]``: the row of
    ``tokens[i]``)."""
    keep = torch.zeros_like(x, dtype=torch.bool)
    keep[rows, tokens] = True
    keep |= ~restricted.unsqueeze(1)
    x.masked_fill_(~keep, -math.inf)


def apply_bias(x: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, bias: torch.Tensor) -> None:
    """``x[rows[i], tokens[i]] += bias[i]`` (each (row, token) pair at most once)."""
    x.index_put_((rows, tokens), bias, accumulate=True)


def apply_penalties(x: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> None:
    """vLLM's ``apply_penalties`` in place: ``prompt_mask`` (rows, V) bool, ``output_counts`` (rows, V) counts of
    the output tokens, the three penalties (rows,); a row with (0, 0, 1) is left exactly as it was."""
    output_mask = output_counts > 0
    penalties = torch.where(prompt_mask | output_mask, repetition.unsqueeze(1), 1.0)
    x.mul_(torch.where(x > 0, 1.0 / penalties, penalties))
    x.sub_(frequency.unsqueeze(1) * output_counts)
    x.sub_(presence.unsqueeze(1) * output_mask)


def bad_word_hits(tail: torch.Tensor, tail_valid: torch.Tensor, prefixes: torch.Tensor,
                  prefix_used: torch.Tensor) -> torch.Tensor:
    """Which bad words complete at each position: ``tail`` (P, M) the last M output tokens before each position
    (right-aligned; ``tail_valid`` False where the output is shorter), ``prefixes`` (W, M) each word's tokens
    before its last, right-aligned, ``prefix_used`` (W, M) which of those columns the word has. (P, W) bool."""
    same = (tail.unsqueeze(1) == prefixes.unsqueeze(0)) & tail_valid.unsqueeze(1)
    return (same | ~prefix_used.unsqueeze(0)).all(dim=2)
