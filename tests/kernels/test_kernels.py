"""Tests for hyserve.kernels.

* The plain-torch references (the CPU path) are checked against independent implementations: transformers'
  Qwen3.5 ``causal_conv1d_fn`` / ``causal_conv1d_update`` / ``torch_recurrent_gated_delta_rule`` /
  ``torch_chunk_gated_delta_rule`` run one row at a time (batch 1), and naive per-token loops for attention.
* Every Triton kernel is run under the Triton interpreter (``TRITON_INTERPRET=1``) on CPU tensors against the
  references, in ONE subprocess (the env var must be set before any kernel is decorated; a subprocess keeps this
  pytest process untouched). Outputs are NaN-poisoned before the kernels write them.
* A CUDA-only test compares the CUDA dispatch against the CPU reference in bf16 (skipped without a GPU).

Every problem uses mixed row lengths (including 0 and 1), permuted state slots with gaps, and checks that slots no
non-empty row names stay bit-identical.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hyserve.kernels import causal_conv1d_varlen, gdn_forward, paged_attention, store_kv
from hyserve.kernels.attention.reference import paged_attention_ref, store_kv_ref
from hyserve.kernels.conv import causal_conv1d_split
from hyserve.kernels.conv.reference import causal_conv1d_varlen_ref
from hyserve.kernels.gdn.reference import gdn_forward_ref
from hyserve.testing.triton_interpreter import (
    interpreter_subprocess_results,
    mutated_module,
    patch_triton_interpreter,
    print_results,
    record_check,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------------------------------
# Problem builders (shared by the in-process tests and the interpreter subprocess)
# --------------------------------------------------------------------------------------------------------------------


def _qsl(lens: list[int], device: str = "cpu") -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def _slots(num_rows: int, pool: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct, permuted slots drawn from a larger pool (so the pool has untouched gaps)."""
    return torch.randperm(pool, generator=gen)[:num_rows].to(torch.int64)


def _touched(slots: torch.Tensor, lens: list[int]) -> set[int]:
    return {int(s) for s, n in zip(slots.tolist(), lens, strict=True) if n > 0}


def _assert_untouched(before: torch.Tensor, after: torch.Tensor, touched: set[int]) -> None:
    for s in range(before.shape[0]):
        if s not in touched:
            assert torch.equal(before[s], after[s]), f"slot {s} was modified"


def _close(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float = 0.0) -> tuple[bool, float]:
    a, b = a.float().cpu(), b.float().cpu()
    if a.shape != b.shape:
        return False, float("inf")
    if a.numel() == 0:
        return True, 0.0
    if not torch.isfinite(a).all() or not torch.isfinite(b).all():
        return False, float("nan")
    err = (a - b).abs()
    ok = bool((err <= atol + rtol * b.abs()).all())
    return ok, float(err.max())


def conv_problem(lens: list[int], D: int, K: int, pool: int, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    wide = torch.randn(T, D + 7, generator=gen).to(dtype)
    return {
        "x": wide[:, 3 : 3 + D],  # a strided view, as the model's split of in_proj output is
        "weight": torch.randn(D, K, generator=gen) * 0.5,
        "conv_state": torch.randn(pool, D, K - 1, generator=gen).to(dtype),
        "state_slots": _slots(len(lens), pool, gen),
        "query_start_loc": _qsl(lens),
    }


def gdn_problem(
    lens: list[int], Hk: int, Hv: int, Dk: int, Dv: int, pool: int, dtype: torch.dtype, seed: int
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    # q, k, v as views of one projection output, like the model's split of the conv output.
    mixed = torch.randn(T, 2 * Hk * Dk + Hv * Dv, generator=gen).to(dtype)
    q, k, v = torch.split(mixed, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    return {
        "q": q.reshape(T, Hk, Dk),
        "k": k.reshape(T, Hk, Dk),
        "v": v.reshape(T, Hv, Dv),
        "g": -torch.nn.functional.softplus(torch.randn(T, Hv, generator=gen)) * 0.5,
        "beta": torch.rand(T, Hv, generator=gen),
        "ssm_state": torch.randn(pool, Hv, Dk, Dv, generator=gen) * 0.3,
        "state_slots": _slots(len(lens), pool, gen),
        "query_start_loc": _qsl(lens),
        "max_query_len": max(lens, default=0),
    }


def attn_problem(
    lens: list[int],
    ctxs: list[int],
    Hq: int,
    Hkv: int,
    D: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
) -> dict[str, Any]:
    """ctxs[r]: tokens already cached before this step; seq_lens = ctxs + lens."""
    gen = torch.Generator().manual_seed(seed)
    R = len(lens)
    T = sum(lens)
    seq_lens = [c + n for c, n in zip(ctxs, lens, strict=True)]
    max_blocks = max(1, max(-(-s // block_size) for s in seq_lens)) + 1
    num_blocks = R * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=gen)
    return {
        "q": torch.randn(T, Hq, D, generator=gen).to(dtype),
        "k_cache": torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype),
        "v_cache": torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype),
        "block_tables": perm[: R * max_blocks].view(R, max_blocks).to(torch.int32),
        "query_start_loc": _qsl(lens),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "scale": D**-0.5,
        "max_query_len": max(lens, default=0),
        "max_seq_len": max(seq_lens, default=0),
    }


def _clone(p: dict[str, Any]) -> dict[str, Any]:
    """Copy of a problem whose in-place operands (state pools, caches) are cloned."""
    return {k: (v.clone() if k.endswith(("state", "cache")) else v) for k, v in p.items()}


# --------------------------------------------------------------------------------------------------------------------
# Independent yardsticks
# --------------------------------------------------------------------------------------------------------------------


def _hf(name: str) -> Any:
    """The plain-torch function ``name`` of transformers' Qwen3.5 module.

    ``inspect.unwrap`` strips transformers' hub/package dispatch: where fla-core or causal_conv1d is installed (the GPU
    machine), the decorated names call those packages' CUDA kernels instead of the torch code.
    """
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5

    return inspect.unwrap(getattr(modeling_qwen3_5, name))


def conv_yardstick(p: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' causal_conv1d_update, one row at a time (float32)."""
    conv_update = _hf("causal_conv1d_update")
    x, w, state = p["x"].float(), p["weight"].float(), p["conv_state"].float().clone()
    qsl = p["query_start_loc"].tolist()
    outs = []
    for r, slot in enumerate(p["state_slots"].tolist()):
        xs = x[qsl[r] : qsl[r + 1]]
        if xs.shape[0] == 0:
            continue
        st = state[slot : slot + 1].clone()
        outs.append(conv_update(xs.t()[None], st, w, None, "silu")[0].t())
        state[slot] = st[0]
    return torch.cat(outs) if outs else x.new_zeros((0, x.shape[1])), state


def gdn_yardstick(p: dict[str, Any], chunked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' torch_{chunk,recurrent}_gated_delta_rule, one row at a time, q/k repeat_interleaved."""
    fn = _hf("torch_chunk_gated_delta_rule" if chunked else "torch_recurrent_gated_delta_rule")
    q, k, v = p["q"].float(), p["k"].float(), p["v"].float()
    grp = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(grp, dim=1), k.repeat_interleave(grp, dim=1)
    state = p["ssm_state"].clone()
    qsl = p["query_start_loc"].tolist()
    outs = []
    for r, slot in enumerate(p["state_slots"].tolist()):
        a, b = qsl[r], qsl[r + 1]
        if a == b:
            continue
        o, final = fn(
            q[None, a:b], k[None, a:b], v[None, a:b], g=p["g"][None, a:b].float(), beta=p["beta"][None, a:b].float(),
            initial_state=state[slot : slot + 1], output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        outs.append(o[0])
        state[slot] = final[0]
    return torch.cat(outs) if outs else v.new_zeros((0, *v.shape[1:])), state


def attn_yardstick(p: dict[str, Any]) -> torch.Tensor:
    """Naive per-row, per-token attention with python-level page lookups (float32)."""
    q = p["q"].float()
    kc, vc, bt = p["k_cache"].float(), p["v_cache"].float(), p["block_tables"]
    bs = kc.shape[1]
    grp = q.shape[1] // kc.shape[2]
    qsl = p["query_start_loc"].tolist()
    out = torch.zeros_like(q)
    for r, seq_len in enumerate(p["seq_lens"].tolist()):
        n = qsl[r + 1] - qsl[r]
        keys = torch.stack([kc[int(bt[r, j // bs]), j % bs] for j in range(seq_len)]) if seq_len else None
        vals = torch.stack([vc[int(bt[r, j // bs]), j % bs] for j in range(seq_len)]) if seq_len else None
        for i in range(n):
            pos = seq_len - n + i
            for h in range(q.shape[1]):
                kk, vv = keys[: pos + 1, h // grp], vals[: pos + 1, h // grp]
                w = torch.softmax((kk @ q[qsl[r] + i, h]) * p["scale"], dim=0)
                out[qsl[r] + i, h] = w @ vv
    return out


# --------------------------------------------------------------------------------------------------------------------
# Reference tests (in process, CPU)
# --------------------------------------------------------------------------------------------------------------------

MIXED_LENS = [3, 0, 1, 9, 2, 1, 0]
DECODE_LENS = [1, 1, 0, 1, 1]


@pytest.mark.parametrize("lens", [MIXED_LENS, DECODE_LENS, [0, 0]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_reference_matches_transformers(lens: list[int], dtype: torch.dtype) -> None:
    p = conv_problem(lens, D=24, K=4, pool=11, dtype=dtype, seed=1)
    before = p["conv_state"].clone()
    want_out, want_state = conv_yardstick(p)
    out = causal_conv1d_varlen(p["x"], p["weight"], p["conv_state"], p["state_slots"], p["query_start_loc"])
    assert out.dtype == dtype and out.shape == p["x"].shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(p["conv_state"].float(), want_state, atol=0, rtol=0)
    _assert_untouched(before, p["conv_state"], _touched(p["state_slots"], lens))


def test_conv_reference_chunked_calls_match_one_shot() -> None:
    """A sequence fed over several calls (interleaved with other rows, fresh zero state) equals one causal_conv1d_fn."""
    gen = torch.Generator().manual_seed(2)
    D, K = 16, 4
    full = torch.randn(13, D, generator=gen)
    w = torch.randn(D, K, generator=gen)
    state = torch.zeros(5, D, K - 1)
    state[1] = torch.randn(D, K - 1, generator=gen)  # another request's slot
    outs = []
    for a, b in [(0, 5), (5, 6), (6, 6), (6, 13)]:
        other = torch.randn(2, D, generator=gen)
        x = torch.cat([other, full[a:b]])
        out = causal_conv1d_varlen(x, w, state, torch.tensor([1, 3]), _qsl([2, b - a]))
        outs.append(out[2:])
    want = _hf("causal_conv1d_fn")(full.t()[None], w, None, activation="silu")[0].t()
    torch.testing.assert_close(torch.cat(outs), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[3], full[-(K - 1) :].t(), atol=0, rtol=0)


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("lens", [MIXED_LENS, DECODE_LENS])
def test_gdn_reference_matches_transformers(chunked: bool, lens: list[int]) -> None:
    p = gdn_problem(lens, Hk=2, Hv=4, Dk=16, Dv=8, pool=10, dtype=torch.float32, seed=3)
    before = p["ssm_state"].clone()
    want_out, want_state = gdn_yardstick(p, chunked)
    out = gdn_forward(**p)
    assert out.shape == p["v"].shape and out.dtype == p["v"].dtype
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(p["ssm_state"], want_state, atol=2e-5, rtol=1e-4)
    _assert_untouched(before, p["ssm_state"], _touched(p["state_slots"], lens))


def test_gdn_reference_bf16_inputs() -> None:
    p = gdn_problem(MIXED_LENS, Hk=1, Hv=2, Dk=16, Dv=16, pool=9, dtype=torch.bfloat16, seed=4)
    want_out, want_state = gdn_yardstick(p, chunked=False)
    out = gdn_forward(**p)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(p["ssm_state"], want_state, atol=1e-5, rtol=1e-5)


def test_gdn_reference_empty_batch() -> None:
    p = gdn_problem([0, 0, 0], Hk=1, Hv=1, Dk=8, Dv=8, pool=4, dtype=torch.float32, seed=5)
    before = p["ssm_state"].clone()
    out = gdn_forward(**p)
    assert out.shape == (0, 1, 8)
    assert torch.equal(before, p["ssm_state"])


def test_store_kv_reference() -> None:
    gen = torch.Generator().manual_seed(6)
    k, v = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen)
    kc, vc = torch.randn(5, 4, 2, 8, generator=gen), torch.randn(5, 4, 2, 8, generator=gen)
    slot_mapping = torch.tensor([7, -1, 0, 19, -1, 9])
    want_k, want_v = kc.clone(), vc.clone()
    for t, s in enumerate(slot_mapping.tolist()):
        if s >= 0:
            want_k[s // 4, s % 4], want_v[s // 4, s % 4] = k[t], v[t]
    store_kv(k, v, kc, vc, slot_mapping)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


ATTN_CASES = [
    ([3, 0, 1, 7, 2], [5, 0, 10, 3, 0]),  # mixed prefill / decode / empty
    ([1, 1, 0, 1], [0, 17, 4, 40]),  # decode (first token of a fresh request too)
    ([12], [0]),  # plain prefill
]


@pytest.mark.parametrize(("lens", "ctxs"), ATTN_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_reference_matches_naive(lens: list[int], ctxs: list[int], dtype: torch.dtype) -> None:
    p = attn_problem(lens, ctxs, Hq=4, Hkv=2, D=8, block_size=4, dtype=dtype, seed=7)
    out = paged_attention(**p)
    assert out.dtype == dtype and out.shape == p["q"].shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), attn_yardstick(p), atol=tol, rtol=tol)


def test_paged_attention_reference_loose_host_bounds() -> None:
    """Host bounds larger than needed (as a captured graph would pass) change nothing."""
    p = attn_problem([3, 1, 0], [2, 9, 1], Hq=2, Hkv=1, D=8, block_size=4, dtype=torch.float32, seed=8)
    want = paged_attention(**p)
    loose = dict(p, max_query_len=p["max_query_len"] + 5, max_seq_len=p["max_seq_len"] + 7)
    torch.testing.assert_close(paged_attention(**loose), want, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (one subprocess)
# --------------------------------------------------------------------------------------------------------------------


def _conv_against_reference(p: dict[str, Any], lens: list[int], max_query_len: int | None) -> tuple[bool, str]:
    """The Triton conv on problem ``p`` (into a NaN-poisoned buffer) against the reference: outputs within a rounding,
    windows exact, slots no row names untouched."""
    from hyserve.kernels.conv import causal_conv1d_varlen_triton

    dtype = p["x"].dtype
    ref = _clone(p)
    want = causal_conv1d_varlen_ref(**ref)
    before = p["conv_state"].clone()
    out = torch.full(p["x"].shape, float("nan"), dtype=dtype)
    causal_conv1d_varlen_triton(**p, max_query_len=max_query_len, out=out)
    tol = 1e-5 if dtype == torch.float32 else 3.2e-2  # bf16: one ulp at |y| ~ 4
    ok1, e1 = _close(out, want, tol, tol)
    ok2, e2 = _close(p["conv_state"], ref["conv_state"], 0.0)
    _assert_untouched(before, p["conv_state"], _touched(p["state_slots"], lens))
    return ok1 and ok2, f"out err {e1:.3g}, state err {e2:.3g}"


def _interp_conv(lens: list[int], dtype: torch.dtype, max_query_len: int | None) -> tuple[bool, str]:
    return _conv_against_reference(conv_problem(lens, D=40, K=4, pool=9, dtype=dtype, seed=11), lens, max_query_len)


# Sabotaged prefill conv kernels (``hyserve/kernels/conv/_triton.py`` mutated in its source), each must disagree: the
# taps of a block inside a row read one token late; a row's first block reading its older taps from ``x`` (before the
# row) instead of the slot's window; a row's last, partial block skipped.
CONV_SABOTAGES = {
    "conv_inside_taps_late": [("base = x_ptr + (start + tb * BLOCK_T - (K - 1)) * sx_t",
                               "base = x_ptr + (start + tb * BLOCK_T - (K - 2)) * sx_t")],
    "conv_row_start_from_x": [("if tb * BLOCK_T >= K - 1:", "if tb * BLOCK_T >= 0:")],
    "conv_partial_block_skipped": [("if tb * BLOCK_T >= n:", "if tb * BLOCK_T + BLOCK_T > n:")],
}


def _interp_conv_long(dtype: torch.dtype, max_query_len: int | None, sabotage: str | None = None) -> tuple[bool, str]:
    """Prefill rows of several 32-token blocks (most of them read no window; the longest row's last partial) and 2
    channel blocks, the last partial, beside empty and one-token rows, against the reference; ``sabotage``: a mutated
    kernel, which must disagree."""
    _triton = importlib.import_module("hyserve.kernels.conv._triton")
    original = _triton._conv1d_fwd_kernel
    if sabotage is not None:
        _triton._conv1d_fwd_kernel = mutated_module(_triton.__name__, CONV_SABOTAGES[sabotage])._conv1d_fwd_kernel
    try:
        lens = [70, 0, 33, 1, 64, 2]
        ok, msg = _conv_against_reference(conv_problem(lens, D=160, K=4, pool=11, dtype=dtype, seed=12), lens,
                                          max_query_len)
    finally:
        _triton._conv1d_fwd_kernel = original
    return ok != (sabotage is not None), msg


# The split launches' rows: one of two 32-token blocks (the second partial, its taps inside the row), an empty row, a
# one-token row and a short one. The normed and two-part launches take one 16-channel block a program (one head of
# q or k), so their grid is D / 16 blocks a row and token block: two heads in the first part and 24 channels after it
# (the last block half full); the plain split launch's D = 160 is a 128-channel block and a partial one.
SPLIT_LENS, NORMED_D, NORMED_SPLIT = [40, 0, 1, 5], 56, 32


def _interp_conv_split_normed(dtype: torch.dtype, sabotage: bool = False) -> tuple[bool, str]:
    """The split launch with the first part l2-normed per head of 16 channels (GDN's q and k for fla): that part
    within a rounding of ``l2_norm_heads_ref`` over the unsplit output's channels, the second bit for bit; the CPU
    path (``causal_conv1d_split``) alike; ``sabotage``: the norm summed over tokens, not channels, caught."""
    from hyserve.kernels.conv import causal_conv1d_split, causal_conv1d_split_triton, causal_conv1d_varlen_triton
    from hyserve.kernels.norm.reference import l2_norm_heads_ref

    _triton = importlib.import_module("hyserve.kernels.conv._triton")
    p = conv_problem(SPLIT_LENS, D=NORMED_D, K=4, pool=11, dtype=dtype, seed=14)
    whole, cpu = _clone(p), _clone(p)
    mql, s = max(SPLIT_LENS), NORMED_SPLIT
    want = causal_conv1d_varlen_triton(**whole, max_query_len=mql)
    t = p["x"].shape[0]
    want_qk = l2_norm_heads_ref(want[:, :s].reshape(t, s // 16, 16)).reshape(t, s)
    original = _triton._conv1d_fwd_kernel
    if sabotage:
        edits = [("tl.sum(yr * yr, axis=1) + 1e-6))[:, None]", "tl.sum(yr * yr, axis=0) + 1e-6))[None, :]")]
        _triton._conv1d_fwd_kernel = mutated_module(_triton.__name__, edits)._conv1d_fwd_kernel
    try:
        a, b = causal_conv1d_split_triton(**p, split=s, max_query_len=mql, norm_dim=16)
    finally:
        _triton._conv1d_fwd_kernel = original
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: one unit in the last place of a unit vector's entries
    ok1, e1 = _close(a, want_qk, tol, tol)
    ok2 = torch.equal(b, want[:, s:]) and torch.equal(p["conv_state"], whole["conv_state"])
    ca, cb = causal_conv1d_split(**cpu, split=s, max_query_len=mql, norm_dim=16)
    ok3 = _close(ca, want_qk, tol, tol)[0] and _close(cb, want[:, s:], 3.2e-2, 3.2e-2)[0]
    return (ok1 and ok2 and ok3) != sabotage, f"normed part err {e1:.3g}, second part equal {ok2}, cpu {ok3}"


def _interp_conv_split_blocks(dtype: torch.dtype) -> tuple[bool, str]:
    """The split and normed launch at another token block and warp count (``conv_prefill_bench.py --sweep``'s
    choices): 8-token blocks (rows of 70 and 33 take several, the window rolled by the second launch) and 64-token
    ones, 2 and 8 warps: outputs and windows bit for bit the default launch's."""
    from hyserve.kernels.conv import causal_conv1d_split_triton

    p = conv_problem([70, 0, 33, 1, 5], D=300, K=4, pool=11, dtype=dtype, seed=16)
    base = _clone(p)
    want = causal_conv1d_split_triton(**base, split=128, max_query_len=70, norm_dim=16)
    msgs, goods = [], []
    for block_t, warps in ((8, 2), (64, 8)):
        q = _clone(p)
        got = causal_conv1d_split_triton(**q, split=128, max_query_len=70, norm_dim=16, block_t=block_t,
                                         num_warps=warps)
        same = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        goods.append(same and torch.equal(q["conv_state"], base["conv_state"]))
        msgs.append(f"block_t={block_t} warps={warps}: {goods[-1]}")
    return all(goods), ", ".join(msgs)


def _interp_conv_split_parts(dtype: torch.dtype, sabotage: bool = False) -> tuple[bool, str]:
    """The split launch writing its first part as two contiguous halves (``parts=2``: GDN's q and k apart, as fla
    reads them), normed per 16-channel head and not: each half bit for bit its channels of the one-part launch,
    nothing written outside them (NaN-poisoned), the windows alike; the CPU path's layout the same.
    ``sabotage``: the part stride ignored (both halves written over the first), which must disagree."""
    from hyserve.kernels.conv import causal_conv1d_split, causal_conv1d_split_triton

    _triton = importlib.import_module("hyserve.kernels.conv._triton")
    p = conv_problem(SPLIT_LENS, D=NORMED_D, K=4, pool=11, dtype=dtype, seed=17)
    t = p["x"].shape[0]
    mql, s = max(SPLIT_LENS), NORMED_SPLIT
    goods, msgs = [], []
    original = _triton._conv1d_fwd_kernel
    if sabotage:
        edits = [("base = out_ptr + part.to(tl.int64) * so_p", "base = out_ptr + part.to(tl.int64) * 0")]
        _triton._conv1d_fwd_kernel = mutated_module(_triton.__name__, edits)._conv1d_fwd_kernel
    try:
        for norm_dim in (None, 16):
            one, two = _clone(p), _clone(p)
            a1, b1 = causal_conv1d_split_triton(**one, split=s, max_query_len=mql, norm_dim=norm_dim)
            outs = (torch.full((2, t, s // 2), float("nan"), dtype=dtype),
                    torch.full((t, NORMED_D - s), float("nan"), dtype=dtype))
            a2, b2 = causal_conv1d_split_triton(**two, split=s, max_query_len=mql, norm_dim=norm_dim, outs=outs,
                                                parts=2)
            cpu = causal_conv1d_split(**_clone(p), split=s, max_query_len=mql, norm_dim=norm_dim, parts=2)[0]
            same = (torch.equal(a2[0], a1[:, : s // 2]) and torch.equal(a2[1], a1[:, s // 2 :]) and torch.equal(b2, b1)
                    and torch.equal(one["conv_state"], two["conv_state"]))
            layout = cpu.shape == a2.shape and cpu.is_contiguous() and a2[0].is_contiguous()
            goods.append(same and layout)
            msgs.append(f"norm {norm_dim}: same {same}, layout {layout}")
    finally:
        _triton._conv1d_fwd_kernel = original
    return all(goods) != sabotage, ", ".join(msgs)


def _interp_gdn_qk_normed(sabotage: bool = False) -> tuple[bool, str]:
    """The recurrent kernel given q and k l2-normed already (``qk_normed``, the chunked path's snapshots): as the
    kernel norming raw ones, float32; ``sabotage``: raw q and k passed as normed, which must disagree."""
    from hyserve.kernels.gdn import gdn_recurrent_triton
    from hyserve.kernels.norm.reference import l2_norm_heads_ref

    p = gdn_problem([3, 0, 1, 2], Hk=2, Hv=4, Dk=16, Dv=32, pool=9, dtype=torch.float32, seed=15)  # 6 tokens
    normed = _clone(p)
    if not sabotage:
        normed["q"], normed["k"] = l2_norm_heads_ref(p["q"]), l2_norm_heads_ref(p["k"])
    args = {k: v for k, v in p.items() if k != "max_query_len"}
    want = gdn_recurrent_triton(**args)
    got = gdn_recurrent_triton(**{k: v for k, v in normed.items() if k != "max_query_len"}, qk_normed=True)
    ok1, e1 = _close(got, want, 1e-5, 1e-5)
    ok2, e2 = _close(normed["ssm_state"], p["ssm_state"], 1e-5, 1e-5)
    return (ok1 and ok2) != sabotage, f"out err {e1:.3g}, state err {e2:.3g}"


def _interp_conv_split(dtype: torch.dtype, split: int, sabotage: bool = False) -> tuple[bool, str]:
    """The output split in two at channel ``split`` (GDN's [q | k] and v): each part bit for bit the unsplit launch's
    channels, the second contiguous, the windows rolled alike, nothing written outside the parts (NaN-poisoned
    buffers); ``sabotage``: the second part's columns shifted by one, which must disagree."""
    from hyserve.kernels.conv import causal_conv1d_split_triton, causal_conv1d_varlen_triton

    _triton = importlib.import_module("hyserve.kernels.conv._triton")
    p = conv_problem(SPLIT_LENS, D=160, K=4, pool=11, dtype=dtype, seed=13)
    whole = _clone(p)
    want = causal_conv1d_varlen_triton(**whole, max_query_len=max(SPLIT_LENS))
    t = p["x"].shape[0]
    outs = (torch.full((t, split), float("nan"), dtype=dtype), torch.full((t, 160 - split), float("nan"), dtype=dtype))
    original = _triton._conv1d_fwd_kernel
    if sabotage:
        edits = [("(offs_d - SPLIT)[None, :]", "(offs_d - SPLIT + 1)[None, :]")]
        _triton._conv1d_fwd_kernel = mutated_module(_triton.__name__, edits)._conv1d_fwd_kernel
    try:
        a, b = causal_conv1d_split_triton(**p, split=split, max_query_len=max(SPLIT_LENS), outs=outs)
    finally:
        _triton._conv1d_fwd_kernel = original
    ok = (a is outs[0] and b.is_contiguous() and torch.equal(a, want[:, :split]) and torch.equal(b, want[:, split:])
          and torch.equal(p["conv_state"], whole["conv_state"]))
    return ok != sabotage, f"split {split}: parts equal {ok}"


def _interp_gdn(lens: list[int], dtype: torch.dtype, state_dtype: torch.dtype = torch.float32) -> tuple[bool, str]:
    """The recurrent kernel against the reference; ``state_dtype``: the pool stored in a 16-bit float
    (``--mamba-ssm-cache-dtype``; both sides compute in float32 and round the final state once)."""
    from hyserve.kernels.gdn import gdn_recurrent_triton

    p = gdn_problem(lens, Hk=2, Hv=4, Dk=16, Dv=32, pool=9, dtype=dtype, seed=12)
    p["ssm_state"] = p["ssm_state"].to(state_dtype)
    ref = _clone(p)
    want = gdn_forward_ref(**ref)
    before = p["ssm_state"].clone()
    out = torch.full(p["v"].shape, float("nan"), dtype=dtype)
    args = {k: v for k, v in p.items() if k != "max_query_len"}
    gdn_recurrent_triton(**args, out=out)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    ok1, e1 = _close(out, want, tol, tol)
    stol = 1e-5 if state_dtype == torch.float32 else 1.6e-2  # one ulp of a 16-bit state
    ok2, e2 = _close(p["ssm_state"], ref["ssm_state"], stol, stol)
    _assert_untouched(before, p["ssm_state"], _touched(p["state_slots"], lens))
    return ok1 and ok2 and p["ssm_state"].dtype == state_dtype, f"out err {e1:.3g}, state err {e2:.3g}"


def _interp_attn(
    lens: list[int], ctxs: list[int], dtype: torch.dtype, block_size: int, partition: int | None, D: int = 16
) -> tuple[bool, str]:
    from hyserve.kernels.attention import paged_attention_triton

    p = attn_problem(lens, ctxs, Hq=4, Hkv=2, D=D, block_size=block_size, dtype=dtype, seed=13)
    want = paged_attention_ref(**p)
    caches = (p["k_cache"].clone(), p["v_cache"].clone())
    out = torch.full(p["q"].shape, float("nan"), dtype=dtype)
    paged_attention_triton(**p, decode_partition=partition, out=out)
    assert torch.equal(caches[0], p["k_cache"]) and torch.equal(caches[1], p["v_cache"])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ok, err = _close(out, want, tol, tol)
    return ok, f"out err {err:.3g}"


def _interp_store_kv(dtype: torch.dtype) -> tuple[bool, str]:
    from hyserve.kernels.attention import store_kv_triton

    gen = torch.Generator().manual_seed(14)
    k, v = torch.randn(7, 2, 12, generator=gen).to(dtype), torch.randn(7, 2, 12, generator=gen).to(dtype)
    kc, vc = torch.randn(6, 4, 2, 12, generator=gen).to(dtype), torch.randn(6, 4, 2, 12, generator=gen).to(dtype)
    slot_mapping = torch.tensor([5, -1, 0, 23, -1, 9, 10])
    want_k, want_v = kc.clone(), vc.clone()
    store_kv_ref(k, v, want_k, want_v, slot_mapping)
    store_kv_triton(k, v, kc, vc, slot_mapping)
    return torch.equal(kc, want_k) and torch.equal(vc, want_v), "bit-exact"


def _interp_norm(dtype: torch.dtype, lead: tuple[int, ...], d: int, gated: bool) -> tuple[bool, str]:
    """Both norms against their torch references; the input is a strided view (rows wider than D). With heads
    (``lead`` of two), the gate is a strided ``(T, H, D)`` view of wider rows, as GDN's z is of the input projection's
    output, and is read in place (no copy)."""
    from hyserve.kernels.norm import gated_rms_norm_ref, gated_rms_norm_triton, rms_norm_ref, rms_norm_triton

    gen = torch.Generator().manual_seed(15 + d)
    wide = (torch.randn(*lead, d + 8, generator=gen) * 3).to(dtype)
    x = wide[..., 4 : 4 + d]  # last stride 1, row stride d + 8
    gate = (torch.randn(*lead, d, generator=gen) * 2).to(dtype)
    if len(lead) == 2:
        t, h = lead
        gate = (torch.randn(t, h * d + 5, generator=gen) * 2).to(dtype)[:, 2 : 2 + h * d].view(t, h, d)
        assert gate.stride() == (h * d + 5, d, 1)
    w = (torch.randn(d, generator=gen) * 0.5).to(dtype)
    if gated:
        got, want = gated_rms_norm_triton(x, gate, w, 1e-6), gated_rms_norm_ref(x, gate, w, 1e-6)
    else:
        got, want = rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16: a float32 sum in another order moves one rounding
    return _close(got, want, tol, tol)[0], f"err {_close(got, want, tol, tol)[1]:.3g}"


def _interp_gating(dtype: torch.dtype) -> tuple[bool, str]:
    """GDN gates against the reference, over the softplus regimes (large negative, around 0, past the threshold)."""
    from hyserve.kernels.gating import gdn_gating_ref, gdn_gating_triton

    gen = torch.Generator().manual_seed(16)
    t, h = 70, 12
    a = (torch.randn(t, h, generator=gen) * 12).to(dtype)
    a[0, :4] = torch.tensor([-40.0, 25.0, 0.0, -90.0]).to(dtype)
    wide = (torch.randn(t, h + 5, generator=gen) * 4).to(dtype)
    b = wide[:, 2 : 2 + h]  # strided rows
    a_log = torch.empty(h).uniform_(0.5, 8.0, generator=gen).log().to(dtype)
    dt_bias = (torch.randn(h, generator=gen) * 0.5).to(dtype)
    g, beta = gdn_gating_triton(a, b, a_log, dt_bias)
    g_ref, beta_ref = gdn_gating_ref(a, b, a_log, dt_bias)
    ok1, e1 = _close(g, g_ref, 1e-6, 1e-5)
    ok2, e2 = _close(beta, beta_ref, 1e-6, 1e-6)
    return ok1 and ok2 and g.dtype == beta.dtype == torch.float32, f"g err {e1:.3g}, beta err {e2:.3g}"


def _interp_bitmask(dtype: torch.dtype, sabotage: bool = False) -> tuple[bool, str]:
    """Structured output's token masks on non-identity rows (a verify row's positions and single rows), a vocabulary
    that is not a multiple of 32 nor of the block: bit-exact against the reference, the other rows untouched. With
    ``sabotage`` the reference reads the words one bit off, and must disagree."""
    from hyserve.kernels.bitmask import apply_token_bitmask_ref, apply_token_bitmask_triton

    gen = torch.Generator().manual_seed(31)
    n_rows, vocab = 9, 1300
    logits = torch.randn(n_rows, vocab, generator=gen).to(dtype)
    rows = torch.tensor([6, 2, 3, 4, 0], dtype=torch.long)
    words = torch.randint(-(2**31), 2**31 - 1, (5, (vocab + 31) // 32), generator=gen, dtype=torch.int64)
    words = words.to(torch.int32)
    words[1] = -1  # everything allowed
    words[2] = 0  # nothing allowed
    got, want = logits.clone(), logits.clone()
    apply_token_bitmask_triton(got, rows, words)
    apply_token_bitmask_ref(want, rows, (words << 1) if sabotage else words)
    same = torch.equal(got, want)
    masked = int(torch.isinf(got).sum())
    return same != sabotage and 0 < masked < 5 * vocab, f"equal {same}, {masked} entries masked"


def _interp_rope(dtype: torch.dtype, d: int, r2: int) -> tuple[bool, str]:
    """Partial rotary on a strided (T, H, D) view against the reference; bit-exact (the roundings are replayed)."""
    from hyserve.kernels.rope import apply_rope_ref, apply_rope_triton

    gen = torch.Generator().manual_seed(17 + d)
    t, h = 21, 3
    wide = (torch.randn(t, h, d + 4, generator=gen) * 2).to(dtype)
    x = wide[..., 2 : 2 + d]
    pos = torch.randint(0, 30000, (t,), generator=gen).float()
    freqs = pos[:, None] / (10000.0 ** (torch.arange(0, 2 * r2, 2).float() / (2 * r2)))[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    got, want = apply_rope_triton(x, cos, sin), apply_rope_ref(x, cos, sin)
    tol = 2e-6 if dtype == torch.float32 else 0.0
    ok, err = _close(got, want, tol, tol)
    return ok and got.dtype == dtype, f"err {err:.3g}"


def _interp_add_norm_silu(dtype: torch.dtype, d: int) -> tuple[bool, str]:
    """The residual add + RMSNorm and SwiGLU's silu * up against their references, on strided rows."""
    from hyserve.kernels.norm import add_rms_norm_ref, add_rms_norm_triton, silu_mul_ref, silu_mul_triton

    gen = torch.Generator().manual_seed(18 + d)
    wide = (torch.randn(13, d + 6, generator=gen) * 3).to(dtype)
    x, delta = wide[:, :d], (torch.randn(13, d, generator=gen) * 2).to(dtype)
    w = (torch.randn(d, generator=gen) * 0.5).to(dtype)
    (res, out), (res_ref, out_ref) = add_rms_norm_triton(x, delta, w, 1e-6), add_rms_norm_ref(x, delta, w, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 0.0
    ok1, e1 = _close(res, res_ref, 0.0)
    ok2, e2 = _close(out, out_ref, tol, tol)
    g, u = wide[:, 3 : 3 + d], (torch.randn(13, d, generator=gen) * 2).to(dtype)
    # bf16: silu's exp may differ from torch's by an ulp in float32, which can move one bf16 rounding
    ok3, e3 = _close(silu_mul_triton(g, u), silu_mul_ref(g, u), tol or 1e-6, 1e-5 if dtype == torch.float32 else 8e-3)
    return ok1 and ok2 and ok3, f"res err {e1:.3g}, norm err {e2:.3g}, silu*up err {e3:.3g}"


def _interp_l2norm(dtype: torch.dtype) -> tuple[bool, str]:
    """The gated delta rule's q/k l2 norm on a strided (T, H, D) view (a split of [q | k | v]) against the
    reference; the output is contiguous."""
    from hyserve.kernels.norm import l2_norm_heads_ref, l2_norm_heads_triton

    gen = torch.Generator().manual_seed(19)
    t, h, d = 11, 3, 24
    wide = (torch.randn(t, 2 * h * d + 5, generator=gen) * 3).to(dtype)
    x = wide[:, h * d : 2 * h * d].view(t, h, d)  # row stride 2hd + 5, head stride d
    got, want = l2_norm_heads_triton(x, 1e-6), l2_norm_heads_ref(x, 1e-6)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    ok, err = _close(got, want, tol, tol)
    return ok and got.is_contiguous() and got.dtype == dtype, f"err {err:.3g}"


def _interp_fp8_quant(dtype: torch.dtype, mode: str) -> tuple[bool, str]:
    """One-launch activation quantization (per token over several column blocks, per 128-group with a partial last
    group, static) against the torch reference: the same FP8 bytes and scales, bit for bit."""
    from hyserve.kernels import fp8

    gen = torch.Generator().manual_seed(23)
    x = (torch.randn(6, 2100, generator=gen) * 5).to(dtype)
    x[2] = 0  # an all-zero token takes the eps scale
    x[3, 7] = 900.0  # beyond e4m3's range once scaled by a static scale
    if mode == "token":
        (q, s), (qr, sr) = fp8.quantize_rows(x), fp8.quantize_per_token(x)
    elif mode == "token_block256":  # nine 256-column passes a row, two warps (a choice the benchmark sweeps)
        (q, s), (qr, sr) = fp8.quantize_rows(x, launch=(256, 2)), fp8.quantize_per_token(x)
    elif mode == "group":
        (q, s), (qr, sr) = fp8.quantize_rows(x, group=128), fp8.quantize_per_token_group(x, 128)
    elif mode == "group_token_major":  # torch._scaled_mm's 1x128 layout: tokens fastest, columns M apart
        (q, s) = fp8.quantize_rows(x, group=128, token_major_scales=True)
        qr, sr = fp8.quantize_per_token_group(x, 128)
        if s.stride() != (1, 6) or s.shape != sr.shape:
            return False, f"scales {tuple(s.shape)} strides {s.stride()}"
    else:
        static = torch.tensor([0.5])
        (q, s), sr = fp8.quantize_rows(x, static_scale=static), static.reshape(1, 1)
        qr = fp8.quantize_fp8(x, sr)
    same = torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
    return same, f"bytes differing {int((q.view(torch.uint8) != qr.view(torch.uint8)).sum())}"


def _interp_fp8_gemm(m: int, n: int, k: int, block: bool, group: bool, split: int | None,
                     sabotage: bool = False) -> tuple[bool, str]:
    """The FP8 GEMM (channel or 128x128 block scales; token or token-group activation scales; split K) against the
    dequantize-and-matmul reference. ``sabotage``: the group scales replaced by each token's first one, which the
    comparison must catch (the check passes when it does)."""
    from hyserve.kernels import fp8

    gen = torch.Generator().manual_seed(29 + m + n)
    x = torch.randn(m, k, generator=gen) * torch.linspace(0.1, 8, k)  # group amaxes differ across K
    w = torch.randn(n, k, generator=gen) / k**0.5
    ws = w.abs().amax(1, keepdim=True) / 448
    wq = (w / ws).clamp(-448, 448).to(fp8.FP8_DTYPE)
    if block:
        scale = torch.rand(-(-n // 128), -(-k // 128), generator=gen) / 448 + 1e-3
        q, qs = fp8.quantize_per_token_group(x, 128) if group else fp8.quantize_per_token(x)
        want = fp8.fp8_block_linear_ref(x, wq, scale, (128, 128), 128 if group else None)
    else:
        scale = ws
        q, qs = fp8.quantize_per_token(x)
        want = fp8.fp8_linear_ref(x, wq, scale)
    if sabotage:
        qs = qs[:, :1].expand(m, qs.shape[1]).contiguous()
    cfg = None if split is None else fp8.GemmConfig(16, 32, 128, split, 2, 4, 2)
    got = fp8.triton_fp8_gemm(q, qs, wq, scale, (128, 128) if block else None, torch.float32, cfg)
    ok, err = _close(got, want, 1e-4, 1e-4)
    return ok != sabotage, f"err {err:.3g}"


def _interp_fp8_split_locks(stale: bool) -> tuple[bool, str]:
    """Split K reduced by the last program of each tile: two launches in a row (the locks back at zero after each),
    four splits of five K tiles (one split empty), against the reference. ``stale``: the locks left at 1 before the
    launch (a reset that did not happen): a tile is written one partial short, which the comparison must catch."""
    from hyserve.kernels import fp8

    gen = torch.Generator().manual_seed(31)
    m, n, k = 2, 72, 520
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    ws = w.abs().amax(1, keepdim=True) / 448
    wq = (w / ws).clamp(-448, 448).to(fp8.FP8_DTYPE)
    q, qs = fp8.quantize_per_token(x)
    want = fp8.fp8_linear_ref(x, wq, ws)
    locks = fp8.split_locks(x.device)
    if stale:
        locks.fill_(1)
    cfg = fp8.GemmConfig(16, 32, 128, 4, 2, 4, 2)
    errs = []
    for _ in range(2):
        got = fp8.triton_fp8_gemm(q, qs, wq, ws, None, torch.float32, cfg)
        errs.append(_close(got, want, 1e-4, 1e-4))
    zeroed = int(locks.count_nonzero()) == 0
    locks.zero_()
    ok = all(e[0] for e in errs) and zeroed
    return ok != stale, f"errs {[round(e[1], 4) for e in errs]}, locks zero after: {zeroed}"


def _interp_fp8_gemm_fused(m: int, n: int, k: int, block: bool, mode: str, split: int | None,
                           reference_mode: str | None = None) -> tuple[bool, str]:
    """The GEMM quantizing its unquantized bf16 activation itself (``mode``: token, group or static) against the
    reference of ``reference_mode`` (default: the same). A different reference mode must be told apart (the check
    passes when the comparison fails), so a GEMM quantizing at the wrong granularity is caught."""
    from hyserve.kernels import fp8

    gen = torch.Generator().manual_seed(31 + m + k)
    x = (torch.randn(m, k, generator=gen) * torch.linspace(0.1, 8, k)).bfloat16()
    x[0, 3] = 600.0  # past the static scale's range: clamped
    w = torch.randn(n, k, generator=gen) / k**0.5
    ws = w.abs().amax(1, keepdim=True) / 448
    wq = (w / ws).clamp(-448, 448).to(fp8.FP8_DTYPE)
    static = torch.tensor([0.05])
    ref_mode = reference_mode or mode
    if block:
        scale = torch.rand(-(-n // 128), -(-k // 128), generator=gen) / 448 + 1e-3
        want = fp8.fp8_block_linear_ref(x.float(), wq, scale, (128, 128), 128 if ref_mode == "group" else None)
    else:  # the reference on the same values in float32, so that its output is not rounded to bf16
        scale = ws
        want = fp8.fp8_linear_ref(x.float(), wq, scale, static if ref_mode == "static" else None)
    cfg = None if split is None else fp8.GemmConfig(16, 32, 128, split, 2, 4, 2)
    got = fp8.triton_fp8_gemm(x, static if mode == "static" else None, wq, scale, (128, 128) if block else None,
                              torch.float32, cfg, quantize=mode)
    ok, err = _close(got, want.float(), 1e-4, 1e-4)
    return ok == (ref_mode == mode), f"err {err:.3g}"


def run_interpreter_checks(names: list[str]) -> dict[str, list[Any]]:
    """Run the checks ``names`` (one of the two groups) under the interpreter; returns {name: [ok, message]}. Needs
    TRITON_INTERPRET=1."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_triton_interpreter()
    res: dict[str, list[Any]] = {}

    def check(name: str, fn: Callable[[], tuple[bool, str]]) -> None:
        if name in names:
            record_check(res, name, fn)

    f32, bf16 = torch.float32, torch.bfloat16
    long_lens = [3, 0, 1, 37, 2, 1]  # 37 > the 16-token block: separate state kernel
    for dt in (f32, bf16):
        n = str(dt).split(".")[-1]
        check(f"conv_mixed_{n}", lambda dt=dt: _interp_conv(long_lens, dt, 37))
        check(f"conv_fused_{n}", lambda dt=dt: _interp_conv([3, 0, 1, 5, 2], dt, 5))
        check(f"conv_decode_{n}", lambda dt=dt: _interp_conv(DECODE_LENS, dt, 1))
        check(f"conv_long_{n}", lambda dt=dt: _interp_conv_long(dt, 70))
        check(f"gdn_decode_{n}", lambda dt=dt: _interp_gdn(DECODE_LENS, dt))
        check(f"gdn_mixed_{n}", lambda dt=dt: _interp_gdn(MIXED_LENS, dt))
        check(f"attn_decode_1split_{n}", lambda dt=dt: _interp_attn([1, 1, 0, 1], [0, 17, 4, 40], dt, 4, None))
        check(f"attn_decode_splits_{n}", lambda dt=dt: _interp_attn([1, 1, 0, 1], [0, 17, 4, 60], dt, 4, 16))
        check(f"attn_prefill_{n}", lambda dt=dt: _interp_attn([3, 0, 1, 20, 2], [5, 0, 10, 3, 0], dt, 4, None))
        check(f"store_kv_{n}", lambda dt=dt: _interp_store_kv(dt))
        check(f"gdn_gating_{n}", lambda dt=dt: _interp_gating(dt))
        check(f"token_bitmask_{n}", lambda dt=dt: _interp_bitmask(dt))
        check(f"add_norm_silu_{n}", lambda dt=dt: _interp_add_norm_silu(dt, 40))
        check(f"add_norm_silu_wide_{n}", lambda dt=dt: _interp_add_norm_silu(dt, 2100))
        check(f"rope_partial_{n}", lambda dt=dt: _interp_rope(dt, 24, 6))
        check(f"rope_full_{n}", lambda dt=dt: _interp_rope(dt, 16, 8))
        check(f"l2_norm_heads_{n}", lambda dt=dt: _interp_l2norm(dt))
        for gated in (False, True):
            g = "gated_" if gated else ""
            check(f"{g}rms_norm_heads_{n}", lambda dt=dt, gated=gated: _interp_norm(dt, (37, 3), 40, gated))
            check(f"{g}rms_norm_hidden_{n}", lambda dt=dt, gated=gated: _interp_norm(dt, (3,), 2048, gated))
    check("gdn_mixed_bf16_state", lambda: _interp_gdn(MIXED_LENS, bf16, bf16))
    check("conv_long_grid_of_all_tokens", lambda: _interp_conv_long(f32, None))
    check("conv_split_128_bfloat16", lambda: _interp_conv_split(bf16, 128))
    check("conv_split_64_float32", lambda: _interp_conv_split(f32, 64))
    check("conv_split_shifted_caught", lambda: _interp_conv_split(f32, 128, sabotage=True))
    check("conv_split_normed_float32", lambda: _interp_conv_split_normed(f32))
    check("conv_split_normed_bfloat16", lambda: _interp_conv_split_normed(bf16))
    check("conv_split_other_blocks_bfloat16", lambda: _interp_conv_split_blocks(bf16))
    check("conv_split_parts_float32", lambda: _interp_conv_split_parts(f32))
    check("conv_split_parts_bfloat16", lambda: _interp_conv_split_parts(bf16))
    check("conv_split_parts_stride_ignored_caught", lambda: _interp_conv_split_parts(bf16, sabotage=True))
    check("conv_split_normed_over_tokens_caught", lambda: _interp_conv_split_normed(f32, sabotage=True))
    check("gdn_qk_normed", lambda: _interp_gdn_qk_normed())
    check("gdn_raw_qk_as_normed_caught", lambda: _interp_gdn_qk_normed(sabotage=True))
    for what in CONV_SABOTAGES:
        check(f"{what}_caught", lambda w=what: _interp_conv_long(f32, 70, w))
    for dt in (f32, bf16):
        for mode in ("token", "token_block256", "group", "group_token_major", "static"):
            name = f"fp8_quant_{mode}_{str(dt).split('.')[-1]}"
            check(name, lambda dt=dt, mode=mode: _interp_fp8_quant(dt, mode))
    # M = 1 / 5 (decode tiles, split K) and 70 (prefill tiles); K and N not multiples of the tiles.
    check("fp8_gemm_channel_decode", lambda: _interp_fp8_gemm(5, 200, 300, False, False, None))
    check("fp8_gemm_channel_split3", lambda: _interp_fp8_gemm(1, 72, 520, False, False, 3))
    check("fp8_gemm_channel_prefill", lambda: _interp_fp8_gemm(70, 136, 264, False, False, None))
    check("fp8_gemm_block_groups", lambda: _interp_fp8_gemm(5, 300, 400, True, True, None))
    check("fp8_gemm_block_groups_split2", lambda: _interp_fp8_gemm(3, 260, 520, True, True, 2))
    check("fp8_gemm_block_tokens", lambda: _interp_fp8_gemm(70, 136, 264, True, False, None))
    check("fp8_gemm_block_sabotaged_groups_caught", lambda: _interp_fp8_gemm(5, 300, 400, True, True, None, True))
    check("token_bitmask_shifted_caught", lambda: _interp_bitmask(f32, sabotage=True))
    check("fp8_split_locks", lambda: _interp_fp8_split_locks(False))
    check("fp8_split_stale_locks_caught", lambda: _interp_fp8_split_locks(True))
    # The GEMM quantizing its activation: per token over several K tiles (split too), static, per group.
    check("fp8_fused_token", lambda: _interp_fp8_gemm_fused(5, 200, 300, False, "token", None))
    check("fp8_fused_token_split3", lambda: _interp_fp8_gemm_fused(3, 72, 520, False, "token", 3))
    check("fp8_fused_static", lambda: _interp_fp8_gemm_fused(4, 136, 264, False, "static", None))
    check("fp8_fused_block_group", lambda: _interp_fp8_gemm_fused(5, 300, 400, True, "group", 2))
    check("fp8_fused_block_token", lambda: _interp_fp8_gemm_fused(6, 260, 520, True, "token", None))
    check("fp8_fused_group_for_token_caught",
          lambda: _interp_fp8_gemm_fused(6, 260, 520, True, "group", None, reference_mode="token"))
    # Odd shapes: head dim not a power of two, block size 16, a prefill row spanning several query blocks.
    check("attn_prefill_d12_bs16", lambda: _interp_attn([40, 1, 0], [0, 30, 2], f32, 16, None, D=12))
    check("attn_decode_d12_bs16", lambda: _interp_attn([1, 1], [33, 0], f32, 16, 16, D=12))
    return res


_PER_DTYPE = ("conv_mixed conv_fused conv_decode conv_long gdn_decode gdn_mixed attn_decode_1split attn_decode_splits "
              "attn_prefill")
INTERP_CHECKS = [f"{name}_{dt}" for dt in ("float32", "bfloat16") for name in (*_PER_DTYPE.split(), "store_kv")]
INTERP_CHECKS += ["attn_prefill_d12_bs16", "attn_decode_d12_bs16", "gdn_mixed_bf16_state"]
INTERP_CHECKS += ["conv_long_grid_of_all_tokens", *(f"{what}_caught" for what in CONV_SABOTAGES)]
INTERP_CHECKS += ["conv_split_128_bfloat16", "conv_split_64_float32", "conv_split_shifted_caught"]
INTERP_CHECKS += ["conv_split_normed_float32", "conv_split_normed_bfloat16", "conv_split_other_blocks_bfloat16",
                  "conv_split_parts_float32", "conv_split_parts_bfloat16", "conv_split_parts_stride_ignored_caught",
                  "conv_split_normed_over_tokens_caught",
                  "gdn_qk_normed", "gdn_raw_qk_as_normed_caught"]
INTERP_CHECKS += [f"{g}rms_norm_{s}_{dt}" for g in ("", "gated_") for s in ("heads", "hidden")
                  for dt in ("float32", "bfloat16")]
INTERP_CHECKS += ["gdn_gating_float32", "gdn_gating_bfloat16"]
INTERP_CHECKS += ["token_bitmask_float32", "token_bitmask_bfloat16", "token_bitmask_shifted_caught"]
INTERP_CHECKS += [f"add_norm_silu{w}_{dt}" for w in ("", "_wide") for dt in ("float32", "bfloat16")]
INTERP_CHECKS += [f"rope_{k}_{dt}" for k in ("partial", "full") for dt in ("float32", "bfloat16")]
INTERP_CHECKS += [f"l2_norm_heads_{dt}" for dt in ("float32", "bfloat16")]
INTERP_CHECKS += [f"fp8_quant_{m}_{dt}"
                  for m in ("token", "token_block256", "group", "group_token_major", "static")
                  for dt in ("float32", "bfloat16")]
INTERP_CHECKS += [f"fp8_gemm_{c}" for c in ("channel_decode", "channel_split3", "channel_prefill", "block_groups",
                                            "block_groups_split2", "block_tokens", "block_sabotaged_groups_caught")]
INTERP_CHECKS += [f"fp8_fused_{c}" for c in ("token", "token_split3", "static", "block_group", "block_token",
                                             "group_for_token_caught")]
INTERP_CHECKS += ["fp8_split_locks", "fp8_split_stale_locks_caught"]
# The slow group (scripts/test.sh -m slow; the default suite's budget): the split conv's other token blocks and warps
# (10 s), its two-part output in bf16 and the part stride ignored (6-7 s each; parts in float32 stays), its normed
# first part in bf16 and the norm summed over tokens (about 3 s each; normed in float32 stays), the long prefill rows
# in bf16 (float32 and its three sabotages stay).
SLOW_INTERP_CHECKS = ["conv_split_other_blocks_bfloat16", "conv_split_parts_bfloat16",
                      "conv_split_parts_stride_ignored_caught", "conv_split_normed_bfloat16",
                      "conv_split_normed_over_tokens_caught", "conv_long_bfloat16"]
DEFAULT_INTERP_CHECKS = [name for name in INTERP_CHECKS if name not in SLOW_INTERP_CHECKS]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, list[Any]]:
    pytest.importorskip("triton")
    return interpreter_subprocess_results(__file__, "--interpreter-checks")


@pytest.fixture(scope="module")
def slow_interpreter_results() -> dict[str, list[Any]]:
    pytest.importorskip("triton")
    return interpreter_subprocess_results(__file__, "--interpreter-checks-slow")


def test_the_two_groups_hold_every_check_once() -> None:
    assert sorted(DEFAULT_INTERP_CHECKS + SLOW_INTERP_CHECKS) == sorted(INTERP_CHECKS)
    assert not set(DEFAULT_INTERP_CHECKS) & set(SLOW_INTERP_CHECKS)


def test_every_check_ran(interpreter_results: dict[str, list[Any]]) -> None:
    assert sorted(interpreter_results) == sorted(DEFAULT_INTERP_CHECKS)


@pytest.mark.parametrize("name", DEFAULT_INTERP_CHECKS)
def test_triton_kernel_interpreter(interpreter_results: dict[str, list[Any]], name: str) -> None:
    ok, msg = interpreter_results[name]
    assert ok, f"{name}: {msg}"


@pytest.mark.slow  # about 30 s under the interpreter
def test_every_slow_check_ran(slow_interpreter_results: dict[str, list[Any]]) -> None:
    assert sorted(slow_interpreter_results) == sorted(SLOW_INTERP_CHECKS)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_INTERP_CHECKS)
def test_triton_kernel_interpreter_slow(slow_interpreter_results: dict[str, list[Any]], name: str) -> None:
    ok, msg = slow_interpreter_results[name]
    assert ok, f"{name}: {msg}"


# --------------------------------------------------------------------------------------------------------------------
# CUDA dispatch (GPU machines only)
# --------------------------------------------------------------------------------------------------------------------


def to_device(p: dict[str, Any], device: str) -> dict[str, Any]:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in p.items()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_norms_gating_rope_match_reference() -> None:
    from hyserve.kernels.norm import gated_rms_norm, gated_rms_norm_ref, rms_norm, rms_norm_ref

    gen = torch.Generator().manual_seed(25)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)):
        for shape in ((1, 2048), (37, 16, 128), (5, 2, 256), (300, 2048), (3, 5120)):
            x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
            gate = torch.randn(*shape, generator=gen).to(dtype)
            w = (torch.randn(shape[-1], generator=gen) * 0.5).to(dtype)
            got = rms_norm(x.cuda(), w.cuda(), 1e-6).cpu()
            torch.testing.assert_close(got.float(), rms_norm_ref(x, w, 1e-6).float(), atol=tol, rtol=tol)
            got = gated_rms_norm(x.cuda(), gate.cuda(), w.cuda(), 1e-6).cpu()
            torch.testing.assert_close(got.float(), gated_rms_norm_ref(x, gate, w, 1e-6).float(), atol=tol, rtol=tol)

    from hyserve.kernels.norm import add_rms_norm, add_rms_norm_ref, silu_mul, silu_mul_ref

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)):
        x, d = (torch.randn(300, 2048, generator=gen) * 3).to(dtype), torch.randn(300, 2048, generator=gen).to(dtype)
        w = (torch.randn(2048, generator=gen) * 0.5).to(dtype)
        res, out = add_rms_norm(x.cuda(), d.cuda(), w.cuda(), 1e-6)
        res_ref, out_ref = add_rms_norm_ref(x, d, w, 1e-6)
        torch.testing.assert_close(res.cpu(), res_ref, atol=0, rtol=0)
        torch.testing.assert_close(out.cpu().float(), out_ref.float(), atol=tol, rtol=tol)
        g, u = (torch.randn(7, 6144, generator=gen) * 3).to(dtype), torch.randn(7, 6144, generator=gen).to(dtype)
        torch.testing.assert_close(silu_mul(g.cuda(), u.cuda()).cpu().float(), silu_mul_ref(g, u).float(),
                                   atol=tol, rtol=tol)

    from hyserve.kernels.rope import apply_rope, apply_rope_ref

    # bf16: the GPU compiler may keep a product in float32 where the reference rounds it to bf16 first (one bf16 ulp
    # of the inputs' magnitude, seen on the H200); a wrong pairing or sign would be off by O(1).
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 3.2e-2)):
        for t, h, d, r2 in ((1, 8, 256, 32), (300, 2, 256, 32), (37, 16, 128, 64)):
            x = torch.randn(t, h, d, generator=gen).to(dtype)
            freqs = torch.randint(0, 32768, (t,), generator=gen).float()[:, None] * torch.rand(r2, generator=gen)
            cos, sin = freqs.cos(), freqs.sin()
            got = apply_rope(x.cuda(), cos.cuda(), sin.cuda()).cpu()
            want = apply_rope_ref(x, cos, sin)
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
            assert torch.equal(got[..., 2 * r2:], x[..., 2 * r2:]), "channels past the rotary part are copied"

    from hyserve.kernels.gating import gdn_gating, gdn_gating_ref

    for dtype in (torch.float32, torch.bfloat16):
        a = (torch.randn(300, 32, generator=gen) * 12).to(dtype)
        b = (torch.randn(300, 32, generator=gen) * 4).to(dtype)
        a_log = torch.empty(32).uniform_(0.5, 8.0, generator=gen).log().to(dtype)
        dt_bias = (torch.randn(32, generator=gen) * 0.5).to(dtype)
        got = gdn_gating(a.cuda(), b.cuda(), a_log.cuda(), dt_bias.cuda())
        for x, y in zip(got, gdn_gating_ref(a, b, a_log, dt_bias), strict=True):
            torch.testing.assert_close(x.cpu(), y, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dispatch_matches_reference_bf16() -> None:
    bf16 = torch.bfloat16
    lens_mixed = [1, 0, 300, 1, 70, 5, 0, 1]
    lens_decode = [1] * 37 + [0, 1]

    # conv (fused and two-launch paths)
    for lens, mql in ((lens_decode, 1), (lens_mixed, max(lens_mixed))):
        p = conv_problem(lens, D=2 * 16 * 128 + 32 * 128, K=4, pool=64, dtype=bf16, seed=21)
        ref = _clone(p)
        want = causal_conv1d_varlen_ref(**ref)
        g = to_device(p, "cuda")
        out = causal_conv1d_varlen(**g, max_query_len=mql)
        torch.testing.assert_close(out.cpu().float(), want.float(), atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(g["conv_state"].cpu(), ref["conv_state"], atol=0, rtol=0)
        # The same split at [q | k] and v (GDN's prefill): each part the whole's channels, bit for bit.
        g2 = to_device(p, "cuda")
        qk, v = causal_conv1d_split(**g2, split=2 * 16 * 128, max_query_len=mql)
        assert v.is_contiguous() and torch.equal(torch.cat([qk, v], dim=1), out)
        assert torch.equal(g2["conv_state"], g["conv_state"])

    # GDN: decode (own kernel) and mixed (fla), Qwen3.5 shapes (16 key heads, 32 value heads, 128 dims)
    for lens in (lens_decode, lens_mixed):
        if max(lens) > 1:
            pytest.importorskip("fla")
        p = gdn_problem(lens, Hk=16, Hv=32, Dk=128, Dv=128, pool=64, dtype=bf16, seed=22)
        ref = _clone(p)
        want = gdn_forward_ref(**ref)
        g = to_device(p, "cuda")
        out = gdn_forward(**g)
        torch.cuda.synchronize()
        torch.testing.assert_close(out.cpu().float(), want.float(), atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(g["ssm_state"].cpu(), ref["ssm_state"], atol=2e-2, rtol=2e-2)
        touched = _touched(p["state_slots"], lens)
        _assert_untouched(p["ssm_state"], g["ssm_state"].cpu(), touched)

    # attention: store_kv then decode / mixed prefill (head dim 256, GQA 16 -> 2 heads, block size 16)
    for lens, ctxs in ((lens_decode, [(37 * i) % 2000 for i in range(len(lens_decode))]), (lens_mixed, [0] * 8)):
        p = attn_problem(lens, ctxs, Hq=16, Hkv=2, D=256, block_size=16, dtype=bf16, seed=23)
        want = paged_attention_ref(**p)
        out = paged_attention(**to_device(p, "cuda"))
        torch.testing.assert_close(out.cpu().float(), want.float(), atol=2e-2, rtol=2e-2)

    gen = torch.Generator().manual_seed(24)
    k, v = torch.randn(9, 2, 256, generator=gen).to(bf16), torch.randn(9, 2, 256, generator=gen).to(bf16)
    kc, vc = torch.randn(4, 16, 2, 256, generator=gen).to(bf16), torch.randn(4, 16, 2, 256, generator=gen).to(bf16)
    sm = torch.tensor([3, -1, 40, 0, -1, 63, 17, 18, 2])
    want_k, want_v = kc.clone(), vc.clone()
    store_kv_ref(k, v, want_k, want_v, sm)
    kc_g, vc_g = kc.cuda(), vc.cuda()
    store_kv(k.cuda(), v.cuda(), kc_g, vc_g, sm.cuda())
    assert torch.equal(kc_g.cpu(), want_k) and torch.equal(vc_g.cpu(), want_v)


if __name__ == "__main__":
    if sys.argv[1:] == ["--interpreter-checks"]:
        results = run_interpreter_checks(DEFAULT_INTERP_CHECKS)
        print_results(results)
    if sys.argv[1:] == ["--interpreter-checks-slow"]:
        results = run_interpreter_checks(SLOW_INTERP_CHECKS)
        print_results(results)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gdn_prefill_with_the_steps_rows_takes_no_sync() -> None:
    """GDN's chunked prefill (fla-core) given the step's rows (``ChunkedRows``: the host's offsets, fla's chunk
    indices made on the host and copied through pinned memory) waits for nothing, and gives bit for bit what it gives
    working its rows out itself, and what it gives with q and k normed before (``qk_normed``); the chunk indices
    are fla's own."""
    pytest.importorskip("fla")
    from fla.ops.utils import prepare_chunk_indices

    from hyserve.kernels.varlen import ChunkedRows
    from hyserve.testing.cuda import no_sync

    bf16 = torch.bfloat16
    lens = [1, 0, 300, 1, 70, 5, 64]
    p = gdn_problem(lens, Hk=16, Hv=32, Dk=128, Dv=128, pool=64, dtype=bf16, seed=26)
    qsl_cpu = p["query_start_loc"].clone()
    runs = []
    for with_rows in (False, True):
        for attempt in range(2):  # the first compiles and autotunes
            g = to_device(p, "cuda")
            rows = ChunkedRows.of(g["state_slots"], g["query_start_loc"], qsl_cpu) if with_rows else None
            torch.cuda.synchronize()
            if with_rows and attempt == 1:
                assert rows is not None
                want_idx = prepare_chunk_indices(rows.cu_seqlens, 64, cu_seqlens_cpu=rows.cu_seqlens_cpu)
                assert torch.equal(rows.chunk_indices(64), want_idx), "the chunk indices are not fla's"
                with no_sync():
                    out = gdn_forward(**g, query_start_loc_cpu=qsl_cpu, rows=rows)
            else:
                out = gdn_forward(**g, query_start_loc_cpu=qsl_cpu, rows=rows)
            torch.cuda.synchronize()
        runs.append((out.cpu(), g["ssm_state"].cpu()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    # q and k normed before (as the conv's split launch norms them for this path): the same bits again.
    from hyserve.kernels.norm import l2_norm_heads

    g = to_device(p, "cuda")
    g["q"], g["k"] = l2_norm_heads(g["q"]), l2_norm_heads(g["k"])
    out = gdn_forward(**g, query_start_loc_cpu=qsl_cpu, qk_normed=True)
    assert torch.equal(out.cpu(), runs[0][0]) and torch.equal(g["ssm_state"].cpu(), runs[0][1])


@pytest.mark.parametrize("block_d", [64, 128, 256])
def test_attention_tiles_fit_shared_memory(block_d: int) -> None:
    """float32 tiles at D=256 overflowed Hopper's 227 KiB of shared memory (seen on an H200 with the 2B shape):
    the prefill and decode configurations shrink to fit, and the bf16 ones, tuned on the H200, stay unchanged."""
    from hyserve.kernels.attention import PREFILL_CONFIG, SMEM_BUDGET, fit_tiles

    bm0, bn0, _, st0 = PREFILL_CONFIG
    for elem in (2, 4):
        for bm, bn, st in (fit_tiles(bm0, bn0, st0, block_d, elem), fit_tiles(16, 32, 3, block_d, elem)):
            assert (bm * block_d + st * 2 * bn * block_d) * elem <= SMEM_BUDGET
            assert bm >= 16 and bn >= 16 and st >= 1
    assert fit_tiles(bm0, bn0, st0, block_d, 2) == (bm0, bn0, st0)
    assert fit_tiles(16, 32, 3, block_d, 2) == (16, 32, 3)
    if block_d == 256:
        assert fit_tiles(bm0, bn0, st0, block_d, 4) != (bm0, bn0, st0)
