"""The Gated DeltaNet mixer's whole decode step in one launch: conv window update, gates, l2-normed delta rule and
gated RMSNorm, from the input projection's output to the output projection's input.

:func:`gdn_decode_fused` is the entry point for a pure decode step (every row one token, no verify rows). It computes
what the unfused sequence computes (:func:`gdn_decode_fused_ref`, the CPU path and the yardstick)::

    mixed = causal_conv1d_varlen(x, conv_weight, conv_state, ...)   # [q | k | v], SiLU, rolls the window
    g, beta = gdn_gating(a, b, A_log, dt_bias)
    o = gdn_forward(q, k, v, g, beta, ssm_state, ...)                # l2-normed q / k, state in place
    out = gated_rms_norm(o, z, norm_weight, eps)                      # per value head

with the same rounding points (conv output, delta-rule output and the norm's two roundings in the model dtype; the
state rounded to its dtype where it is stored), so outputs agree with the unfused kernels to within the reduction
order of the norm's sum of squares (summed per block of ``BV`` channels here, in one row there: one unit in the last
place at most, usually bit for bit) and states bit for bit (``tests/kernels/test_gdn_decode_fused.py``).

Dispatch: CUDA runs ``_gdn_decode_fused_kernel`` (``_triton.py``: one program per (row, value head) walking the
head's state in ``BV``-wide tiles, no host sync, fixed-shape launch: safe to capture in a CUDA graph) or, split
(:func:`decode_launch`, ``HYSERVE_GDN_DECODE_SPLIT``), ``_gdn_decode_split_kernel`` (one program per (row, value head,
value block): ``Dv / BV`` times the programs, each one tile in flight; the head's norm by the last of its programs,
counted in :func:`head_counters_for`'s counters). On a value-major pool from :data:`UPFRONT_FROM` (row, head) pairs
the walk takes its UPFRONT form (one 128-wide tile, every independent load first, the norm from registers;
``HYSERVE_GDN_DECODE_UPFRONT``), and from :data:`PERSIST_FROM` pairs, unquantized, it runs as
``_gdn_decode_persist_kernel`` (two programs an SM looping over the pairs; :func:`persists`,
``HYSERVE_GDN_DECODE_PERSIST``) with the windows rolled by ``_conv_roll_kernel`` after it. Everything else runs the
reference sequence.

Contract (that of the unfused kernels): ``state_slots[r]`` names row ``r``'s conv window and SSM state; rows are one
token (``query_start_loc`` steps by 1) or empty (an empty row reads and writes nothing); slots of rows with a token
are distinct, except the pad rows of a captured graph, which all share the pool's pad slot (nothing reads it back).
When ``Hv > Hk`` the kernel needs ``arrivals`` (:func:`arrivals_for`): an int32 ``(S, Hk)`` counter per slot and key
head, zero at allocation, which every launch leaves at zero, so that the key head's q / k window is rolled once, by
the last of its value heads' programs to read it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from hyserve.kernels.conv.reference import causal_conv1d_varlen_ref
from hyserve.kernels.fp8.reference import AMAX_EPS, FP8_DTYPE, FP8_MAX, Fp8Activation, quantize_activation_ref
from hyserve.kernels.gating.reference import gdn_gating_ref
from hyserve.kernels.gdn.reference import gdn_forward_ref
from hyserve.kernels.norm.reference import gated_rms_norm_ref
from hyserve.utils import next_pow2

__all__ = ["arrivals_for", "as_output", "compile_variants", "decode_launch", "fp8_output", "gdn_decode_fused",
           "gdn_decode_fused_ref", "gdn_decode_fused_triton", "head_counters_for", "quant_block", "row_counters_for"]


def arrivals_for(num_slots: int, num_k_heads: int, num_v_heads: int, device: torch.device,
                 split: bool = False) -> torch.Tensor | None:
    """The fused kernel's arrival counters for a state pool of ``num_slots`` entries: int32 zeros ``(S, Hk)``, or
    None when each key head has one value head and the launches do not split heads (no counter needed)."""
    if num_v_heads == num_k_heads and not split:
        return None
    return torch.zeros((num_slots, num_k_heads), dtype=torch.int32, device=device)


def head_counters_for(num_slots: int, num_v_heads: int, device: torch.device) -> torch.Tensor:
    """The per-(row, value head) counters of a launch that splits each head over value blocks (``split=True``):
    int32 zeros ``(S, Hv)``, one row a row of the launch (at most one a slot), which every launch leaves at zero."""
    return torch.zeros((num_slots, num_v_heads), dtype=torch.int32, device=device)


# The launch by (row, value head) pairs (rows x Hv), from the walk against the split launch on an H100 with bf16
# states (benchmarks/gdn_decode_bench.py --launch, 2026-12-05; us a layer, the 9B's 32 heads / the 27B's 48):
#   batch 1:  walk 11.4 / 11.6, split (32, 2 warps) 7.2 / 7.6
#   batch 8:  walk 14.0 / 16.6, split at best 12.3 (32, 1) / 19.1 (64, 4): no clear winner, the walk stays
#   batch 32: walk 53.3 / 84.2, split (64, 4) 50.5 / 76.5
#   batch 64: walk 112.6 / 163.2, split (64, 4) 98.4 / 146.4
SPLIT_UP_TO = 128  # pairs: split in (32, 2 warps) blocks
SPLIT_FROM = 1024  # pairs: split in (64, 4 warps) blocks
# On a value-major pool (HYSERVE_GDN_STATE_LAYOUT=value: each head's state stored as value rows of contiguous keys),
# the walk at every batch, from the same bench on an H100 (2026-12-06, us a layer, 9B / 27B heads, best launch):
#   batch 1:  walk (128, 4) 6.25 / 6.33, split at best 6.81 / 7.14 (32, 4)
#   batch 8:  walk (128, 4) 8.74 / 14.33, (64, 4) 9.94 / 11.41; split at best 11.03 / 18.10
#   batch 32: walk (128, 4) 33.71 / 58.03, (64, 4) 35.03 / 57.98; split at best 38.57 / 60.05
#   batch 64: walk (128, 4) 76.55 / 109.32, (64, 4) 78.19 / 109.04; split at best 78.47 / 110.80
# (key-major, the launches above: 7.14 / 7.74, 14.04 / 16.33, 50.89 / 75.38, 96.86 / 143.90).
WALK_WIDE_UP_TO = 256  # pairs: a value-major walk in (128, 4 warps) tiles, in (64, 4) beyond
# The walk's UPFRONT form (the head's whole state one 128-wide tile, every load that waits only on the slot issued
# first, the norm from registers) against the walk on a value-major bf16 pool, the same bench on an H100 (2026-12-06,
# eighteenth session, us a layer, 9B / 27B heads; walk (128, 4), walk (64, 4), UPFRONT (128, 4)):
#   batch 1:  6.30 / 6.56, 8.16 / 8.33, 6.37 / 6.62
#   batch 8:  9.12 / 14.77, 10.39 / 11.71, 9.46 / 15.02
#   batch 32: 34.35 / 59.15, 35.60 / 58.57, 32.79 / 55.51
#   batch 64: 76.90 / 110.55, 78.50 / 110.26, 71.29 / 100.41
# (8 warps: 2x slower). In the engine (9B, bf16 state): 4,079 / 6,809 tok/s at batch 32 / 64 against 4,015 / 6,751.
UPFRONT_FROM = 1024  # pairs: a value-major walk in its UPFRONT form (9B batch 32 on, 27B batch 22 on)
# The persistent launch (the UPFRONT walk on two programs an SM looping over the pairs, the windows rolled after) at
# 3 / 2 / 1 stages of its loop against the UPFRONT launch, the same bench on an H100 (2026-12-06, nineteenth session,
# us a layer, 9B / 27B heads; UPFRONT (128, 4), persistent 3 / 2 / 1 stages):
#   batch 1:  6.17 / 6.68, 7.96 / 8.08, 7.30 / 7.50, 6.51 / 6.71
#   batch 8:  9.04 / 14.70, 11.15 / 16.19, 10.48 / 14.76, 9.64 / 13.53
#   batch 32: 32.50 / 54.73, 32.24 / 59.41, 31.80 / 59.79, 28.25 / 49.68
#   batch 64: 71.20 / 99.76, 79.76 / 114.12, 80.00 / 115.11, 65.65 / 92.32
# One stage (no buffers in shared memory) is the fastest at every batch, 1.08-1.15x the UPFRONT launch from batch 32.
PERSIST_FROM = 1024  # pairs: on a value-major pool, unquantized, the persistent launch (9B batch 32 on, 27B 22 on)
PERSIST_STAGES = 1  # its loop's stages


def as_value_major(ssm_state: torch.Tensor) -> torch.Tensor:
    """A copy of an ``(S, Hv, Dk, Dv)`` pool's values stored value-major (``HYSERVE_GDN_STATE_LAYOUT=value``'s
    layout): the same view, strides ``(.., 1, Dk)``."""
    return ssm_state.transpose(-1, -2).contiguous().transpose(-1, -2)


def is_value_major(ssm_state: torch.Tensor) -> bool:
    """Whether an ``(S, Hv, Dk, Dv)`` pool stores each head's state as value rows of contiguous keys."""
    return ssm_state.stride(2) == 1 and ssm_state.stride(3) != 1


def decode_launch(rows: int, num_v_heads: int, split: bool | None = None, value_major: bool = False,
                  upfront: bool | None = None) -> tuple[bool, int | None, int, bool]:
    """``(split, BV, warps, upfront)`` for a decode launch of ``rows`` rows: whether each value head is split over
    programs (``_gdn_decode_split_kernel``), its value block (None: :func:`launch_config`'s, or the head's whole
    width for an UPFRONT walk), warps, and whether the walk takes its UPFRONT form. ``split`` None: split at up to
    :data:`SPLIT_UP_TO` and from :data:`SPLIT_FROM` (row, value head) pairs, where the card's sweep has the split
    launch ahead, the walk between; on a ``value_major`` pool the walk, in 128-wide tiles up to
    :data:`WALK_WIDE_UP_TO` pairs and 64-wide beyond; True / False forces one launch (``HYSERVE_GDN_DECODE_SPLIT``).
    ``upfront`` None: a value-major walk takes the UPFRONT form from :data:`UPFRONT_FROM` pairs, where the card's
    sweep has it ahead; True / False: every walk in that form or none (``HYSERVE_GDN_DECODE_UPFRONT``). A split
    launch has no such form."""
    pairs = rows * num_v_heads
    if split is None:
        split = False if value_major else pairs <= SPLIT_UP_TO or pairs >= SPLIT_FROM
    if split:
        return (True, 32, 2, False) if pairs <= SPLIT_UP_TO else (True, 64, 4, False)
    if upfront is None:
        upfront = value_major and pairs >= UPFRONT_FROM
    if upfront:
        return (False, None, 4, True)
    return (False, 128 if pairs <= WALK_WIDE_UP_TO else 64, 4, False) if value_major else (False, None, 4, False)


def persists(rows: int, num_v_heads: int, value_major: bool, quant: str | None = None, split: bool | None = None,
             upfront: bool | None = None) -> bool:
    """Whether a decode launch of ``rows`` rows takes the persistent launch by the rule: on a ``value_major`` pool,
    from :data:`PERSIST_FROM` (row, value head) pairs, where the card's sweep has it ahead of the UPFRONT launch;
    never when it quantizes its output (``quant``), when a split launch is forced (``split`` True) or the walk's
    UPFRONT form is forced off (``upfront`` False: the persistent launch is that form)."""
    return (value_major and quant is None and split is not True and upfront is not False
            and rows * num_v_heads >= PERSIST_FROM)


def row_counters_for(num_slots: int, device: torch.device) -> torch.Tensor:
    """The per-row counters of a launch that quantizes its output for an FP8 ``out_proj`` (``quant="fp8"``): int32
    zeros, one a row of the launch (a step has at most one row a slot, so ``num_slots`` of them suffice), which
    every launch leaves at zero."""
    return torch.zeros((num_slots,), dtype=torch.int32, device=device)


def fp8_output(out: torch.Tensor, rows: int, quant: str | None, row_counts: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 values ``(T, W)``, per-token scales ``(T, 1)`` and row counters a fused GDN launch writes when
    ``quant == "fp8"``; stand-ins it never touches (``out`` itself) when ``quant`` is None."""
    assert quant in (None, "fp8"), "the GDN output feeds out_proj alone: quantized (fp8) or plain"
    if quant is None:
        return out, out, out
    assert row_counts is not None and row_counts.dtype == torch.int32 and row_counts.shape[0] >= rows, \
        "quant='fp8' needs int32 row counters, one a row (row_counters_for)"
    return (torch.empty(out.shape, dtype=FP8_DTYPE, device=out.device),
            torch.empty((out.shape[0], 1), dtype=torch.float32, device=out.device), row_counts)


def as_output(out: torch.Tensor, q: torch.Tensor, qs: torch.Tensor, quant: str | None) -> torch.Tensor | Fp8Activation:
    return out if quant is None else Fp8Activation(q, qs, out.dtype)


def gdn_decode_fused(
    x: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_k_heads: int,
    arrivals: torch.Tensor | None = None,
    quant: str | None = None,
    row_counts: torch.Tensor | None = None,
    head_counts: torch.Tensor | None = None,
    split: bool | None = None,
    upfront: bool | None = None,
    persist: bool | None = None,
) -> torch.Tensor | Fp8Activation:
    """The mixer's decode step from ``in_proj``'s output to ``out_proj``'s input; returns ``(T, Hv * Dv)`` in the
    model dtype, or (``quant="fp8"``) that output quantized per token for an FP8 ``out_proj`` in the same launch, as
    an :class:`Fp8Activation` (exactly ``quantize_activation_ref`` of the plain output). Updates ``conv_state`` and
    ``ssm_state`` in place.

    Args:
        x: ``(T, 2 * Hk * Dk + Hv * Dv)`` the conv's input [q | k | v]; z: ``(T, Hv * Dv)`` the norm's gate;
            b, a: ``(T, Hv)``. Views of one projection output are fine (unit last strides).
        conv_weight: ``(conv_dim, K)``; a_log, dt_bias: ``(Hv,)``; norm_weight: ``(Dv,)``.
        conv_state: ``(S, conv_dim, K - 1)`` model dtype; ssm_state: ``(S, Hv, Dk, Dv)`` float32 / bf16 / fp16.
        state_slots: ``(R,)``; query_start_loc: ``(R + 1,)`` int32, every row one token or none.
        num_k_heads: ``Hk`` (this rank's); ``Hv`` and ``Dv`` come from ``ssm_state``, ``Dk`` from both.
        arrivals: :func:`arrivals_for`'s counters (needed on CUDA when ``Hv > Hk``).
        quant: None or ``"fp8"``; row_counts: :func:`row_counters_for`'s counters (needed on CUDA with ``"fp8"``).
        head_counts: :func:`head_counters_for`'s counters, for a launch that splits each head over programs
            (``arrivals`` then from :func:`arrivals_for` with ``split``); without them no launch splits.
        split: on CUDA, whether the launch splits each head; None: where :func:`decode_launch` says so.
        upfront: on CUDA, whether a walk takes its UPFRONT form; None: where :func:`decode_launch` says so.
        persist: on CUDA, the persistent launch (the UPFRONT walk looping over pairs) for every step (True), never
            (False), or where :func:`persists` says (None). True not with ``quant``.
    """
    if not x.is_cuda:
        out = gdn_decode_fused_ref(x, z, b, a, conv_weight, a_log, dt_bias, norm_weight, eps, conv_state,
                                   ssm_state, state_slots, query_start_loc, num_k_heads)
        return out if quant is None else quantize_activation_ref(out)
    if persist is None:
        persist = persists(state_slots.shape[0], ssm_state.shape[1], is_value_major(ssm_state), quant, split, upfront)
    if persist:
        return gdn_decode_fused_triton(x, z, b, a, conv_weight, a_log, dt_bias, norm_weight, eps, conv_state,
                                       ssm_state, state_slots, query_start_loc, num_k_heads, arrivals, quant,
                                       row_counts, persist=True)
    split, block_v, warps, upfront = decode_launch(state_slots.shape[0], ssm_state.shape[1],
                                                   False if head_counts is None else split,
                                                   value_major=is_value_major(ssm_state), upfront=upfront)
    return gdn_decode_fused_triton(x, z, b, a, conv_weight, a_log, dt_bias, norm_weight, eps, conv_state, ssm_state,
                                   state_slots, query_start_loc, num_k_heads, arrivals, quant, row_counts,
                                   block_v=block_v, num_warps=warps, split=split, head_counts=head_counts,
                                   upfront=upfront)


def gdn_decode_fused_ref(
    x: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_k_heads: int,
) -> torch.Tensor:
    """The unfused references in sequence (conv, gates, delta rule, gated norm): the op's definition."""
    t = x.shape[0]
    hv, dk, dv = ssm_state.shape[1:]
    key_dim = num_k_heads * dk
    mixed = causal_conv1d_varlen_ref(x, conv_weight, conv_state, state_slots, query_start_loc)
    q, k, v = torch.split(mixed, [key_dim, key_dim, hv * dv], dim=-1)
    g, beta = gdn_gating_ref(a, b, a_log, dt_bias)
    o = gdn_forward_ref(q.reshape(t, num_k_heads, dk), k.reshape(t, num_k_heads, dk), v.reshape(t, hv, dv), g, beta,
                        ssm_state, state_slots, query_start_loc, 1)
    out = gated_rms_norm_ref(o.reshape(-1, dv), z.reshape(-1, dv), norm_weight, eps)
    return out.reshape(t, hv * dv)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def launch_config(dk: int, dv: int, k: int) -> dict[str, int]:
    """The kernel's tiling: the head's key dim in one tile (``BK``), its value dim in blocks of ``BV`` (the float32
    state tile at most 4096 elements, as ``gdn_recurrent_triton``) and whole for the conv windows (``DVP``), the conv
    window padded to a power of two."""
    bk = next_pow2(dk)
    return {"KM1_PAD": next_pow2(k - 1), "BK": bk, "BV": min(next_pow2(dv), max(16, 4096 // bk)),
            "DVP": next_pow2(dv)}


def gdn_decode_fused_triton(
    x: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_k_heads: int,
    arrivals: torch.Tensor | None = None,
    quant: str | None = None,
    row_counts: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    block_v: int | None = None,
    qblock: int | None = None,
    num_warps: int = 4,
    split: bool = False,
    head_counts: torch.Tensor | None = None,
    early_state: bool = False,
    one_pass: bool = False,
    upfront: bool = False,
    persist: bool = False,
    programs: int | None = None,
    stages: int = PERSIST_STAGES,
    roll_inside: bool = False,
) -> torch.Tensor | Fp8Activation:
    """Triton implementation of :func:`gdn_decode_fused` (also runs under ``TRITON_INTERPRET=1`` on CPU); ``out``
    optionally supplies the contiguous ``(T, Hv * Dv)`` output (NaN-poisoned in tests); ``block_v`` overrides the
    value block ``BV`` (a power of two; tests take several blocks of a small head), ``qblock`` the quantization
    pass's block (:func:`quant_block`; ``benchmarks/fp8_quant_bench.py`` sweeps it); ``num_warps`` the program's
    warps (``benchmarks/gdn_decode_bench.py --launch`` sweeps both). ``split``: one program per (row, value head,
    value block) (``_gdn_decode_split_kernel``), which needs ``arrivals`` (:func:`arrivals_for` with ``split``) and
    ``head_counts`` (:func:`head_counters_for`); ``early_state`` (split only) loads each program's state tile before
    its q / k prologue (``EARLY``; ``gdn_decode_bench.py --launch BVxWse`` times it), ``one_pass`` (split only)
    takes the output from the decayed state before the update (``ONEPASS``; ``--launch BVxWs1``). ``upfront`` (the
    walk with the head's whole state one tile: ``block_v`` at least ``Dv``) issues every independent load before the
    q / k prologue and takes the norm from registers (``UPFRONT``; ``--launch BVxWu``). ``persist``: the UPFRONT
    walk on a fixed grid of ``programs`` programs (default :func:`persist_programs`), each looping over (row, head)
    pairs in a loop Triton pipelines over ``stages`` stages (``_gdn_decode_persist_kernel``), then the conv windows
    rolled in a second launch (``_conv_roll_kernel``; ``--launch BVxWpN``), or with ``roll_inside`` (one stage)
    by each pair in the loop, as the UPFRONT launch's programs roll them (``arrivals`` needed when ``Hv > Hk``;
    ``--launch BVxWp1r``)."""
    from hyserve.kernels.gdn._triton import (
        _conv_roll_kernel,
        _gdn_decode_fused_kernel,
        _gdn_decode_persist_kernel,
        _gdn_decode_split_kernel,
    )

    t = x.shape[0]
    hk = num_k_heads
    _, hv, dk, dv = ssm_state.shape
    conv_dim, kw = conv_weight.shape
    r = state_slots.shape[0]
    assert hv % hk == 0, "Hv must be a multiple of Hk"
    assert x.shape[1] == conv_dim == 2 * hk * dk + hv * dv, "x must be (T, 2 * Hk * Dk + Hv * Dv)"
    assert conv_state.shape[1:] == (conv_dim, kw - 1) and kw >= 2, "conv_state must be (S, conv_dim, K - 1)"
    assert z.shape == (t, hv * dv) and a.shape == (t, hv) and b.shape == (t, hv), "z (T, Hv * Dv), a and b (T, Hv)"
    assert norm_weight.shape == (dv,) and a_log.shape == (hv,) and dt_bias.shape == (hv,)
    assert arrivals is not None or (hv == hk and not split) or (persist and not roll_inside), \
        "Hv > Hk, or a split launch, needs the arrival counters (arrivals_for)"
    assert not roll_inside or (persist and stages == 1), "roll_inside is a form of the persistent launch at one stage"
    assert not split or (head_counts is not None and head_counts.dtype == torch.int32
                         and head_counts.shape[0] >= r and head_counts.shape[1] == hv), \
        "a split launch needs int32 head counters, a row per launch row (head_counters_for)"
    assert arrivals is None or (arrivals.dtype == torch.int32 and arrivals.shape == (ssm_state.shape[0], hk))
    assert split or not (early_state or one_pass), "early_state and one_pass are forms of the split launch"
    assert not (upfront and split), "upfront is a form of the walk (one program a head)"
    assert not (persist and (split or quant is not None)), "persist is a form of the walk that does not quantize"
    upfront = upfront or persist
    x, z, a, b = (_unit_last(u) for u in (x, z, a, b))
    if out is None:
        out = torch.empty((t, hv * dv), dtype=x.dtype, device=x.device)
    assert out.shape == (t, hv * dv) and out.stride(1) == 1
    q, qs, cnt = fp8_output(out, r, quant, row_counts)
    if r == 0 or t == 0:
        return as_output(out, q, qs, quant)
    arr = conv_state if arrivals is None else arrivals  # never read when Hv == Hk
    cfg = launch_config(dk, dv, kw)
    if block_v is not None:
        assert block_v == next_pow2(block_v), "block_v must be a power of two"
        cfg["BV"] = block_v
    elif upfront:
        cfg["BV"] = cfg["DVP"]  # the head's whole state one tile
    assert not upfront or cfg["BV"] >= dv, "upfront takes the head's whole state as one tile (block_v >= Dv)"
    qb = quant_block(hv * dv) if qblock is None else qblock
    assert qb == next_pow2(qb), "qblock must be a power of two"
    common = dict(HK=hk, DK=dk, DV=dv, GROUP=hv // hk, K=kw, **cfg, QUANT=quant is not None, QBLOCK=qb,
                  num_warps=num_warps)
    strides = (x.stride(0), z.stride(0), b.stride(0), a.stride(0), conv_weight.stride(0), conv_weight.stride(1),
               conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
               ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), ssm_state.stride(3))
    scalars = (dk**-0.5, float(eps), FP8_MAX, AMAX_EPS)
    pools = (conv_state, ssm_state, state_slots, query_start_loc, arr)
    if persist:
        nprog = min(r * hv, persist_programs(x.device) if programs is None else programs)
        _gdn_decode_persist_kernel[(nprog,)](
            x, z, b, a, conv_weight, a_log, dt_bias, norm_weight, *pools, out, r, *strides, arr.stride(0),
            out.stride(0), dk**-0.5, float(eps), HK=hk, DK=dk, DV=dv, GROUP=hv // hk, K=kw, KM1_PAD=cfg["KM1_PAD"],
            BK=cfg["BK"], BV=cfg["BV"], DVP=cfg["DVP"], STAGES=stages, ROLL=roll_inside, num_warps=num_warps)
        if not roll_inside:
            _conv_roll_kernel[(r, -(-conv_dim // ROLL_BLOCK))](
                x, conv_state, state_slots, query_start_loc, conv_dim, x.stride(0), conv_state.stride(0),
                conv_state.stride(1), conv_state.stride(2), K=kw, KM1_PAD=cfg["KM1_PAD"], BC=ROLL_BLOCK)
        return as_output(out, q, qs, quant)
    if split:
        assert head_counts is not None
        nvb = -(-dv // cfg["BV"])
        _gdn_decode_split_kernel[(r, hv * nvb)](
            x, z, b, a, conv_weight, a_log, dt_bias, norm_weight, *pools, head_counts, out, q, qs, cnt,
            *strides, arr.stride(0), head_counts.stride(0), out.stride(0), q.stride(0), *scalars, **common,
            EARLY=early_state, ONEPASS=one_pass)
    else:
        _gdn_decode_fused_kernel[(r, hv)](
            x, z, b, a, conv_weight, a_log, dt_bias, norm_weight, *pools, out, q, qs, cnt,
            *strides, arr.stride(0), out.stride(0), q.stride(0), *scalars, **common, UPFRONT=upfront)
    return as_output(out, q, qs, quant)


ROLL_BLOCK = 512  # channels a program of the window roll after a persistent launch


@functools.lru_cache(maxsize=8)
def persist_programs(device: torch.device) -> int:
    """A persistent launch's programs: two per SM on a card (what its registers allow resident), four under the
    interpreter (several pairs a program in the tests' small launches)."""
    if device.type != "cuda":
        return 4
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def quant_block(width: int) -> int:
    """The block of the FP8 quantization pass over a ``width``-wide output row."""
    return min(1024, next_pow2(width))


def card_values(num_k_heads: int = 16, num_v_heads: int = 32, head_dim: int = 128, conv_width: int = 4,
                rows: int = 64) -> dict[str, int]:
    """The integer arguments of a decode launch as the engine passes them on a card, for
    :func:`hyserve.testing.triton_compile.compile_for_sm90`'s ``values`` (the 9B's heads by default): x, z, b and
    a views of one ``in_proj`` output, the conv weight ``(conv_dim, K)``, and the conv window and the value-major
    bf16 SSM state carved from one pool row of bf16 elements each (``StatePool``)."""
    conv_dim = 2 * num_k_heads * head_dim + num_v_heads * head_dim
    width = conv_dim + num_v_heads * head_dim + 2 * num_v_heads
    row = conv_dim * (conv_width - 1) + num_v_heads * head_dim * head_dim
    return dict(sx_t=width, sz_t=width, sb_t=width, sa_t=width, scw_d=conv_width, scw_k=1, sc_s=row,
                sc_d=conv_width - 1, sc_k=1, ss_s=row, ss_h=head_dim * head_dim, ss_k=1, ss_v=head_dim,
                sarr_s=num_k_heads, so_t=num_v_heads * head_dim, sq_t=num_v_heads * head_dim, shc_r=num_v_heads,
                rows=rows, C=conv_dim)


def compile_variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """The fused decode kernel's variants for the Qwen3.5 shapes (Dk = Dv = 128, conv width 4; Hv / Hk = 1 as the 2B,
    2 as the 9B, 3 as the 27B) in a bf16 model with a float32 state, and with a bf16 state, a float32 and an fp16
    model, as ``(name, jit function, argument types, constexprs)`` for a compile check without a GPU
    (``tests/kernels/test_gdn_decode_fused.py``)."""
    from hyserve.kernels.gdn._triton import _gdn_decode_fused_kernel, _gdn_decode_split_kernel

    out: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = []
    i32 = "i32"
    combos = [("bf16", "fp32", g) for g in (1, 2, 3)]
    combos += [("bf16", "bf16", 2), ("fp32", "fp32", 2), ("fp16", "fp16", 1)]
    for act, state, group in combos:
        sig = dict(x_ptr=f"*{act}", z_ptr=f"*{act}", b_ptr=f"*{act}", a_ptr=f"*{act}", cw_ptr=f"*{act}",
                   alog_ptr="*fp32", dtb_ptr="*fp32", nw_ptr=f"*{act}", conv_ptr=f"*{act}", state_ptr=f"*{state}",
                   slots_ptr="*i64", qsl_ptr="*i32", arr_ptr="*i32", out_ptr=f"*{act}", q_ptr="*fp8e4nv",
                   qs_ptr="*fp32", cnt_ptr="*i32",
                   **{s: i32 for s in ("sx_t", "sz_t", "sb_t", "sa_t", "scw_d", "scw_k", "sc_s", "sc_d", "sc_k",
                                       "ss_s", "ss_h", "ss_k", "ss_v", "sarr_s", "so_t", "sq_t")},
                   scale="fp32", eps="fp32", fp8_max="fp32", amax_eps="fp32")
        # FP8 out_proj (the seed's 27B shape: 48 value heads, Hv / Hk = 3): the output quantized in the launch
        for quant in (False, True) if (act, state, group) == ("bf16", "fp32", 3) else (False,):
            out.append((f"gdn_decode_fused_g{group}_{act}_{state}_state{'_fp8' if quant else ''}",
                        _gdn_decode_fused_kernel, sig,
                        dict(HK=16, DK=128, DV=128, GROUP=group, K=4, **launch_config(128, 128, 4), QUANT=quant,
                             QBLOCK=quant_block(16 * group * 128), UPFRONT=False)))
    # The walk's UPFRONT form (the head's whole state one 128-wide tile) on the 9B's bf16 state
    bf16_g2 = next(v for v in out if v[0] == "gdn_decode_fused_g2_bf16_bf16_state")
    out.append(("gdn_decode_fused_g2_bf16_bf16_state_upfront", bf16_g2[1], bf16_g2[2],
                {**bf16_g2[3], "BV": 128, "UPFRONT": True}))
    # The persistent launch (the UPFRONT walk looping over pairs in a pipelined loop) on the 9B's bf16 state, and the
    # windows' roll after it
    from hyserve.kernels.gdn._triton import _conv_roll_kernel, _gdn_decode_persist_kernel

    persist_sig = {k: v for k, v in bf16_g2[2].items() if k not in ("q_ptr", "qs_ptr", "cnt_ptr", "sq_t", "fp8_max",
                                                                   "amax_eps")}
    persist_consts = {k: v for k, v in bf16_g2[3].items() if k not in ("QUANT", "QBLOCK", "UPFRONT")}
    out.append(("gdn_decode_persist_g2_bf16_bf16_state", _gdn_decode_persist_kernel, {**persist_sig, "rows": i32},
                {**persist_consts, "BV": 128, "STAGES": 3, "ROLL": False}))
    # ... and at one stage with the windows rolled in its loop (roll_inside)
    out.append(("gdn_decode_persist_g2_bf16_bf16_state_roll", _gdn_decode_persist_kernel,
                {**persist_sig, "rows": i32}, {**persist_consts, "BV": 128, "STAGES": 1, "ROLL": True}))
    out.append(("conv_roll_bf16", _conv_roll_kernel,
                dict(x_ptr="*bf16", conv_ptr="*bf16", slots_ptr="*i64", qsl_ptr="*i32", C=i32, sx_t=i32, sc_s=i32,
                     sc_d=i32, sc_k=i32), dict(K=4, KM1_PAD=4, BC=ROLL_BLOCK)))
    # The split launch (one program per value block, the head counters): the 9B's and the 27B's bf16 models
    # and the state tile loaded before the q / k prologue (EARLY), the output from the state before its update
    # (ONEPASS), on the 9B's bf16 state
    for state, group, quant, early, one in (("fp32", 2, False, False, False), ("bf16", 2, False, False, False),
                                            ("fp32", 3, True, False, False), ("bf16", 2, False, True, False),
                                            ("bf16", 2, False, False, True)):
        sig = dict(x_ptr="*bf16", z_ptr="*bf16", b_ptr="*bf16", a_ptr="*bf16", cw_ptr="*bf16", alog_ptr="*fp32",
                   dtb_ptr="*fp32", nw_ptr="*bf16", conv_ptr="*bf16", state_ptr=f"*{state}", slots_ptr="*i64",
                   qsl_ptr="*i32", arr_ptr="*i32", hcnt_ptr="*i32", out_ptr="*bf16", q_ptr="*fp8e4nv",
                   qs_ptr="*fp32", cnt_ptr="*i32",
                   **{s: i32 for s in ("sx_t", "sz_t", "sb_t", "sa_t", "scw_d", "scw_k", "sc_s", "sc_d", "sc_k",
                                       "ss_s", "ss_h", "ss_k", "ss_v", "sarr_s", "shc_r", "so_t", "sq_t")},
                   scale="fp32", eps="fp32", fp8_max="fp32", amax_eps="fp32")
        form = ("_fp8" if quant else "") + ("_early" if early else "") + ("_onepass" if one else "")
        out.append((f"gdn_decode_split_g{group}_bf16_{state}_state{form}", _gdn_decode_split_kernel, sig,
                    dict(HK=16, DK=128, DV=128, GROUP=group, K=4, **{**launch_config(128, 128, 4), "BV": 32},
                         QUANT=quant, QBLOCK=quant_block(16 * group * 128), EARLY=early, ONEPASS=one)))
    return out
