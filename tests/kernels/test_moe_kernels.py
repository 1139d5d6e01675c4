"""Tests for hyserve.kernels.moe (the routed experts' sum).

* The reference (the CPU path) against a token-by-token loop written here: bf16, float32, expert parallel (a slice
  of the experts), FP8 channel- and block-scaled experts, channel-scaled experts with static activation scales
  (ModelOpt FP8: one scale per GEMM for every token and expert).
* ``align_pairs`` (the torch formulation; the Triton one under the interpreter) as properties over random
  routings: each block holds one expert's pairs, every local pair appears once, foreign pairs (expert parallel)
  none; at decode each chosen expert gets exactly one block (its weights are read once).
* The Triton kernels under the interpreter (``TRITON_INTERPRET=1``) in one subprocess against the reference, both
  orders (sorted by expert; one pair per program up to ``DIRECT_MAX_TOKENS`` tokens), with a sabotaged alignment
  (runs not padded to whole blocks) that the comparison must catch.
* The fused routing (softmax, top k, renormalization, the shared expert's gate) against the reference, under the
  interpreter and on CUDA; the shared expert's gated output added in the kernels' final sum.
* Nemotron 3's sigmoid routing (sigmoid, correction bias for the choice alone, grouped top-k by the groups' top-2
  sums, renormalization, scaling) under the interpreter against its torch formulation over several configs (one
  group with 128 experts top 6, 8 groups keep 4, three groups, no renormalization) and T = 0, 1, odd; the group
  score taken as the maximum (a sabotaged kernel helper), the bias leaking into the weights and a dropped
  renormalization (sabotaged references) all caught; planted exact ties resolved as documented (lower group, then
  lower expert id first); on CUDA against the CPU and replayed from a CUDA graph.
* On CUDA: the kernels against the reference in bf16 and FP8, and replayed from a CUDA graph with new routings.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from hyserve.kernels import moe
from hyserve.kernels.fp8.reference import FP8_DTYPE, FP8_MAX, quantize_per_token, quantize_per_token_group
from hyserve.kernels.moe import ExpertScales, MoeConfig, MoePlan, fused_experts, fused_experts_ref
from hyserve.testing.triton_interpreter import interpreter_subprocess_results

REPO_ROOT = Path(__file__).resolve().parents[2]


def make_problem(t: int, k: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int,
                 expert_start: int = 0, num_local: int | None = None, fp8: str | None = None,
                 device: str = "cpu", activation: str = "silu") -> tuple[Any, ...]:
    """``(x, w13, w2, weights, ids, scales)``: a routing over all ``num_experts`` and the weights of
    ``[expert_start, expert_start + num_local)``; ``w13`` the up weight alone for ``relu2`` experts."""
    g = torch.Generator().manual_seed(seed)
    nl = num_local or num_experts
    x = torch.randn(t, hidden, generator=g).to(dtype)
    rows = inter if activation == "relu2" else 2 * inter
    w13 = torch.randn(nl, rows, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(nl, hidden, inter, generator=g) / inter**0.5
    scales = None
    if fp8 in ("channel", "static"):
        s13, s2 = w13.abs().amax(-1) / FP8_MAX, w2.abs().amax(-1) / FP8_MAX
        statics: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if fp8 == "static":  # calibrated on the float experts: the amax of the inputs and of the activations / 448
            h = torch.einsum("th,enh->etn", x.float(), w13)
            act = F.relu(h) ** 2 if activation == "relu2" else F.silu(h[..., :inter]) * h[..., inter:]
            statics = (x.float().abs().amax().reshape(1) / FP8_MAX, act.abs().amax().reshape(1) / FP8_MAX)
        w13, w2 = (w13 / s13[..., None]).to(FP8_DTYPE), (w2 / s2[..., None]).to(FP8_DTYPE)
        scales = ExpertScales(s13, s2, None, *statics)
    elif fp8 == "block":
        s13 = torch.rand(nl, -(-rows // 128), -(-hidden // 128), generator=g).add(0.5) / 100 / hidden**0.5
        s2 = torch.rand(nl, -(-hidden // 128), -(-inter // 128), generator=g).add(0.5) / 100 / inter**0.5
        w13 = (torch.randn(w13.shape, generator=g) * 100).clamp(-448, 448).to(FP8_DTYPE)
        w2 = (torch.randn(w2.shape, generator=g) * 100).clamp(-448, 448).to(FP8_DTYPE)
        scales = ExpertScales(s13, s2, (128, 128))
    else:
        w13, w2 = w13.to(dtype), w2.to(dtype)
    weights, ids = torch.softmax(torch.randn(t, num_experts, generator=g), -1).topk(k, -1)
    if device != "cpu":
        scales = None if scales is None else ExpertScales(*(v.to(device) if isinstance(v, torch.Tensor) else v
                                                           for v in scales))
    return (x.to(device), w13.to(device), w2.to(device), weights.to(device), ids.to(device), scales)


def _dequant(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """One expert's float32 weight, block scales expanded element by element."""
    if block is None:
        return w.float() * s.float()[:, None]
    rows = torch.arange(w.shape[0]) // block[0]
    cols = torch.arange(w.shape[1]) // block[1]
    return w.float() * s.float()[rows[:, None], cols[None, :]]


def _as_gemm_sees(v: torch.Tensor, block: tuple[int, int] | None, static: torch.Tensor | None = None) -> torch.Tensor:
    if static is not None:
        return (v / static).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * static
    if block is None:
        q, s = quantize_per_token(v[None])
        return (q.float() * s)[0]
    q, s = quantize_per_token_group(v[None], block[1])
    return (q.float() * s.repeat_interleave(block[1], 1)[:, : v.numel()])[0]


def token_loop(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               expert_start: int, scales: ExpertScales | None, activation: str = "silu") -> torch.Tensor:
    """The routed sum one token and one choice at a time."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - expert_start
            if not 0 <= e < w13.shape[0]:
                continue
            xt = x[t].float()
            up_w, down_w = w13[e].float(), w2[e].float()
            if scales is not None:
                xt = _as_gemm_sees(xt, scales.block, scales.input13)
                up_w = _dequant(w13[e], scales.w13[e], scales.block)
                down_w = _dequant(w2[e], scales.w2[e], scales.block)
            h = up_w @ xt
            if activation == "relu2":
                a = (F.relu(h) ** 2).to(x.dtype).float()
            else:
                a = (F.silu(h[:inter]) * h[inter:]).to(x.dtype).float()
            if scales is not None:
                a = _as_gemm_sees(a, scales.block, scales.input2)
            out[t] += ((down_w @ a) * weights[t, j]).to(x.dtype).float()
    return out.to(x.dtype)


@pytest.mark.parametrize("case", [
    dict(t=9, k=3, num_experts=6, hidden=40, inter=24, dtype=torch.float32),
    dict(t=9, k=3, num_experts=6, hidden=40, inter=24, dtype=torch.bfloat16),
    dict(t=7, k=2, num_experts=8, hidden=32, inter=16, dtype=torch.float32, expert_start=3, num_local=3),
    dict(t=5, k=2, num_experts=4, hidden=64, inter=48, dtype=torch.bfloat16, fp8="channel"),
    dict(t=5, k=2, num_experts=4, hidden=200, inter=136, dtype=torch.bfloat16, fp8="block"),
    dict(t=9, k=3, num_experts=6, hidden=40, inter=24, dtype=torch.float32, activation="relu2"),
    dict(t=9, k=3, num_experts=6, hidden=40, inter=24, dtype=torch.bfloat16, activation="relu2"),
    dict(t=5, k=2, num_experts=4, hidden=200, inter=136, dtype=torch.bfloat16, fp8="block", activation="relu2"),
    dict(t=9, k=3, num_experts=6, hidden=64, inter=48, dtype=torch.bfloat16, fp8="static", activation="relu2"),
    dict(t=9, k=3, num_experts=6, hidden=64, inter=48, dtype=torch.bfloat16, fp8="static"),
])  # fmt: skip
def test_reference_equals_a_token_by_token_loop(case: dict) -> None:
    x, w13, w2, weights, ids, scales = make_problem(seed=1, **case)
    act = case.get("activation", "silu")
    got = fused_experts_ref(x, w13, w2, weights, ids, case.get("expert_start", 0), scales, activation=act)
    want = token_loop(x, w13, w2, weights, ids, case.get("expert_start", 0), scales, act)
    tol = 1e-5 if case["dtype"] == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert got.abs().max() > 0.05


def test_an_empty_step_and_no_local_choice() -> None:
    x, w13, w2, weights, ids, _ = make_problem(4, 2, 8, 16, 8, torch.float32, 0, expert_start=6, num_local=2)
    assert fused_experts(x[:0], w13, w2, weights[:0], ids[:0], 6).shape == (0, 16)
    ids = ids % 6  # every choice another rank's
    assert torch.equal(fused_experts_ref(x, w13, w2, weights, ids, 6), torch.zeros_like(x))


def alignment_errors(ids: torch.Tensor, start: int, num_local: int, block_m: int, sorted_pairs: torch.Tensor,
                     block_expert: torch.Tensor) -> list[str]:
    """What is wrong with an alignment: each block holds one expert's pairs (or none, past the runs), every local
    pair appears once and no foreign one, the runs in expert order; at one token, one block per chosen expert."""
    t, k = ids.shape
    errors = []
    if sorted_pairs.numel() != block_expert.numel() * block_m:
        errors.append(f"{sorted_pairs.numel()} rows for {block_expert.numel()} blocks of {block_m}")
    flat = ids.reshape(-1) - start
    local = sorted(p for p in range(t * k) if 0 <= int(flat[p]) < num_local)
    seen = sorted(int(p) for p in sorted_pairs if int(p) != t * k)
    if seen != local:
        errors.append(f"pairs placed {seen}, local pairs {local}")
    used = 0
    for b, e in enumerate(block_expert.tolist()):
        pairs = [int(p) for p in sorted_pairs[b * block_m : (b + 1) * block_m] if int(p) != t * k]
        if e < 0:
            if pairs:
                errors.append(f"block {b} past the runs holds {pairs}")
            continue
        used += 1
        if not pairs or any(int(flat[p]) != e for p in pairs):
            errors.append(f"block {b} of expert {e} holds {pairs}")
    if block_expert.tolist() != sorted(block_expert.tolist(), key=lambda e: (e < 0, e)):
        errors.append(f"runs out of order: {block_expert.tolist()}")
    if t == 1 and block_m >= k and used != len(local):
        errors.append(f"{used} blocks for {len(local)} chosen experts at one token")
    return errors


def random_routing(t: int, k: int, num_experts: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(t)])


@settings(max_examples=40, deadline=None)
@given(t=st.integers(1, 40), k=st.integers(1, 4), num_experts=st.integers(4, 24), block_m=st.sampled_from([1, 4, 16]),
       split=st.booleans(), seed=st.integers(0, 2**16))
def test_align_pairs_makes_whole_blocks_of_one_expert(t: int, k: int, num_experts: int, block_m: int, split: bool,
                                                      seed: int) -> None:
    ids = random_routing(t, k, num_experts, seed)
    start, num_local = (num_experts // 3, num_experts // 2) if split else (0, num_experts)
    assert not alignment_errors(ids, start, num_local, block_m, *moe.align_pairs_ref(ids, num_local, start, block_m))


def test_the_alignment_check_catches_a_misplaced_pair_a_lost_pair_and_a_mislabelled_block() -> None:
    """The property check the interpreter runs on the Triton alignment can fail: three corruptions of a correct one."""
    ids = random_routing(12, 2, 6, 3)
    pairs, experts = moe.align_pairs_ref(ids, 6, 0, 4)
    assert not alignment_errors(ids, 0, 6, 4, pairs, experts)
    last = int((pairs < ids.numel()).nonzero().max())  # a pair of the last run: another expert than the first's
    swapped = pairs.clone()
    swapped[0], swapped[last] = pairs[last], pairs[0]
    lost = pairs.clone()
    lost[0] = ids.numel()
    relabelled = experts.clone()
    relabelled[0] = (int(experts[0]) + 1) % 6
    for bad_pairs, bad_experts in ((swapped, experts), (lost, experts), (pairs, relabelled)):
        assert alignment_errors(ids, 0, 6, 4, bad_pairs, bad_experts)


ALIGN_CASES = {"decode": (1, 8, 64, 0, 64, 16), "mixed": (37, 3, 10, 0, 10, 16), "split": (40, 4, 24, 8, 12, 4),
               "one_local": (9, 2, 8, 5, 1, 16), "many_chunks": (300, 4, 48, 0, 48, 64)}


# --------------------------------------------------------------------------------------------------------------------
# The Triton kernels under the interpreter
# --------------------------------------------------------------------------------------------------------------------

INTERP_CASES: dict[str, dict[str, Any]] = {
    "decode_f32": dict(t=1, k=4, num_experts=8, hidden=64, inter=32, dtype=torch.float32, shared=True),
    "prefill_odd_widths_f32": dict(t=37, k=3, num_experts=8, hidden=200, inter=48, dtype=torch.float32),
    "prefill_bf16": dict(t=37, k=3, num_experts=8, hidden=200, inter=48, dtype=torch.bfloat16, shared=True),
    "expert_parallel_f32": dict(t=20, k=2, num_experts=8, hidden=64, inter=32, dtype=torch.float32, expert_start=2,
                                num_local=3),
    "expert_parallel_direct_f32": dict(direct=True, t=4, k=3, num_experts=8, hidden=64, inter=32,
                                       dtype=torch.float32, expert_start=2, num_local=3),
    "fp8_block_direct": dict(direct=True, t=3, k=2, num_experts=4, hidden=200, inter=136, dtype=torch.bfloat16,
                             fp8="block"),
    "fp8_channel": dict(t=5, k=2, num_experts=4, hidden=256, inter=128, dtype=torch.bfloat16, fp8="channel"),
    "fp8_block": dict(t=70, k=2, num_experts=4, hidden=200, inter=136, dtype=torch.bfloat16, fp8="block"),
    # Ungated squared-ReLU experts (Nemotron 3's): w13 the up weight alone
    "relu2_direct_f32": dict(direct=True, t=3, k=3, num_experts=8, hidden=72, inter=48, dtype=torch.float32,
                             activation="relu2", shared=True),
    "relu2_prefill_f32": dict(t=37, k=3, num_experts=8, hidden=72, inter=48, dtype=torch.float32,
                              activation="relu2"),
    "relu2_prefill_bf16": dict(t=20, k=2, num_experts=8, hidden=200, inter=48, dtype=torch.bfloat16,
                               activation="relu2"),
    "relu2_fp8_block_direct": dict(direct=True, t=2, k=2, num_experts=4, hidden=200, inter=136, dtype=torch.bfloat16,
                                   fp8="block", activation="relu2"),
    "relu2_fp8_channel": dict(t=12, k=2, num_experts=4, hidden=256, inter=128, dtype=torch.bfloat16, fp8="channel",
                              activation="relu2"),
    # ModelOpt FP8: static activation scales (one per GEMM), both orders
    "relu2_fp8_static_direct": dict(direct=True, t=3, k=2, num_experts=4, hidden=96, inter=64, dtype=torch.bfloat16,
                                    fp8="static", activation="relu2"),
    "relu2_fp8_static": dict(t=12, k=2, num_experts=4, hidden=96, inter=64, dtype=torch.bfloat16, fp8="static",
                             activation="relu2"),
    # expert parallel (Nemotron-H's MoE with --enable-expert-parallel): a rank's experts, with static scales too
    "relu2_expert_parallel_f32": dict(t=20, k=3, num_experts=8, hidden=72, inter=48, dtype=torch.float32,
                                      activation="relu2", expert_start=4, num_local=4),
    "relu2_fp8_static_expert_parallel_direct": dict(direct=True, t=4, k=2, num_experts=4, hidden=96, inter=64,
                                                    dtype=torch.bfloat16, fp8="static", activation="relu2",
                                                    expert_start=2, num_local=2),
}
SWEPT = ("prefill_odd_widths_f32", "fp8_block", "expert_parallel_f32", "relu2_prefill_f32")  # run at every plan
PLANS = {"decode": MoePlan(MoeConfig(16, 32, 32, 4, 2), MoeConfig(16, 32, 32, 4, 2)),
         "prefill": MoePlan(MoeConfig(32, 64, 64, 4, 2), MoeConfig(32, 64, 32, 4, 2))}


def _interp_case(case: dict[str, Any], plan: MoePlan | None) -> tuple[bool, str]:
    case = dict(case)
    with_shared = case.pop("shared", False)
    direct = case.pop("direct", None)  # the cases named *_direct: one pair per program at several tokens
    x, w13, w2, weights, ids, scales = make_problem(seed=2, **case)
    start = case.get("expert_start", 0)
    shared = gate = None
    if with_shared:  # a shared expert's output and gate, added in the same sum
        g = torch.Generator().manual_seed(9)
        shared, gate = torch.randn(x.shape, generator=g).to(x.dtype), torch.rand(x.shape[0], generator=g)
    act = case.get("activation", "silu")
    got = fused_experts(x, w13, w2, weights, ids, start, scales, plan, num_experts=case["num_experts"],
                        shared=shared, shared_gate=gate, activation=act, direct=direct)
    want = fused_experts_ref(x, w13, w2, weights, ids, start, scales, shared, gate, act)
    tol = 1e-5 if case["dtype"] == torch.float32 else 2e-2
    err = float((got.float() - want.float()).abs().max())
    return bool(err <= tol * max(1.0, float(want.float().abs().max()))), f"err {err:.3g}"


def run_interpreter_checks(slow: bool = False) -> dict[str, list[Any]]:
    """The default group of checks under the interpreter; ``slow``: the slow group (``SLOW_INTERP_NAMES``) alone.
    Needs TRITON_INTERPRET=1."""
    from hyserve.testing.triton_interpreter import patch_triton_interpreter

    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_triton_interpreter()
    res: dict[str, list[Any]] = {}
    for name, case in INTERP_CASES.items():
        for pname, plan in [("default", None), *PLANS.items()]:
            if pname != "default" and name not in SWEPT:
                continue
            if (f"{name}/{pname}" in SLOW_INTERP_NAMES) != slow:
                continue
            if case.get("fp8") == "block" and pname == "prefill":
                plan = PLANS["decode"]  # BLOCK_K divides the scale block
            try:
                res[f"{name}/{pname}"] = list(_interp_case(case, plan))
            except Exception as exc:  # reported, not raised
                res[f"{name}/{pname}"] = [False, repr(exc)]
    for t in STACKED_TOKENS:
        for fmt in (None, *STACKED_FP8):
            stacked = f"stacked_shared{'' if fmt is None else f'_{fmt}'}/{t}"
            if (stacked in SLOW_INTERP_NAMES) == slow:
                res[stacked] = list(_stacked_shared_case(t, fmt))
    if slow:
        return res
    for name, (t, k, ne, start, nl, bm) in ALIGN_CASES.items():
        ids = random_routing(t, k, ne, 5)
        errors = alignment_errors(ids, start, nl, bm, *moe.align_pairs(ids, nl, start, bm))
        res[f"align/{name}"] = [not errors, "; ".join(errors)[:500]]
    for name, (t, e, k, renorm, gate) in ROUTE_CASES.items():
        res[f"route/{name}"] = list(_route_case(t, e, k, renorm, gate))
    res["route/shared_slot"] = list(_route_slot_case())
    for name in SIGMOID_ROUTE_CASES:
        res[f"sigmoid_route/{name}"] = list(_sigmoid_route_case(name))
    for name in SIGMOID_TIES:
        res[f"sigmoid_route_ties/{name}"] = list(_sigmoid_ties_case(name))
    # Sabotage: the groups scored by their maximum, not their top-2 sum (the kernel's helper replaced), must be
    # caught on some grouped case; the bias in the weights and a dropped renormalization likewise (by the comparison).
    import hyserve.kernels.moe._triton as kt_route

    real_top2 = kt_route._group_top2_sum
    kt_route._group_top2_sum = _group_max
    caught = [name for name in SIGMOID_ROUTE_GROUPED if not _sigmoid_route_case(name)[0]]
    kt_route._group_top2_sum = real_top2
    res["sigmoid_route_group_max_caught"] = [bool(caught), f"caught on {caught}"]
    for sab_name, ref in (("bias_in_weights", _bias_in_weights_ref), ("unnormalized", _unnormalized_ref)):
        missed = [n for n, c in SIGMOID_ROUTE_CASES.items() if c[0] and c[5] and _sigmoid_route_case(n, ref=ref)[0]]
        res[f"sigmoid_route_{sab_name}_caught"] = [not missed, f"missed on {missed}"]
    # Sabotage: the stacked shared expert's output added ungated (weight 1, not its gate's sigmoid) must be caught.
    import hyserve.layers.moe as layer_moe

    real_route = layer_moe.route_experts

    def ungated(*args: Any, **kw: Any) -> tuple[torch.Tensor, torch.Tensor, None]:
        weights, ids, _ = real_route(*args, **kw)
        if kw.get("shared_slot") is not None:
            weights[:, -1] = 1.0
        return weights, ids, None

    layer_moe.route_experts = ungated  # type: ignore[assignment]
    ok, msg = _stacked_shared_case(STACKED_TOKENS[0])
    layer_moe.route_experts = real_route
    res["ungated_shared_caught"] = [not ok, msg]
    # Sabotage: runs not padded to whole blocks (a block then mixes experts) must be caught.
    real = moe.align_pairs
    moe.align_pairs = lambda ids, nl, start, bm: _unpadded(real, ids, nl, start, bm)
    ok, msg = _interp_case(INTERP_CASES["prefill_odd_widths_f32"], PLANS["prefill"])
    moe.align_pairs = real
    res["unpadded_runs_caught"] = [not ok, msg]
    # Sabotage: the ungated experts' activation without its square, or SiLU in its place, must be caught on both
    # orders (the kernel's ``_relu2`` helper replaced: the interpreter looks it up at each call; the replacements
    # are defined at the end of this file, where ``tl`` is a global as the interpreter wants).
    import hyserve.kernels.moe._triton as kt

    real_act = kt._relu2
    for sab_name, sabotage in (("square_dropped", _relu_only), ("silu", _silu)):
        kt._relu2 = sabotage
        for case_name in ("relu2_direct_f32", "relu2_prefill_f32"):
            ok, msg = _interp_case(INTERP_CASES[case_name], None)
            res[f"relu2_{sab_name}_caught/{case_name}"] = [not ok, msg]
    kt._relu2 = real_act
    return res


def _unpadded(real: Any, ids: torch.Tensor, nl: int, start: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs in expert order without padding, each block labelled with its first pair's expert."""
    pairs, _ = real(ids, nl, start, 1)
    pairs = pairs[pairs < ids.numel()]
    rows = -(-ids.numel() // bm) * bm + nl * (bm - 1)
    rows = -(-rows // bm) * bm
    out = torch.full((rows,), ids.numel(), dtype=torch.int32)
    out[: pairs.numel()] = pairs
    first = (ids.reshape(-1)[pairs[::bm].long()] - start).to(torch.int32)
    experts = torch.full((rows // bm,), -1, dtype=torch.int32)
    experts[: first.numel()] = first
    return out, experts


STACKED_TOKENS = (3, 20)  # one pair per program, and the sorted order (both within STACKED_MAX_TOKENS)
STACKED_FP8 = ("block", "ct_dynamic")  # FP8 shared experts stacked with FP8 experts: block and channel scales


def moe_block(shared_inter: int = 32, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32,
              fp8: str | None = None) -> Any:
    """A small ``SparseMoeBlock`` (8 experts of width 32, top 2, hidden 64, a shared expert) with random weights,
    built where it runs (as the engine builds models: the stacked experts' views do not survive a ``.to()``);
    ``fp8``: a checkpoint format of ``hyserve.testing.fp8`` (``block`` in 32 x 32 blocks, ``ct_dynamic``)."""
    from hyserve.layers.quantization import parse_quantization_config
    from hyserve.testing.fp8 import quantization_config
    from hyserve.testing.qwen3_5_moe import build_moe_block

    quant = None
    if fp8 is not None:
        quant = parse_quantization_config({"quantization_config": quantization_config(fp8, [], (32, 32))},
                                          "Qwen3_5MoeForCausalLM")
    block = build_moe_block(64, 8, 2, 32, shared_inter, device=device, dtype=dtype, quant=quant)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in block.named_parameters():
            values = torch.randn(param.shape, generator=g)
            if "scale" in name:  # FP8 scales: positive, about what weights of 0.2 quantize to
                values = values.abs().add(0.5) * 0.2 / 448
            elif param.dtype != dtype:  # FP8 weights: on the format's range
                values = (values * 100).clamp(-448, 448)
            else:
                values *= 0.2
            param.copy_(values)
        block.router_weight.copy_(torch.randn(block.router_weight.shape, generator=g))
    return block


def _stacked_shared_case(t: int, fp8: str | None = None) -> tuple[bool, str]:
    """The block with its shared expert stacked after the experts (the kernels' path) against the block's
    reference path (the shared expert apart, gated by its sigmoid), on the same weights."""
    block = moe_block(fp8=fp8)
    assert block.experts.stacked is not None and (fp8 is None) == (block.experts.stacked_scales is None)
    x = torch.randn(t, 64, generator=torch.Generator().manual_seed(t))
    with torch.no_grad():
        got = block(x)
        os.environ["TRITON_INTERPRET"] = "0"  # the reference path of the same block
        try:
            want = block(x)
        finally:
            os.environ["TRITON_INTERPRET"] = "1"
    err, top = float((got - want).abs().max()), float(want.abs().max())
    return bool(top > 0 and err <= 1e-5 * top), f"err {err:.3g} of {top:.3g}"


ROUTE_CASES = {"renorm_gate": (9, 10, 3, True, True), "plain": (5, 7, 2, False, False),
               "top1_wide": (3, 40, 1, True, True), "decode_k8": (1, 64, 8, True, True)}


def _route_case(t: int, e: int, k: int, renorm: bool, gate: bool, device: str = "cpu") -> tuple[bool, str]:
    """The fused routing (softmax, top k, renormalization, the shared gate's sigmoid) against the reference."""
    logits = torch.randn(t, e + gate, generator=torch.Generator().manual_seed(t * e + k)).to(device)
    w, ids, g = moe.route_experts(logits, k, renorm, e)
    w_ref, ids_ref = moe.route_ref(logits[:, :e], k, renorm)
    ok = torch.equal(ids.long().cpu(), ids_ref.cpu()) and torch.allclose(w.cpu(), w_ref.cpu(), atol=1e-6)
    if gate:
        assert g is not None
        ok = ok and torch.allclose(g.cpu(), torch.sigmoid(logits[:, e].float()).cpu(), atol=1e-6)
    else:
        ok = ok and g is None
    return bool(ok), f"ids {ids.tolist()} vs {ids_ref.tolist()}"


def _route_slot_case(device: str = "cpu") -> tuple[bool, str]:
    """The routing with the shared expert as one more choice: the top k, then (sigmoid(gate), the slot)."""
    t, e, k = 6, 12, 3
    logits = torch.randn(t, e + 1, generator=torch.Generator().manual_seed(4)).to(device)
    w, ids, g = moe.route_experts(logits, k, True, e, shared_slot=e)
    w_ref, ids_ref = moe.route_ref(logits[:, :e], k, True)
    gate = torch.sigmoid(logits[:, e].float())
    ok = (g is None and tuple(w.shape) == tuple(ids.shape) == (t, k + 1)
          and torch.equal(ids[:, :k].long().cpu(), ids_ref.cpu()) and bool((ids[:, k] == e).all())
          and torch.allclose(w[:, :k].cpu(), w_ref.cpu(), atol=1e-6) and torch.allclose(w[:, k].cpu(), gate.cpu(),
                                                                                          atol=1e-6))
    return bool(ok), f"ids {ids.tolist()} weights {w.tolist()}"


# (tokens, experts, top k, n_group, topk_group, renormalize, routed scaling)
SIGMOID_ROUTE_CASES = {
    "nano_decode": (1, 128, 6, 1, 1, True, 2.5), "nano_odd": (7, 128, 6, 1, 1, True, 2.5),
    "nano_empty": (0, 128, 6, 1, 1, True, 2.5), "groups8_keep4": (9, 64, 8, 8, 4, True, 1.0),
    "groups4_keep2_plain": (5, 16, 3, 4, 2, False, 2.5), "groups3_keep2": (3, 96, 5, 3, 2, True, 1.5),
}
SIGMOID_ROUTE_GROUPED = ("groups8_keep4", "groups4_keep2_plain", "groups3_keep2")


def _sigmoid_route_inputs(t: int, e: int, k: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] and a correction bias wide enough to move choices (no exact ties: continuous values)."""
    g = torch.Generator().manual_seed(1000 + t * e + k)
    return (2 * torch.randn(t, e, generator=g)).to(device), (0.3 * torch.randn(e, generator=g)).to(device)


def _sigmoid_route_case(name: str, device: str = "cpu", ref: Any = None) -> tuple[bool, str]:
    """The fused sigmoid routing against its torch formulation (``ref``: a sabotaged one): the same ids in the same
    order, float32 weights within float32 rounding, int32 ids."""
    t, e, k, groups, keep, renorm, scaling = SIGMOID_ROUTE_CASES[name]
    logits, bias = _sigmoid_route_inputs(t, e, k, device)
    w, ids = moe.route_sigmoid_experts(logits, bias, k, groups, keep, renorm, scaling)
    w_ref, ids_ref = (ref or moe.route_sigmoid_ref)(logits.cpu(), bias.cpu(), k, groups, keep, renorm, scaling)
    ok = (w.dtype == torch.float32 and ids.dtype == torch.int32 and tuple(w.shape) == tuple(ids.shape) == (t, k)
          and torch.equal(ids.long().cpu(), ids_ref) and torch.allclose(w.cpu(), w_ref, rtol=1e-6, atol=1e-7))
    return bool(ok), f"ids {ids.tolist()} vs {ids_ref.tolist()}; weights {w.tolist()} vs {w_ref.tolist()}"


def _bias_in_weights_ref(logits: torch.Tensor, bias: torch.Tensor, k: int, groups: int, keep: int, renorm: bool,
                         scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sabotage: the weights taken from the biased scores."""
    _, ids = moe.route_sigmoid_ref(logits, bias, k, groups, keep, renorm, scaling)
    w = (torch.sigmoid(logits) + bias).gather(1, ids)
    return (w / (w.sum(-1, keepdim=True) + 1e-20) if renorm else w) * scaling, ids


def _unnormalized_ref(logits: torch.Tensor, bias: torch.Tensor, k: int, groups: int, keep: int, renorm: bool,
                      scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sabotage: no renormalization."""
    return moe.route_sigmoid_ref(logits, bias, k, groups, keep, False, scaling)


def _tie_rule(logits: torch.Tensor, bias: torch.Tensor, k: int, groups: int, keep: int) -> list[list[int]]:
    """The kernel's documented tie rule, one token at a time in Python: groups by descending top-2 sum, the lower
    group first on a tie; then experts of the kept groups by descending biased score, the lower id first."""
    out = []
    for row in (torch.sigmoid(logits) + bias).tolist():
        size = len(row) // groups
        tops = [sum(sorted(row[g * size : (g + 1) * size])[-2:]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: (-tops[g], g))[:keep] if groups > 1 else [0]
        cand = [i for i in range(len(row)) if i // size in kept]
        out.append(sorted(cand, key=lambda i: (-row[i], i))[:k])
    return out


# Planted exact ties (logits 0: every sigmoid exactly 0.5; biases exact in float32): (n_group, topk_group, top k,
# bias) and the ids the rule gives: groups 0 and 1 tie and experts 0-3 tie (experts 0, 1); groups 1 and 2 tie with one
# kept (group 1: experts 2, 3); one group, all tied (experts 0-2).
SIGMOID_TIES = {"experts": (4, 2, 2, [0.25] * 4 + [0.0] * 4, [0, 1]),
                "groups": (4, 1, 2, [0.0, 0.0] + [0.25] * 4 + [0.0, 0.0], [2, 3]),
                "one_group": (1, 1, 3, [0.0] * 8, [0, 1, 2])}


def _sigmoid_ties_case(name: str, device: str = "cpu") -> tuple[bool, str]:
    groups, keep, k, bias_list, want = SIGMOID_TIES[name]
    logits = torch.zeros(2, 8, device=device)
    bias = torch.tensor(bias_list, device=device)
    w, ids = moe.route_sigmoid_experts(logits, bias, k, groups, keep, True, 2.5)
    rule = _tie_rule(logits.cpu(), bias.cpu(), k, groups, keep)
    w_ref, _ = moe.route_sigmoid_ref(logits.cpu(), bias.cpu(), k, groups, keep, True, 2.5)
    ok = ids.tolist() == rule == [want, want] and torch.allclose(w.cpu(), w_ref, rtol=1e-6)
    return bool(ok), f"ids {ids.tolist()} (rule {rule}); weights {w.tolist()}"


def test_the_shared_expert_is_stacked_where_the_kernels_can_run_it() -> None:
    """The stacked layout shares storage with the shared expert's and the experts' parameters (what the loader
    fills), and is kept apart where it cannot be stacked (another width); the routing's CPU formulation of the
    extra column agrees with the kernel's contract."""
    block = moe_block()
    big13, big2 = block.experts.stacked
    mlp = block.shared_expert
    assert big13.shape[0] == big2.shape[0] == 9
    assert mlp.gate_up_proj.gemms[0].weight.data_ptr() == big13[8].data_ptr()
    assert mlp.down_proj.weight.data_ptr() == big2[8].data_ptr()
    assert block.experts.gate_up_proj.data_ptr() == big13.data_ptr()
    assert moe_block(shared_inter=48).experts.stacked is None
    fp8 = moe_block(fp8="block")
    assert fp8.experts.stacked_scales is not None
    assert fp8.shared_expert.down_proj.weight_scale_inv.data_ptr() == fp8.experts.stacked_scales.w2[8].data_ptr()
    assert moe_block(fp8="ct_dynamic").shared_expert.gate_up_proj.gemms[0].weight_scale.shape == (64, 1)
    ok, msg = _route_slot_case()
    assert ok, msg


INTERP_NAMES = [f"{c}/{p}" for c in INTERP_CASES for p in ("default", *PLANS) if p == "default" or c in SWEPT]
INTERP_NAMES += ["unpadded_runs_caught", "ungated_shared_caught"]
INTERP_NAMES += [f"relu2_{s}_caught/{c}" for s in ("square_dropped", "silu")
                 for c in ("relu2_direct_f32", "relu2_prefill_f32")]
INTERP_NAMES += [f"stacked_shared{f}/{t}" for t in STACKED_TOKENS for f in ("", *(f"_{x}" for x in STACKED_FP8))]
INTERP_NAMES += ["route/shared_slot"]
INTERP_NAMES += [f"sigmoid_route/{n}" for n in SIGMOID_ROUTE_CASES] + [f"sigmoid_route_ties/{n}" for n in SIGMOID_TIES]
INTERP_NAMES += [f"sigmoid_route_{s}_caught" for s in ("group_max", "bias_in_weights", "unnormalized")]
INTERP_NAMES += [f"align/{name}" for name in ALIGN_CASES] + [f"route/{name}" for name in ROUTE_CASES]
# The slow group (scripts/test.sh -m slow; the default suite's budget): the sweep's decode and prefill plans (fp8_block
# runs both at the decode plan, about 4.5 s each; every case stays at its default plan, and prefill_odd_widths_f32 at
# the prefill plan, where the unpadded runs are caught), and the stacked FP8 shared experts at 20 tokens (at 3 tokens,
# and unquantized at 20, they stay).
SLOW_INTERP_NAMES = [f"{c}/{p}" for c in SWEPT for p in PLANS if f"{c}/{p}" != "prefill_odd_widths_f32/prefill"]
SLOW_INTERP_NAMES += [f"stacked_shared_{f}/{STACKED_TOKENS[-1]}" for f in STACKED_FP8]
DEFAULT_INTERP_NAMES = [name for name in INTERP_NAMES if name not in SLOW_INTERP_NAMES]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, list[Any]]:
    pytest.importorskip("triton")
    return interpreter_subprocess_results(__file__, "--interpreter-checks")


@pytest.fixture(scope="module")
def slow_interpreter_results() -> dict[str, list[Any]]:
    pytest.importorskip("triton")
    return interpreter_subprocess_results(__file__, "--interpreter-checks-slow")


def test_the_two_groups_hold_every_check_once() -> None:
    assert sorted(DEFAULT_INTERP_NAMES + SLOW_INTERP_NAMES) == sorted(INTERP_NAMES)
    assert not set(DEFAULT_INTERP_NAMES) & set(SLOW_INTERP_NAMES)


def test_every_check_ran(interpreter_results: dict[str, list[Any]]) -> None:
    assert sorted(interpreter_results) == sorted(DEFAULT_INTERP_NAMES)


@pytest.mark.parametrize("name", DEFAULT_INTERP_NAMES)
def test_triton_kernels_under_the_interpreter(interpreter_results: dict[str, list[Any]], name: str) -> None:
    ok, msg = interpreter_results[name]
    assert ok, f"{name}: {msg}"


@pytest.mark.slow  # about 15 s under the interpreter
def test_every_slow_check_ran(slow_interpreter_results: dict[str, list[Any]]) -> None:
    assert sorted(slow_interpreter_results) == sorted(SLOW_INTERP_NAMES)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_INTERP_NAMES)
def test_triton_kernels_under_the_interpreter_slow(slow_interpreter_results: dict[str, list[Any]], name: str) -> None:
    ok, msg = slow_interpreter_results[name]
    assert ok, f"{name}: {msg}"


# --------------------------------------------------------------------------------------------------------------------
# Hopper code on the CPU: every kernel variant compiles for sm_90 (Triton's own ptxas; the interpreter above checks
# the arithmetic, this what only a GPU build would otherwise find: types, constexpr branches, helper returns)
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "sorted"])
@pytest.mark.parametrize("quant", [0, 1, 2], ids=["bf16", "fp8_channel", "fp8_block"])
def test_the_kernels_compile_for_hopper(direct: bool, quant: int, activation: str) -> None:
    pytest.importorskip("triton.backends.nvidia")
    small = direct and not quant and activation == "silu"
    assert moe.compile_variants((9, 0), direct=direct, quant=quant, with_small=small, activation=activation) >= 2


# --------------------------------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("fp8", [None, "channel", "block", "static"])
@pytest.mark.parametrize("t", [1, 8, "8_direct", 64, 300])
def test_cuda_kernels_match_the_reference(fp8: str | None, t: int | str, activation: str) -> None:
    direct = True if t == "8_direct" else None  # several tokens in the direct order (forced; sorted by default)
    t = 8 if t == "8_direct" else int(t)
    case = dict(t=t, k=8, num_experts=64, hidden=512, inter=256, dtype=torch.bfloat16, fp8=fp8, activation=activation)
    x, w13, w2, weights, ids, scales = make_problem(seed=3, device="cuda", **case)
    got = fused_experts(x, w13, w2, weights, ids, 0, scales, activation=activation, direct=direct)
    cpu = [v.cpu() if isinstance(v, torch.Tensor) else v for v in (x, w13, w2, weights, ids)]
    cs = None if scales is None else ExpertScales(*(v.cpu() if isinstance(v, torch.Tensor) else v for v in scales))
    want = fused_experts_ref(*cpu, 0, cs, activation=activation)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=3e-2, rtol=3e-2)


@cuda
@pytest.mark.parametrize("name", sorted(ROUTE_CASES))
def test_cuda_routing_matches_the_reference(name: str) -> None:
    ok, msg = _route_case(*ROUTE_CASES[name], device="cuda")
    assert ok, msg


@cuda
@pytest.mark.parametrize("name", sorted(SIGMOID_ROUTE_CASES))
def test_cuda_sigmoid_routing_matches_the_reference(name: str) -> None:
    ok, msg = _sigmoid_route_case(name, device="cuda")
    assert ok, msg


@cuda
@pytest.mark.parametrize("name", sorted(SIGMOID_TIES))
def test_cuda_sigmoid_routing_ties(name: str) -> None:
    ok, msg = _sigmoid_ties_case(name, device="cuda")
    assert ok, msg


@cuda
def test_cuda_graph_replays_the_sigmoid_routing() -> None:
    """Captured once, replayed with new logits: no host sync in the launch, the routing of the new values."""
    logits, bias = _sigmoid_route_inputs(4, 128, 6, "cuda")
    moe.route_sigmoid_experts(logits, bias, 6, 1, 1, True, 2.5)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        w, ids = moe.route_sigmoid_experts(logits, bias, 6, 1, 1, True, 2.5)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in range(3):
        logits.copy_(torch.randn(4, 128, generator=torch.Generator().manual_seed(seed)).cuda())
        graph.replay()
        w_ref, ids_ref = moe.route_sigmoid_ref(logits.cpu(), bias.cpu(), 6, 1, 1, True, 2.5)
        assert torch.equal(ids.long().cpu(), ids_ref)
        torch.testing.assert_close(w.cpu(), w_ref, rtol=1e-6, atol=1e-7)


@cuda
def test_cuda_routing_with_the_shared_slot() -> None:
    ok, msg = _route_slot_case("cuda")
    assert ok, msg


@cuda
@pytest.mark.parametrize("fp8", [None, *STACKED_FP8])
@pytest.mark.parametrize("t", [1, 3, 20, 64])
def test_cuda_stacked_shared_expert_matches_the_block_apart(t: int, fp8: str | None) -> None:
    """On CUDA in bf16, the block with its shared expert stacked (the kernels' path) against the same block with the
    shared expert run apart (``stacked`` cleared: its own GEMMs, gated in the combine). FP8: an activation whose
    bf16 rounding differs between the paths may land on the next FP8 value, so a few outputs may move by up to
    that much of one term (as in ``test_fp8_moe``)."""
    block = moe_block(device="cuda", dtype=torch.bfloat16, fp8=fp8)
    assert block.experts.stacked is not None
    x = torch.randn(t, 64, generator=torch.Generator().manual_seed(t)).cuda().bfloat16()
    with torch.no_grad():
        got = block(x).float()
        stacked, block.experts.stacked = block.experts.stacked, None
        want = block(x).float()
        block.experts.stacked = stacked
    err = (got - want).abs()
    top = float(want.abs().max())
    if fp8 is None:
        assert float(err.max()) <= 2e-2 * top, (t, float(err.max()), top)
    else:
        assert float(err.max()) <= 0.1 * top, (t, float(err.max()), top)
        outliers = int((err > 3e-2 * top).sum())
        assert outliers <= max(2, err.numel() // 1000), (t, outliers)


@cuda
def test_cuda_graph_replays_new_routings() -> None:
    x, w13, w2, weights, ids, _ = make_problem(16, 8, 64, 512, 256, torch.bfloat16, 4, device="cuda")
    fused_experts(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = fused_experts(x, w13, w2, weights, ids)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in range(3):
        _, _, _, w_new, ids_new, _ = make_problem(16, 8, 64, 512, 256, torch.bfloat16, 10 + seed, device="cuda")
        weights.copy_(w_new)
        ids.copy_(ids_new)
        graph.replay()
        want = fused_experts_ref(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
        torch.testing.assert_close(out.cpu().float(), want.float(), atol=3e-2, rtol=3e-2)


if __name__ == "__main__" and sys.argv[1:] in (["--interpreter-checks"], ["--interpreter-checks-slow"]):
    import triton
    import triton.language as tl

    @triton.jit
    def _relu_only(x):  # type: ignore[no-untyped-def]
        return tl.maximum(x, 0.0)

    @triton.jit
    def _silu(x):  # type: ignore[no-untyped-def]
        return x / (1.0 + tl.exp(-x))

    @triton.jit
    def _group_max(c, S_PAD: tl.constexpr):  # type: ignore[no-untyped-def]
        return tl.max(c, axis=1)

    print("RESULTS " + json.dumps(run_interpreter_checks(slow=sys.argv[1:] == ["--interpreter-checks-slow"])))
