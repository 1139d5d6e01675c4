"""The split-context decode attention's empty splits: a decode graph sizes its splits for the model's length, so most
of a short row's splits lie past its context. Such a split reads nothing and writes only its (max, sum) = (floor, 0);
its partial sums are neither written by the decode kernel nor read by the reduction (``l == 0``). Checked under the
Triton interpreter with the partial buffers poisoned with NaN: the output against the reference, the empty splits'
partial sums still NaN afterwards (the traffic saved), and three sabotaged kernels caught."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest
import torch
from test_kernels import attn_problem

from hyserve.kernels.attention.reference import paged_attention_ref
from hyserve.testing.triton_interpreter import (
    interpreter_subprocess_results,
    mutated_module,
    print_results,
    record_check,
)

KERNELS = "hyserve.kernels.attention._triton"  # the decode and reduce kernels, swapped for sabotaged copies
PART = 16  # context positions per split (decode_partition)
LENS, CTXS = [1, 1, 0, 1, 1], [0, 17, 4, 60, 31]  # seq_lens 1, 18, (an empty row), 61, 32
MAX_SEQ = 200  # as a graph sized for a longer model: 13 splits, 2 to 4 live ones per row

SABOTAGES = {
    # the reduction reads every split's partial sums, the empty splits' unwritten ones too
    "reduce_reads_empty_splits": [("mask=(smask & (l_s > 0))[:, None] & dmask[None, :]",
                                   "mask=smask[:, None] & dmask[None, :]")],
    # an empty split leaves its (max, sum) unwritten as well
    "empty_split_writes_no_max": [("tl.store(ml, m_i, mask=gmask)", "tl.store(ml, m_i, mask=gmask & (l_i > 0))")],
    # every split of a live row writes its partial sums again (correct output, the saved traffic lost)
    "empty_split_writes_sums": [("qmask = gmask[:, None] & dmask[None, :] & (lo < kv_len)",
                                 "qmask = gmask[:, None] & dmask[None, :] & (n > 0)")],
}


def _run(kernels: Any, dtype: torch.dtype) -> tuple[bool, str]:
    """One decode launch with NaN-poisoned partial buffers through ``kernels`` (a module holding the decode and
    reduce kernels): ``(ok, message)``, ok when the output matches the reference, the partial (max, sum) pairs
    are all written, and exactly the live splits' partial sums are."""
    import hyserve.kernels.attention as attention

    _triton = importlib.import_module(KERNELS)

    p = attn_problem(LENS, CTXS, Hq=4, Hkv=2, D=16, block_size=4, dtype=dtype, seed=21)
    p["max_seq_len"] = MAX_SEQ
    want = paged_attention_ref(**p)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    split_partials = attention.split_partials

    def poisoned(out: torch.Tensor, rows: int, splits: int) -> Any:
        po, pml, *strides = split_partials(out, rows, splits)
        po.fill_(float("nan"))
        pml.fill_(float("nan"))
        seen.append((po, pml))
        return (po, pml, *strides)

    saved = (_triton._paged_decode_kernel, _triton._paged_decode_reduce_kernel)
    attention.split_partials = poisoned  # type: ignore[assignment]
    _triton._paged_decode_kernel = kernels._paged_decode_kernel
    _triton._paged_decode_reduce_kernel = kernels._paged_decode_reduce_kernel
    try:
        out = torch.full(p["q"].shape, float("nan"), dtype=dtype)
        attention.paged_attention_triton(**p, decode_partition=PART, out=out)
    finally:
        attention.split_partials = split_partials  # type: ignore[assignment]
        _triton._paged_decode_kernel, _triton._paged_decode_reduce_kernel = saved
    (po, pml), = seen
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    rows = [r for r, n in enumerate(LENS) if n]
    err = float((out.float() - want.float()).abs().max())
    ok_out = bool(torch.isfinite(out).all()) and err <= tol
    ok_ml = not bool(pml.isnan().any())
    live = torch.zeros(po.shape[0], po.shape[2], dtype=torch.bool)  # (row, split)
    for r, (c, n) in enumerate(zip(CTXS, LENS, strict=True)):
        if n:
            live[r, : -(-(c + n) // PART)] = True
    written = ~po.isnan().all(dim=-1).all(dim=1)  # (row, split): any head's sums written
    ok_po = torch.equal(written, live) and bool(torch.isfinite(po[live.unsqueeze(1).expand(-1, po.shape[1], -1)]).all())
    return ok_out and ok_ml and ok_po, (f"{po.shape[2]} splits, rows {rows}; out err {err:.3g}, (max, sum) all "
                                        f"written {ok_ml}, partial sums of the live splits alone {ok_po}")


def interpreter_checks() -> dict[str, list[Any]]:
    _triton = importlib.import_module(KERNELS)
    results: dict[str, list[Any]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        record_check(results, f"empty_splits_{str(dtype)[6:]}", lambda dt=dtype: _run(_triton, dt))
    for name, edits in SABOTAGES.items():
        mutated = mutated_module(KERNELS, edits)
        record_check(results, f"sabotage_{name}", lambda m=mutated: _run(m, torch.float32))
    return results


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, list[Any]]:
    return interpreter_subprocess_results(__file__, "--interpreter-checks")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_empty_splits_are_skipped_and_the_output_kept(interpreter_results: dict[str, list[Any]], dtype: str) -> None:
    ok, msg = interpreter_results[f"empty_splits_{dtype}"]
    assert ok, msg


@pytest.mark.parametrize("name", sorted(SABOTAGES))
def test_sabotaged_split_kernels_are_caught(interpreter_results: dict[str, list[Any]], name: str) -> None:
    ok, msg = interpreter_results[f"sabotage_{name}"]
    assert not ok, f"{name} went unseen: {msg}"


if __name__ == "__main__":
    if "--interpreter-checks" in sys.argv:
        from hyserve.testing.triton_interpreter import patch_triton_interpreter

        patch_triton_interpreter()
        print_results(interpreter_checks())
