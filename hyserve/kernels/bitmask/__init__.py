"""Structured output's allowed-token masks applied to a step's logits (``hyserve.structured_output.bitmask`` has the
layout: per row, ``ceil(V / 32)`` int32 words, bit ``t % 32`` of word ``t // 32`` set where token ``t`` is allowed).

On CUDA one Triton launch that writes -inf only where a token is not allowed (``_triton.py``); elsewhere the
plain-torch reference of ``reference.py``, which defines the semantics.
"""

from __future__ import annotations

import torch

from hyserve.kernels.bitmask.reference import apply_token_bitmask_ref

__all__ = ["apply_token_bitmask", "apply_token_bitmask_ref", "apply_token_bitmask_triton"]

BLOCK = 1024


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> None:
    """In place on ``logits`` ``(N, V)`` (float, contiguous rows): rows ``rows`` (long) masked by ``words``."""
    if not logits.is_cuda:
        apply_token_bitmask_ref(logits, rows, words)
    else:
        apply_token_bitmask_triton(logits, rows, words)


def apply_token_bitmask_triton(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> None:
    from hyserve.kernels.bitmask._triton import _apply_token_bitmask_kernel

    n, vocab = rows.numel(), logits.shape[1]
    assert logits.stride(1) == 1, "the vocabulary dim must be contiguous"
    assert words.dtype == torch.int32 and words.shape[0] == n and words.shape[1] * 32 >= vocab, "words (n, >= V/32)"
    if n:
        _apply_token_bitmask_kernel[(n, triton_cdiv(vocab, BLOCK))](logits, rows, words.contiguous(), vocab,
                                                                     words.shape[1], logits.stride(0), BLOCK=BLOCK)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
