"""Tests for the verify variants and the commit (hyserve.kernels.{conv,gdn}.verify, hyserve.kernels.commit: speculative
decoding; docs/design.md invariant 2).

* CPU path (the references), in process: outputs equal ``causal_conv1d_varlen`` / ``gdn_forward`` run on a copy of the
  pool; the live pools are bit-identical afterwards; conv candidate ``a`` of each row, and the SSM state
  ``gdn_replay`` rebuilds from the stash for ``a``, equal the slot state those functions leave after consuming only
  the row's first ``a + 1`` tokens; the stash holds exactly the rows' raw inputs; scratch and stash entries past a
  row's end stay NaN (unwritten); the commit with a per-row mix of accepted counts (incl. -1) updates exactly those
  slots; candidate snapshots replayed into other entries (rows in another order) leave the slots alone; a replay one
  position long is caught.
* Triton kernels under the interpreter (``TRITON_INTERPRET=1``) in one subprocess, against the references, with
  NaN-poisoned outputs, scratch and stash (every written element is checked, every other one must still be NaN); the
  replayed state equals the recurrent kernel's over the same tokens bit for bit (one state update, shared).
* A CUDA test (skipped without a GPU) at Qwen3.5 shapes in bf16.

Problems use mixed row lengths (0, 1, 3, k + 1), permuted slots with gaps, and spare scratch rows.
"""

from __future__ import annotations

import itertools
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from hyserve.kernels import causal_conv1d_varlen, gdn_forward
from hyserve.kernels.commit import commit_verified
from hyserve.kernels.commit.reference import commit_verified_ref
from hyserve.kernels.conv.reference import causal_conv1d_verify_ref
from hyserve.kernels.conv.verify import causal_conv1d_verify
from hyserve.kernels.gdn.reference import gdn_replay_ref, gdn_verify_ref
from hyserve.kernels.gdn.verify import STASH_NAMES, gdn_replay, gdn_stash_shapes, gdn_verify
from hyserve.testing.triton_interpreter import interpreter_subprocess_results, print_results, record_check

REPO_ROOT = Path(__file__).resolve().parents[2]

K_DRAFT = 4
P_MAX = K_DRAFT + 1
VERIFY_LENS = [3, 0, P_MAX, 1, P_MAX, 0, 1, 3]  # rows of a verify batch: 0, 1, 3 and k + 1 tokens
DECODE_LENS = [1, 1, 0, 1]  # k = 0 (plain decode through the verify path)


# --------------------------------------------------------------------------------------------------------------------
# Problem builders
# --------------------------------------------------------------------------------------------------------------------


def _qsl(lens: list[int]) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def _slots(num_rows: int, pool: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct, permuted slots drawn from a larger pool (so the pool has untouched gaps)."""
    return torch.randperm(pool, generator=gen)[:num_rows].to(torch.int64)


def conv_problem(lens: list[int], D: int, K: int, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    T, R = sum(lens), len(lens)
    wide = torch.randn(T, D + 7, generator=gen).to(dtype)
    return {
        "x": wide[:, 3 : 3 + D],  # a strided view, as the model's split of in_proj output is
        "weight": torch.randn(D, K, generator=gen) * 0.5,
        "conv_state": torch.randn(2 * R + 3, D, K - 1, generator=gen).to(dtype),
        "state_slots": _slots(R, 2 * R + 3, gen),
        "query_start_loc": _qsl(lens),
        "conv_scratch": torch.full((R + 2, max(max(lens, default=0), 1), D, K - 1), float("nan"), dtype=dtype),
        "max_query_len": max(lens, default=0),
    }


def gdn_problem(lens: list[int], Hk: int, Hv: int, Dk: int, Dv: int, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    T, R = sum(lens), len(lens)
    mixed = torch.randn(T, 2 * Hk * Dk + Hv * Dv, generator=gen).to(dtype)
    q, k, v = torch.split(mixed, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    P = max(max(lens, default=0), 1)
    return {
        "q": q.reshape(T, Hk, Dk),
        "k": k.reshape(T, Hk, Dk),
        "v": v.reshape(T, Hv, Dv),
        "g": -torch.nn.functional.softplus(torch.randn(T, Hv, generator=gen)) * 0.5,
        "beta": torch.rand(T, Hv, generator=gen),
        "ssm_state": torch.randn(2 * R + 3, Hv, Dk, Dv, generator=gen) * 0.3,
        "state_slots": _slots(R, 2 * R + 3, gen),
        "query_start_loc": _qsl(lens),
        "stash": {n: torch.full((R + 2, P, *shape), float("nan"))
                  for n, shape in gdn_stash_shapes(Hk, Dk, Hv, Dv).items()},
        "max_query_len": max(lens, default=0),
    }


def _cap_stash(p: dict[str, Any], cap: int) -> None:
    """The stash shortened to ``cap`` positions (rows longer than it)."""
    p["stash"] = {n: t[:, :cap].clone() for n, t in p["stash"].items()}


def _clone_stash(p: dict[str, Any]) -> dict[str, Any]:
    return dict(p, stash={n: t.clone() for n, t in p["stash"].items()})


def _lens(p: dict[str, Any]) -> list[int]:
    qsl = p["query_start_loc"].tolist()
    return [b - a for a, b in itertools.pairwise(qsl)]


def _truncate(p: dict[str, Any], m: list[int], token_keys: tuple[str, ...]) -> dict[str, Any]:
    """The problem with row r cut to its first m[r] tokens (and a cloned pool)."""
    qsl = p["query_start_loc"].tolist()
    idx = torch.tensor([t for r, n in enumerate(m) for t in range(qsl[r], qsl[r] + n)], dtype=torch.int64)
    out = {key: p[key][idx] for key in token_keys}
    out["query_start_loc"] = _qsl(m)
    out["max_query_len"] = max(m, default=0)
    return out


def _conv_forward_args(p: dict[str, Any]) -> dict[str, Any]:
    keys = ("x", "weight", "conv_state", "state_slots", "query_start_loc", "max_query_len")
    return {k: (p[k].clone() if k == "conv_state" else p[k]) for k in keys}


def _gdn_forward_args(p: dict[str, Any]) -> dict[str, Any]:
    keys = ("q", "k", "v", "g", "beta", "ssm_state", "state_slots", "query_start_loc", "max_query_len")
    return {k: (p[k].clone() if k == "ssm_state" else p[k]) for k in keys}


def conv_candidates_expected(p: dict[str, Any]) -> dict[tuple[int, int], torch.Tensor]:
    """{(row, a): slot state after causal_conv1d_varlen consumes only the row's first a + 1 tokens}."""
    lens, slots = _lens(p), p["state_slots"].tolist()
    want = {}
    for a in range(max(lens, default=0)):
        m = [min(n, a + 1) for n in lens]
        args = _conv_forward_args(p) | _truncate(p, m, ("x",))
        causal_conv1d_varlen(**args)
        for r, n in enumerate(lens):
            if n > a:
                want[(r, a)] = args["conv_state"][slots[r]]
    return want


def gdn_candidates_expected(p: dict[str, Any]) -> dict[tuple[int, int], torch.Tensor]:
    """{(row, a): slot state after gdn_forward consumes only the row's first a + 1 tokens}."""
    lens, slots = _lens(p), p["state_slots"].tolist()
    want = {}
    for a in range(max(lens, default=0)):
        m = [min(n, a + 1) for n in lens]
        args = _gdn_forward_args(p) | _truncate(p, m, ("q", "k", "v", "g", "beta"))
        gdn_forward(**args)
        for r, n in enumerate(lens):
            if n > a:
                want[(r, a)] = args["ssm_state"][slots[r]]
    return want


def check_stash(p: dict[str, Any], lens: list[int]) -> tuple[bool, str]:
    """Entry (r, j < n_r) of each stash tensor is row r's token j's raw input in float32, exactly; every other entry
    of the NaN-poisoned stash is still all NaN."""
    starts = p["query_start_loc"].tolist()
    for name, src in zip(STASH_NAMES, (p["k"], p["v"], p["g"], p["beta"]), strict=True):
        st = p["stash"][name]
        for r in range(st.shape[0]):
            for j in range(st.shape[1]):
                if r < len(lens) and j < lens[r]:
                    if not torch.equal(st[r, j], src[starts[r] + j].float()):
                        return False, f"stash {name}[{r}, {j}] is not the row's input"
                elif not torch.isnan(st[r, j]).all():
                    return False, f"stash {name}[{r}, {j}] written but no such position"
    return True, "stash exact"


def replayed_candidates(p: dict[str, Any], lens: list[int],
                        replay: Any = gdn_replay) -> dict[tuple[int, int], torch.Tensor]:
    """{(row, a): the state ``replay`` rebuilds for row r's first a + 1 tokens}, each into a spare pool entry (rows
    taken in reverse order, several at once), the slots left alone (checked)."""
    pool = p["ssm_state"].clone()
    slots = p["state_slots"]
    pairs = [(r, a) for r, n in enumerate(lens) for a in range(n)]
    spare = [s for s in range(pool.shape[0]) if s not in set(slots.tolist())]
    got: dict[tuple[int, int], torch.Tensor] = {}
    for i in range(0, len(pairs), len(spare)):
        chunk = list(reversed(pairs[i : i + len(spare)]))
        rows = torch.tensor([r for r, _ in chunk])
        counts = torch.tensor([a for _, a in chunk])
        replay(pool, p["stash"], rows, slots[rows], torch.tensor(spare[: len(chunk)]), counts)
        for (r, a), e in zip(chunk, spare, strict=False):
            got[(r, a)] = pool[e].clone()
    assert torch.equal(pool[slots], p["ssm_state"][slots]), "a candidate replay wrote a slot"
    return got


def check_candidates(got: dict[tuple[int, int], torch.Tensor], want: dict[tuple[int, int], torch.Tensor],
                     atol: float) -> tuple[bool, str]:
    if set(got) != set(want):
        return False, f"candidates {sorted(set(got) ^ set(want))} missing or extra"
    worst = max((_max_err(got[key], want[key]) for key in want), default=0.0)
    return worst <= atol, f"candidate err {worst:.3g}"


def check_scratch(
    scratch: torch.Tensor, lens: list[int], want: dict[tuple[int, int], torch.Tensor], atol: float
) -> tuple[bool, str]:
    """Every (r, j < n_r) entry matches ``want``; every other entry of the NaN-poisoned scratch is still all NaN."""
    worst = 0.0
    for r in range(scratch.shape[0]):
        for j in range(scratch.shape[1]):
            got = scratch[r, j]
            if r < len(lens) and j < lens[r]:
                if not torch.isfinite(got).all():
                    return False, f"scratch[{r}, {j}] not (fully) written"
                err = float((got.float() - want[(r, j)].float()).abs().max())
                worst = max(worst, err)
                if err > atol:
                    return False, f"scratch[{r}, {j}] err {err:.3g}"
            elif not torch.isnan(got).all():
                return False, f"scratch[{r}, {j}] written but no such position"
    return True, f"scratch err {worst:.3g}"


# --------------------------------------------------------------------------------------------------------------------
# CPU path (references), in process
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lens", [VERIFY_LENS, DECODE_LENS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_verify_reference(lens: list[int], dtype: torch.dtype) -> None:
    p = conv_problem(lens, D=24, K=4, dtype=dtype, seed=1)
    live = p["conv_state"].clone()
    fwd = _conv_forward_args(p)
    want_out = causal_conv1d_varlen(**fwd)
    out = causal_conv1d_verify(**p)
    # (a) same output, (b) live pool untouched
    assert out.dtype == dtype and torch.equal(out, want_out)
    assert torch.equal(p["conv_state"], live)
    # (c) candidate a == state after the first a + 1 tokens (window copies: bit-exact); nothing else written
    want = conv_candidates_expected(p)
    ok, msg = check_scratch(p["conv_scratch"], lens, want, atol=0.0)
    assert ok, msg
    # the last candidate of each row is exactly what causal_conv1d_varlen leaves in the slot
    for r, (s, n) in enumerate(zip(p["state_slots"].tolist(), lens)):
        if n:
            assert torch.equal(p["conv_scratch"][r, n - 1], fwd["conv_state"][s])


@pytest.mark.parametrize("lens", [VERIFY_LENS, DECODE_LENS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_verify_reference(lens: list[int], dtype: torch.dtype) -> None:
    p = gdn_problem(lens, Hk=2, Hv=4, Dk=16, Dv=8, dtype=dtype, seed=2)
    live = p["ssm_state"].clone()
    fwd = _gdn_forward_args(p)
    want_out = gdn_forward(**fwd)
    out = gdn_verify(**p)
    assert out.dtype == dtype and out.shape == p["v"].shape
    assert torch.equal(out, want_out)  # the same float32 arithmetic, op for op
    assert torch.equal(p["ssm_state"], live)
    ok, msg = check_stash(p, lens)
    assert ok, msg
    got = replayed_candidates(p, lens)
    ok, msg = check_candidates(got, gdn_candidates_expected(p), atol=1e-6)
    assert ok, msg
    for r, (s, n) in enumerate(zip(p["state_slots"].tolist(), lens)):
        if n:
            torch.testing.assert_close(got[(r, n - 1)], fwd["ssm_state"][s], atol=1e-6, rtol=0)


def test_a_replay_one_position_long_is_caught() -> None:
    """Sabotage: a replay that advances over one token more than asked (the first rejected draft) fails the
    candidate check above."""
    p = gdn_problem(VERIFY_LENS, Hk=2, Hv=4, Dk=16, Dv=8, dtype=torch.float32, seed=2)
    gdn_verify(**p)

    def long_replay(pool: torch.Tensor, stash: Any, rows: Any, src: Any, dst: Any, counts: torch.Tensor) -> None:
        gdn_replay(pool, stash, rows, src, dst, (counts + 1).clamp(max=stash["k"].shape[1] - 1))

    ok, msg = check_candidates(replayed_candidates(p, VERIFY_LENS, long_replay), gdn_candidates_expected(p), 1e-6)
    assert not ok, msg


def test_verify_reference_empty_batches() -> None:
    for lens in ([0, 0, 0], []):
        c = conv_problem(lens, D=8, K=4, dtype=torch.float32, seed=3)
        g = gdn_problem(lens, Hk=1, Hv=2, Dk=8, Dv=8, dtype=torch.float32, seed=3)
        cs, ss = c["conv_state"].clone(), g["ssm_state"].clone()
        assert causal_conv1d_verify(**c).shape == (0, 8)
        assert gdn_verify(**g).shape == (0, 2, 8)
        assert torch.equal(cs, c["conv_state"]) and torch.equal(ss, g["ssm_state"])
        assert torch.isnan(c["conv_scratch"]).all() and all(torch.isnan(t).all() for t in g["stash"].values())


def test_verify_reference_rows_longer_than_scratch() -> None:
    """A row longer than P_max still gets the full outputs; only its first P_max positions are recorded."""
    lens = [7, 2, 0]
    c = conv_problem(lens, D=8, K=4, dtype=torch.float32, seed=4)
    g = gdn_problem(lens, Hk=1, Hv=2, Dk=8, Dv=8, dtype=torch.float32, seed=4)
    c["conv_scratch"] = c["conv_scratch"][:, :3].clone()
    _cap_stash(g, 3)
    assert torch.equal(causal_conv1d_verify(**c), causal_conv1d_varlen(**_conv_forward_args(c)))
    assert torch.equal(gdn_verify(**g), gdn_forward(**_gdn_forward_args(g)))
    capped = [min(n, 3) for n in lens]
    want_g = {key: t for key, t in gdn_candidates_expected(g).items() if key[1] < 3}
    for ok, msg in (
        check_scratch(c["conv_scratch"], capped, conv_candidates_expected(c), 0.0),
        check_stash(g, capped),
        check_candidates(replayed_candidates(g, capped), want_g, 1e-6),
    ):
        assert ok, msg


def _accepted(lens: list[int], gen: torch.Generator) -> torch.Tensor:
    """A per-row mix: -1 for empty rows and some non-empty ones, else a random candidate in [0, n_r)."""
    acc = []
    for r, n in enumerate(lens):
        acc.append(-1 if n == 0 or r % 4 == 3 else int(torch.randint(0, n, (1,), generator=gen)))
    return torch.tensor(acc, dtype=torch.int32)


def commit_expected(pool: torch.Tensor, slots: torch.Tensor, scratch: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    want = pool.clone()
    for r, (s, a) in enumerate(zip(slots.tolist(), acc.tolist())):
        if a >= 0:
            want[s] = scratch[r, a]
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_commit_verified_reference(dtype: torch.dtype) -> None:
    """(d) commit updates exactly the slots of rows with a >= 0: the conv window with candidate a, the SSM state
    replayed over a + 1 tokens in its slot; verify + commit equals the plain forward over the accepted prefixes (a + 1
    tokens; none for a = -1), and every other slot is untouched."""
    gen = torch.Generator().manual_seed(5)
    lens = VERIFY_LENS
    c = conv_problem(lens, D=24, K=4, dtype=dtype, seed=6)
    g = gdn_problem(lens, Hk=2, Hv=4, Dk=16, Dv=8, dtype=dtype, seed=6)
    g["state_slots"] = c["state_slots"]  # one slot per request across both pools
    causal_conv1d_verify(**c)
    gdn_verify(**g)
    acc = _accepted(lens, gen)
    assert (acc == -1).any() and (acc >= 0).sum() >= 4
    conv_want = commit_expected(c["conv_state"], c["state_slots"], c["conv_scratch"], acc)
    before = g["ssm_state"].clone()
    prefix = [a + 1 for a in acc.tolist()]
    conv_fwd = _conv_forward_args(c) | _truncate(c, prefix, ("x",))
    ssm_fwd = _gdn_forward_args(g) | _truncate(g, prefix, ("q", "k", "v", "g", "beta"))
    causal_conv1d_varlen(**conv_fwd)
    gdn_forward(**ssm_fwd)

    commit_verified([c["conv_state"]], [c["conv_scratch"]], c["state_slots"], acc)
    gdn_replay(g["ssm_state"], g["stash"], None, g["state_slots"], g["state_slots"], acc)
    assert torch.equal(c["conv_state"], conv_want)
    assert torch.equal(c["conv_state"], conv_fwd["conv_state"])
    torch.testing.assert_close(g["ssm_state"], ssm_fwd["ssm_state"], atol=1e-6, rtol=0)
    committed = g["state_slots"][acc >= 0]
    others = torch.ones(before.shape[0], dtype=torch.bool)
    others[committed] = False
    assert torch.equal(g["ssm_state"][others], before[others])  # rows at -1 and slots of no row: bit-identical
    assert not torch.equal(g["ssm_state"][committed], before[committed])

    # all rows rejected: nothing changes
    before_c, before_s = c["conv_state"].clone(), g["ssm_state"].clone()
    none = torch.full_like(acc, -1)
    commit_verified([c["conv_state"]], [c["conv_scratch"]], c["state_slots"], none)
    gdn_replay(g["ssm_state"], g["stash"], None, g["state_slots"], g["state_slots"], none)
    assert torch.equal(before_c, c["conv_state"]) and torch.equal(before_s, g["ssm_state"])


# --------------------------------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (one subprocess)
# --------------------------------------------------------------------------------------------------------------------


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _interp_conv(
    lens: list[int], dtype: torch.dtype, max_query_len: int | None, p_cap: int | None = None
) -> tuple[bool, str]:
    from hyserve.kernels.conv.verify import causal_conv1d_verify_triton

    p = conv_problem(lens, D=40, K=4, dtype=dtype, seed=11)
    if p_cap is not None:  # scratch shorter than the longest row
        p["conv_scratch"] = p["conv_scratch"][:, :p_cap].clone()
        lens = [min(n, p_cap) for n in lens]
    ref = dict(p, conv_scratch=p["conv_scratch"].clone())
    want_out = causal_conv1d_verify_ref(**{k: v for k, v in ref.items() if k != "max_query_len"})
    live = p["conv_state"].clone()
    out = torch.full(p["x"].shape, float("nan"), dtype=dtype)
    causal_conv1d_verify_triton(**dict(p, max_query_len=max_query_len), out=out)
    tol = 1e-5 if dtype == torch.float32 else 3.2e-2  # bf16: one ulp at |y| ~ 4
    ok_out = bool(torch.isfinite(out).all()) and torch.allclose(out.float(), want_out.float(), atol=tol, rtol=tol)
    want = {(r, j): ref["conv_scratch"][r, j] for r, n in enumerate(lens) for j in range(n)}
    ok_s, msg = check_scratch(p["conv_scratch"], lens, want, atol=0.0)  # copies: bit-exact
    ok_live = torch.equal(live, p["conv_state"])
    return ok_out and ok_s and ok_live, f"out err {_max_err(out, want_out):.3g}, {msg}, live untouched {ok_live}"


def _interp_gdn(lens: list[int], dtype: torch.dtype, p_cap: int | None = None,
                state_dtype: torch.dtype = torch.float32) -> tuple[bool, str]:
    """The verify kernel against the reference (outputs; the stash exactly); ``state_dtype``: the pool stored in a
    16-bit float (``--mamba-ssm-cache-dtype``)."""
    from hyserve.kernels.gdn.verify import gdn_verify_triton

    p = gdn_problem(lens, Hk=2, Hv=4, Dk=16, Dv=32, dtype=dtype, seed=12)
    p["ssm_state"] = p["ssm_state"].to(state_dtype)
    if p_cap is not None:  # a stash shorter than the longest row
        _cap_stash(p, p_cap)
        lens = [min(n, p_cap) for n in lens]
    want_out = gdn_verify_ref(**_clone_stash(p))
    live = p["ssm_state"].clone()
    out = torch.full(p["v"].shape, float("nan"), dtype=dtype)
    gdn_verify_triton(**{k: v for k, v in p.items() if k != "max_query_len"}, out=out)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    ok_out = bool(torch.isfinite(out).all()) and torch.allclose(out.float(), want_out.float(), atol=tol, rtol=tol)
    ok_s, msg = check_stash(p, lens)
    ok_live = torch.equal(live, p["ssm_state"])
    return ok_out and ok_s and ok_live, f"out err {_max_err(out, want_out):.3g}, {msg}, live untouched {ok_live}"


def _interp_replay(dtype: torch.dtype, state_dtype: torch.dtype = torch.float32) -> tuple[bool, str]:
    """The replay kernel against the reference: candidates into spare entries (rows in another order), then the
    commit in place with a mix of counts (-1 too); and the committed state equals, bit for bit, what the recurrent
    kernel leaves over the accepted tokens (the two share one state update)."""
    from hyserve.kernels.gdn import gdn_recurrent_triton
    from hyserve.kernels.gdn.verify import gdn_replay_triton

    lens = VERIFY_LENS[:4]  # rows of 3, 0, k + 1 and 1 tokens: 8 candidates, each a replay under the interpreter
    p = gdn_problem(lens, Hk=2, Hv=4, Dk=16, Dv=32, dtype=dtype, seed=14)
    p["ssm_state"] = p["ssm_state"].to(state_dtype)
    gdn_verify_ref(**p)
    tol = 1e-5 if state_dtype == torch.float32 else 1.6e-2  # a 16-bit state: one rounding may land one ulp apart
    got = replayed_candidates(p, lens, gdn_replay_triton)
    ok_c, msg_c = check_candidates(got, replayed_candidates(p, lens, gdn_replay_ref), tol)
    acc = _accepted(lens, torch.Generator().manual_seed(15))
    pool, pool_ref = p["ssm_state"].clone(), p["ssm_state"].clone()
    slots = p["state_slots"]
    gdn_replay_triton(pool, p["stash"], None, slots, slots, acc)
    gdn_replay_ref(pool_ref, p["stash"], None, slots, slots, acc)
    ok_commit = _max_err(pool, pool_ref) <= tol
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[slots[acc >= 0]] = False
    ok_rest = torch.equal(pool[untouched], p["ssm_state"][untouched])
    fwd = _gdn_forward_args(p) | _truncate(p, [a + 1 for a in acc.tolist()], ("q", "k", "v", "g", "beta"))
    rec = fwd["ssm_state"]
    gdn_recurrent_triton(fwd["q"], fwd["k"], fwd["v"], fwd["g"], fwd["beta"], rec, slots, fwd["query_start_loc"])
    ok_exact = torch.equal(pool, rec)
    ok = ok_c and ok_commit and ok_rest and ok_exact
    return ok, f"{msg_c}, commit err {_max_err(pool, pool_ref):.3g}, others untouched {ok_rest}, = recurrent {ok_exact}"


def _interp_commit(dtype: torch.dtype) -> tuple[bool, str]:
    from hyserve.kernels.commit import commit_verified_triton

    gen = torch.Generator().manual_seed(13)
    lens = VERIFY_LENS
    R, S = len(lens), 2 * len(lens) + 3
    conv = torch.randn(S, 40, 3, generator=gen).to(dtype)
    ssm = torch.randn(S, 4, 16, 32, generator=gen)
    slots = _slots(R, S, gen)
    conv_scr = torch.randn(R + 2, P_MAX, 40, 3, generator=gen).to(dtype)
    ssm_scr = torch.randn(R + 2, P_MAX, 4, 16, 32, generator=gen)
    acc = _accepted(lens, gen)
    conv_want = commit_expected(conv, slots, conv_scr, acc)
    ssm_want = commit_expected(ssm, slots, ssm_scr, acc)
    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    commit_verified_ref([conv_ref, ssm_ref], [conv_scr, ssm_scr], slots, acc)
    commit_verified_triton([conv, ssm], [conv_scr, ssm_scr], slots, acc)
    ok = all(torch.equal(a, b) for a, b in ((conv, conv_want), (ssm, ssm_want), (conv_ref, conv), (ssm_ref, ssm)))
    return ok, "bit-exact" if ok else "mismatch"


def run_interpreter_checks() -> dict[str, list[Any]]:
    """Run the verify kernels under the interpreter; returns {name: [ok, message]}. Needs TRITON_INTERPRET=1."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from hyserve.testing.triton_interpreter import patch_triton_interpreter  # triton 3.6 interpreter workarounds

    patch_triton_interpreter()
    res: dict[str, list[Any]] = {}
    for dt in (torch.float32, torch.bfloat16):
        n = str(dt).split(".")[-1]
        record_check(res, f"conv_verify_{n}", partial(_interp_conv, VERIFY_LENS, dt, P_MAX))
        record_check(res, f"conv_verify_decode_{n}", partial(_interp_conv, DECODE_LENS, dt, 1))
        record_check(res, f"gdn_verify_{n}", partial(_interp_gdn, VERIFY_LENS, dt))
        record_check(res, f"gdn_verify_decode_{n}", partial(_interp_gdn, DECODE_LENS, dt))
        record_check(res, f"commit_{n}", partial(_interp_commit, dt))
        record_check(res, f"gdn_replay_{n}", partial(_interp_replay, dt))
    # token blocks of 2 (loose host bound -> several programs per row along t)
    record_check(res, "conv_verify_tblocks", lambda: _interp_conv([2, 0, 1, 2], torch.float32, 2))
    # rows longer than P_max: full outputs, only the first P_max positions recorded
    record_check(res, "conv_verify_long_rows", lambda: _interp_conv([7, 2, 0, 3], torch.float32, None, p_cap=3))
    record_check(res, "gdn_verify_long_rows", lambda: _interp_gdn([7, 2, 0, 3], torch.float32, p_cap=3))
    record_check(res, "gdn_verify_bf16_state",
                 lambda: _interp_gdn(VERIFY_LENS, torch.bfloat16, state_dtype=torch.bfloat16))
    record_check(res, "gdn_replay_bf16_state", lambda: _interp_replay(torch.bfloat16, torch.bfloat16))
    return res


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, list[Any]]:
    pytest.importorskip("triton")
    return interpreter_subprocess_results(__file__, "--interpreter-checks")


_PER_DTYPE = ["conv_verify", "conv_verify_decode", "gdn_verify", "gdn_verify_decode", "commit", "gdn_replay"]
INTERP_CHECKS = [f"{name}_{dt}" for dt in ("float32", "bfloat16") for name in _PER_DTYPE]
INTERP_CHECKS += ["conv_verify_tblocks", "conv_verify_long_rows", "gdn_verify_long_rows", "gdn_verify_bf16_state",
                  "gdn_replay_bf16_state"]


@pytest.mark.parametrize("name", INTERP_CHECKS)
def test_triton_verify_interpreter(interpreter_results: dict[str, list[Any]], name: str) -> None:
    ok, msg = interpreter_results[name]
    assert ok, f"{name}: {msg}"


def test_gdn_verify_and_replay_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton")
    from hyserve.kernels.gdn import verify
    from hyserve.testing.triton_compile import compile_failures

    # the fused verify's variants compile in tests/kernels/test_gdn_verify_fused.py
    variants = [v for v in verify.compile_variants() if not v[0].startswith("gdn_verify_fused")]
    assert len({name for name, *_ in variants}) == len(variants) == 12
    failures = compile_failures(variants)
    assert not failures, failures


# --------------------------------------------------------------------------------------------------------------------
# CUDA dispatch (GPU machines only)
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_verify_matches_reference_bf16() -> None:
    from test_kernels import to_device

    bf16 = torch.bfloat16
    gen = torch.Generator().manual_seed(21)
    lens = [P_MAX, 0, 1, 3, P_MAX, P_MAX, 2, 0, 1, P_MAX]

    c = conv_problem(lens, D=2 * 16 * 128 + 32 * 128, K=4, dtype=bf16, seed=22)
    c_ref = dict(c, conv_scratch=c["conv_scratch"].clone())
    want_out = causal_conv1d_verify_ref(**{k: v for k, v in c_ref.items() if k != "max_query_len"})
    cg = to_device(c, "cuda")
    out = causal_conv1d_verify(**cg)
    torch.testing.assert_close(out.cpu().float(), want_out.float(), atol=3e-2, rtol=2e-2)
    assert torch.equal(cg["conv_state"].cpu(), c["conv_state"])
    want = {(r, j): c_ref["conv_scratch"][r, j] for r, n in enumerate(lens) for j in range(n)}
    ok, msg = check_scratch(cg["conv_scratch"].cpu(), lens, want, atol=0.0)
    assert ok, msg

    g = gdn_problem(lens, Hk=16, Hv=32, Dk=128, Dv=128, dtype=bf16, seed=23)
    g["state_slots"] = c["state_slots"]
    g_ref = _clone_stash(g)
    want_out = gdn_verify_ref(**g_ref)
    gg = to_device(g, "cuda")
    gg["stash"] = {n: t.cuda() for n, t in g["stash"].items()}
    out = gdn_verify(**gg)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu().float(), want_out.float(), atol=3e-2, rtol=3e-2)
    assert torch.equal(gg["ssm_state"].cpu(), g["ssm_state"])
    ok, msg = check_stash({**g, "stash": {n: t.cpu() for n, t in gg["stash"].items()}}, lens)
    assert ok, msg

    acc = _accepted(lens, gen)
    conv_want = commit_expected(cg["conv_state"].cpu(), c["state_slots"], cg["conv_scratch"].cpu(), acc)
    ssm_want = g["ssm_state"].clone()
    gdn_replay_ref(ssm_want, g_ref["stash"], None, g["state_slots"], g["state_slots"], acc)
    commit_verified([cg["conv_state"]], [cg["conv_scratch"]], cg["state_slots"], acc.cuda())
    slots = gg["state_slots"]
    fwd = _gdn_forward_args(gg) | _truncate(gg, [a + 1 for a in acc.tolist()], ("q", "k", "v", "g", "beta"))
    gdn_replay(gg["ssm_state"], gg["stash"], None, slots, slots, acc.cuda())
    assert torch.equal(cg["conv_state"].cpu(), conv_want)
    torch.testing.assert_close(gg["ssm_state"].cpu(), ssm_want, atol=1e-4, rtol=0)
    # the committed state is the one the recurrent kernel leaves over the accepted tokens (from the state before the
    # commit: fwd's pool is a copy taken then); the two kernels share the update's code (bit for bit under the
    # interpreter; here within float32 rounding, should the compiler order a reduction otherwise)
    fwd["query_start_loc"] = fwd["query_start_loc"].cuda()
    rec = fwd["ssm_state"]
    from hyserve.kernels.gdn import gdn_recurrent_triton

    gdn_recurrent_triton(fwd["q"], fwd["k"], fwd["v"], fwd["g"], fwd["beta"], rec, slots, fwd["query_start_loc"])
    torch.testing.assert_close(gg["ssm_state"], rec, atol=1e-5, rtol=0)


if __name__ == "__main__":
    if sys.argv[1:] == ["--interpreter-checks"]:
        torch.set_num_threads(1)
        results = run_interpreter_checks()
        print_results(results)


def test_replays_refuse_strided_index_vectors() -> None:
    """The replay kernels read entry i's row, slots and count at ``ptr + i``: a column of an ``(N, 3)`` buffer (as
    the snapshot graph's triples were laid out) names other slots on the card. Both replays refuse such views on
    every device (the CPU path holds callers to the CUDA path's contract) and take the same indices contiguous."""
    from hyserve.kernels.gdn.verify import gdn_replay
    from hyserve.kernels.mamba2.verify import mamba2_replay, mamba2_stash_shapes

    triples = torch.tensor([[0, 1, 5], [1, 0, 6]])  # (row, count, entry) per candidate
    rows, counts, dst = triples.unbind(1)  # stride 3
    src = torch.tensor([2, 3])
    gdn_stash = {n: torch.zeros(2, 2, *shape) for n, shape in gdn_stash_shapes(1, 4, 2, 4).items()}
    gdn_pool = torch.zeros(8, 2, 4, 4)
    m_pool = torch.zeros(8, 2, 4, 3)
    m_stash = {n: torch.zeros(2, 2, *shape) for n, shape in mamba2_stash_shapes(2, 4, 1, 3).items()}
    for call in (lambda r, c, d: gdn_replay(gdn_pool, gdn_stash, r, src, d, c),
                 lambda r, c, d: mamba2_replay(m_pool, torch.zeros(2), m_stash, r, src, d, c)):
        with pytest.raises(AssertionError, match="contiguous"):
            call(rows, counts, dst)
        call(rows.contiguous(), counts.contiguous(), dst.contiguous())
