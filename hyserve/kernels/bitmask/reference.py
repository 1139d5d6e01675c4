"""Structured output's allowed-token masks applied to logits, in plain torch (the CPU path and the yardstick)."""

from __future__ import annotations

import torch


def apply_token_bitmask_ref(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> None:
    """In place: in each row ``rows[i]`` of ``logits`` ``(N, V)``, token ``t`` becomes -inf unless bit ``t % 32`` of
    ``words[i, t // 32]`` is set (``words`` int32 ``(len(rows), ceil(V / 32))``)."""
    if rows.numel() == 0:
        return
    keep = token_mask(words, logits.shape[1])
    sub = logits.index_select(0, rows)
    sub.masked_fill_(~keep, float("-inf"))
    logits.index_copy_(0, rows, sub)


def token_mask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bool ``(n, vocab)`` from int32 words ``(n, ceil(vocab / 32))``: token ``t`` allowed where bit ``t % 32`` of
    word ``t // 32`` is set (on the device of ``words``)."""
    bits = torch.arange(32, device=words.device, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> bits) & 1).view(words.shape[0], -1)[:, :vocab].bool()
