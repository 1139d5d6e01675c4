"""The RMSNorm kernels (hyserve.kernels.norm: the zero-centred and scaled forms, their residual add with and without
Granite's multiplier, Mamba2's grouped gated norm in both gate orders, its sum-of-squares and given-sum forms for a
group spanning ranks, the gate alone) compiled for the H200 (sm_90) on the CPU, with no GPU: Triton's front end and
its bundled ptxas see type and constexpr errors the interpreter (``tests/kernels/test_norm_kernels.py``) does not.
One compile per variant the launchers make at Nemotron-H-8B's shapes, bf16, fp16 and float32 models.
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


def test_norm_kernels_compile_for_sm90() -> None:
    from hyserve.kernels import norm

    variants = norm.compile_variants()
    names = [name for name, *_ in variants]
    assert len(set(names)) == len(names)
    assert {"rms_norm_scaled_bf16", "add_rms_norm_scaled_multiplied_bf16", "grouped_gated_rms_norm_gate_first_bf16",
            "grouped_gated_rms_norm_norm_first_given_sum_bf16", "gated_sum_squares_gate_first_bf16",
            "silu_gate_bf16"} <= set(names)
    failures = {}
    for name, fn, sig, consts in variants:
        try:
            kernel = _compile(fn, sig, consts)
            assert kernel.asm.get("cubin"), "no cubin"
        except Exception as e:  # report every variant, not the first
            failures[name] = f"{type(e).__name__}: {str(e)[:400]}"
    assert not failures, failures
