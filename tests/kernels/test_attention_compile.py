"""The split-context decode attention kernel compiled for the H200 (sm_90) on the CPU, with no GPU: Triton's front
end and its bundled ptxas see type and constexpr errors the interpreter (``test_attention_splits.py``) does not.
Its variants at the 9B layer's heads: a bf16 cache with each row's own split over one split and several, an FP8
cache with a fixed split; and its rows of several tokens (verify rows) at the 27B's and the 9B's heads."""

from __future__ import annotations

import pytest

from hyserve.testing.triton_compile import compile_failures

triton = pytest.importorskip("triton")


def test_decode_attention_compiles_for_sm90() -> None:
    from hyserve.kernels import attention

    variants = attention.compile_variants()
    names = [name for name, *_ in variants]
    assert len(set(names)) == len(names) == 5
    failures = compile_failures(variants)
    assert not failures, failures
