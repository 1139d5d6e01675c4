"""Qwen4-Exp's Triton kernels (QSA scores, pooled scores, lanes, index-key store and attention; the
hyper-connections; the PLE n-grams; the FP8 activation quantization all FP8 models launch)
compiled for the H200 (sm_90) on the CPU, with no GPU: Triton's front end and its bundled ptxas see type and
constexpr errors the interpreter (which runs the kernels' Python, ``tests/model/test_qsa.py`` and the others) does
not. One compile per variant the launchers make for bf16 models (an FP8 KV cache too, and a split and a single
program); the same in float32 for QSA's attention, whose tiles are the largest.
"""

from __future__ import annotations

from typing import Any

import pytest

from hyserve.testing.triton_compile import compile_failures, compile_for_sm90

triton = pytest.importorskip("triton")


def _variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    from hyserve.kernels import fp8, hyper_connection, ple
    from hyserve.kernels.attention import qsa

    return [*qsa.compile_variants(), *hyper_connection.compile_variants(), *ple.compile_variants(),
            *fp8.compile_variants()]


def test_qwen4_exp_kernels_compile_for_sm90() -> None:
    failures = compile_failures(_variants())
    assert not failures, failures


def test_a_broken_kernel_does_not_compile() -> None:
    """The check can fail: a kernel adding a pointer to a float does not compile."""
    import triton.language as tl

    @triton.jit
    def broken(x_ptr, y):
        tl.store(x_ptr + y, 1.0)

    with pytest.raises(Exception):  # Triton's compile error types vary by version
        compile_for_sm90(broken, dict(x_ptr="*fp32", y="fp32"), {})
