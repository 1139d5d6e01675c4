"""Rows of a few tokens (verify rows: k + 1; the MTP head's pass over a verify row's accepted positions) through the
split-context kernel: one program per (row, kv head, context split) holds every (token, query head) pair of the row's
GQA group as a lane, so each key tile is read once a kv head, and query i of the row sees positions up to
``seq_len - n + i``. The partial sums are the tokens' (a row writes only its own). Checked under the Triton
interpreter with the partial buffers and the output poisoned with NaN and the prefill kernel taken away (the launch
must not reach it): the output against the reference, every token's (max, sum) written, exactly the live splits'
partial sums written, in both split modes, and three sabotaged kernels caught."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from test_attention_splits import launch_poisoned
from test_kernels import attn_problem

from hyserve.kernels.attention import SHORT_ROW_MAX_LANES, decode_splits, short_row_lanes
from hyserve.kernels.attention.reference import paged_attention_ref
from hyserve.testing.triton_interpreter import (
    case_and_sabotage_checks,
    interpreter_subprocess_results,
    print_results,
)

KERNELS = "hyserve.kernels.attention._triton"
TILE = 64  # the kernel's key tile at head dim 16
# (lens, contexts, query heads, kv heads, max_seq_len, decode_partition). "verify": rows of 3 (one of 2, one of 1,
# one empty) at GQA group 3 (9 lanes in 16) on one KV head, each row's context over the launch's splits; "fixed": 16
# positions a split; "group4": rows of 4 at group 4 (16 lanes), a row with no context before its tokens; both on two
# KV heads.
CASES = {
    "verify": ([3, 3, 0, 2, 3, 1], [9, 130, 4, 300, 0, 63], 3, 1, 400, None),
    "fixed": ([3, 1, 3, 2], [17, 40, 0, 29], 6, 2, 200, 16),
    "group4": ([4, 4, 2], [0, 77, 150], 8, 2, 400, None),
}

SABOTAGES = {
    # every query of a row sees the row's whole step (its later tokens' keys too)
    "no_causal_limit": [("allowed = gmask[:, None] & pmask[None, :] & (pos[None, :] <= qpos[:, None])",
                         "allowed = gmask[:, None] & pmask[None, :]")],
    # the partial sums filed by row: a row's tokens overwrite each other's
    "partials_by_row": [("        prow = tok\n", "        prow = start + 0 * oi\n")],
    # the lanes' tokens and heads swapped around
    "lanes_mismatched": [("oi = om // GROUP  # the lane's token in the row", "oi = om % GROUP")],
}
SABOTAGE_CASE = {"no_causal_limit": "verify", "partials_by_row": "fixed", "lanes_mismatched": "group4"}


def _live(seq: int, splits: int, partition: int | None) -> int:
    """The splits a row of ``seq`` positions fills."""
    part = partition or -(-(-(-seq // splits)) // TILE) * TILE
    return -(-seq // part)


def _run(kernels: Any, dtype: torch.dtype, case: str) -> tuple[bool, str]:
    """One launch of ``case`` through ``kernels`` (a module holding the decode and reduce kernels) with NaN-poisoned
    partial buffers and output: ``(ok, message)``."""
    lens, ctxs, hq, hkv, max_seq, partition = CASES[case]
    p = attn_problem(lens, ctxs, Hq=hq, Hkv=hkv, D=16, block_size=4, dtype=dtype, seed=31)
    p["max_seq_len"] = max_seq
    want = paged_attention_ref(**p)
    out, po, pml = launch_poisoned(kernels, p, partition, prefill=False)
    tokens, splits = po.shape[0], po.shape[2]
    want_splits = -(-max_seq // partition) if partition else decode_splits(len(lens), hkv, -(-max_seq // TILE))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = float((out.float() - want.float()).abs().max())
    ok_out = bool(torch.isfinite(out).all()) and err <= tol
    ok_ml = not bool(pml.isnan().any())
    live = torch.zeros(tokens, splits, dtype=torch.bool)  # (token, split)
    t = 0
    for c, n in zip(ctxs, lens, strict=True):
        live[t : t + n, : _live(c + n, splits, partition)] = True
        t += n
    written = ~po.isnan().all(dim=-1).all(dim=1)  # (token, split): any head's sums written
    ok_po = torch.equal(written, live) and bool(torch.isfinite(po[live.unsqueeze(1).expand(-1, po.shape[1], -1)]).all())
    return (ok_out and ok_ml and ok_po and splits == want_splits and tokens == sum(lens),
            f"{tokens} partial rows, {splits} splits (want {want_splits}); out err {err:.3g}, (max, sum) all written "
            f"{ok_ml}, partial sums of the live splits alone {ok_po}")


def interpreter_checks() -> dict[str, list[Any]]:
    return case_and_sabotage_checks(KERNELS, list(CASES), SABOTAGES, SABOTAGE_CASE, _run)


def test_the_lanes_decide_which_rows_are_short() -> None:
    """Decode rows always; verify rows of the 27B's heads (group 6) up to 10 tokens (60 lanes in 64), of the 9B's
    (group 4) up to 16; longer rows take the prefill kernel."""
    assert SHORT_ROW_MAX_LANES == 64
    assert short_row_lanes(1, 6) == 16 and short_row_lanes(0, 6) == 16 and short_row_lanes(1, 128) == 128
    assert short_row_lanes(3, 6) == 32 and short_row_lanes(10, 6) == 64 and short_row_lanes(11, 6) is None
    assert short_row_lanes(3, 4) == 16 and short_row_lanes(16, 4) == 64 and short_row_lanes(17, 4) is None
    assert short_row_lanes(128, 4) is None


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, list[Any]]:
    return interpreter_subprocess_results(__file__, "--interpreter-checks")


@pytest.mark.parametrize("case", [f"{c}_{d}" for c in CASES for d in ("float32", "bfloat16")])
def test_short_rows_match_the_reference_one_partial_row_a_token(interpreter_results: dict[str, list[Any]],
                                                                case: str) -> None:
    ok, msg = interpreter_results[case]
    assert ok, msg


@pytest.mark.parametrize("name", sorted(SABOTAGES))
def test_sabotaged_short_row_kernels_are_caught(interpreter_results: dict[str, list[Any]], name: str) -> None:
    ok, msg = interpreter_results[f"sabotage_{name}"]
    assert not ok, f"{name} went unseen: {msg}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hq", [24, 16])
def test_cuda_verify_rows_match_the_reference_at_model_heads(hq: int) -> None:
    """The 27B's (24 query heads) and the 9B's (16) attention layers, 4 kv heads of 256, bf16: 32 verify rows of 3
    tokens over contexts up to 6,000 positions (blocks of 16, shuffled), and a launch of 8-token rows."""
    for lens, ctx_hi in (([3] * 32, 6000), ([8, 8, 5, 8], 3000)):
        gen = torch.Generator().manual_seed(len(lens))
        ctxs = torch.randint(1, ctx_hi, (len(lens),), generator=gen).tolist()
        p = attn_problem(lens, ctxs, Hq=hq, Hkv=4, D=256, block_size=16, dtype=torch.bfloat16, seed=5)
        want = paged_attention_ref(**p)
        cuda = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in p.items()}
        from hyserve.kernels.attention import paged_attention_triton

        got = paged_attention_triton(**cuda).cpu()
        assert (got.float() - want.float()).abs().max() < 2e-2


if __name__ == "__main__":
    if "--interpreter-checks" in sys.argv:
        from hyserve.testing.triton_interpreter import patch_triton_interpreter

        patch_triton_interpreter()
        print_results(interpreter_checks())
