"""The fused Gated DeltaNet verify kernel (``hyserve.kernels.gdn.verify.gdn_verify_fused``: the conv's candidate
windows, gates, the delta rule's verify with its stash and the gated RMSNorm in one launch) under the Triton
interpreter (one subprocess: ``TRITON_INTERPRET=1`` must be set before any kernel is decorated), compiled for sm_90,
and on CUDA where there is a card.

Against: the unfused Triton kernels in sequence (``causal_conv1d_verify``, ``gdn_gating``, ``gdn_verify``,
``gated_rms_norm``: outputs, candidate windows and stash bit for bit under the interpreter) and the unfused plain-torch
references in sequence (the op's definition, within float32 / one-unit-in-the-last-place rules). Problems: verify rows
of 1 to P tokens and empty ones, on non-identity slots, with more scratch rows than rows; float32 and bf16 models,
float32 and bf16 states; Hv / Hk = 1, 2 and 3; head widths that are not powers of two and several value blocks per
head. The live conv windows and SSM states are never written, nor any scratch or stash entry past a row's tokens.
The commit (one ``gdn_replay`` launch with the window's copy) over the fused kernel's scratch and stash gives the
conv window and state that the plain kernels reach over the accepted tokens; so do candidate snapshots into free
entries. The mixer takes the
kernel on a step with verify rows of drafts (alone, and followed by prefill rows) and gives its unfused path's
output; a step of one-token verify rows (speculation length 0) followed by prefill rows takes the fused decode
kernel for them instead.

Sabotaged kernels (each mutated in its source, each must disagree): a candidate window one token late, the stash's k
stored l2-normed, the live state written back, the key head ``h % Hk`` instead of ``h // (Hv / Hk)``, the norm read
before the barrier's stores are all in (the norm pass's token index off by one); the commit's window copy one
element short of each program's piece.

With ``quant="fp8"`` (an FP8 ``out_proj``) the last of a row's programs quantizes each of the row's tokens per token:
FP8 bytes and scales equal to ``quantize_per_token`` of the plain launch's output, the plain output, scratch and stash
bit for bit the plain launch's, over two launches on the same row counters (back at zero after each); the decode
kernel's three sabotages of the quantizing tail are caught here too. The mixer hands its FP8 ``out_proj`` that
activation for a step of verify rows alone, and the plain output when prefill rows follow them.

The split launch (``split=True``: one program a (row, value head, value block), the head's norm by the last of its
programs to arrive on a per-(row, head) counter): outputs, scratch and stash bit for bit the unfused kernels' and the
walk's, on two and three blocks a head (the last partial), an empty row, the engine's pools, and quantizing for an
FP8 out_proj; the counters back at zero after each launch. Sabotages caught: the norm by the first program to arrive,
the counter not reset, every block's v windows and stash written from block 0's channels. The mixer hands the
fused entry point its ``HYSERVE_GDN_VERIFY_SPLIT`` choice and its counters.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from test_gdn_decode_fused import FP8_SABOTAGES, assert_three_way_switch, check_quantized
from test_gdn_decode_fused import tiny_gdn as decode_tiny_gdn

from hyserve.kernels.gdn.decode import as_value_major
from hyserve.kernels.gdn.verify import STASH_NAMES, gdn_stash_shapes, gdn_verify_fused, gdn_verify_fused_ref
from hyserve.layers import gdn as gdn_layer
from hyserve.model.metadata import VerifyMetadata
from hyserve.testing.pools import on_contiguous_copies, on_pool_rows, same_strides
from hyserve.testing.triton_compile import compile_failures, compile_group
from hyserve.testing.triton_interpreter import (
    interpreter_subprocess_results,
    print_results,
    record_check,
    swapped_kernel,
)

F32, BF16 = torch.float32, torch.bfloat16
EPS = 1e-6
POOLS = ("conv_state", "ssm_state")


def verify_problem(lens: list[int], p_max: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype,
                   state_dtype: torch.dtype, seed: int, k: int = 4, device: str = "cpu") -> dict[str, Any]:
    """Verify rows of ``lens`` tokens (each <= ``p_max``) on distinct shuffled slots; ``x``, ``z``, ``b``, ``a``
    views of one wide projection output; scratch and stash for two rows more than there are, NaN-poisoned."""
    gen = torch.Generator().manual_seed(seed)
    pool = len(lens) + 4
    conv_dim = 2 * hk * dk + hv * dv
    t = sum(lens)
    wide = torch.randn(t, conv_dim + hv * dv + 2 * hv + 3, generator=gen).to(dtype)
    c = conv_dim + hv * dv
    slots = torch.randperm(pool, generator=gen)[: len(lens)].tolist()
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    r_max = len(lens) + 2
    shapes = gdn_stash_shapes(hk, dk, hv, dv)
    p = dict(x=wide[:, :conv_dim], z=wide[:, conv_dim:c], b=wide[:, c : c + hv], a=wide[:, c + hv : c + 2 * hv],
             conv_weight=(torch.randn(conv_dim, k, generator=gen) * 0.5).to(dtype),
             a_log=torch.rand(hv, generator=gen).mul(2.0).log1p(), dt_bias=torch.rand(hv, generator=gen) + 0.5,
             norm_weight=(1.0 + 0.3 * torch.randn(dv, generator=gen)).to(dtype), eps=EPS,
             conv_state=torch.randn(pool, conv_dim, k - 1, generator=gen).to(dtype),
             ssm_state=(torch.randn(pool, hv, dk, dv, generator=gen) * 0.3).to(state_dtype),
             state_slots=torch.tensor(slots, dtype=torch.int64), query_start_loc=qsl, num_k_heads=hk,
             conv_scratch=torch.full((r_max, p_max, conv_dim, k - 1), float("nan"), dtype=dtype),
             stash={n: torch.full((r_max, p_max, *shapes[n]), float("nan")) for n in STASH_NAMES},
             max_query_len=max(lens))
    return {n: (v.to(device) if isinstance(v, torch.Tensor) else
                {m: u.to(device) for m, u in v.items()} if isinstance(v, dict) else v) for n, v in p.items()}


def fresh(p: dict[str, Any]) -> dict[str, Any]:
    """A copy whose pools, scratch and stash are the problem's, cloned."""
    q = dict(p)
    for n in (*POOLS, "conv_scratch"):
        q[n] = same_strides(p[n])
    q["stash"] = {n: t.clone() for n, t in p["stash"].items()}
    return q


def unfused_triton(p: dict[str, Any]) -> torch.Tensor:
    """Today's verify sequence of Triton kernels (conv verify, gating, delta-rule verify, gated norm)."""
    from hyserve.kernels.conv.verify import causal_conv1d_verify_triton
    from hyserve.kernels.gating import gdn_gating_triton
    from hyserve.kernels.gdn.verify import gdn_verify_triton
    from hyserve.kernels.norm import gated_rms_norm_triton

    x, hk = p["x"], p["num_k_heads"]
    t = x.shape[0]
    _, hv, dk, dv = p["ssm_state"].shape
    mixed = causal_conv1d_verify_triton(x, p["conv_weight"], p["conv_state"], p["state_slots"],
                                        p["query_start_loc"], p["conv_scratch"], p["max_query_len"])
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    g, beta = gdn_gating_triton(p["a"], p["b"], p["a_log"], p["dt_bias"])
    o = gdn_verify_triton(q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv), g, beta,
                          p["ssm_state"], p["state_slots"], p["query_start_loc"], p["stash"])
    return gated_rms_norm_triton(o.reshape(-1, dv), p["z"].reshape(-1, dv), p["norm_weight"], EPS).reshape(t, -1)


def fused_triton(p: dict[str, Any], block_v: int | None = None, split: bool = False,
                 num_warps: int = 4) -> torch.Tensor:
    """The fused launch on ``p`` (an output of NaN first) on ``num_warps`` warps (on a card a reduction's order
    follows them). ``split``: each head over its value blocks, on head counters that must be back at zero after the
    launch."""
    from hyserve.kernels.gdn.decode import head_counters_for
    from hyserve.kernels.gdn.verify import gdn_verify_fused_triton

    args = {n: v for n, v in p.items() if n != "max_query_len"}
    out = torch.full((p["x"].shape[0], p["z"].shape[1]), float("nan"), dtype=p["x"].dtype, device=p["x"].device)
    if not split:
        return gdn_verify_fused_triton(**args, out=out, block_v=block_v, num_warps=num_warps)
    _, hv = p["ssm_state"].shape[:2]
    counts = head_counters_for(p["ssm_state"].shape[0], hv, p["x"].device)
    got = gdn_verify_fused_triton(**args, out=out, block_v=block_v, split=True, head_counts=counts,
                                  num_warps=num_warps)
    assert not counts.any(), f"head counters left at {counts.nonzero().tolist()}"
    return got


def _agree(got: torch.Tensor, want: torch.Tensor, f32_tol: float = 2e-6, ulps: int = 1) -> tuple[bool, str]:
    """float32 within ``f32_tol`` relative (plus as much absolute); 16-bit within ``ulps`` units in the last place;
    NaN where the other has NaN."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False, f"{got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
    g, w = got.float(), want.float()
    if not torch.equal(g.isnan(), w.isnan()):
        return False, "NaN in different places"
    g, w = g.nan_to_num(), w.nan_to_num()
    err = (g - w).abs()
    if want.dtype == F32:
        return bool((err <= f32_tol * (w.abs() + 1)).all()), f"max err {float(err.max()):.3g}"
    ulp = ulps * 2.0 ** (-7 if want.dtype == BF16 else -10)
    ok = bool((err <= ulp * w.abs().clamp(min=2.0**-10) * 1.01 + 1e-6).all())
    return ok, f"max err {float(err.max()):.3g}"


def check_fused(p: dict[str, Any], want_fn: Any, exact: bool, block_v: int | None = None,
                split: bool = False) -> tuple[bool, str]:
    """The fused kernel (``split``: its split launch) against ``want_fn`` on copies: outputs, every scratch and stash
    entry (written ones equal, the rest still NaN), the pools untouched. ``exact``: all bit for bit but the outputs,
    within one unit in the last place; else within ``_agree``'s tolerances."""
    want_p, got_p = fresh(p), fresh(p)
    want = want_fn(want_p)
    got = fused_triton(got_p, block_v, split)
    goods, msgs = [], []

    def cmp(name: str, g: torch.Tensor, w: torch.Tensor) -> None:
        if exact and name != "out":
            ok = bool(torch.equal(g.nan_to_num(7.0), w.nan_to_num(7.0))) and torch.equal(g.isnan(), w.isnan())
            msg = "equal" if ok else "differ"
        else:
            ok, msg = _agree(g, w, 2.4e-7 if exact else 2e-6)
        goods.append(ok)
        msgs.append(f"{name} {msg}")

    cmp("out", got, want)
    cmp("conv_scratch", got_p["conv_scratch"], want_p["conv_scratch"])
    for n in STASH_NAMES:
        cmp(f"stash_{n}", got_p["stash"][n], want_p["stash"][n])
    for n in POOLS:
        goods.append(bool(torch.equal(got_p[n], p[n])))
    return all(goods), f"{'; '.join(msgs)}; all {goods}"


# (name, lens, P, Hk, Hv, Dk, Dv, model dtype, state dtype, block_v)
CASES = [
    ("f32_g1", [3, 0, 1], 3, 2, 2, 16, 32, F32, F32, 16),
    ("f32_g2", [2, 3, 1], 3, 1, 2, 16, 32, F32, F32, 16),
    ("bf16_g1", [4, 1], 4, 2, 2, 16, 32, BF16, F32, None),
    ("bf16_g2", [0, 3, 2, 3], 3, 2, 4, 16, 48, BF16, F32, 16),
    ("bf16_g2_bf16_state", [1, 3], 3, 2, 4, 16, 32, BF16, BF16, 16),
    ("bf16_g3_odd_widths", [1, 0, 3], 3, 1, 3, 12, 40, BF16, F32, 16),
]


# The problems also run with the output quantized for an FP8 out_proj (Hv / Hk = 1, 2, 3, odd widths, a bf16 state).
FP8_CASES = ["f32_g1", "bf16_g2", "bf16_g3_odd_widths", "bf16_g2_bf16_state"]


# The problems also checked against the plain-torch references (the others differ from these in one dimension).
REFERENCE_CASES = ["f32_g2", "bf16_g2_bf16_state", "bf16_g3_odd_widths"]


def _case(name: str, seed: int) -> tuple[dict[str, Any], int | None]:
    _, lens, p_max, hk, hv, dk, dv, dt, sdt, bv = next(c for c in CASES if c[0] == name)
    return verify_problem(lens, p_max, hk, hv, dk, dv, dt, sdt, seed), bv


def _on(p: dict[str, Any], pool: str) -> None:
    """``pool``: ``value`` the SSM pool stored value-major; ``rows`` both pools as the engine's ``StatePool`` views
    (one row of bytes per entry, the SSM state value-major); ``dense`` as made."""
    if pool == "value":
        p["ssm_state"] = as_value_major(p["ssm_state"])
    elif pool == "rows":
        p["conv_state"], p["ssm_state"] = on_pool_rows(p["conv_state"], p["ssm_state"])


def _interp_vs_unfused(name: str, pool: str = "dense") -> tuple[bool, str]:
    """``pool`` other than dense (``_on``): the fused kernel reads such pools, the unfused ones contiguous key-major
    copies."""
    p, bv = _case(name, 21)
    if pool == "dense":
        return check_fused(p, unfused_triton, exact=True, block_v=bv)
    _on(p, pool)
    return check_fused(p, on_contiguous_copies(unfused_triton, POOLS), exact=True, block_v=bv)


def _interp_vs_reference(name: str) -> tuple[bool, str]:
    p, bv = _case(name, 22)
    return check_fused(p, lambda q: gdn_verify_fused_ref(**q), exact=False, block_v=bv)


def _interp_commit_reaches_the_plain_state(snapshot: bool, pool: str = "dense") -> tuple[bool, str]:
    """The commit over the fused kernel's scratch and stash, one ``gdn_replay`` launch with the window's copy (each
    row's first ``a + 1`` tokens), against the plain kernels (conv, gates, recurrent delta rule) run over the same
    tokens in place: the same conv windows and states (bit for bit in float32). ``snapshot``: candidate snapshots
    of two of the rows (out of order) into free pool entries instead; the live slots left alone. ``pool`` (``_on``):
    the fused kernel and the commit on such pools, the plain kernels on contiguous key-major copies."""
    from hyserve.kernels.conv import causal_conv1d_varlen_triton
    from hyserve.kernels.gating import gdn_gating_triton
    from hyserve.kernels.gdn import gdn_recurrent_triton
    from hyserve.kernels.gdn.verify import gdn_replay_triton

    p, _ = _case("f32_g2", 23)
    _on(p, pool)
    got_p = fresh(p)
    fused_triton(got_p, 16)
    slots = p["state_slots"]
    lens = (p["query_start_loc"][1:] - p["query_start_loc"][:-1]).tolist()
    accepted = [n - 2 if n >= 2 else n - 1 for n in lens]  # candidate a: tokens 0 .. a kept (-1: none)
    counts = torch.tensor(accepted, dtype=torch.int64)
    if snapshot:
        rows = torch.tensor([2, 0], dtype=torch.int64)
        free = [e for e in range(p["ssm_state"].shape[0]) if e not in slots.tolist()][:2]
        dst = torch.tensor(free, dtype=torch.int64)
        gdn_replay_triton(got_p["ssm_state"], got_p["stash"], rows, slots[rows], dst, counts[rows],
                          conv=(got_p["conv_state"], got_p["conv_scratch"]))
    else:
        gdn_replay_triton(got_p["ssm_state"], got_p["stash"], None, slots, slots, counts,
                          conv=(got_p["conv_state"], got_p["conv_scratch"]))
    # The plain kernels over the kept tokens of each row, in place on a copy.
    want_p = fresh(p)
    for n in POOLS:
        want_p[n] = want_p[n].contiguous()
    starts = p["query_start_loc"].tolist()
    keep = [i for r, a in enumerate(accepted) for i in range(starts[r], starts[r] + a + 1)]
    kept_lens = [a + 1 for a in accepted]
    qsl = torch.tensor([0, *torch.tensor(kept_lens).cumsum(0).tolist()], dtype=torch.int32)
    hk = p["num_k_heads"]
    _, hv, dk, dv = p["ssm_state"].shape
    mixed = causal_conv1d_varlen_triton(p["x"][keep], p["conv_weight"], want_p["conv_state"], slots, qsl,
                                        max(kept_lens))
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    g, beta = gdn_gating_triton(p["a"][keep], p["b"][keep], p["a_log"], p["dt_bias"])
    t = len(keep)
    gdn_recurrent_triton(q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv), g, beta,
                         want_p["ssm_state"], slots, qsl)
    goods = []
    for n in POOLS:
        want = want_p[n]
        if snapshot:  # the snapshot entries hold the plain states of the rows' slots; every other entry untouched
            want = p[n].clone()
            want[dst] = want_p[n][slots[rows]]
        goods.append(bool(torch.equal(got_p[n], want)))
    return all(goods), f"conv windows, states equal: {goods} (accepted {accepted})"


# Mutations of the kernel source: (problem, [(replaced, replacement)]). Each must be caught.
SABOTAGES: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "window_one_token_late": ("bf16_g2", [("rel = i - (K - 2) + p", "rel = i - (K - 3) + p")]),
    "stash_k_normed": ("f32_g2", [("hk * stk_h + ok, kv, mask=kmask & first)",
                                   "hk * stk_h + ok, kv / tl.sqrt(tl.sum(kv * kv, axis=0) + 1e-6), "
                                   "mask=kmask & first)")]),
    "live_state_written": ("f32_g1", [("            tl.store(out_ptr + (start + i) * so_t + h * DV + ov, o.to(dt), "
                                       "mask=vmask)\n",
                                       "            tl.store(out_ptr + (start + i) * so_t + h * DV + ov, o.to(dt), "
                                       "mask=vmask)\n            tl.store(s_head + ok[:, None] * ss_k + ov[None, :] * "
                                       "ss_v, S.to(state_ptr.dtype.element_ty), mask=tile)\n")]),
    "key_head_h_mod_hk": ("bf16_g2", [("    hk = h // GROUP\n    first = h % GROUP == 0",
                                       "    hk = h % HK\n    first = h % GROUP == 0")]),
    "norm_of_the_next_token": ("bf16_g1", [("        o_row = out_ptr + (start + i) * so_t + h * DV\n        of = "
                                            "tl.load(o_row + oall",
                                            "        o_row = out_ptr + (start + i) * so_t + h * DV\n        of = "
                                            "tl.load(o_row + so_t * (i + 1 < n) + oall")]),
}


def _interp_sabotage(what: str) -> tuple[bool, str]:
    name, edits = SABOTAGES[what]
    with swapped_kernel("hyserve.kernels.gdn._triton", "_gdn_verify_fused_kernel", edits):
        ok, msg = _interp_vs_unfused(name)
    return not ok, msg


def _interp_fp8(name: str) -> tuple[bool, str]:
    p, bv = _case(name, 23)
    return check_fused_fp8(p, bv)


def check_fused_fp8(p: dict[str, Any], bv: int | None) -> tuple[bool, str]:
    """``quant="fp8"`` against the plain launch, twice on the same row counters: the quantized rows exactly the
    quantization of the launch's own plain output, that output, scratch and stash the plain launch's; counters back
    at 0."""
    from hyserve.kernels.gdn.decode import row_counters_for
    from hyserve.kernels.gdn.verify import gdn_verify_fused_triton

    plain_p = fresh(p)
    want = fused_triton(plain_p, bv)
    counts = row_counters_for(p["ssm_state"].shape[0], p["x"].device)
    goods, msgs = [], []
    for launch in range(2):
        got_p = fresh(p)
        args = {n: v for n, v in got_p.items() if n != "max_query_len"}
        out = torch.full(want.shape, float("nan"), dtype=want.dtype, device=want.device)
        act = gdn_verify_fused_triton(**args, quant="fp8", row_counts=counts, out=out, block_v=bv)
        ok, msg = check_quantized(act, out)
        same = [torch.equal(got_p["conv_scratch"].nan_to_num(7.0), plain_p["conv_scratch"].nan_to_num(7.0)),
                *(torch.equal(got_p["stash"][n].nan_to_num(7.0), plain_p["stash"][n].nan_to_num(7.0))
                  for n in STASH_NAMES), *(torch.equal(got_p[n], p[n]) for n in POOLS)]
        goods += [ok, bool(torch.equal(out, want)), all(same), not bool(counts.any())]
        msgs.append(f"launch {launch}: {msg}")
    return all(goods), f"{'; '.join(msgs)}; all {goods}"


def _interp_fp8_sabotage(what: str) -> tuple[bool, str]:
    with swapped_kernel("hyserve.kernels.gdn._triton", "_gdn_verify_fused_kernel", FP8_SABOTAGES[what]):
        ok, msg = _interp_fp8("bf16_g2")
    return not ok, msg


def _interp_window_sabotage() -> tuple[bool, str]:
    """The replay's window copy in pieces for one program more than there are (its last piece never copied) must
    be caught by the commit check."""
    edits = [("E, h, tl.num_programs(1), CBLOCK)", "E, h, tl.num_programs(1) + 1, CBLOCK)")]
    with swapped_kernel("hyserve.kernels.gdn._triton", "_gdn_replay_kernel", edits):
        ok, msg = _interp_commit_reaches_the_plain_state(False)
    return not ok, msg


# The split launch (each value head over its value blocks, one program each; the last of a head's programs to
# arrive normalizes it): problems with two and three blocks a head (the last one partial), an empty row, a bf16
# state on the engine's pools.
SPLIT_CASES = ["f32_g1", "bf16_g3_odd_widths"]


def _interp_split(name: str, pool: str = "dense") -> tuple[bool, str]:
    """The split launch against the unfused kernels, bit for bit as the walk is (outputs within a unit)."""
    p, bv = _case(name, 24)
    if pool == "dense":
        return check_fused(p, unfused_triton, exact=True, block_v=bv, split=True)
    _on(p, pool)
    return check_fused(p, on_contiguous_copies(unfused_triton, POOLS), exact=True, block_v=bv, split=True)


def _interp_split_vs_walk(name: str) -> tuple[bool, str]:
    """The split launch against the walk (one program a head): every output, scratch and stash entry equal."""
    p, bv = _case(name, 25)
    return check_fused(p, lambda q: fused_triton(q, bv), exact=True, block_v=bv, split=True)


def _interp_split_fp8() -> tuple[bool, str]:
    """The split launch quantizing for an FP8 out_proj: the quantization of the walk's plain output, counters back
    at zero (row counters and head counters), over two launches."""
    from hyserve.kernels.gdn.decode import head_counters_for, row_counters_for
    from hyserve.kernels.gdn.verify import gdn_verify_fused_triton

    p, bv = _case("bf16_g2", 26)
    want = fused_triton(fresh(p), bv)
    rows, heads = row_counters_for(p["ssm_state"].shape[0], p["x"].device), None
    goods, msgs = [], []
    for launch in range(2):
        got_p = fresh(p)
        heads = head_counters_for(p["ssm_state"].shape[0], p["ssm_state"].shape[1], p["x"].device)
        args = {n: v for n, v in got_p.items() if n != "max_query_len"}
        out = torch.full(want.shape, float("nan"), dtype=want.dtype, device=want.device)
        act = gdn_verify_fused_triton(**args, quant="fp8", row_counts=rows, out=out, block_v=bv, split=True,
                                      head_counts=heads)
        ok, msg = check_quantized(act, out)
        goods += [ok, bool(torch.equal(out, want)), not bool(rows.any()), not bool(heads.any())]
        msgs.append(f"launch {launch}: {msg}")
    return all(goods), f"{'; '.join(msgs)}; all {goods}"


# Mutations of the split form: each must be caught.
SPLIT_SABOTAGES: dict[str, tuple[str, list[tuple[str, str]]]] = {
    # the head's norm by the first of its programs to arrive (before the other blocks' outputs are in)
    "split_norm_by_the_first_caught": ("f32_g1", [
        ("            if arrived == NVB - 1:\n                _verify_gated_norm",
         "            if arrived == 0:\n                _verify_gated_norm")]),
    # the head counter left as the launch made it (the next launch's last program never sees NVB - 1)
    "split_counter_not_reset_caught": ("f32_g1", [
        ("                tl.atomic_xchg(hc, 0, sem=\"relaxed\")\n", "")]),
    # every block's v windows and stash by block 0's channels
    "split_v_by_block_0_caught": ("f32_g1", [
        ("        oall = vj * BV + tl.arange(0, BV)\n", "        oall = tl.arange(0, BV)\n")]),
}


def _interp_split_sabotage(what: str) -> tuple[bool, str]:
    name, edits = SPLIT_SABOTAGES[what]
    with swapped_kernel("hyserve.kernels.gdn._triton", "_gdn_verify_fused_kernel", edits):
        try:
            ok, msg = _interp_split(name)
        except AssertionError as e:  # fused_triton's check of the head counters
            ok, msg = False, str(e)
    return not ok, msg


def tiny_gdn(dtype: torch.dtype, hk: int = 2, hv: int = 4, p_max: int = 3, seed: int = 5) -> Any:
    """``test_gdn_decode_fused``'s GatedDeltaNet (random weights, 9 slots), its verify scratch (4 rows of ``p_max``)
    bound too."""
    layer = decode_tiny_gdn(dtype, hk=hk, hv=hv, seed=seed)
    layer.bind_verify_scratch({s.name: torch.zeros(4, p_max, *s.shape, dtype=s.dtype)
                               for s in layer.verify_scratch_spec(dtype).tensors})
    return layer


def verify_meta(lens: list[int], slots: list[int], rest_lens: list[int], rest_slots: list[int]) -> Any:
    """A step's metadata: verify rows ``lens`` on ``slots``, then plain rows ``rest_lens`` on ``rest_slots``."""
    from hyserve.model.metadata import StepMetadata

    def cum(ls: list[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(ls, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)

    tv, t = sum(lens), sum(lens) + sum(rest_lens)
    all_lens = lens + rest_lens
    vm = VerifyMetadata(num_rows=len(lens), num_tokens=tv, state_slots=torch.tensor(slots, dtype=torch.int64),
                        query_start_loc=cum(lens), max_query_len=max(lens),
                        rest_state_slots=torch.tensor(rest_slots, dtype=torch.int64),
                        rest_query_start_loc=cum(rest_lens),
                        rest_max_query_len=max(rest_lens, default=0), rest_query_start_loc_cpu=cum(rest_lens))
    qsl = cum(all_lens)
    return StepMetadata(positions=torch.zeros(t, dtype=torch.int64), query_start_loc=qsl,
                        seq_lens=torch.tensor(all_lens, dtype=torch.int32),
                        state_slots=torch.tensor(slots + rest_slots, dtype=torch.int64),
                        block_tables=torch.zeros(len(all_lens), 1, dtype=torch.int32),
                        slot_mapping=torch.full((t,), -1, dtype=torch.int64), max_query_len=max(all_lens),
                        max_seq_len=max(all_lens), query_start_loc_cpu=qsl, verify=vm)


def run_layer(layer: Any, x: torch.Tensor, meta: Any, fused: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """The layer's forward on copies of its pools and scratch, with ``fused`` as the verify kernel wherever the
    layer would take it on CUDA (None: the layer as it is off CUDA); (output, pools and scratch after, calls)."""
    saved = {"conv_state": layer.conv_state, "ssm_state": layer.ssm_state}
    saved_scratch = dict(layer.verify_scratch)
    layer.bind_state({n: t.clone() for n, t in saved.items()})
    layer.bind_verify_scratch({n: t.clone() for n, t in saved_scratch.items()})
    calls = [0]
    orig = gdn_layer.uses_fused_verify, gdn_layer.gdn_verify_fused

    def counted(*a: Any, **k: Any) -> torch.Tensor:
        calls[0] += 1
        return fused(*a, **k)

    if fused is not None:
        gdn_layer.uses_fused_verify = lambda t: True  # type: ignore[assignment]
        gdn_layer.gdn_verify_fused = counted  # type: ignore[assignment]
    try:
        with torch.no_grad():
            out = layer(x, meta)
        after = {"conv_state": layer.conv_state, "ssm_state": layer.ssm_state, **layer.verify_scratch}
    finally:
        gdn_layer.uses_fused_verify, gdn_layer.gdn_verify_fused = orig  # type: ignore[assignment]
        layer.bind_state(saved)
        layer.bind_verify_scratch(saved_scratch)
    return out, after, calls[0]


def _interp_layer(dtype: torch.dtype, rest: bool) -> tuple[bool, str]:
    """The mixer's verify step on the fused kernel against its unfused CPU path: outputs, pools, scratch."""
    from hyserve.kernels.gdn.verify import gdn_verify_fused_triton

    layer = tiny_gdn(dtype, hk=1, hv=2)
    rest_lens, rest_slots = ([5, 2], [1, 8]) if rest else ([], [])
    meta = verify_meta([3, 1, 2], [6, 2, 4], rest_lens, rest_slots)
    x = torch.randn(6 + sum(rest_lens), 32).to(dtype)
    want, want_after, _ = run_layer(layer, x, meta, None)
    got, got_after, calls = run_layer(layer, x, meta, lambda *a, **k: gdn_verify_fused_triton(*a[:-1], **k))
    checks = [_agree(got, want, 2e-5, 2), *(_agree(got_after[n], want_after[n], 2e-5) for n in want_after)]
    ok = all(c for c, _ in checks) and calls == 1
    return ok, f"{'; '.join(m for _, m in checks)}; fused calls {calls}"


def _interp_layer_split() -> tuple[bool, str]:
    """The mixer's verify step with prefill rows on the split launch (``verify_split`` on, the layer's own head
    counters) against its unfused CPU path; the counters back at zero."""
    layer = tiny_gdn(BF16, hk=1, hv=2)
    layer.verify_split = True
    meta = verify_meta([3, 1, 2], [6, 2, 4], [5, 2], [1, 8])
    x = torch.randn(13, 32).to(BF16)
    want, want_after, _ = run_layer(layer, x, meta, None)
    splits: list[bool] = []

    def split_launch(*a: Any, **k: Any) -> Any:
        from hyserve.kernels.gdn.verify import gdn_verify_fused_triton

        splits.append(k.get("split") is True and k.get("head_counts") is layer.head_counts)
        args = a[:-1]  # max_query_len is the entry point's
        return gdn_verify_fused_triton(*args, quant=k.get("quant"), row_counts=k.get("row_counts"), split=True,
                                       head_counts=k["head_counts"], out=k.get("out"), block_v=8)  # two blocks

    got, got_after, calls = run_layer(layer, x, meta, split_launch)
    checks = [_agree(got, want, 2e-5, 2), *(_agree(got_after[n], want_after[n], 2e-5) for n in want_after)]
    ok = all(c for c, _ in checks) and calls == 1 and splits == [True] and not bool(layer.head_counts.any())
    return ok, f"{'; '.join(m for _, m in checks)}; fused calls {calls}, split asked {splits}"


def _interp_layer_fp8() -> tuple[bool, str]:
    """A mixer whose ``out_proj`` takes FP8 activations (``out_quant``; the GEMM replaced by a recorder): a step of
    verify rows alone hands it the :class:`Fp8Activation` of the plain launch's output; with prefill rows after the
    verify rows it gets the plain output (the verify launch unquantized)."""
    from hyserve.kernels.fp8 import Fp8Activation
    from hyserve.kernels.gdn.decode import row_counters_for
    from hyserve.kernels.gdn.verify import gdn_verify_fused_triton

    layer = tiny_gdn(BF16, hk=1, hv=2)
    seen: list[Any] = []

    class Recorder(torch.nn.Module):
        def forward(self, a: Any) -> torch.Tensor:
            seen.append(a)
            return torch.zeros(1)

    layer.out_proj = Recorder()
    layer.row_counts = row_counters_for(9, torch.device("cpu"))
    fused = lambda *a, **k: gdn_verify_fused_triton(*a[:-1], **k)
    msgs, goods = [], []
    for rest_lens, rest_slots in (([], []), ([5, 2], [1, 8])):
        meta = verify_meta([3, 1, 2], [6, 2, 4], rest_lens, rest_slots)
        x = torch.randn(6 + sum(rest_lens), 32).to(BF16)
        for quant in ("fp8", None):
            layer.out_quant = quant
            calls = run_layer(layer, x, meta, fused)[2]
            goods.append(calls == 1)
        fp8_act, plain = seen[-2], seen[-1]
        if rest_lens:
            ok, msg = isinstance(fp8_act, torch.Tensor) and torch.equal(fp8_act, plain), "plain with prefill rows"
        else:
            ok, msg = check_quantized(fp8_act, plain)
            ok = ok and isinstance(plain, torch.Tensor) and not isinstance(plain, Fp8Activation)
        goods += [ok, not bool(layer.row_counts.any())]
        msgs.append(msg)
    return all(goods), f"{'; '.join(msgs)}; all {goods}"


def _interp_layer_one_token_rows(dtype: torch.dtype) -> tuple[bool, str]:
    """A step at speculation length 0 (verify rows of one token) followed by prefill rows: the verify rows on the
    fused decode kernel (in place), against the mixer's unfused CPU path: outputs and pools."""
    from hyserve.kernels.gdn.decode import gdn_decode_fused_triton

    layer = tiny_gdn(dtype, hk=1, hv=2)
    meta = verify_meta([1, 1, 1], [6, 2, 4], [5, 2], [1, 8])
    x = torch.randn(10, 32).to(dtype)
    want, want_after, _ = run_layer(layer, x, meta, None)
    calls = [0]

    def counted(*a: Any, **k: Any) -> torch.Tensor:
        calls[0] += 1
        return gdn_decode_fused_triton(*a, **k)

    saved = gdn_layer.uses_fused_decode, gdn_layer.gdn_decode_fused
    gdn_layer.uses_fused_decode = lambda t: True  # type: ignore[assignment]
    gdn_layer.gdn_decode_fused = counted  # type: ignore[assignment]
    try:
        got, got_after, verify_calls = run_layer(layer, x, meta, lambda *a, **k: gdn_verify_fused(*a, **k))
    finally:
        gdn_layer.uses_fused_decode, gdn_layer.gdn_decode_fused = saved  # type: ignore[assignment]
    checks = [_agree(got, want, 2e-5, 2), *(_agree(got_after[n], want_after[n], 2e-5) for n in POOLS)]
    ok = all(c for c, _ in checks) and calls[0] == 1 and verify_calls == 0
    return ok, f"{'; '.join(m for _, m in checks)}; decode calls {calls[0]}, verify calls {verify_calls}"


def run_interpreter_checks(names: list[str]) -> dict[str, list[Any]]:
    """The checks ``names`` (one of the two groups) under the interpreter; {name: [ok, message]}. Needs
    TRITON_INTERPRET=1."""
    from hyserve.testing.triton_interpreter import patch_triton_interpreter

    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_triton_interpreter()
    res: dict[str, list[Any]] = {}

    def check(name: str, fn: Callable[[], tuple[bool, str]]) -> None:
        if name in names:
            record_check(res, name, fn)

    for name, *_ in CASES:
        check(f"vs_unfused_{name}", lambda n=name: _interp_vs_unfused(n))
    for name in REFERENCE_CASES:
        check(f"vs_reference_{name}", lambda n=name: _interp_vs_reference(n))
    check("commit_reaches_the_plain_state", lambda: _interp_commit_reaches_the_plain_state(False))
    check("snapshots_reach_the_plain_state", lambda: _interp_commit_reaches_the_plain_state(True))
    check("window_piece_short_caught", _interp_window_sabotage)
    check("vs_unfused_bf16_g2_bf16_state_on_value_major", lambda: _interp_vs_unfused("bf16_g2_bf16_state", "value"))
    check("snapshots_reach_the_plain_state_on_value_major",
          lambda: _interp_commit_reaches_the_plain_state(True, "value"))
    check("vs_unfused_bf16_g2_bf16_state_on_the_pools_rows", lambda: _interp_vs_unfused("bf16_g2_bf16_state", "rows"))
    check("commit_reaches_the_plain_state_on_the_pools_rows",
          lambda: _interp_commit_reaches_the_plain_state(False, "rows"))
    check("layer_f32", lambda: _interp_layer(F32, rest=False))
    check("layer_f32_with_prefill_rows", lambda: _interp_layer(F32, rest=True))
    check("layer_bf16_with_prefill_rows", lambda: _interp_layer(BF16, rest=True))
    check("layer_one_token_rows_with_prefill_rows", lambda: _interp_layer_one_token_rows(BF16))
    for what in SABOTAGES:
        check(f"{what}_caught", lambda w=what: _interp_sabotage(w))
    for name in FP8_CASES:
        check(f"fp8_{name}", lambda n=name: _interp_fp8(n))
    for what in FP8_SABOTAGES:
        check(f"fp8_{what}_caught", lambda w=what: _interp_fp8_sabotage(w))
    check("layer_hands_out_proj_fp8", _interp_layer_fp8)
    for name in SPLIT_CASES:
        check(f"split_vs_unfused_{name}", lambda n=name: _interp_split(n))
    check("split_vs_unfused_bf16_g2_bf16_state_on_the_pools_rows", lambda: _interp_split("bf16_g2_bf16_state", "rows"))
    check("split_vs_walk_bf16_g2", lambda: _interp_split_vs_walk("bf16_g2"))
    check("split_fp8_bf16_g2", _interp_split_fp8)
    for what in SPLIT_SABOTAGES:
        check(what, lambda w=what: _interp_split_sabotage(w))
    check("layer_split_with_prefill_rows", _interp_layer_split)
    return res


INTERP_CHECKS = [
    *[f"vs_unfused_{name}" for name, *_ in CASES], *[f"vs_reference_{name}" for name in REFERENCE_CASES],
    "commit_reaches_the_plain_state", "snapshots_reach_the_plain_state", "window_piece_short_caught",
    "vs_unfused_bf16_g2_bf16_state_on_value_major", "snapshots_reach_the_plain_state_on_value_major",
    "vs_unfused_bf16_g2_bf16_state_on_the_pools_rows", "commit_reaches_the_plain_state_on_the_pools_rows",
    "layer_f32", "layer_f32_with_prefill_rows", "layer_bf16_with_prefill_rows",
    "layer_one_token_rows_with_prefill_rows",
    *[f"{what}_caught" for what in SABOTAGES],
    *[f"fp8_{name}" for name in FP8_CASES], *[f"fp8_{what}_caught" for what in FP8_SABOTAGES],
    "layer_hands_out_proj_fp8",
    *[f"split_vs_unfused_{name}" for name in SPLIT_CASES], "split_vs_unfused_bf16_g2_bf16_state_on_the_pools_rows",
    "split_vs_walk_bf16_g2", "split_fp8_bf16_g2", *SPLIT_SABOTAGES, "layer_split_with_prefill_rows",
]
# The slow group (scripts/test.sh -m slow; the default suite's budget): the FP8 quantizing tail's problems and its
# three sabotages (3-11 s each; the tail is shared with the fused decode, whose default group keeps its bf16_g2 problem
# and its mixer's hand-off, and off by default, HYSERVE_GDN_FUSED_QUANT) and this mixer's hand-off, the widest problem
# (bf16_g2) and f32_g2 with the three sabotages caught on them (f32_g1, bf16_g1, the bf16 state, odd widths and two
# sabotages stay), two of the three reference problems and the float32 mixer with prefill rows (bf16 stays).
SLOW_INTERP_CHECKS = [
    "vs_unfused_f32_g2", "vs_unfused_bf16_g2", "vs_reference_f32_g2", "vs_reference_bf16_g2_bf16_state",
    "layer_f32_with_prefill_rows", "window_one_token_late_caught", "stash_k_normed_caught", "key_head_h_mod_hk_caught",
    "fp8_bf16_g2", "fp8_bf16_g3_odd_widths", "fp8_bf16_g2_bf16_state",
    *[f"fp8_{what}_caught" for what in FP8_SABOTAGES], "fp8_f32_g1", "layer_hands_out_proj_fp8",
    # 2026-12-07, the default run past its budget: the checks on dense key-major pools whose twins on the engine's
    # pools (value-major, one row of bytes an entry) or value-major pools stay (the unfused comparison, the commit,
    # the snapshots), and the odd widths against the unfused kernels (against the references they stay): 29 s of
    # the file's 82 under the interpreter
    "vs_unfused_bf16_g2_bf16_state", "commit_reaches_the_plain_state", "snapshots_reach_the_plain_state",
    "vs_unfused_bf16_g3_odd_widths",
    # The split launch (opt-in, HYSERVE_GDN_VERIFY_SPLIT=1, until a card's sweep sets its pairs): the default group
    # keeps three blocks a head (the last partial) with an empty row against the unfused kernels, the norm by the
    # first block caught and the counters' reset caught (the mixer's hand-off is checked without the interpreter:
    # test_the_mixer_hands_its_split_choice_and_counters_on); these 80 s or so go to the slow suite
    "split_vs_unfused_f32_g1", "split_vs_unfused_bf16_g2_bf16_state_on_the_pools_rows", "split_vs_walk_bf16_g2",
    "split_fp8_bf16_g2", "split_v_by_block_0_caught", "layer_split_with_prefill_rows",
    # the twenty-eighth session (the default run past its budget again): the unfused comparison on a value-major pool,
    # whose twin on the engine's pool rows (value-major too, one row of bytes an entry) stays, as the snapshots on a
    # value-major pool and the commit on the pool rows do
    "vs_unfused_bf16_g2_bf16_state_on_value_major",
]
DEFAULT_INTERP_CHECKS = [name for name in INTERP_CHECKS if name not in SLOW_INTERP_CHECKS]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, list[Any]]:
    pytest.importorskip("triton")
    return interpreter_subprocess_results(__file__, "--interpreter-checks")


@pytest.fixture(scope="module")
def slow_interpreter_results() -> dict[str, list[Any]]:
    pytest.importorskip("triton")
    # about 6 minutes of CPU (an idle machine): past the helper's default 300 s
    return interpreter_subprocess_results(__file__, "--interpreter-checks-slow", timeout=900)


def test_the_two_groups_hold_every_check_once() -> None:
    assert sorted(DEFAULT_INTERP_CHECKS + SLOW_INTERP_CHECKS) == sorted(INTERP_CHECKS)
    assert not set(DEFAULT_INTERP_CHECKS) & set(SLOW_INTERP_CHECKS)


def test_every_check_ran(interpreter_results: dict[str, list[Any]]) -> None:
    assert sorted(interpreter_results) == sorted(DEFAULT_INTERP_CHECKS)


@pytest.mark.parametrize("name", DEFAULT_INTERP_CHECKS)
def test_triton_kernel_interpreter(interpreter_results: dict[str, list[Any]], name: str) -> None:
    ok, msg = interpreter_results[name]
    assert ok, f"{name}: {msg}"


@pytest.mark.slow  # about 6 minutes under the interpreter
def test_every_slow_check_ran(slow_interpreter_results: dict[str, list[Any]]) -> None:
    assert sorted(slow_interpreter_results) == sorted(SLOW_INTERP_CHECKS)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_INTERP_CHECKS)
def test_triton_kernel_interpreter_slow(slow_interpreter_results: dict[str, list[Any]], name: str) -> None:
    ok, msg = slow_interpreter_results[name]
    assert ok, f"{name}: {msg}"


# The sm_90 compiles (about 10 s each with a cold Triton cache, as on CI): the seed's 27B FP8 form and the bf16
# state by default, the float32-state group sizes in the slow suite.
COMPILE_DEFAULT = {"gdn_verify_fused_g3_fp32_state_fp8", "gdn_verify_fused_g2_bf16_state"}


def _fused_verify_variants(default: bool) -> list[Any]:
    from hyserve.kernels.gdn import verify

    variants = [v for v in verify.compile_variants() if v[0].startswith("gdn_verify_fused")]
    assert len(variants) >= 4
    return compile_group(variants, COMPILE_DEFAULT, default)


def test_fused_verify_compiles_for_sm90() -> None:
    pytest.importorskip("triton")
    failures = compile_failures(_fused_verify_variants(default=True))
    assert not failures, failures


@pytest.mark.slow  # three more compiles, about 30 s cold: the suite's budget
def test_fused_verify_compiles_for_sm90_every_group() -> None:
    pytest.importorskip("triton")
    variants = _fused_verify_variants(default=False)
    assert len(variants) >= 3
    failures = compile_failures(variants)
    assert not failures, failures


def test_layer_on_cpu_takes_the_fused_entry_point_only_with_drafts() -> None:
    """Off CUDA the entry point is the reference sequence: the mixer's fused path (forced) gives its unfused path's
    output, pools and scratch bit for bit; a step whose verify rows hold one token each (no drafts) does not take
    it."""
    layer = tiny_gdn(BF16, hk=1, hv=2)
    meta = verify_meta([2, 3], [7, 3], [], [])
    x = torch.randn(5, 32).to(BF16)
    want, want_after, _ = run_layer(layer, x, meta, None)
    got, got_after, calls = run_layer(layer, x, meta, gdn_verify_fused)
    assert calls == 1 and torch.equal(got, want)
    assert all(torch.equal(got_after[n], want_after[n]) for n in want_after)
    one_token = verify_meta([1, 1], [7, 3], [4], [5])
    assert run_layer(layer, torch.randn(6, 32).to(BF16), one_token, gdn_verify_fused)[2] == 0
    assert not gdn_layer.uses_fused_verify(x)


def test_layer_on_cpu_writes_verify_and_prefill_rows_into_one_buffer() -> None:
    """A step of verify rows of drafts followed by prefill rows through the fused entry point (forced, its CPU
    reference): both parts written into one buffer that out_proj takes whole, equal to the unfused path's output,
    pools and scratch; the fused entry point given that buffer's first rows."""
    layer = tiny_gdn(BF16, hk=1, hv=2)
    meta = verify_meta([2, 3], [7, 3], [4, 2], [5, 1])
    x = torch.randn(11, 32).to(BF16)
    want, want_after, _ = run_layer(layer, x, meta, None)
    outs: list[Any] = []

    def entry(*a: Any, **k: Any) -> Any:
        outs.append(k.get("out"))
        return gdn_verify_fused(*a, **k)

    got, got_after, calls = run_layer(layer, x, meta, entry)
    assert calls == 1 and torch.equal(got, want)
    assert all(torch.equal(got_after[n], want_after[n]) for n in want_after)
    assert outs[0] is not None and outs[0].shape == (5, layer.value_dim) and outs[0].storage_offset() == 0


def test_the_verify_split_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert_three_way_switch(monkeypatch, "HYSERVE_GDN_VERIFY_SPLIT", gdn_layer.verify_split_switch, "verify_split")


def test_the_mixer_hands_its_split_choice_and_counters_on() -> None:
    """The mixer passes its ``verify_split`` (the switch's choice) and its own head counters to the fused entry
    point; :func:`verify_launch` splits by itself up to 48 (row, value head) pairs in (32, 4) blocks (one row of the
    27B's 48 value heads, where the card's sweep has the split ahead), walks beyond, follows the switch where it is
    set, and never splits without counters."""
    from hyserve.kernels.gdn.verify import verify_launch

    layer = tiny_gdn(BF16, hk=1, hv=2)
    meta = verify_meta([2, 3], [7, 3], [], [])
    x = torch.randn(5, 32).to(BF16)
    seen: list[tuple[Any, bool]] = []

    def recorder(*a: Any, **k: Any) -> Any:
        seen.append((k["split"], k["head_counts"] is layer.head_counts))
        return gdn_verify_fused(*a, **k)

    for choice in (None, True, False):
        layer.verify_split = choice
        run_layer(layer, x, meta, recorder)
    assert seen == [(None, True), (True, True), (False, True)]
    assert [verify_launch(r, 48, None) for r in (1, 2, 18, 64)] == [(True, 32, 4)] + [(False, None, 4)] * 3
    assert verify_launch(1, 32, None) == (True, 32, 4) and verify_launch(2, 32, None) == (False, None, 4)
    assert verify_launch(18, 48, True) == (True, 64, 4) and verify_launch(1, 48, False) == (False, None, 4)


# ---------------------------------------------------------------------------------------------------------------------
# On the card (skipped without CUDA)
# ---------------------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("ratio", [1, 2, 3])
@pytest.mark.parametrize("dtype,state_dtype", [(BF16, F32), (BF16, BF16), (F32, F32)],
                         ids=["bf16", "bf16_state", "f32"])
def test_cuda_fused_verify_matches_the_unfused_kernels(ratio: int, dtype: torch.dtype,
                                                       state_dtype: torch.dtype) -> None:
    """The Qwen3.5 head shape (Dk = Dv = 128, conv 4) on the card, 8 key heads, rows of 0-4 tokens at P = 4:
    outputs within two units in the last place of the four unfused kernels, scratch and stash bit for bit, pools
    untouched."""
    lens = [4, 0, 1, 3, 4, 2, 4, 4, 1, 4]
    p = verify_problem(lens, 4, 8, 8 * ratio, 128, 128, dtype, state_dtype, 31, device="cuda")
    want_p, got_p = fresh(p), fresh(p)
    want = unfused_triton(want_p)
    got = fused_triton(got_p)
    ok, msg = _agree(got, want, 2e-6, 2)
    assert ok, msg
    assert torch.equal(got_p["conv_scratch"].nan_to_num(7.0), want_p["conv_scratch"].nan_to_num(7.0))
    for n in STASH_NAMES:
        assert torch.equal(got_p["stash"][n].nan_to_num(7.0), want_p["stash"][n].nan_to_num(7.0)), n
    for n in POOLS:
        assert torch.equal(got_p[n], p[n]), n


@cuda
def test_cuda_fused_verify_on_a_value_major_pool() -> None:
    """The fused verify on a value-major pool (``HYSERVE_GDN_STATE_LAYOUT=value``) against the same launch on a
    key-major copy, 9B heads, bf16 state: outputs within two units in the last place (the key reductions add up in
    the tile layout's order), scratch bit for bit, the stash within float32 rounding, both pools untouched; then the
    commit (``gdn_replay``) into each pool, the states within a unit in the last place."""
    from hyserve.kernels.gdn.verify import gdn_replay_triton

    lens = [4, 0, 1, 3, 4, 2, 4, 4]
    p = verify_problem(lens, 4, 16, 32, 128, 128, BF16, BF16, 35, device="cuda")
    key_p, val_p = fresh(p), fresh(p)
    val_p["ssm_state"] = as_value_major(p["ssm_state"])
    outs = [fused_triton(q) for q in (key_p, val_p)]
    ok, msg = _agree(outs[1], outs[0], 2e-6, 2)
    assert ok, msg
    assert torch.equal(val_p["conv_scratch"].nan_to_num(7.0), key_p["conv_scratch"].nan_to_num(7.0))
    for n in STASH_NAMES:
        ok, msg = _agree(val_p["stash"][n].nan_to_num(7.0), key_p["stash"][n].nan_to_num(7.0))
        assert ok, (n, msg)
    assert torch.equal(val_p["ssm_state"], p["ssm_state"]) and torch.equal(key_p["ssm_state"], p["ssm_state"])
    counts = torch.tensor([min(n, 3) - 1 for n in lens], dtype=torch.int64, device="cuda")
    for q in (key_p, val_p):
        gdn_replay_triton(q["ssm_state"], q["stash"], None, q["state_slots"], q["state_slots"], counts,
                          conv=(q["conv_state"], q["conv_scratch"]))
    ok, msg = _agree(val_p["ssm_state"], key_p["ssm_state"])
    assert ok, msg
    assert val_p["ssm_state"].stride()[2:] == (1, 128)


@cuda
@pytest.mark.parametrize("bv,warps", [(32, 2), (32, 4), (16, 2), (64, 4)])
def test_cuda_split_fused_verify_is_the_walk(bv: int, warps: int) -> None:
    """The split launch (one program a (row, value head, value block)) on the card, the seed's 27B heads (16 key
    heads, 48 value heads) on a value-major float32 pool, rows of 0-3 tokens: outputs, scratch and stash bit for bit
    the walk's at the same value block and warps (2026-12-07d: against a walk at 4 warps the splits at 2 differed, a
    reduction's order), the pools untouched, the head counters back at zero; twice on the same counters; and
    quantizing for an FP8 out_proj, the quantization of that output."""
    from hyserve.kernels.gdn.decode import head_counters_for, row_counters_for
    from hyserve.kernels.gdn.verify import gdn_verify_fused_triton

    lens = [3, 0, 3, 1, 3, 2, 3, 3, 3, 3]
    p = verify_problem(lens, 3, 16, 48, 128, 128, BF16, F32, 41, device="cuda")
    p["ssm_state"] = as_value_major(p["ssm_state"])
    walk_p = fresh(p)
    want = fused_triton(walk_p, bv, num_warps=warps)
    heads = head_counters_for(p["ssm_state"].shape[0], 48, torch.device("cuda"))
    rows = row_counters_for(p["ssm_state"].shape[0], torch.device("cuda"))
    for quant in (None, None, "fp8"):
        got_p = fresh(p)
        args = {n: v for n, v in got_p.items() if n != "max_query_len"}
        out = torch.full(want.shape, float("nan"), dtype=want.dtype, device="cuda")
        act = gdn_verify_fused_triton(**args, out=out, block_v=bv, split=True, head_counts=heads, num_warps=warps,
                                      quant=quant, row_counts=rows)
        torch.cuda.synchronize()
        assert torch.equal(out.nan_to_num(7.0), want.nan_to_num(7.0)) and torch.equal(out.isnan(), want.isnan())
        assert torch.equal(got_p["conv_scratch"].nan_to_num(7.0), walk_p["conv_scratch"].nan_to_num(7.0))
        for n in STASH_NAMES:
            assert torch.equal(got_p["stash"][n].nan_to_num(7.0), walk_p["stash"][n].nan_to_num(7.0)), n
        assert all(torch.equal(got_p[n], p[n]) for n in POOLS)
        assert not heads.any() and not rows.any()
        if quant:
            ok, msg = check_quantized(act, out)
            assert ok, msg


@cuda
def test_cuda_fused_verify_quantizes_for_an_fp8_out_proj() -> None:
    """The seed's 27B heads (16 key heads, 48 value heads) on the card, rows of 0-3 tokens (MTP 2), with
    ``quant="fp8"``: two launches on the same row counters, FP8 bytes and scales those of ``quantize_rows`` over the
    plain launch's output; output, scratch and stash the plain launch's; counters at zero."""
    p = verify_problem([3, 0, 1, 3, 2, 3, 3], 3, 16, 48, 128, 128, BF16, F32, 33, device="cuda")
    ok, msg = check_fused_fp8(p, None)
    assert ok, msg


@cuda
def test_cuda_fused_verify_replays_in_a_graph() -> None:
    """Captured once, replayed over new inputs: the same as an eager launch on the same inputs."""
    from hyserve.kernels.gdn.verify import gdn_verify_fused_triton

    p = verify_problem([3, 1, 0, 3, 2], 3, 4, 8, 128, 128, BF16, F32, 41, device="cuda")
    args = {n: v for n, v in p.items() if n != "max_query_len"}
    out = torch.empty((p["x"].shape[0], p["z"].shape[1]), dtype=BF16, device="cuda")
    gdn_verify_fused_triton(**args, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gdn_verify_fused_triton(**args, out=out)
    for step in range(3):
        for n in ("x", "z", "a", "b"):
            p[n].copy_(torch.randn_like(p[n]))
        eager = fresh(p)
        want = gdn_verify_fused_triton(**{n: v for n, v in eager.items() if n != "max_query_len"})
        graph.replay()
        assert torch.equal(out, want), step
        for n in STASH_NAMES:
            assert torch.equal(p["stash"][n].nan_to_num(7.0), eager["stash"][n].nan_to_num(7.0)), (step, n)


@contextlib.contextmanager
def gdn_on_triton_kernels(calls: collections.Counter[str]) -> Iterator[None]:
    """Within: the GDN layers take the fused decode and verify on every device, and their decode, verify and replay
    run the Triton kernels (under the interpreter here), each call counted in ``calls``."""
    from hyserve.kernels.gdn.decode import gdn_decode_fused_triton
    from hyserve.kernels.gdn.verify import gdn_replay_triton, gdn_verify_fused_triton

    def counting(name: str, fn: Any) -> Any:
        def wrapped(*a: Any, **k: Any) -> Any:
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    saved = (gdn_layer.uses_fused_decode, gdn_layer.uses_fused_verify, gdn_layer.gdn_decode_fused,
             gdn_layer.gdn_verify_fused, gdn_layer.gdn_replay)
    gdn_layer.uses_fused_decode = gdn_layer.uses_fused_verify = lambda x: True  # type: ignore[assignment]
    gdn_layer.gdn_decode_fused = counting("decode", gdn_decode_fused_triton)  # type: ignore[assignment]
    gdn_layer.gdn_verify_fused = counting("verify", lambda *a, **k: gdn_verify_fused_triton(*a[:-1], **k))  # type: ignore
    gdn_layer.gdn_replay = counting("replay", gdn_replay_triton)  # type: ignore[assignment]
    try:
        yield
    finally:
        (gdn_layer.uses_fused_decode, gdn_layer.uses_fused_verify, gdn_layer.gdn_decode_fused,  # type: ignore
         gdn_layer.gdn_verify_fused, gdn_layer.gdn_replay) = saved


def _interp_engine() -> tuple[bool, str]:
    """The engine (tiny Qwen3.5 with its MTP head, 3 GDN layers with Hv = 2 Hk and 1 attention layer, float32) with
    MTP k = 2, emulated CUDA graphs, chunked prefill beside verify rows, prefix caching with snapshots every 16
    tokens, staggered lengths: every GDN verify, decode, commit and candidate snapshot on the Triton kernels, against
    the same engine on the references: the same greedy tokens, log-probabilities within 1e-4, each kernel run."""
    import tempfile

    from hyserve import SamplingParams
    from hyserve.testing import write_tiny_checkpoint
    from hyserve.testing.engine import make_llm, random_prompts
    from hyserve.worker import cuda_graphs

    path = write_tiny_checkpoint(tempfile.mkdtemp(), layer_types=["linear_attention"] * 3 + ["full_attention"],
                                 with_mtp=True)
    prompts = random_prompts(5, [7, 40, 4, 23, 9], seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True, logprobs=1) for i in range(5)]
    cuda_graphs.EMULATE = True
    calls: collections.Counter[str] = collections.Counter()

    def run() -> list[Any]:
        llm = make_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, block_size=16,
                       max_num_seqs=4, max_num_batched_tokens=24, enable_prefix_caching=True,
                       recurrent_snapshot_interval=16, num_snapshot_slots=32)
        assert llm.llm_engine.runner.graphs is not None
        return llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)

    want = run()
    try:
        with gdn_on_triton_kernels(calls):
            got = run()
    finally:
        cuda_graphs.EMULATE = False
    same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(got, want, strict=True))
    diff = max(abs(a.outputs[0].logprobs[i][t].logprob - b.outputs[0].logprobs[i][t].logprob)
               for a, b in zip(got, want, strict=True) for i, t in enumerate(b.outputs[0].token_ids))
    ok = same and diff <= 1e-4 and min(calls[n] for n in ("verify", "replay")) > 0
    return ok, f"tokens same {same}, logprob diff {diff:.3g}, calls {dict(calls)}"


def _interp_random_schedule() -> tuple[bool, str]:
    """The scenario of ``test_adaptive_k_behind.py``'s random schedules (seven staggered requests, real MTP drafts,
    async scheduling, emulated graphs, chunks of 32 tokens, the speculation length at random, then the same prompts
    on the prefix cache) with every GDN decode, verify, commit and candidate snapshot on the Triton kernels: the
    tokens of plain decoding. It caught the candidate snapshots' index vectors read at the wrong stride (the replay
    kernel then wrote other slots); the CPU references had hidden it."""
    import random
    import tempfile

    from hyserve import SamplingParams
    from hyserve.testing.engine import drive, make_llm, random_prompts
    from hyserve.testing.families import CheckpointCache
    from hyserve.worker import cuda_graphs

    path = CheckpointCache(tempfile.mkdtemp()).get("conditional", "gdn3_attn1", with_mtp=True)
    prompts = random_prompts(7, [9, 30, 3, 17, 25, 5, 12], seed=81)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw: dict[str, Any] = dict(max_num_batched_tokens=32, max_num_seqs=6, num_state_slots=6, num_kv_blocks=128)
    cuda_graphs.EMULATE = True
    plain = drive(make_llm(path, **kw).llm_engine, {3 * i: [(f"r{i}", q, params)] for i, q in enumerate(prompts)})
    calls: collections.Counter[str] = collections.Counter()

    try:
        with gdn_on_triton_kernels(calls):
            llm = make_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 3, "adaptive": True},
                           async_scheduling=True, **kw)
            assert llm.llm_engine.drafts is not None
            rng = random.Random(0)
            llm.llm_engine.drafts.policy.script([rng.randrange(4) for _ in range(37)])
            parted = []
            for tag in ("r", "b"):
                out = drive(llm.llm_engine, {3 * i: [(f"{tag}{i}", q, params)] for i, q in enumerate(prompts)})
                parted += [f"{tag}{i}" for i in range(7)
                           if out[f"{tag}{i}"].outputs[0].token_ids != plain[f"r{i}"].outputs[0].token_ids]
    finally:
        cuda_graphs.EMULATE = False
    ok = not parted and min(calls[n] for n in ("decode", "verify", "replay")) > 0
    return ok, f"requests parting from plain decoding {parted}, calls {dict(calls)}"


def run_one_check(name: str, check: Any) -> dict[str, list[Any]]:
    """One engine check alone (a slow test's subprocess). Needs TRITON_INTERPRET=1."""
    from hyserve.testing.triton_interpreter import patch_triton_interpreter

    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_triton_interpreter()
    res: dict[str, list[Any]] = {}
    record_check(res, name, check)
    return res


@pytest.mark.slow  # seven requests twice with MTP under the interpreter: about four minutes
def test_random_schedules_on_the_kernels_emit_plain_decoding_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    results = interpreter_subprocess_results(__file__, "--random-schedule-check", timeout=1200)
    ok, msg = results["random_schedule_on_the_kernels"]
    assert ok, msg


@pytest.mark.slow  # the whole engine with MTP under the interpreter
def test_engine_with_mtp_on_the_kernels_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    results = interpreter_subprocess_results(__file__, "--engine-check", timeout=900)
    ok, msg = results["engine_mtp_on_the_kernels"]
    assert ok, msg


if __name__ == "__main__":
    if sys.argv[1:] == ["--interpreter-checks"]:
        print_results(run_interpreter_checks(DEFAULT_INTERP_CHECKS))
    if sys.argv[1:] == ["--interpreter-checks-slow"]:
        print_results(run_interpreter_checks(SLOW_INTERP_CHECKS))
    if sys.argv[1:] == ["--engine-check"]:
        print_results(run_one_check("engine_mtp_on_the_kernels", _interp_engine))
    if sys.argv[1:] == ["--random-schedule-check"]:
        print_results(run_one_check("random_schedule_on_the_kernels", _interp_random_schedule))
