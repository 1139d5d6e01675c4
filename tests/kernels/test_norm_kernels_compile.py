"""The RMSNorm kernels (hyserve.kernels.norm: the zero-centred and scaled forms, their residual add with and without
Granite's multiplier, Mamba2's grouped gated norm in both gate orders, its sum-of-squares and given-sum forms for a
group spanning ranks, the gate alone) compiled for the H200 (sm_90) on the CPU, with no GPU: Triton's front end and
its bundled ptxas see type and constexpr errors the interpreter (``tests/kernels/test_norm_kernels.py``) does not.
One compile per variant the launchers make at Nemotron-H-8B's shapes, bf16, fp16 and float32 models.
"""

from __future__ import annotations

import pytest

from hyserve.testing.triton_compile import compile_failures

triton = pytest.importorskip("triton")


def test_norm_kernels_compile_for_sm90() -> None:
    from hyserve.kernels import norm

    variants = norm.compile_variants()
    names = [name for name, *_ in variants]
    assert len(set(names)) == len(names)
    assert {"rms_norm_scaled_bf16", "add_rms_norm_scaled_multiplied_bf16", "grouped_gated_rms_norm_gate_first_bf16",
            "grouped_gated_rms_norm_norm_first_given_sum_bf16", "gated_sum_squares_gate_first_bf16",
            "silu_gate_bf16"} <= set(names)
    failures = compile_failures(variants)
    assert not failures, failures
