"""The split-context decode attention's splits. A launch's split count is fixed when a graph captures it (by the rows,
the KV heads and the key tiles of ``max_seq_len``), and each row divides its own context over the splits in whole key
tiles, so a short row spreads its work over several programs while the splits past its context read nothing and
write only their (max, sum) = (floor, 0); the reduction reads no partial sums of a split whose sum is 0. Checked
under the Triton interpreter with the partial buffers poisoned with NaN: the output against the reference, every
(max, sum) written, exactly the live splits' partial sums written (the traffic saved), in both split modes (each
row's own, and ``decode_partition``'s fixed positions a split), and four sabotaged kernels caught."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest
import torch
from test_kernels import attn_problem

from hyserve.kernels.attention import decode_splits
from hyserve.kernels.attention.reference import paged_attention_ref
from hyserve.testing.triton_interpreter import (
    case_and_sabotage_checks,
    interpreter_subprocess_results,
    print_results,
)

KERNELS = "hyserve.kernels.attention._triton"  # the decode and reduce kernels, swapped for sabotaged copies
TILE = 64  # the decode kernel's key tile at head dim 16
# (lens, contexts, max_seq_len, decode_partition): rows of one token (one empty row) in a launch sized for a longer
# model, 2 query heads on one KV head (a program a row, KV head and split: test_kernels' split decode checks take two
# KV heads). "rows": each row's context over the splits (16 of them; the long row's 301 positions over 5);
# "fixed": 16 positions a split, 13 splits, 2 to 4 live per row.
HQ, HKV = 2, 1
CASES = {
    "rows": ([1, 1, 0, 1, 1], [0, 130, 4, 300, 63], 1000, None),
    "fixed": ([1, 1, 0, 1, 1], [0, 17, 4, 60, 31], 200, 16),
}

SABOTAGES = {
    # the reduction reads every split's partial sums, the empty splits' unwritten ones too
    "reduce_reads_empty_splits": [("mask=(smask & (l_s > 0))[:, None] & dmask[None, :]",
                                   "mask=smask[:, None] & dmask[None, :]")],
    # an empty split leaves its (max, sum) unwritten as well
    "empty_split_writes_no_max": [("tl.store(ml, m_i, mask=gmask)", "tl.store(ml, m_i, mask=gmask & (l_i > 0))")],
    # every split of a live row writes its partial sums again (correct output, the saved traffic lost)
    "empty_split_writes_sums": [("qmask = gmask[:, None] & dmask[None, :] & (lo < kv_len)",
                                 "qmask = gmask[:, None] & dmask[None, :] & (n > 0)")],
    # a row's context divided over the splits rounding down: its last positions fall past every split
    "row_split_drops_its_tail": [("part = tl.cdiv(tl.cdiv(kv_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N",
                                  "part = kv_len // tl.num_programs(2)")],
}
SABOTAGE_CASE = {"reduce_reads_empty_splits": "fixed", "empty_split_writes_no_max": "fixed",
                 "empty_split_writes_sums": "fixed", "row_split_drops_its_tail": "rows"}


def _live(seq: int, splits: int, partition: int | None) -> int:
    """The splits a row of ``seq`` positions fills."""
    part = partition or -(-(-(-seq // splits)) // TILE) * TILE
    return -(-seq // part)


def launch_poisoned(kernels: Any, p: dict[str, Any], partition: int | None, prefill: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``paged_attention_triton`` of problem ``p`` through ``kernels``' decode and reduce kernels (a module holding
    them) with the output and the partial buffers poisoned with NaN (``prefill`` False: the prefill kernel taken
    away, so a launch that reaches it fails): ``(out, partial sums, (max, sum))``."""
    import hyserve.kernels.attention as attention

    _triton = importlib.import_module(KERNELS)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    split_partials = attention.split_partials

    def poisoned(out: torch.Tensor, rows: int, splits: int) -> Any:
        po, pml, *strides = split_partials(out, rows, splits)
        po.fill_(float("nan"))
        pml.fill_(float("nan"))
        seen.append((po, pml))
        return (po, pml, *strides)

    saved = (_triton._paged_decode_kernel, _triton._paged_decode_reduce_kernel, _triton._paged_prefill_kernel)
    attention.split_partials = poisoned  # type: ignore[assignment]
    _triton._paged_decode_kernel = kernels._paged_decode_kernel
    _triton._paged_decode_reduce_kernel = kernels._paged_decode_reduce_kernel
    if not prefill:
        _triton._paged_prefill_kernel = None
    try:
        out = torch.full(p["q"].shape, float("nan"), dtype=p["q"].dtype)
        attention.paged_attention_triton(**p, decode_partition=partition, out=out)
    finally:
        attention.split_partials = split_partials  # type: ignore[assignment]
        _triton._paged_decode_kernel, _triton._paged_decode_reduce_kernel, _triton._paged_prefill_kernel = saved
    (po, pml), = seen
    return out, po, pml


def _run(kernels: Any, dtype: torch.dtype, case: str) -> tuple[bool, str]:
    """One decode launch with NaN-poisoned partial buffers through ``kernels`` (a module holding the decode and
    reduce kernels): ``(ok, message)``, ok when the output matches the reference, the partial (max, sum) pairs
    are all written, and exactly the live splits' partial sums are."""
    lens, ctxs, max_seq, partition = CASES[case]
    p = attn_problem(lens, ctxs, Hq=HQ, Hkv=HKV, D=16, block_size=4, dtype=dtype, seed=21)
    p["max_seq_len"] = max_seq
    want = paged_attention_ref(**p)
    out, po, pml = launch_poisoned(kernels, p, partition)
    splits = po.shape[2]
    want_splits = -(-max_seq // partition) if partition else decode_splits(len(lens), HKV, -(-max_seq // TILE))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = float((out.float() - want.float()).abs().max())
    ok_out = bool(torch.isfinite(out).all()) and err <= tol
    ok_ml = not bool(pml.isnan().any())
    live = torch.zeros(po.shape[0], splits, dtype=torch.bool)  # (row, split)
    for r, (c, n) in enumerate(zip(ctxs, lens, strict=True)):
        if n:
            live[r, : _live(c + n, splits, partition)] = True
    written = ~po.isnan().all(dim=-1).all(dim=1)  # (row, split): any head's sums written
    ok_po = torch.equal(written, live) and bool(torch.isfinite(po[live.unsqueeze(1).expand(-1, po.shape[1], -1)]).all())
    counts = live.sum(dim=1).tolist()
    return (ok_out and ok_ml and ok_po and splits == want_splits,
            f"{splits} splits (want {want_splits}), live per row {counts}; out err {err:.3g}, (max, sum) all written "
            f"{ok_ml}, partial sums of the live splits alone {ok_po}")


def interpreter_checks() -> dict[str, list[Any]]:
    return case_and_sabotage_checks(KERNELS, list(CASES), SABOTAGES, SABOTAGE_CASE, _run)


def test_the_split_count_follows_the_rows_not_the_model_length() -> None:
    """About 1024 programs a launch, at most one key tile a split and 64 splits: batch 1 of a 9B layer's 4 KV heads
    takes 64 splits of a long context and 19 of 600 positions (in 32-position tiles), batch 64 four."""
    assert decode_splits(1, 4, 8192 // 32) == 64
    assert decode_splits(1, 4, 19) == 19
    assert decode_splits(64, 4, 8192 // 32) == 4 and decode_splits(8, 4, 256) == 32
    assert decode_splits(300, 4, 256) == 1 and decode_splits(0, 4, 1) == 1


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, list[Any]]:
    return interpreter_subprocess_results(__file__, "--interpreter-checks")


@pytest.mark.parametrize("case", [f"{c}_{d}" for c in CASES for d in ("float32", "bfloat16")])
def test_splits_match_the_reference_and_skip_past_the_context(interpreter_results: dict[str, list[Any]],
                                                              case: str) -> None:
    ok, msg = interpreter_results[case]
    assert ok, msg


def test_a_long_row_spreads_over_several_splits(interpreter_results: dict[str, list[Any]]) -> None:
    """In the rows' own split, the 301-position row fills 5 of the 16 splits (one fixed part of 512 positions,
    as before, would have put it in one program a head)."""
    ok, msg = interpreter_results["rows_float32"]
    assert ok and "live per row [1, 3, 0, 5, 1]" in msg, msg


@pytest.mark.parametrize("name", sorted(SABOTAGES))
def test_sabotaged_split_kernels_are_caught(interpreter_results: dict[str, list[Any]], name: str) -> None:
    ok, msg = interpreter_results[f"sabotage_{name}"]
    assert not ok, f"{name} went unseen: {msg}"


if __name__ == "__main__":
    if "--interpreter-checks" in sys.argv:
        from hyserve.testing.triton_interpreter import patch_triton_interpreter

        patch_triton_interpreter()
        print_results(interpreter_checks())
