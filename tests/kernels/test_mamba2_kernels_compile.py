"""The Mamba2 mixer's Triton kernels (the scan's recurrent and verify kernels, float32 / bf16 / fp16 models with
float32 or 16-bit states; the conv's forward, state and verify kernels with a bias) compiled for the H200 (sm_90) on
the CPU, with no GPU: Triton's front end and its bundled ptxas see type and constexpr errors the interpreter
(``tests/kernels/test_mamba2_kernels.py``) does not. One compile per variant the launchers make at Nemotron-H's
shapes.
"""

from __future__ import annotations

import pytest

from hyserve.testing.triton_compile import compile_failures

triton = pytest.importorskip("triton")


def test_mamba2_kernels_compile_for_sm90() -> None:
    from hyserve.kernels import conv, mamba2

    variants = [*mamba2.compile_variants(), *conv.compile_variants()]
    names = [name for name, *_ in variants]
    assert len(set(names)) == len(names) and any("verify" in n for n in names) and any("bf16" in n for n in names)
    failures = compile_failures(variants)
    assert not failures, failures
