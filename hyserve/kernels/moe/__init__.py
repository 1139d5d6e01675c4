"""The routed experts' sum of a mixture-of-experts block: ``y = sum_j w_j expert_{e_j}(x)`` over each token's ``k``
choices, ``expert(x) = down(silu(gate(x)) * up(x))`` (``activation="silu"``, gated experts: ``w13`` [E, 2I, H], gate
rows then up rows), or ``expert(x) = down(relu(up(x))^2)`` (``activation="relu2"``, Nemotron 3's ungated experts:
``w13`` the up weight alone, [E, I, H]) (semantics: :mod:`hyserve.kernels.moe.reference`).

On CUDA, three steps and no host synchronization (so a CUDA graph can capture them):

1. :func:`align_pairs` sorts the ``T k`` (token, choice) pairs by expert and pads each expert's run to a multiple of
   ``BLOCK_M``, so that every block of rows belongs to one expert (two launches, shapes fixed by ``T``);
2. ``_moe_gate_up_kernel`` computes ``silu(x W_gate^T) * (x W_up^T)`` (or ``relu(x W_up^T)^2``: its constexpr
   ``ACT``, one weight tile and one accumulator) for each block's rows (one launch);
3. ``_moe_down_kernel`` multiplies by ``W2``, scales each pair by its routing weight and writes it to the pair's row;
   the ``k`` rows of a token are then summed (float32).

At one token (``DIRECT_MAX_TOKENS``) step 1 is skipped: each pair gets its own programs, which read its expert from
the routing (a token's experts are distinct: each is read once; tokens that share an expert would read it once each).

bf16/fp16 experts and FP8 W8A8 experts (``ExpertScales``: channel scales with per-token activations, or block scales
with per-token groups as wide as a block, or channel scales with one static activation scale per GEMM, ModelOpt
FP8's; the activations quantized by :func:`hyserve.kernels.fp8.quantize_rows`; a static scale reaches the kernels
as every token's per-token scale, a stride-0 column, so their channel path is unchanged).
Both activations take either (``relu2`` FP8: the up weight's scales alone, ``[E, I]`` or its blocks). Tile sizes
come from a tuned table per (experts, widths, dtype, card, and the activation when it is not ``silu``) stored beside
this file (``configs/``, written by ``benchmarks/moe_tune.py``), else from :func:`default_config`; no ``relu2``
table is tuned yet, so the ungated experts take the defaults. Elsewhere the reference runs.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import NamedTuple

import torch

from hyserve.kernels.moe.reference import (
    ExpertScales,
    dequantize_experts,
    fused_experts_ref,
    quantize_dequantize,
    route_ref,
    route_sigmoid_ref,
)
from hyserve.utils import next_pow2

__all__ = ["ACTIVATIONS", "ExpertScales", "MoeConfig", "align_pairs", "align_pairs_ref", "check_sigmoid_routing",
           "compile_variants", "config_path", "default_config", "dequantize_experts", "fused_experts",
           "fused_experts_ref", "load_configs", "quantize_dequantize", "route_experts", "route_ref",
           "route_sigmoid_experts", "route_sigmoid_ref", "select_config", "uses_triton"]

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
# Up to this many tokens each (token, choice) pair is computed by its own programs, its expert read from the routing
# (no sorting launches); above, the sorted order. One token only: its k experts are distinct, so each is read once.
# Two tokens or more may share experts, which the direct order reads once per pair: at batch 8 on the Nemotron 3 Nano
# shape (6 of 128 experts of 20 MB) a step took 5.8 ms in the direct order against 5.1 ms for batch 32 sorted
# (results/h200/mamba2_2026-12-05).
DIRECT_MAX_TOKENS = 1


class MoeConfig(NamedTuple):
    """One GEMM's tiles: rows (pairs) per block, output columns and K per program, warps, pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


class MoePlan(NamedTuple):
    gate_up: MoeConfig
    down: MoeConfig


def default_config(num_tokens: int, block_k: int | None = None) -> MoePlan:
    """Tiles when no tuned table covers the shape: 16-row blocks while most experts see a few pairs (decode), 64 for
    prefill. ``block_k`` fixed for block-scaled weights (it must divide the scale block)."""
    bk = min(block_k or 128, 128)
    if num_tokens <= 64:
        cfg = MoeConfig(16, 64, bk, 4, 4)
        return MoePlan(cfg, cfg)
    return MoePlan(MoeConfig(64, 64, min(bk, 64), 4, 3), MoeConfig(64, 128, min(bk, 64), 8, 3))


ACTIVATIONS = {"silu": "silu_glu", "relu2": "relu2"}  # fused_experts' names -> the gate/up kernel's ``ACT``


def config_path(num_experts: int, hidden: int, intermediate: int, dtype: str, device_name: str,
                activation: str = "silu") -> Path:
    """The tuned table's file for one expert shape (this rank's experts and intermediate width) on one card; a
    table of ungated experts (``relu2``: one weight tile, not two) is a file of its own (``,act=relu2``)."""
    card = device_name.replace(" ", "_")
    act = "" if activation == "silu" else f",act={activation}"
    return CONFIG_DIR / f"E={num_experts},H={hidden},I={intermediate},dtype={dtype},device={card}{act}.json"


@functools.cache
def load_configs(path: Path) -> dict[int, MoePlan]:
    """``{tokens: plan}`` from a tuned table (``{"16": {"gate_up": [bm, bn, bk, warps, stages], "down": [...]}}``);
    empty when there is none."""
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    return {int(m): MoePlan(MoeConfig(*v["gate_up"]), MoeConfig(*v["down"])) for m, v in raw["configs"].items()}


def _dtype_name(w: torch.Tensor, scales: ExpertScales | None) -> str:
    if scales is None:
        return str(w.dtype).removeprefix("torch.")
    return "fp8_channel" if scales.block is None else f"fp8_block{scales.block[0]}x{scales.block[1]}"


@functools.cache
def _card_name(index: int | None) -> str:
    """The CUDA device's name, asked once (every MoE layer of every eager step looks up its tiles)."""
    return torch.cuda.get_device_name(index)


def select_config(num_tokens: int, w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales | None,
                  routed_experts: int | None = None, activation: str = "silu") -> MoePlan:
    """The tuned plan of the nearest tuned token count at or above ``num_tokens``, else the default; the table of
    ``routed_experts`` experts when ``w13`` holds a shared expert after them (default: all of ``w13``'s), of the
    ``activation``'s experts (``config_path``)."""
    block_k = scales.block[1] if scales is not None and scales.block is not None else None
    if w13.is_cuda:
        path = config_path(routed_experts or w13.shape[0], w13.shape[2], w2.shape[2], _dtype_name(w13, scales),
                           _card_name(w13.device.index), activation)
        table = load_configs(path)
        above = [m for m in table if m >= num_tokens]
        if above:  # a count past the table's largest takes the defaults, not a decode tile
            return table[min(above)]
    return default_config(num_tokens, block_k)


def max_padded_pairs(num_pairs: int, num_local: int, block_m: int) -> int:
    """Rows the padded order may need: each of at most ``min(E, T k)`` experts with pairs pads fewer than
    ``block_m`` rows; rounded up to whole blocks."""
    rows = num_pairs + min(num_local, num_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


def align_pairs(topk_ids: torch.Tensor, num_local: int, expert_start: int,
                block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, block_expert)`` (see :func:`align_pairs_ref`): on CUDA (and under the interpreter) two
    Triton launches, the runs' lengths and blocks in one program, the pairs placed by the next; else the torch
    formulation. Within a run the pairs' order may differ between the two (no output depends on it)."""
    if not topk_ids.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return align_pairs_ref(topk_ids, num_local, expert_start, block_m)
    from hyserve.kernels.moe._triton import _moe_align_kernel, _moe_scatter_kernel

    num_pairs = topk_ids.numel()
    rows = max_padded_pairs(num_pairs, num_local, block_m)
    ids = topk_ids.reshape(-1)
    e_pad = next_pow2(max(num_local, 2))
    cursor = torch.empty(e_pad, dtype=torch.int32, device=ids.device)
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=ids.device)
    _moe_align_kernel[(1,)](ids, cursor, sorted_pairs, block_expert, num_pairs, rows, expert_start, num_local,
                            BLOCK_M=block_m, E_PAD=e_pad, BLOCK=1024, BLOCK_B=max(1, 16384 // e_pad))
    _moe_scatter_kernel[(-(-num_pairs // 1024),)](ids, cursor, sorted_pairs, num_pairs, expert_start, num_local,
                                                  BLOCK=1024)
    return sorted_pairs, block_expert


def align_pairs_ref(topk_ids: torch.Tensor, num_local: int, expert_start: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, block_expert)``: the pairs (``token * k + choice``) in expert order, each expert's run
    padded with ``T k`` (no pair) to a multiple of ``block_m``; and each block's local expert id (-1: past the
    last run). Pairs of experts outside ``[expert_start, expert_start + num_local)`` are left out (expert
    parallelism). Shapes depend on ``T`` alone, and no value goes to the host."""
    num_pairs = topk_ids.numel()
    dev = topk_ids.device
    rows = max_padded_pairs(num_pairs, num_local, block_m)
    local = topk_ids.reshape(-1).long() - expert_start
    bucket = torch.where((local >= 0) & (local < num_local), local, num_local)  # foreign pairs: one last bucket
    counts = torch.zeros(num_local + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:num_local] + block_m - 1) // block_m * block_m
    run_end = torch.cumsum(padded, 0)
    run_start = torch.cat([run_end.new_zeros(1), run_end[:-1], run_end.new_full((1,), rows)])  # foreign: dump row
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    first = torch.cumsum(counts, 0) - counts  # each bucket's first index in ``order``
    rank = torch.arange(num_pairs, device=dev) - first[sorted_bucket]
    pos = torch.where(sorted_bucket < num_local, run_start[sorted_bucket] + rank, rows)
    sorted_pairs = torch.full((rows + 1,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, pos, order.to(torch.int32))
    block_start = torch.arange(0, rows, block_m, device=dev)
    block_expert = torch.searchsorted(run_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_local, block_expert, -1).to(torch.int32)
    return sorted_pairs[:rows], block_expert


def uses_triton(t: torch.Tensor) -> bool:
    """Whether the fused kernels run for ``t``: on CUDA, and anywhere under the Triton interpreter (tests)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def route_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, num_experts: int,
                  shared_slot: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(weights, experts, shared_gate)``: :func:`route_ref` over the first ``num_experts`` logits of each token
    (float32 weights, int32 ids on CUDA); a further column is the shared expert's gate logit, returned as its float32
    sigmoid [T] (else None). With ``shared_slot`` (the shared expert stacked with the experts as expert
    ``shared_slot``) the gate is instead one more choice of every token: weights and ids [T, top_k + 1], the last
    column ``(sigmoid(gate), shared_slot)``, and ``shared_gate`` None. On CUDA one launch, one warp a token up to 512
    experts (its 2k reductions stay within the warp: no shared-memory round trips on the decode path)."""
    t, width = router_logits.shape
    has_gate = width > num_experts
    if shared_slot is not None and not has_gate:
        raise ValueError("route_experts: a shared slot needs the shared expert's gate logit after the experts'")
    if not uses_triton(router_logits):
        weights, experts = route_ref(router_logits[:, :num_experts], top_k, renormalize)
        gate = torch.sigmoid(router_logits[:, num_experts].float()) if has_gate else None
        if shared_slot is not None:
            assert gate is not None
            slot = torch.full((t, 1), shared_slot, dtype=experts.dtype, device=experts.device)
            return torch.cat([weights, gate[:, None]], 1), torch.cat([experts, slot], 1), None
        return weights, experts, gate
    from hyserve.kernels.moe._triton import _moe_route_kernel

    dev = router_logits.device
    fold = shared_slot is not None
    width = top_k + 1 if fold else top_k
    weights = torch.empty(t, width, dtype=torch.float32, device=dev)
    experts = torch.empty(t, width, dtype=torch.int32, device=dev)
    gate = torch.empty(t, dtype=torch.float32, device=dev) if has_gate and not fold else weights
    if t:
        _moe_route_kernel[(t,)](router_logits, weights, experts, gate, num_experts, router_logits.stride(0),
                                shared_slot if fold else 0, TOP_K=top_k, K_PAD=next_pow2(top_k),
                                RENORM=renormalize, SHARED_GATE=has_gate, E_PAD=next_pow2(num_experts),
                                SHARED_SLOT=fold, num_warps=1 if num_experts <= 512 else 4)
    return weights, experts, gate if has_gate and not fold else None


# The sigmoid routing's kernel holds a token's experts in one block of [groups, experts a group] (each padded to a
# power of two); above this many lanes the routing takes its torch formulation (no config served today comes near:
# Nemotron 3 Nano has 128 experts, DeepSeek-V3's shape 256).
SIGMOID_ROUTE_MAX_LANES = 4096


def check_sigmoid_routing(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """Refuse a grouped sigmoid routing that transformers' rule leaves ill-defined: groups that do not split the
    experts evenly, groups of one expert (their top-2 sum), ``topk_group`` outside ``[1, n_group]``, or fewer kept
    experts than ``top_k`` (torch would then choose masked experts, the kernel an arbitrary one)."""
    if n_group < 1 or num_experts % n_group or (n_group > 1 and num_experts // n_group < 2):
        raise ValueError(f"n_routed_experts={num_experts} must split into n_group={n_group} groups of at least 2")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    if not 1 <= top_k <= topk_group * (num_experts // n_group):
        raise ValueError(f"num_experts_per_tok={top_k} must be in [1, {topk_group * (num_experts // n_group)}] (the "
                         f"experts of topk_group={topk_group} groups of {num_experts // n_group})")


def route_sigmoid_experts(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                          renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights float32, experts)`` [T, top_k]: :func:`route_sigmoid_ref` (Nemotron 3's sigmoid routing with the
    correction ``bias`` [E] and grouped top-k) of the router logits [T, E] (float32: the router GEMM's output). On CUDA
    (and under the interpreter) one launch, int32 ids, no host sync (a CUDA graph captures it); else the torch
    formulation, int64 ids. The same choices in the same order (descending biased score) and the same weights up to
    float32 rounding of the sigmoid and the sum; on exact ties (of biased scores, or of groups' top-2 sums) the kernel
    takes the lower expert (group) id first, where torch.topk promises no order. Above
    ``SIGMOID_ROUTE_MAX_LANES`` padded experts the torch formulation runs everywhere."""
    t, e = router_logits.shape
    check_sigmoid_routing(e, top_k, n_group, topk_group)
    if tuple(bias.shape) != (e,):
        raise ValueError(f"the correction bias has shape {tuple(bias.shape)}, not ({e},)")
    s = e // n_group
    g_pad, s_pad = next_pow2(n_group), next_pow2(s)
    if not uses_triton(router_logits) or g_pad * s_pad > SIGMOID_ROUTE_MAX_LANES:
        return route_sigmoid_ref(router_logits, bias, top_k, n_group, topk_group, renormalize, scaling)
    from hyserve.kernels.moe._triton import _moe_sigmoid_route_kernel

    dev = router_logits.device
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    experts = torch.empty(t, top_k, dtype=torch.int32, device=dev)
    if t:
        _moe_sigmoid_route_kernel[(t,)](logits, bias.contiguous(), weights, experts, s, logits.stride(0),
                                        float(scaling), TOP_K=top_k, K_PAD=next_pow2(top_k), N_GROUP=n_group,
                                        TOPK_GROUP=topk_group, G_PAD=g_pad, S_PAD=s_pad, RENORM=renormalize,
                                        num_warps=1 if g_pad * s_pad <= 512 else 4)
    return weights, experts


def _combine(pair_out: torch.Tensor, t: int, k: int, shared: torch.Tensor | None,
             shared_gate: torch.Tensor | None) -> torch.Tensor:
    """Each token's k rows summed, plus its gated shared-expert output: one launch."""
    from hyserve.kernels.moe._triton import _moe_combine_kernel

    hidden = pair_out.shape[1]
    out = torch.empty(t, hidden, dtype=pair_out.dtype, device=pair_out.device)
    sh = shared.contiguous() if shared is not None else pair_out
    _moe_combine_kernel[(t, -(-hidden // 1024))](pair_out, sh, shared_gate if shared_gate is not None else pair_out,
                                                 out, hidden, TOP_K=k, SHARED=shared is not None, BLOCK=1024)
    return out


def _gemm_input(x: torch.Tensor, scales: ExpertScales | None,
                static_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The activation a GEMM reads: as is, or FP8 with its per-token (group) scales; with a ``static_scale`` that
    one value as every token's scale ([T, 1] of stride 0: the kernels read row ``t``'s scale at ``t * 0``)."""
    if scales is None:
        return x, None
    from hyserve.kernels.fp8 import quantize_rows

    if static_scale is not None:
        q, s = quantize_rows(x, static_scale=static_scale)
        return q, s.expand(x.shape[0], 1)
    return quantize_rows(x, group=None if scales.block is None else scales.block[1])


def _check_activation(activation: str, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """The activation is known and ``w13``'s rows are what it reads (shapes only: nothing goes to the host)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r} (known: {sorted(ACTIVATIONS)})")
    rows = (2 if activation == "silu" else 1) * w2.shape[2]
    if w13.shape[1] != rows:
        raise ValueError(f"{activation} experts of width {w2.shape[2]} read {rows} rows of w13, not {w13.shape[1]}")


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_start: int = 0, scales: ExpertScales | None = None,
                  plan: MoePlan | None = None, num_experts: int | None = None, shared: torch.Tensor | None = None,
                  shared_gate: torch.Tensor | None = None, routed_experts: int | None = None,
                  activation: str = "silu", direct: bool | None = None) -> torch.Tensor:
    """The routed sum [T, H] in ``x.dtype`` (see the module docstring and :func:`fused_experts_ref`): ``x`` [T, H];
    ``w13`` [E_local, 2I, H] (``activation="silu"``: gate rows then up rows) or [E_local, I, H] (``"relu2"``: the
    up weight of ungated experts); ``w2`` [E_local, H, I]; ``topk_weights`` (float32) and ``topk_ids`` [T, k] with
    global expert ids; ``scales`` for FP8 experts; ``num_experts`` the global count when the weights hold a part of them
    (expert parallel); ``shared`` [T, H] and ``shared_gate`` [T] (float32) a shared expert's output and gate, added
    to the sum. ``w13``/``w2`` may also hold the shared expert as their last expert, chosen by every token as one
    more column of the routing (``route_experts(..., shared_slot=)``): ``routed_experts`` then names the routed
    count, for the tile table. ``direct`` forces the order (one pair per program, or sorted by expert); by default
    the direct order up to ``DIRECT_MAX_TOKENS`` tokens. CPU tensors take the reference unless the Triton interpreter
    is on."""
    _check_activation(activation, w13, w2)
    if not uses_triton(x):
        return fused_experts_ref(x, w13, w2, topk_weights, topk_ids, expert_start, scales, shared, shared_gate,
                                 activation)
    from hyserve.kernels.moe._triton import _moe_down_kernel, _moe_gate_up_kernel

    t, k = topk_ids.shape
    num_local, hidden, inter = w13.shape[0], w13.shape[2], w2.shape[2]
    if t == 0:
        return torch.zeros_like(x) if shared is None else shared.clone()
    plan = plan or select_config(t, w13, w2, scales, routed_experts, activation)
    block = scales.block if scales is not None else None
    quant = 0 if scales is None else (1 if block is None else 2)
    gn, gk = block if block is not None else (1, 1)
    for cfg in plan:
        if quant == 2 and gk % cfg.block_k:
            raise ValueError(f"block FP8 experts: BLOCK_K {cfg.block_k} must divide the scale block {gk}")
    if plan.gate_up.block_m != plan.down.block_m:
        raise ValueError(f"the two GEMMs walk the same padded order: block_m {plan.gate_up.block_m} != "
                         f"{plan.down.block_m}")
    bm = plan.gate_up.block_m
    ids = topk_ids.contiguous()
    direct = t <= DIRECT_MAX_TOKENS if direct is None else direct
    if direct:  # one pair per program: nothing to sort
        sorted_pairs = block_expert = ids
        rows, grid_m = t * k, t * k
    else:
        sorted_pairs, block_expert = align_pairs(ids, num_local, expert_start, bm)
        rows = sorted_pairs.shape[0]
        grid_m = rows // bm
    upcast = not x.is_cuda
    precision = "ieee" if x.dtype == torch.float32 and quant == 0 else "tf32"
    if scales is not None and scales.block is not None and (scales.input13 is not None or scales.input2 is not None):
        raise ValueError("block FP8 experts quantize their activations per token and group, not with static scales")
    xa, xs = _gemm_input(x.contiguous(), scales, scales.input13 if scales is not None else None)
    act = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    s13 = scales.w13 if scales is not None else w13  # unread without FP8
    xs_ = xs if xs is not None else x
    c = plan.gate_up
    _moe_gate_up_kernel[(grid_m, -(-inter // c.block_n))](
        xa, w13, act, xs_, s13, sorted_pairs, block_expert, ids, t * k, k, hidden, inter, expert_start, num_local,
        xa.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0),
        xs_.stride(0), xs_.stride(1) if xs is not None and xs.dim() > 1 else 0,
        s13.stride(0), s13.stride(1), s13.stride(2) if quant == 2 else 0,
        QUANT=quant, GROUP_N=gn, GROUP_K=gk, UPCAST=upcast, PRECISION=precision, DIRECT=direct,
        BLOCK_M=bm, BLOCK_N=c.block_n, BLOCK_K=c.block_k, ACT=ACTIVATIONS[activation],
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    aa, as_ = _gemm_input(act, scales, scales.input2 if scales is not None else None)
    as_ = as_ if as_ is not None else act
    # Pairs routed to another rank's experts are never written (expert parallel): zeros for them.
    alloc = torch.empty if num_experts in (None, num_local) else torch.zeros
    pair_out = alloc(t * k, hidden, dtype=x.dtype, device=x.device)
    s2 = scales.w2 if scales is not None else w2
    c = plan.down
    _moe_down_kernel[(grid_m, -(-hidden // c.block_n))](
        aa, w2, pair_out, as_, s2, sorted_pairs, block_expert, ids, topk_weights.reshape(-1).float().contiguous(),
        t * k, hidden, inter, expert_start, num_local,
        aa.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), pair_out.stride(0),
        as_.stride(0), as_.stride(1) if quant == 2 else 0,
        s2.stride(0), s2.stride(1), s2.stride(2) if quant == 2 else 0,
        QUANT=quant, GROUP_N=gn, GROUP_K=gk, UPCAST=upcast, PRECISION=precision, DIRECT=direct,
        BLOCK_M=bm, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    return _combine(pair_out, t, k, shared, shared_gate)


def compile_variants(capability: tuple[int, int] = (9, 0), direct: bool = True, quant: int = 0,
                     with_small: bool = True, activation: str = "silu") -> int:
    """Compile the GEMM kernels of one variant (``direct`` order or sorted; ``quant`` 0 bf16, 1 FP8 channel, 2 FP8
    block; the gate/up kernel's ``activation``, ``silu`` or ``relu2``) and, ``with_small``, the routing, alignment
    and combine kernels, for a CUDA ``capability``, with no GPU (Triton's own ptxas): what the interpreter cannot
    show (types, constexpr branches, helpers' returns). Returns how many kernels compiled; a kernel that does not
    compile raises."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hyserve.kernels.moe._triton import (
        _moe_align_kernel,
        _moe_combine_kernel,
        _moe_down_kernel,
        _moe_gate_up_kernel,
        _moe_route_kernel,
        _moe_scatter_kernel,
        _moe_sigmoid_route_kernel,
    )

    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)

    def build(fn: object, types: dict[str, str], consts: dict[str, object], warps: int = 4) -> None:
        names = fn.arg_names  # type: ignore[attr-defined]
        signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
        constexprs = {(names.index(c),): v for c, v in consts.items()}
        triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target,
                       options={"num_warps": warps})

    gemm = dict(QUANT=quant, GROUP_N=128, GROUP_K=128, UPCAST=False, PRECISION="tf32", DIRECT=direct, BLOCK_M=16,
                BLOCK_N=32, BLOCK_K=128)
    data = "*fp8e4nv" if quant else "*bf16"
    common = {"ws_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "ids_ptr": "*i64"}
    build(_moe_gate_up_kernel, {**common, "x_ptr": data, "w_ptr": data, "act_ptr": "*bf16", "xs_ptr": "*fp32"},
          {**gemm, "ACT": ACTIVATIONS[activation]})
    build(_moe_down_kernel, {**common, "a_ptr": data, "w_ptr": data, "out_ptr": "*bf16", "as_ptr": "*fp32",
                               "topk_w_ptr": "*fp32"}, gemm)
    if not with_small:
        return 2
    for slot in (False, True):
        build(_moe_route_kernel, {"logits_ptr": "*bf16", "w_ptr": "*fp32", "ids_ptr": "*i32", "gate_ptr": "*fp32"},
              dict(TOP_K=8, K_PAD=8, RENORM=True, SHARED_GATE=True, E_PAD=256, SHARED_SLOT=slot), warps=1)
    for groups, keep, width in ((1, 1, 128), (8, 4, 8)):  # Nemotron 3 Nano's routing; DeepSeek-V3's grouping
        build(_moe_sigmoid_route_kernel, {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "w_ptr": "*fp32",
                                          "ids_ptr": "*i32", "scaling": "fp32"},
              dict(TOP_K=6, K_PAD=8, N_GROUP=groups, TOPK_GROUP=keep, G_PAD=groups, S_PAD=width, RENORM=True),
              warps=1)
    build(_moe_align_kernel, {"ids_ptr": "*i64", "cursor_ptr": "*i32", "sorted_ptr": "*i32",
                                "block_expert_ptr": "*i32"}, dict(BLOCK_M=16, E_PAD=256, BLOCK=1024, BLOCK_B=64))
    build(_moe_scatter_kernel, {"ids_ptr": "*i64", "cursor_ptr": "*i32", "sorted_ptr": "*i32"}, dict(BLOCK=1024))
    build(_moe_combine_kernel, {"pair_ptr": "*bf16", "shared_ptr": "*bf16", "gate_ptr": "*fp32",
                                  "out_ptr": "*bf16"}, dict(TOP_K=8, SHARED=True, BLOCK=1024))
    return 9

