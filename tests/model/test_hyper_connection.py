"""Qwen4-Exp's hyper-connections on their CUDA path (``hyserve.kernels.hyper_connection``), run on CPU tensors under
the Triton interpreter (one subprocess) against the layer's torch formulation, which the model tests hold to
transformers: ``mix`` (with and without the injection weights), ``inject_into``, and ``inject_and_mix`` (one block's
injection fused with the next block's norm) against ``inject_into`` then ``mix``; float32 to rounding, bf16 to the
activation dtype's spacing. Sabotaged kernels' inputs (the streams' injection weights reversed, the norm's weight of
another stream) must differ.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from hyserve.layers.hyper_connection import GatedResidual
from hyserve.testing.triton_interpreter import interpreter_subprocess_results

H, S, RANK = 48, 4, 8


def make_block(dtype: torch.dtype, use_combine: bool = True, seed: int = 0) -> GatedResidual:
    block = GatedResidual(H, S, RANK, 1e-6, use_combine=use_combine)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else 0.5))
    return block.to(dtype)


def _torch_path(fn):  # type: ignore[no-untyped-def]
    """Run ``fn`` with the layer's torch formulation (the interpreter would otherwise take the kernels)."""
    import hyserve.layers.hyper_connection as hc

    real = hc.uses_triton
    hc.uses_triton = lambda t: False  # type: ignore[assignment]
    try:
        return fn()
    finally:
        hc.uses_triton = real  # type: ignore[assignment]


def run_kernel_checks() -> dict[str, list]:
    """Under ``TRITON_INTERPRET=1``: {name: [ok, message]}."""
    import hyserve.layers.norm as hc_norm_module
    from hyserve.kernels.hyper_connection import hc_inject_norm
    from hyserve.testing.triton_interpreter import patch_triton_interpreter

    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_triton_interpreter()
    out: dict[str, list] = {}

    def check(name: str, got: torch.Tensor | None, want: torch.Tensor | None, tol: float,
              differ: bool = False) -> None:
        assert got is not None and want is not None
        err = float((got.float() - want.float()).abs().max())
        out[name] = [(err > 100 * tol) if differ else (err <= tol), f"max err {err:.3g}"]

    gen = torch.Generator().manual_seed(1)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        n = str(dtype).split(".")[-1]
        block = make_block(dtype)
        x = (torch.randn(7, S * H, generator=gen) * 2).to(dtype)
        o = torch.randn(7, H, generator=gen).to(dtype)
        w = (torch.rand(7, S, generator=gen) * 2).to(dtype)
        with torch.no_grad():
            mixed, weights = block.mix(x)
            want_mixed, want_weights = _torch_path(lambda: block.mix(x))
            check(f"mix_{n}", mixed, want_mixed, tol)
            check(f"mix_weights_{n}", weights, want_weights, tol)
            check(f"inject_{n}", GatedResidual.inject_into(x, o, w),
                  _torch_path(lambda: GatedResidual.inject_into(x, o, w)), tol)
            xf, hf, wf = block.inject_and_mix(x, o, w)
            xr, hr, wr = _torch_path(lambda: block.inject_and_mix(x, o, w))
            check(f"inject_and_mix_x_{n}", xf, xr, tol)
            check(f"inject_and_mix_h_{n}", hf, hr, tol)
            check(f"inject_and_mix_w_{n}", wf, wr, tol)
            norm = block.hc_norm
            got_norm = norm(x)
            real = hc_norm_module.uses_triton
            hc_norm_module.uses_triton = lambda t: False  # type: ignore[assignment]
            try:
                want_norm = norm(x)
            finally:
                hc_norm_module.uses_triton = real  # type: ignore[assignment]
            check(f"grouped_norm_{n}", got_norm, want_norm, tol)
            last = make_block(dtype, use_combine=False, seed=3)
            got, none = last.mix(x)
            check(f"mix_no_combine_{n}", got, _torch_path(lambda: last.mix(x))[0], tol)
            out[f"mix_no_combine_weights_{n}"] = [none is None, "no injection weights"]
            if dtype == torch.float32:
                check("reversed_weights_caught", hc_inject_norm(x, o, w.flip(1), None, S, 0.0)[0], xr, tol, True)
                rolled = block.hc_norm.weight.roll(H)
                check("rolled_norm_weight_caught", hc_inject_norm(x, None, None, rolled, S, 1e-6)[1],
                      _torch_path(lambda: block.hc_norm(x)), tol, True)
    return out


CHECKS = [f"{c}_{dt}" for dt in ("float32", "bfloat16")
          for c in ("mix", "mix_weights", "inject", "inject_and_mix_x", "inject_and_mix_h", "inject_and_mix_w",
                    "grouped_norm", "mix_no_combine", "mix_no_combine_weights")]
CHECKS += ["reversed_weights_caught", "rolled_norm_weight_caught"]


@pytest.fixture(scope="module")
def kernel_results() -> dict[str, list]:
    pytest.importorskip("triton")
    return interpreter_subprocess_results(__file__, "--kernel-checks")


@pytest.mark.parametrize("name", CHECKS)
def test_hyper_connection_kernels_under_the_interpreter(kernel_results: dict[str, list], name: str) -> None:
    ok, msg = kernel_results[name]
    assert ok, f"{name}: {msg}"


def test_inject_and_mix_is_inject_then_mix_on_the_cpu() -> None:
    """The torch path of the fused entry point is the two steps it replaces."""
    block = make_block(torch.float32)
    gen = torch.Generator().manual_seed(4)
    x, o, w = torch.randn(5, S * H, generator=gen), torch.randn(5, H, generator=gen), torch.rand(5, S, generator=gen)
    with torch.no_grad():
        x2, h, wt = block.inject_and_mix(x, o, w)
        want_x = GatedResidual.inject_into(x, o, w)
        want_h, want_w = block.mix(want_x)
    assert torch.equal(x2, want_x) and torch.equal(h, want_h) and wt is not None and want_w is not None
    assert torch.equal(wt, want_w)


if __name__ == "__main__":
    if "--kernel-checks" in sys.argv:
        print("RESULTS " + json.dumps(run_kernel_checks()))
