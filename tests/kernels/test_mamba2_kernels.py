"""Mamba2's Triton kernels (hyserve.kernels.mamba2: the recurrent scan and its verify variant) and the conv kernels
with a bias (hyserve.kernels.conv, Mamba2's conv), under the Triton interpreter (``TRITON_INTERPRET=1``, one
subprocess: the variable must be set before any kernel is decorated), against the plain-torch references.

Problems: staggered row lengths with an empty row, rows on permuted slots drawn from a larger pool (slots no row
names must stay bit-identical), grouped B / C (G < H), a dt clamp that bites, float32 and bf16-stored states;
outputs and scratch NaN-poisoned before the kernels write them (every written element is checked, every other one
must still be NaN). Sabotaged (each must disagree with the reference): head ``h`` reading B / C group ``h % G``
instead of ``h // (H / G)``, the kernel handed ``A`` where it reads ``A_log``, the verify scratch written one
position late, the conv bias read one channel off.

The chunked (fla) path's passes before and after fla (``hyserve.kernels.mamba2.chunked``) against their torch
formulation: odd head dims and state sizes, 1 to 4 heads a group, T = 0 and 1, bf16 / fp16 / float32 models with
float32 or 16-bit states; the expanded B / C and the gathered states bit-identical, the time step's products within
float32 ulps of torch's softplus (the rounded ``v`` within one ulp of its dtype), the skip and the stored states exact.
Sabotaged: B / C of group ``h % G``, ``A`` read as ``A_log``, the states gathered from (or stored to) the slots of
the previous row, D of the previous head. And the whole fla path, ``mamba2_scan_fla``, with a plain-torch stand-in
for fla's ``chunk_simple_gla`` against the reference, an empty row among the rows, with and without the host's
offsets.
"""

from __future__ import annotations

import importlib
import itertools
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hyserve.kernels.conv.reference import causal_conv1d_varlen_ref, causal_conv1d_verify_ref
from hyserve.kernels.mamba2 import MAMBA2_STASH_NAMES, mamba2_scan, mamba2_scan_ref, mamba2_stash_shapes
from hyserve.kernels.mamba2.reference import (
    mamba2_chunked_inputs_ref,
    mamba2_chunked_output_ref,
    mamba2_verify_ref,
)
from hyserve.testing.pools import pool_views
from hyserve.testing.triton_interpreter import (
    interpreter_subprocess_results,
    mutated_module,
    patch_triton_interpreter,
    print_results,
    record_check,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
H, P, G, N = 4, 8, 2, 16
POOL = 9
MIXED_LENS = [3, 0, 1, 6, 2]
DECODE_LENS = [1, 1, 0, 1]
VERIFY_LENS = [3, 0, 4, 1]


def _qsl(lens: list[int]) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def _close(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float = 0.0) -> tuple[bool, float]:
    """Within tolerance, NaNs (unwritten entries) in the same places."""
    a, b = a.float(), b.float()
    if a.shape != b.shape:
        return False, float("inf")
    if not torch.equal(torch.isnan(a), torch.isnan(b)):
        return False, float("nan")
    a, b = torch.nan_to_num(a), torch.nan_to_num(b)
    err = (a - b).abs()
    return bool((err <= atol + rtol * b.abs()).all()), float(err.max()) if err.numel() else 0.0


def _untouched(before: torch.Tensor, after: torch.Tensor, slots: torch.Tensor, lens: list[int]) -> bool:
    touched = {int(s) for s, n in zip(slots.tolist(), lens, strict=True) if n > 0}
    return all(torch.equal(before[s], after[s]) for s in range(before.shape[0]) if s not in touched)


def scan_problem(lens: list[int], dtype: torch.dtype, state_dtype: torch.dtype, seed: int,
                 dt_limit: tuple[float, float] = (1e-3, float("inf"))) -> dict[str, Any]:
    """x, B, C as strided views of one conv output and dt of one projection output, as the mixer splits them."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    mixed = torch.randn(t, H * P + 2 * G * N, generator=gen).to(dtype)
    xs, bs, cs = mixed.split([H * P, G * N, G * N], dim=-1)
    proj = (torch.randn(t, H + 3, generator=gen) * 1.5).to(dtype)
    return {
        "x": xs.reshape(t, H, P), "dt": proj[:, 1 : 1 + H], "A_log": torch.log(torch.rand(H, generator=gen) * 2 + 0.1),
        "B": bs.reshape(t, G, N), "C": cs.reshape(t, G, N),
        "D": torch.randn(H, generator=gen).to(dtype), "dt_bias": (torch.randn(H, generator=gen) - 1).to(dtype),
        "dt_limit": dt_limit,
        "ssm_state": (torch.randn(POOL, H, P, N, generator=gen) * 0.5).to(state_dtype),
        "state_slots": torch.randperm(POOL, generator=gen)[: len(lens)],
        "query_start_loc": _qsl(lens),
    }


def _clone(p: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in p.items()}


def _tols(dtype: torch.dtype, state_dtype: torch.dtype) -> tuple[float, float]:
    out = 1e-5 if dtype == torch.float32 and state_dtype == torch.float32 else 2e-2
    return out, 1e-5 if state_dtype == torch.float32 else 1.6e-2  # one ulp of a 16-bit state


def _interp_scan(lens: list[int], dtype: torch.dtype, state_dtype: torch.dtype, sabotage: str = "",
                 dt_limit: tuple[float, float] = (1e-3, float("inf")), pool_rows: bool = False) -> tuple[bool, str]:
    """The recurrent kernel against the reference. ``sabotage="group_mod"``: head h fed group h % G (B / C expanded
    to heads in that order); ``"a_not_a_log"``: the kernel handed ``A = -exp(A_log)`` in place of ``A_log``. Each
    must disagree. ``pool_rows``: the SSM pool a view of the engine's ``StatePool`` rows beside a conv window."""
    from hyserve.kernels.mamba2 import mamba2_recurrent_triton

    p = scan_problem(lens, dtype, state_dtype, seed=21, dt_limit=dt_limit)
    if pool_rows:
        conv = torch.zeros(POOL, 24, 3, dtype=dtype)
        p["ssm_state"] = pool_views({"conv_state": (conv, None), "ssm_state": (p["ssm_state"], None)})["ssm_state"]
    ref = _clone(p)
    want = mamba2_scan_ref(**ref, max_query_len=max(lens))
    before = p["ssm_state"].clone()
    out = torch.full(p["x"].shape, float("nan"))
    if sabotage == "group_mod":
        heads = torch.arange(H) % G
        p["B"], p["C"] = p["B"][:, heads], p["C"][:, heads]
    if sabotage == "a_not_a_log":
        p["A_log"] = -torch.exp(p["A_log"])
    mamba2_recurrent_triton(**p, out=out)
    tol, stol = _tols(dtype, state_dtype)
    ok1, e1 = _close(out, want, tol, tol)
    ok2, e2 = _close(p["ssm_state"], ref["ssm_state"], stol, stol)
    ok3 = _untouched(before, p["ssm_state"], p["state_slots"], lens) and p["ssm_state"].dtype == state_dtype
    ok = ok1 and ok2 and ok3
    return ok != bool(sabotage), f"out err {e1:.3g}, state err {e2:.3g}, untouched {ok3}"


def _stash(rows: int, npos: int) -> dict[str, torch.Tensor]:
    """A NaN-poisoned stash (``mamba2_stash_shapes``) of ``rows`` rows and ``npos`` positions."""
    shapes = mamba2_stash_shapes(H, P, G, N)
    return {n: torch.full((rows, npos, *shapes[n]), float("nan")) for n in MAMBA2_STASH_NAMES}


def _interp_verify(lens: list[int], dtype: torch.dtype, state_dtype: torch.dtype,
                   sabotage: str = "") -> tuple[bool, str]:
    """The verify kernel against the reference: outputs, the stash (every written entry, the rest still NaN), the
    live pool bit-identical. Then the replay kernel rebuilds every candidate (rows taken out of order, into spare
    entries) and commits (a row that keeps its state, the others their own counts) against the reference scan's
    candidate states. ``sabotage="late"``: the verify kernel handed the stash one position on (token j stashed at
    j + 1); ``"replay_long"``: the replay runs one token past its count. Each must disagree."""
    from hyserve.kernels.mamba2.verify import mamba2_replay_triton, mamba2_verify_triton

    p = scan_problem(lens, dtype, state_dtype, seed=22)
    npos, r = max(lens), len(lens)
    stash, ref_stash = _stash(r + 2, npos + 1), _stash(r + 2, npos + 1)
    cands = torch.full((r + 2, npos + 1, H, P, N), float("nan"), dtype=state_dtype)
    want = mamba2_scan_ref(**_clone(p), max_query_len=npos, scratch=cands)  # the candidate states, as a yardstick
    mamba2_verify_ref(**_clone(p), max_query_len=npos, stash=ref_stash)
    before = p["ssm_state"].clone()
    out = torch.full(p["x"].shape, float("nan"))
    given = {n: v[:, 1:] for n, v in stash.items()} if sabotage == "late" else stash
    mamba2_verify_triton(**p, stash=given, out=out)
    tol, stol = _tols(dtype, state_dtype)
    ok1, e1 = _close(out, want, tol, tol)
    oks = [_close(stash[n], ref_stash[n], 1e-6, 1e-6) for n in MAMBA2_STASH_NAMES]
    ok2, e2 = all(o for o, _ in oks), max(e for _, e in oks)
    ok3 = torch.equal(before, p["ssm_state"])
    # every candidate into a spare entry, rows in reverse order
    slots = p["state_slots"].to(torch.int64)
    pairs = [(row, j) for row in reversed(range(r)) for j in range(lens[row])]
    pool = torch.full((POOL + len(pairs), H, P, N), float("nan"), dtype=state_dtype)
    pool[:POOL] = p["ssm_state"]
    rows = torch.tensor([row for row, _ in pairs])
    counts = torch.tensor([j for _, j in pairs]) + (1 if sabotage == "replay_long" else 0)
    entries = torch.arange(POOL, POOL + len(pairs))
    mamba2_replay_triton(pool, p["A_log"], stash, rows, slots[rows], entries, counts)
    ok4, e4 = _close(pool[POOL:], torch.stack([cands[row, j] for row, j in pairs]), stol, stol)
    ok4 = ok4 and torch.equal(pool[:POOL], p["ssm_state"])  # the slots untouched
    # the commit: row 0 keeps its state (-1), the others their last token
    acc = torch.tensor([-1] + [n - 1 for n in lens[1:]])
    live = p["ssm_state"].clone()
    mamba2_replay_triton(live, p["A_log"], stash, None, slots, slots, acc)
    want_live = p["ssm_state"].clone()
    for row in range(1, r):
        if lens[row]:
            want_live[slots[row]] = cands[row, lens[row] - 1]
    ok5, e5 = _close(live, want_live, stol, stol)
    ok5 = ok5 and torch.equal(live[slots[0]], p["ssm_state"][slots[0]])
    ok = ok1 and ok2 and ok3 and ok4 and ok5
    return ok != bool(sabotage), (f"out err {e1:.3g}, stash err {e2:.3g}, pool unchanged {ok3}, candidates err "
                                  f"{e4:.3g} ({ok4}), commit err {e5:.3g} ({ok5})")


def _interp_replay_bitwise(lens: list[int]) -> tuple[bool, str]:
    """float32: the replayed commit of each row's first ``c + 1`` tokens equals, bit for bit, the recurrent kernel's
    state after those tokens fed as a row of their own (one update function, one time step)."""
    from hyserve.kernels.mamba2 import mamba2_recurrent_triton
    from hyserve.kernels.mamba2.verify import mamba2_replay_triton, mamba2_verify_triton

    p = scan_problem(lens, torch.float32, torch.float32, seed=24)
    npos, r = max(lens), len(lens)
    stash = _stash(r, npos)
    mamba2_verify_triton(**_clone(p), stash=stash)
    acc = torch.tensor([max(n - 2, n - 1 if n < 2 else 0) if n else -1 for n in lens])  # some rows keep fewer
    live = p["ssm_state"].clone()
    mamba2_replay_triton(live, p["A_log"], stash, None, p["state_slots"], p["state_slots"], acc)
    sub = [int(a) + 1 if a >= 0 else 0 for a in acc.tolist()]  # each row's accepted prefix
    qsl = _qsl(lens)
    keep = torch.cat([torch.arange(int(qsl[i]), int(qsl[i]) + sub[i]) for i in range(r)]).to(torch.int64)
    q = _clone(p)
    for name in ("x", "dt", "B", "C"):
        q[name] = q[name][keep]
    q["query_start_loc"] = _qsl(sub)
    mamba2_recurrent_triton(**q)
    return torch.equal(live, q["ssm_state"]), f"max diff {float((live - q['ssm_state']).abs().max()):.3g}"


def _interp_replay_window(rows_given: bool, sabotage: bool = False) -> tuple[bool, str]:
    """The replay with the conv window's copy in its launch (``conv=``) against the replay without it followed by
    the plain-torch copy: the pools bit for bit, rows taken out of order into spare entries (``rows_given``) or the
    commit (a row keeping its state, -1). ``sabotage``: the copy cut in one piece more than there are programs (the
    last piece never copied), which must disagree."""
    from hyserve.kernels.commit import copy_candidate_windows
    from hyserve.kernels.mamba2.verify import mamba2_replay_triton, mamba2_verify_triton

    lens = VERIFY_LENS
    p = scan_problem(lens, torch.float32, torch.float32, seed=25)
    npos, r = max(lens), len(lens)
    stash = _stash(r, npos)
    mamba2_verify_triton(**_clone(p), stash=stash)
    gen = torch.Generator().manual_seed(26)
    d, k = 40, 4
    conv = torch.randn(POOL + 4, d, k - 1, generator=gen)
    scratch = torch.randn(r, npos, d, k - 1, generator=gen)
    slots = p["state_slots"].to(torch.int64)
    if rows_given:
        rows = torch.tensor([2, 0, 3])
        src, dst, counts = slots[rows], torch.tensor([POOL, POOL + 2, POOL + 1]), torch.tensor([3, 2, 0])
    else:
        rows, src, dst, counts = None, slots, slots, torch.tensor([1, -1, 3, 0])
    pool = torch.cat([p["ssm_state"], torch.zeros(4, *p["ssm_state"].shape[1:])])
    got_pool, got_conv = pool.clone(), conv.clone()
    module = importlib.import_module("hyserve.kernels.mamba2._triton")
    original = module._mamba2_replay_kernel
    if sabotage:
        edits = [("E, h, tl.num_programs(1), CBLOCK)", "E, h, tl.num_programs(1) + 1, CBLOCK)")]
        module._mamba2_replay_kernel = mutated_module("hyserve.kernels.mamba2._triton", edits)._mamba2_replay_kernel
    try:
        mamba2_replay_triton(got_pool, p["A_log"], stash, rows, src, dst, counts, conv=(got_conv, scratch))
    finally:
        module._mamba2_replay_kernel = original
    want_pool, want_conv = pool.clone(), conv.clone()
    mamba2_replay_triton(want_pool, p["A_log"], stash, rows, src, dst, counts)
    copy_candidate_windows((want_conv, scratch), rows, dst, counts)
    ok = torch.equal(got_pool, want_pool) and torch.equal(got_conv, want_conv)
    same = (torch.equal(got_pool, want_pool), torch.equal(got_conv, want_conv))
    return ok != sabotage, f"pools, windows equal: {same}"


def conv_problem(lens: list[int], dtype: torch.dtype, seed: int, d: int = 40, k: int = 4) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(sum(lens), d + 7, generator=gen).to(dtype)
    return {
        "x": wide[:, 3 : 3 + d], "weight": torch.randn(d, k, generator=gen) * 0.5,
        "conv_state": torch.randn(POOL, d, k - 1, generator=gen).to(dtype),
        "state_slots": torch.randperm(POOL, generator=gen)[: len(lens)], "query_start_loc": _qsl(lens),
        "bias": torch.randn(d, generator=gen).to(dtype),
    }


def _interp_conv(lens: list[int], dtype: torch.dtype, verify: bool, sabotage: bool = False,
                 pool_rows: bool = False) -> tuple[bool, str]:
    """The varlen conv (``verify``: its verify variant) with a bias against the reference. ``sabotage``: the kernel
    reads channel d's bias at d - 1, which must disagree. ``pool_rows``: the conv pool a view of the engine's
    ``StatePool`` rows beside an SSM state."""
    from hyserve.kernels.conv import causal_conv1d_varlen_triton
    from hyserve.kernels.conv.verify import causal_conv1d_verify_triton

    p = conv_problem(lens, dtype, seed=23)
    if pool_rows:
        ssm = torch.zeros(POOL, 2, 4, 8)
        p["conv_state"] = pool_views({"conv_state": (p["conv_state"], None), "ssm_state": (ssm, None)})["conv_state"]
    ref = _clone(p)
    before = p["conv_state"].clone()
    out = torch.full(p["x"].shape, float("nan"), dtype=dtype)
    bias = p.pop("bias")
    kbias = bias.roll(1) if sabotage else bias
    tol = 1e-5 if dtype == torch.float32 else 3.2e-2  # bf16: one ulp at |y| ~ 4
    if verify:
        scratch = torch.full((len(lens) + 1, max(lens), *p["conv_state"].shape[1:]), float("nan"), dtype=dtype)
        ref_scratch = scratch.clone()
        want = causal_conv1d_verify_ref(**ref, conv_scratch=ref_scratch)
        causal_conv1d_verify_triton(**p, conv_scratch=scratch, max_query_len=max(lens), bias=kbias, out=out)
        ok2, e2 = _close(scratch, ref_scratch, 0.0)
        ok2 = ok2 and torch.equal(before, p["conv_state"])
    else:
        want = causal_conv1d_varlen_ref(**ref)
        causal_conv1d_varlen_triton(**p, max_query_len=max(lens), bias=kbias, out=out)
        ok2, e2 = _close(p["conv_state"], ref["conv_state"], 0.0)
        ok2 = ok2 and _untouched(before, p["conv_state"], p["state_slots"], lens)
    ok1, e1 = _close(out, want, tol, tol)
    return (ok1 and ok2) != sabotage, f"out err {e1:.3g}, state err {e2:.3g}"


def chunked_problem(lens: list[int], h: int, g: int, p: int, n: int, dtype: torch.dtype, state_dtype: torch.dtype,
                    seed: int) -> dict[str, Any]:
    """The chunked passes' inputs: x, B, C strided views of one conv output, dt of one projection output, the
    per-head weights in the model's dtype, one slot a row drawn from a larger pool."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    mixed = torch.randn(t, 3 + h * p + 2 * g * n, generator=gen).to(dtype)
    xs, bs, cs = mixed[:, 3:].split([h * p, g * n, g * n], dim=-1)
    proj = (torch.randn(t, h + 3, generator=gen) * 1.5).to(dtype)
    return {
        "x": xs.reshape(t, h, p), "dt": proj[:, 1 : 1 + h],
        "A_log": torch.log(torch.rand(h, generator=gen) * 2 + 0.1).to(dtype),
        "B": bs.reshape(t, g, n), "C": cs.reshape(t, g, n), "dt_bias": (torch.randn(h, generator=gen) - 1).to(dtype),
        "dt_limit": (1e-3, 5.0), "ssm_state": (torch.randn(POOL, h, p, n, generator=gen) * 0.5).to(state_dtype),
        "slots": torch.randperm(POOL, generator=gen)[: len(lens)],
    }


def _ulps_close(got: torch.Tensor, want: torch.Tensor, rel: float) -> tuple[bool, float]:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False, float("inf")
    err = (got.float() - want.float()).abs()
    worst = float((err / want.float().abs().clamp(min=1e-30)).max()) if err.numel() else 0.0
    return bool((err <= rel * want.float().abs()).all()), worst


def _interp_chunked_inputs(lens: list[int], h: int, g: int, p: int, n: int, dtype: torch.dtype,
                           state_dtype: torch.dtype, sabotage: str = "") -> tuple[bool, str]:
    """The pass before fla against its torch formulation. Sabotages: ``"group_mod"`` (head h fed group h % G),
    ``"a_not_a_log"`` (``A`` handed in place of ``A_log``), ``"slots_rolled"`` (each row's state gathered from the
    previous row's slot)."""
    from hyserve.kernels.mamba2.chunked import mamba2_chunked_inputs

    prob = chunked_problem(lens, h, g, p, n, dtype, state_dtype, seed=25)
    want = mamba2_chunked_inputs_ref(**_clone(prob))
    before = prob["ssm_state"].clone()
    if sabotage == "group_mod":
        heads = torch.arange(h) % g
        prob["B"], prob["C"] = prob["B"][:, heads], prob["C"][:, heads]
    elif sabotage == "a_not_a_log":
        prob["A_log"] = -torch.exp(prob["A_log"].float())
    elif sabotage == "slots_rolled":
        prob["slots"] = prob["slots"].roll(1)
    got = mamba2_chunked_inputs(**prob)
    names = ("q", "k", "v", "g", "h0")
    exact = {nm: got[i].dtype == want[i].dtype and torch.equal(got[i], want[i]) for i, nm in enumerate(names)
             if nm in ("q", "k", "h0")}
    g_ok, g_err = _ulps_close(got[3], want[3], 4e-6)  # float32: softplus as log(u) y / (u - 1) against torch's
    v_ok, v_err = _ulps_close(got[2], want[2], max(torch.finfo(dtype).eps, 4e-6))  # rounded: one ulp at most
    contiguous = all(x.is_contiguous() for x in got)
    ok = all(exact.values()) and g_ok and v_ok and contiguous and torch.equal(before, prob["ssm_state"])
    return ok != bool(sabotage), f"exact {exact}, g rel err {g_err:.3g}, v rel err {v_err:.3g}"


def _interp_chunked_output(lens: list[int], h: int, p: int, n: int, dtype: torch.dtype, state_dtype: torch.dtype,
                           sabotage: str = "") -> tuple[bool, str]:
    """The pass after fla against its torch formulation: y and the whole pool (slots no row names unchanged).
    Sabotages: ``"d_rolled"`` (head h given D of head h - 1), ``"slots_rolled"`` (states stored to the previous
    row's slot)."""
    from hyserve.kernels.mamba2.chunked import mamba2_chunked_output

    prob = chunked_problem(lens, h, 1, p, n, dtype, state_dtype, seed=26)
    gen = torch.Generator().manual_seed(27)
    t, r = sum(lens), len(lens)
    o = torch.randn(t, h, p, generator=gen).to(dtype)
    d = torch.randn(h, generator=gen).to(dtype)
    final = torch.randn(r, h, p, n, generator=gen)
    want_state = prob["ssm_state"].clone()
    want = mamba2_chunked_output_ref(o, prob["x"], d, final, want_state, prob["slots"])
    slots = prob["slots"].roll(1) if sabotage == "slots_rolled" else prob["slots"]
    got = mamba2_chunked_output(o, prob["x"], d.roll(1) if sabotage == "d_rolled" else d, final,
                                prob["ssm_state"], slots)
    ok1 = got.dtype == torch.float32 and torch.equal(got, want)
    ok2 = prob["ssm_state"].dtype == state_dtype and torch.equal(prob["ssm_state"], want_state)
    err = float((got - want).abs().max()) if got.shape == want.shape and got.numel() else 0.0
    return (ok1 and ok2) != bool(sabotage), f"y exact {ok1} (err {err:.3g}), pool exact {ok2}"


def naive_chunk_simple_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
                           initial_state: torch.Tensor, output_final_state: bool, state_v_first: bool,
                           cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None) -> tuple[Any, Any]:
    """fla's ``chunk_simple_gla`` as the fla path calls it, token by token in float32: per sequence ``S = exp(g_t)
    S + v_t k_t^T``, ``o_t = scale S q_t`` (``S`` (H, V, K)), ``o`` in ``v``'s dtype, the final states float32."""
    assert state_v_first and output_final_state and q.shape[0] == 1
    assert all(x.is_contiguous() for x in (q, k, v, g, initial_state)), "fla copies what is not contiguous"
    assert cu_seqlens_cpu is None or torch.equal(cu_seqlens_cpu, cu_seqlens.cpu())
    cu = cu_seqlens.tolist()
    assert initial_state.shape[0] == len(cu) - 1 and all(b > a for a, b in itertools.pairwise(cu))
    o = torch.zeros(v.shape, dtype=torch.float32)
    finals = []
    for i in range(len(cu) - 1):
        state = initial_state[i].float()
        for t in range(cu[i], cu[i + 1]):
            state = (torch.exp(g[0, t])[:, None, None] * state
                     + v[0, t].float()[:, :, None] * k[0, t].float()[:, None, :])
            o[0, t] = scale * (state * q[0, t].float()[:, None, :]).sum(-1)
        finals.append(state)
    return o.to(v.dtype), torch.stack(finals)


def _interp_fla_path(lens: list[int], dtype: torch.dtype, state_dtype: torch.dtype, host_offsets: bool,
                     into_buffer: bool = False) -> tuple[bool, str]:
    """``mamba2_scan_fla`` (the passes around fla, the rows with tokens, their states' slots) with
    :func:`naive_chunk_simple_gla` in fla's place, against the reference. ``into_buffer``: ``y`` written into a slice
    of a NaN-poisoned buffer (``out``, as a step of two parts hands it), the rest of the buffer left NaN."""
    from hyserve.kernels.mamba2 import chunked

    real = chunked._import_fla_simple_gla
    chunked._import_fla_simple_gla = lambda: naive_chunk_simple_gla  # type: ignore[attr-defined]
    try:
        prob = scan_problem(lens, dtype, state_dtype, seed=28)
        ref = _clone(prob)
        want = mamba2_scan_ref(**ref, max_query_len=max(lens))
        before = prob["ssm_state"].clone()
        buf = torch.full((sum(lens) + 2, *prob["x"].shape[1:]), float("nan"))
        got = chunked.mamba2_scan_fla(**prob, query_start_loc_cpu=prob["query_start_loc"] if host_offsets else None,
                                      out=buf[1:-1] if into_buffer else None)
        if into_buffer:
            assert got.data_ptr() == buf[1:-1].data_ptr() and bool(buf[[0, -1]].isnan().all()), "out not used alone"
    finally:
        chunked._import_fla_simple_gla = real  # type: ignore[attr-defined]
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: v = x * dt rounded, fla's output rounded
    stol = tol if state_dtype == torch.float32 else 2e-2
    ok1, e1 = _close(got, want, tol, tol)
    ok2, e2 = _close(prob["ssm_state"], ref["ssm_state"], stol, stol)
    ok3 = _untouched(before, prob["ssm_state"], prob["state_slots"], lens)
    return ok1 and ok2 and ok3, f"out err {e1:.3g}, state err {e2:.3g}, untouched {ok3}"


def run_interpreter_checks() -> dict[str, list[Any]]:
    """Every check under the interpreter; {name: [ok, message]}. Needs TRITON_INTERPRET=1."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_triton_interpreter()
    res: dict[str, list[Any]] = {}
    f32, bf16 = torch.float32, torch.bfloat16
    record_check(res, "scan_mixed_float32", lambda: _interp_scan(MIXED_LENS, f32, f32))
    record_check(res, "scan_decode_float32", lambda: _interp_scan(DECODE_LENS, f32, f32))
    record_check(res, "scan_mixed_clamped_float32", lambda: _interp_scan(MIXED_LENS, f32, f32, dt_limit=(0.05, 0.4)))
    record_check(res, "scan_mixed_bf16_bf16_state", lambda: _interp_scan(MIXED_LENS, bf16, bf16))
    record_check(res, "scan_decode_bf16_fp32_state", lambda: _interp_scan(DECODE_LENS, bf16, f32))
    record_check(res, "verify_float32", lambda: _interp_verify(VERIFY_LENS, f32, f32))
    record_check(res, "verify_bf16_bf16_state", lambda: _interp_verify(VERIFY_LENS, bf16, bf16))
    record_check(res, "scan_group_mod_caught", lambda: _interp_scan(MIXED_LENS, f32, f32, sabotage="group_mod"))
    record_check(res, "scan_a_not_a_log_caught", lambda: _interp_scan(MIXED_LENS, f32, f32, sabotage="a_not_a_log"))
    record_check(res, "verify_stash_late_caught", lambda: _interp_verify(VERIFY_LENS, f32, f32, sabotage="late"))
    record_check(res, "replay_long_caught", lambda: _interp_verify(VERIFY_LENS, f32, f32, sabotage="replay_long"))
    record_check(res, "replay_bitwise_float32", lambda: _interp_replay_bitwise(VERIFY_LENS))
    record_check(res, "replay_window_commit", lambda: _interp_replay_window(False))
    record_check(res, "replay_window_rows", lambda: _interp_replay_window(True))
    record_check(res, "replay_window_piece_caught", lambda: _interp_replay_window(False, sabotage=True))
    for dt in (f32, bf16):
        n = str(dt).split(".")[-1]
        record_check(res, f"conv_bias_fused_{n}", lambda dt=dt: _interp_conv([3, 0, 1, 5, 2], dt, False))
        record_check(res, f"conv_bias_split_{n}", lambda dt=dt: _interp_conv([3, 0, 1, 19, 2], dt, False))
        record_check(res, f"conv_bias_verify_{n}", lambda dt=dt: _interp_conv(VERIFY_LENS, dt, True))
    record_check(res, "conv_bias_shifted_caught", lambda: _interp_conv([3, 0, 1, 5, 2], f32, False, sabotage=True))
    record_check(res, "scan_mixed_bf16_fp32_state_on_pool_rows",
                 lambda: _interp_scan(MIXED_LENS, bf16, f32, pool_rows=True))
    record_check(res, "conv_bias_split_bfloat16_on_pool_rows",
                 lambda: _interp_conv([3, 0, 1, 19, 2], bf16, False, pool_rows=True))
    record_check(res, "conv_bias_verify_float32_on_pool_rows",
                 lambda: _interp_conv(VERIFY_LENS, f32, True, pool_rows=True))
    record_check(res, "conv_bias_verify_shifted_caught", lambda: _interp_conv(VERIFY_LENS, f32, True, sabotage=True))
    for name, args in CHUNKED_INPUT_CASES.items():
        record_check(res, f"chunked_inputs_{name}", lambda args=args: _interp_chunked_inputs(*args))
    for sab in ("group_mod", "a_not_a_log", "slots_rolled"):
        record_check(res, f"chunked_inputs_{sab}_caught",
               lambda sab=sab: _interp_chunked_inputs(MIXED_LENS, 4, 2, 8, 16, bf16, f32, sabotage=sab))
    for name, args in CHUNKED_OUTPUT_CASES.items():
        record_check(res, f"chunked_output_{name}", lambda args=args: _interp_chunked_output(*args))
    for sab in ("d_rolled", "slots_rolled"):
        record_check(res, f"chunked_output_{sab}_caught",
               lambda sab=sab: _interp_chunked_output(MIXED_LENS, 4, 8, 16, bf16, f32, sabotage=sab))
    for name, args in FLA_PATH_CASES.items():
        record_check(res, f"fla_path_{name}", lambda args=args: _interp_fla_path(*args))
    return res


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (lens, heads, groups, head dim, state size, model dtype, state dtype)
CHUNKED_INPUT_CASES: dict[str, tuple[Any, ...]] = {
    "bf16_2_groups": (MIXED_LENS, 4, 2, 8, 16, BF16, F32),
    "fp16_odd_sizes_3_groups_fp16_state": ([2, 5, 0, 3], 6, 3, 6, 10, F16, F16),
    "bf16_one_group_bf16_state": ([7, 1], 5, 1, 8, 16, BF16, BF16),
    "float32_a_group_a_head": ([4, 0, 2], 4, 4, 8, 16, F32, F32),
    "bf16_one_token": ([1], 4, 2, 8, 16, BF16, F32),
    "bf16_no_tokens": ([0, 0], 4, 2, 8, 16, BF16, BF16),
}
# (lens, heads, head dim, state size, model dtype, state dtype)
CHUNKED_OUTPUT_CASES: dict[str, tuple[Any, ...]] = {
    "bf16": (MIXED_LENS, 4, 8, 16, BF16, F32),
    "fp16_odd_sizes_fp16_state": ([2, 5, 3], 6, 6, 10, F16, F16),
    "float32_bf16_state": ([4, 2], 3, 8, 16, F32, BF16),
    "bf16_one_token": ([1], 4, 8, 16, BF16, F32),
    "bf16_no_tokens": ([0, 0], 4, 8, 16, BF16, BF16),
}
FLA_PATH_CASES: dict[str, tuple[Any, ...]] = {
    "float32_qsl_cpu": (MIXED_LENS, F32, F32, True),
    "float32_no_qsl_cpu": (MIXED_LENS, F32, F32, False),
    "bf16_bf16_state": (MIXED_LENS, BF16, BF16, True),
    "bf16_into_a_buffer": (MIXED_LENS, BF16, F32, True, True),
}


INTERP_CHECKS = ["scan_mixed_float32", "scan_decode_float32", "scan_mixed_clamped_float32",
                 "scan_mixed_bf16_bf16_state", "scan_decode_bf16_fp32_state", "verify_float32",
                 "verify_bf16_bf16_state", "scan_group_mod_caught", "verify_stash_late_caught", "replay_long_caught",
                 "replay_bitwise_float32", "replay_window_commit", "replay_window_rows", "replay_window_piece_caught",
                 *[f"conv_bias_{k}_{dt}" for k in ("fused", "split", "verify") for dt in ("float32", "bfloat16")],
                 "conv_bias_shifted_caught", "conv_bias_verify_shifted_caught", "scan_a_not_a_log_caught",
                 "scan_mixed_bf16_fp32_state_on_pool_rows", "conv_bias_split_bfloat16_on_pool_rows",
                 "conv_bias_verify_float32_on_pool_rows",
                 *[f"chunked_inputs_{k}" for k in CHUNKED_INPUT_CASES],
                 *[f"chunked_inputs_{k}_caught" for k in ("group_mod", "a_not_a_log", "slots_rolled")],
                 *[f"chunked_output_{k}" for k in CHUNKED_OUTPUT_CASES],
                 *[f"chunked_output_{k}_caught" for k in ("d_rolled", "slots_rolled")],
                 *[f"fla_path_{k}" for k in FLA_PATH_CASES]]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, list[Any]]:
    pytest.importorskip("triton")
    return interpreter_subprocess_results(__file__, "--interpreter-checks")


def test_every_check_ran(interpreter_results: dict[str, list[Any]]) -> None:
    assert sorted(interpreter_results) == sorted(INTERP_CHECKS)


@pytest.mark.parametrize("name", INTERP_CHECKS)
def test_triton_kernel_interpreter(interpreter_results: dict[str, list[Any]], name: str) -> None:
    ok, msg = interpreter_results[name]
    assert ok, f"{name}: {msg}"


def test_cpu_dispatch_is_the_reference() -> None:
    """On the CPU ``mamba2_scan`` is the reference, bit for bit, with or without the host's offsets."""
    p = scan_problem(MIXED_LENS, torch.float32, torch.float32, seed=24)
    ref = _clone(p)
    got = mamba2_scan(**p, max_query_len=6, query_start_loc_cpu=p["query_start_loc"])
    want = mamba2_scan_ref(**ref, max_query_len=6)
    assert torch.equal(got, want) and torch.equal(p["ssm_state"], ref["ssm_state"])


if __name__ == "__main__":
    if sys.argv[1:] == ["--interpreter-checks"]:
        results = run_interpreter_checks()
        print_results(results)


def test_nonempty_rows_picks_the_rows_with_tokens_with_or_without_the_hosts_offsets() -> None:
    """What the chunked (fla) paths of the Mamba2 scan and the gated delta rule hand fla: the rows with tokens, their
    slots (not their row indices) and their offsets; the host's copy where one was given."""
    import torch

    from hyserve.kernels.varlen import nonempty_rows

    slots, qsl = torch.tensor([5, 2, 7, 1]), torch.tensor([0, 3, 3, 8, 9])
    for host in (None, qsl.clone()):
        got_slots, cu, cu_cpu = nonempty_rows(slots, qsl, host)
        assert got_slots.tolist() == [5, 7, 1] and cu.tolist() == [0, 3, 8, 9]
        assert (cu_cpu is None) == (host is None) and (cu_cpu is None or cu_cpu.tolist() == [0, 3, 8, 9])
    full = torch.tensor([0, 1, 2, 3, 4])
    got_slots, cu, _ = nonempty_rows(slots, full, full.clone())
    assert got_slots.tolist() == [5, 2, 7, 1] and cu.tolist() == [0, 1, 2, 3, 4]
