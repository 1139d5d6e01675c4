"""The Mamba2 mixer's Triton kernels (the scan's recurrent and verify kernels, float32 / bf16 / fp16 models with
float32 or 16-bit states; the conv's forward, state and verify kernels with a bias) compiled for the H200 (sm_90) on
the CPU, with no GPU: Triton's front end and its bundled ptxas see type and constexpr errors the interpreter
(``tests/kernels/test_mamba2_kernels.py``) does not. One compile per variant the launchers make at Nemotron-H's
shapes.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

triton = pytest.importorskip("triton")


def _compile(fn: Any, sig: dict[str, str], consts: dict[str, Any]) -> Any:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(fn.fn).parameters)
    missing = [p for p in params if p not in sig and p not in consts]
    assert not missing, f"no type given for {missing}"
    signature = {p: "constexpr" if p in consts else sig[p] for p in params}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts), target=GPUTarget("cuda", 90, 32))


def test_mamba2_kernels_compile_for_sm90() -> None:
    from hyserve.kernels import conv, mamba2

    variants = [*mamba2.compile_variants(), *conv.compile_variants()]
    names = [name for name, *_ in variants]
    assert len(set(names)) == len(names) and any("verify" in n for n in names) and any("bf16" in n for n in names)
    failures = {}
    for name, fn, sig, consts in variants:
        try:
            kernel = _compile(fn, sig, consts)
            assert kernel.asm.get("cubin"), "no cubin"
        except Exception as e:  # report every variant, not the first
            failures[name] = f"{type(e).__name__}: {str(e)[:400]}"
    assert not failures, failures
