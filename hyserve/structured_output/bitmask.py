"""Allowed-token bitmasks as they cross the scheduler/worker seam: per sampled position, ``ceil(V / 32)`` int32
words, bit ``t % 32`` of word ``t // 32`` set where token ``t`` is allowed (llguidance's layout), packed as bytes.
The worker applies them to the logits on the device (``hyserve.kernels.bitmask``); nothing here knows a request."""

from __future__ import annotations

import torch

from hyserve.kernels.bitmask.reference import token_mask


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
    return token_mask(mask_words, vocab_size)
