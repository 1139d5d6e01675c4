"""Allowed-token bitmasks as they cross the scheduler/worker seam: per sampled position, ``ceil(V / 32)`` int32
words, bit ``t % 32`` of word ``t // 32`` set where token ``t`` is allowed (llguidance's layout), packed as bytes.
The worker applies them to the logits on the device (``apply_bitmask``); nothing here knows a request."""

from __future__ import annotations

import torch


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack(packed: bytes, vocab_size: int) -> torch.Tensor:
    """The bytes of ``n`` positions' masks as an int32 tensor ``(n, num_words(vocab_size))`` on the CPU."""
    words = num_words(vocab_size)
    mask = torch.frombuffer(bytearray(packed), dtype=torch.int32)
    if mask.numel() % words:
        raise ValueError(f"a grammar mask of {mask.numel()} words is not a whole number of rows of {words}")
    return mask.view(-1, words)


def allowed(mask_words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool ``(n, vocab_size)``: token t allowed at each position (on the device of ``mask_words``)."""
    bits = torch.arange(32, device=mask_words.device, dtype=torch.int32)
    out = (mask_words.unsqueeze(-1) >> bits) & 1
    return out.view(mask_words.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, mask_words: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place: ``logits`` ``(n, V)``, ``mask_words`` ``(n, words)``
    on the logits' device. Columns past the mask's 32 * words (a padded LM head) are disallowed too."""
    vocab = logits.shape[-1]
    keep = allowed(mask_words, min(vocab, mask_words.shape[1] * 32))
    if keep.shape[1] < vocab:
        logits[:, keep.shape[1]:] = float("-inf")
    logits[:, : keep.shape[1]].masked_fill_(~keep, float("-inf"))
