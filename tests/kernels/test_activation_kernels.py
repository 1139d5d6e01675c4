"""The ungated activation kernel (``hyserve.kernels.activation``: Nemotron-H's ``relu2``) under the Triton interpreter
(``TRITON_INTERPRET=1``, one subprocess: the variable must be set before any kernel is decorated) against
transformers' formula ``torch.square(F.relu(x))``, bit for bit: float32, bf16 and fp16; odd widths, widths above the
launcher's block, zero and one rows, a strided input (rows of a wider tensor), 3-D input, NaN and signed zeros. A
sabotaged launch (the kernel fed ``|x|``, so negatives are squared instead of zeroed) must disagree. The kernel
compiled for sm_90 on the CPU for each dtype.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from hyserve.testing.triton_interpreter import interpreter_subprocess_results, patch_triton_interpreter, print_results

REPO_ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (rows, width, strided)
SHAPES = {"odd": (7, 37, False), "wide": (3, 2500, False), "one_row": (1, 96, False), "no_rows": (0, 96, False),
          "strided": (5, 70, True), "three_d": (-1, 24, False)}


def _problem(rows: int, width: int, strided: bool, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(41)
    if rows < 0:  # (2, 3, width)
        return (torch.randn(2, 3, width, generator=gen) * 3).to(dtype)
    if strided:
        return (torch.randn(rows, width + 9, generator=gen) * 3).to(dtype)[:, 4 : 4 + width]
    x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    if x.numel() > 4:
        x.view(-1)[:4] = torch.tensor([float("nan"), -0.0, 0.0, -float("inf")]).to(dtype)
    return x


def _interp(shape: str, dtype: torch.dtype, sabotage: bool = False) -> tuple[bool, str]:
    from hyserve.kernels.activation import relu_squared, relu_squared_triton

    x = _problem(*SHAPES[shape], dtype)
    want = torch.square(F.relu(x))
    got = relu_squared_triton(x.abs() if sabotage else x)
    same = got.shape == want.shape and got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan()) and \
        torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    # relu_squared takes the kernel under the interpreter (uses_triton)
    dispatched = torch.equal(torch.nan_to_num(relu_squared(x)), torch.nan_to_num(got))
    bad = int((torch.nan_to_num(got) != torch.nan_to_num(want)).sum()) if got.shape == want.shape else -1
    return (same and dispatched) != sabotage, f"identical {same}, elements differing {bad}, dispatched {dispatched}"


def run_interpreter_checks() -> dict[str, list[Any]]:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_triton_interpreter()
    res: dict[str, list[Any]] = {}
    for name, dtype in DTYPES.items():
        for shape in SHAPES:
            try:
                ok, msg = _interp(shape, dtype)
            except Exception as e:  # report, don't abort the other checks
                ok, msg = False, f"{type(e).__name__}: {e}"
            res[f"{shape}_{name}"] = [ok, msg]
    ok, msg = _interp("odd", torch.bfloat16, sabotage=True)
    res["negatives_squared_caught"] = [ok, msg]
    return res


INTERP_CHECKS = [*[f"{s}_{d}" for d in DTYPES for s in SHAPES], "negatives_squared_caught"]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, list[Any]]:
    pytest.importorskip("triton")
    return interpreter_subprocess_results(__file__, "--interpreter-checks")


def test_every_check_ran(interpreter_results: dict[str, list[Any]]) -> None:
    assert sorted(interpreter_results) == sorted(INTERP_CHECKS)


@pytest.mark.parametrize("name", INTERP_CHECKS)
def test_relu_squared_kernel_interpreter(interpreter_results: dict[str, list[Any]], name: str) -> None:
    ok, msg = interpreter_results[name]
    assert ok, f"{name}: {msg}"


def test_cpu_path_is_transformers_formula() -> None:
    """Off the Triton path ``relu_squared`` is ``torch.square(F.relu(x))`` itself (and so the MLP's activation)."""
    from hyserve.kernels.activation import relu_squared

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter takes the kernel")
    x = _problem(7, 37, False, torch.bfloat16)
    assert torch.equal(torch.nan_to_num(relu_squared(x)), torch.nan_to_num(torch.square(F.relu(x))))


def test_relu_squared_compiles_for_sm90() -> None:
    pytest.importorskip("triton")
    from hyserve.kernels import activation
    from hyserve.testing.triton_compile import compile_failures

    failures = compile_failures(activation.compile_variants())
    assert not failures, failures


if __name__ == "__main__":
    if sys.argv[1:] == ["--interpreter-checks"]:
        results = run_interpreter_checks()
        print_results(results)
