"""The allowed-token mask of structured output in one launch: each program takes one row and a block of the
vocabulary, reads the block's mask words and writes -inf only where a token is not allowed."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, rows_ptr, words_ptr, vocab, num_words, stride_row,
                                BLOCK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    row = tl.load(rows_ptr + i).to(tl.int64)
    word = tl.load(words_ptr + i * num_words + offs // 32, mask=inside, other=-1)
    allowed = ((word >> (offs % 32)) & 1) != 0
    tl.store(logits_ptr + row * stride_row + offs, float("-inf"), mask=inside & ~allowed)
