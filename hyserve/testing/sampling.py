"""The logits adjustments of vLLM's sampler written out token by token: the yardstick of the penalty tests."""

from __future__ import annotations

import collections
import math

import torch

from hyserve.sampling_params import SamplingParams


def reference_adjust(raw: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams,
                     eos: set[int]) -> torch.Tensor:
    """The logits a request's next token is drawn from after ``prompt`` and output ``out`` (float64):
    allowed_token_ids, bad words, min_tokens bans (``eos`` unless ignore_eos, and stop_token_ids), logit_bias, then
    the repetition penalty over prompt and output tokens, frequency and presence penalties over the output."""
    x = raw.double().clone()
    if p.allowed_token_ids is not None:
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        x[~keep] = -math.inf
    for word in p.bad_words_token_ids or []:
        prefix = word[:-1]
        if len(prefix) <= len(out) and out[len(out) - len(prefix):] == prefix:
            x[word[-1]] = -math.inf
    if len(out) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else eos):
            x[t] = -math.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(out):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in collections.Counter(out).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x
