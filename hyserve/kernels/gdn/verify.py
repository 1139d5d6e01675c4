"""The gated delta rule's speculative-decoding variant: verify draft tokens without touching the live SSM state.

docs/design.md invariant 2: drafts never touch live state. Verifying ``k`` draft tokens of a request is a row of
``n_r <= k + 1`` tokens; :func:`gdn_verify` computes the same outputs as :func:`~hyserve.kernels.gdn.gdn_forward` but
only READS ``ssm_state``. It does not keep the state after each position (a candidate is the size of the state: 3 MB
a layer for the 27B shape's 48 float32 heads of 128 x 128); it keeps each position's inputs to the recurrence in a
row-indexed **stash**, and :func:`gdn_replay` rebuilds the one state that is wanted from the slot's state and those
inputs: after acceptance, the commit advances each row's slot over its ``a + 1`` kept tokens in place; a prefix-cache
candidate snapshot at position ``p`` advances the slot over ``p + 1`` tokens into its entry (before the commit: it
reads the slot's state before the step). A verify step then reads each state twice and writes it once, where keeping
every candidate wrote ``k + 1`` states and copied one back (read and write): for k = 2 a third of the traffic.

Stash (``gdn_stash_shapes``; allocate once for the largest verify batch ``R_max`` and ``P_max = k + 1`` positions),
float32, the values the kernels load before any arithmetic: ``k`` ``(R_max, P_max, Hk, Dk)`` (not l2-normalised),
``v`` ``(R_max, P_max, Hv, Dv)``, ``g`` and ``beta`` ``(R_max, P_max, Hv)``. Only entries ``(r, j)`` with ``j < n_r``
(and ``j < P_max``) are written; an empty row writes nothing.

Replay and verify share one state update (``_delta_rule_update`` on CUDA; the reference's ops on the CPU), so a
replayed state is the state the verify computed its outputs from.

Dispatch: CUDA tensors run ``_gdn_verify_kernel`` / ``_gdn_replay_kernel`` (``_triton.py``: no host sync,
fixed-shape launches: safe to capture in a CUDA graph); everything else runs the references
(:func:`~hyserve.kernels.gdn.reference.gdn_verify_ref`, :func:`~hyserve.kernels.gdn.reference.gdn_replay_ref`).
"""

from __future__ import annotations

from typing import Any

import torch

from hyserve.kernels.commit import check_index_vectors, copy_candidate_windows, window_args
from hyserve.kernels.fp8.reference import AMAX_EPS, FP8_MAX, Fp8Activation, quantize_activation_ref
from hyserve.kernels.gdn.reference import STASH_NAMES, gdn_replay_ref, gdn_verify_ref
from hyserve.utils import next_pow2

__all__ = [
    "STASH_NAMES",
    "compile_variants",
    "gdn_replay",
    "gdn_replay_ref",
    "gdn_replay_triton",
    "gdn_stash_shapes",
    "gdn_verify",
    "gdn_verify_fused",
    "gdn_verify_fused_ref",
    "gdn_verify_fused_triton",
    "gdn_verify_ref",
    "gdn_verify_triton",
    "verify_launch",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def gdn_stash_shapes(num_k_heads: int, head_k_dim: int, num_v_heads: int,
                     head_v_dim: int) -> dict[str, tuple[int, ...]]:
    """Each stash tensor's shape per (row, position); every one is float32."""
    return {"k": (num_k_heads, head_k_dim), "v": (num_v_heads, head_v_dim), "g": (num_v_heads,),
            "beta": (num_v_heads,)}


def _check_stash(k_head: tuple[int, ...], v_head: tuple[int, ...], rows: int, stash: dict[str, torch.Tensor]) -> None:
    """The stash against a key head's ``(Hk, Dk)`` and a value head's ``(Hv, Dv)`` shapes."""
    assert set(stash) >= set(STASH_NAMES), f"the stash needs {STASH_NAMES}"
    sk, sv, sg, sb = (stash[n] for n in STASH_NAMES)
    assert all(t.dtype == torch.float32 for t in (sk, sv, sg, sb)), "the stash is float32"
    assert sk.shape[2:] == k_head and sv.shape[2:] == v_head, "stash k / v must be (R_max, P_max, H, D)"
    assert sg.shape == sb.shape == sv.shape[:3], "stash g / beta must be (R_max, P_max, Hv)"
    assert sk.shape[:2] == sv.shape[:2] and sk.shape[0] >= rows, "the stash has fewer rows than the batch"
    assert all(t.stride(-1) == 1 for t in (sk, sv, sg, sb)) and sg.stride() == sb.stride()


def gdn_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    stash: dict[str, torch.Tensor],
    max_query_len: int,
) -> torch.Tensor:
    """:func:`~hyserve.kernels.gdn_forward` that leaves ``ssm_state`` alone and stashes every position's inputs.

    Args:
        q, k: ``(T, Hk, Dk)``; v: ``(T, Hv, Dv)`` in the model dtype; g: ``(T, Hv)`` log-decay; beta: ``(T, Hv)``.
        ssm_state: ``(S, Hv, Dk, Dv)`` live pool (read only; float32 or a 16-bit float).
        stash: the module docstring's tensors; ``stash[name][r, j]`` receives row ``r``'s token ``j`` (``j < n_r``).
        max_query_len: host int ``>=`` the longest row.

    Returns ``(T, Hv, Dv)`` in ``v.dtype``. On CUDA this is always the exact token-by-token recurrence (the recurrent
    kernel's math), whatever the row lengths.
    """
    _check_stash(k.shape[1:], v.shape[1:], state_slots.shape[0], stash)
    if q.is_cuda:
        return gdn_verify_triton(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, stash)
    return gdn_verify_ref(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, stash, max_query_len)


def _tiles(dk: int, dv: int) -> tuple[int, int]:
    """(BK, BV): the state tile gdn_recurrent_triton takes."""
    bk = next_pow2(dk)
    return bk, min(next_pow2(dv), max(16, 4096 // bk))


def gdn_verify_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    stash: dict[str, torch.Tensor],
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton :func:`gdn_verify`: one program per (row, value head, ``BV`` block), any row lengths, no host sync.

    ``out`` optionally supplies the ``(T, Hv, Dv)`` output buffer (last dim contiguous)."""
    from hyserve.kernels.gdn._triton import _gdn_verify_kernel

    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    R = state_slots.shape[0]
    assert Hv % Hk == 0, "Hv must be a multiple of Hk"
    assert ssm_state.shape[1:] == (Hv, Dk, Dv), "ssm_state must be (S, Hv, Dk, Dv)"
    _check_stash(k.shape[1:], v.shape[1:], R, stash)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if out is None:
        out = torch.empty((T, Hv, Dv), dtype=v.dtype, device=v.device)
    assert out.shape == (T, Hv, Dv) and out.stride(2) == 1
    if R == 0 or T == 0:
        return out
    bk, bv = _tiles(Dk, Dv)
    ss = ssm_state
    sk, sv, sg, sb = (stash[n] for n in STASH_NAMES)
    grid = (R, Hv, _cdiv(Dv, bv))
    _gdn_verify_kernel[grid](
        q, k, v, g, beta, ss, state_slots, query_start_loc, out,
        sk, sv, sg, sb,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        ss.stride(0), ss.stride(1), ss.stride(2), ss.stride(3),
        out.stride(0), out.stride(1),
        sk.stride(0), sk.stride(1), sk.stride(2), sv.stride(0), sv.stride(1), sv.stride(2), sg.stride(0), sg.stride(1),
        sk.shape[1], Dk**-0.5,
        DK=Dk, DV=Dv, GROUP=Hv // Hk, BK=bk, BV=bv,
        num_warps=4,
    )  # fmt: skip
    return out


def gdn_replay(
    ssm_state: torch.Tensor,
    stash: dict[str, torch.Tensor],
    rows: torch.Tensor | None,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    counts: torch.Tensor,
    conv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Entry ``i`` with ``c = counts[i] >= 0``: ``ssm_state[dst_slots[i]]`` = the state of ``src_slots[i]`` advanced
    over stash row ``rows[i]``'s tokens ``0 .. c`` (``rows`` None: row ``i``); entries with ``c < 0`` do nothing.
    ``conv`` = ``(conv_state, conv_scratch)``: the candidate window ``conv_scratch[row, c]`` copied to
    ``conv_state[dst_slots[i]]`` in the same launch (the whole commit, or candidate snapshot, of a layer).

    The commit of a verify step is ``gdn_replay(pool, stash, None, slots, slots, num_accepted)``; a candidate
    snapshot ``gdn_replay(pool, stash, rows, slots[rows], entries, positions)``, before the commit. ``c`` must name a
    stashed token (``c < min(n_r, P_max)``); destinations must be distinct and no entry's destination another's
    source. All index tensors are ``(N,)`` int on the pool's device; nothing here syncs with the host on CUDA.
    """
    assert src_slots.shape == dst_slots.shape == counts.shape and counts.dim() == 1
    assert rows is None or rows.shape == counts.shape
    if ssm_state.is_cuda:  # the Triton form checks the index vectors itself
        gdn_replay_triton(ssm_state, stash, rows, src_slots, dst_slots, counts, conv)
        return
    check_index_vectors(rows, src_slots, dst_slots, counts)
    if conv is not None:
        copy_candidate_windows(conv, rows, dst_slots, counts)
    gdn_replay_ref(ssm_state, stash, rows, src_slots, dst_slots, counts)


def gdn_replay_triton(
    ssm_state: torch.Tensor,
    stash: dict[str, torch.Tensor],
    rows: torch.Tensor | None,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    counts: torch.Tensor,
    conv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Triton :func:`gdn_replay`: one program per (entry, value head, ``BV`` block), the tile read once and written
    once, the window copied in ``Hv`` pieces by the first block's programs (graph-capturable). The conv pool's and
    scratch's entries must each be contiguous."""
    from hyserve.kernels.gdn._triton import _gdn_replay_kernel

    check_index_vectors(rows, src_slots, dst_slots, counts)
    N = counts.shape[0]
    _, Hv, Dk, Dv = ssm_state.shape
    sk, sv, sg, sb = (stash[n] for n in STASH_NAMES)
    assert sk.shape[3] == Dk and sv.shape[2:] == (Hv, Dv) and Hv % sk.shape[2] == 0
    if N == 0:
        return
    bk, bv = _tiles(Dk, Dv)
    ss = ssm_state
    pool, scratch, entry = window_args(conv, ss)
    _gdn_replay_kernel[(N, Hv, _cdiv(Dv, bv))](
        ss, sk, sv, sg, sb, counts if rows is None else rows, src_slots, dst_slots, counts,
        pool, scratch,
        ss.stride(0), ss.stride(1), ss.stride(2), ss.stride(3),
        sk.stride(0), sk.stride(1), sk.stride(2), sv.stride(0), sv.stride(1), sv.stride(2), sg.stride(0), sg.stride(1),
        pool.stride(0), scratch.stride(0), scratch.stride(1), entry,
        sk.shape[1],
        DK=Dk, DV=Dv, GROUP=Hv // sk.shape[2], BK=bk, BV=bv, ROWS=rows is not None, CONV=conv is not None,
        num_warps=4,
    )  # fmt: skip


def gdn_verify_fused(
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
    conv_scratch: torch.Tensor,
    stash: dict[str, torch.Tensor],
    max_query_len: int,
    quant: str | None = None,
    row_counts: torch.Tensor | None = None,
    head_counts: torch.Tensor | None = None,
    split: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | Fp8Activation:
    """The mixer's verify rows from ``in_proj``'s output to ``out_proj``'s input in one launch on CUDA; returns
    ``(T, Hv * Dv)`` in the model dtype (``quant="fp8"``: quantized per token for an FP8 ``out_proj`` in the same
    launch, an :class:`Fp8Activation`). The live ``conv_state`` and ``ssm_state`` are only read; the candidate
    windows go to ``conv_scratch`` and the delta rule's inputs to ``stash``, as :func:`gdn_verify_fused_ref` (the
    unfused sequence, the op's definition and the CPU path) writes them.

    Arguments as :func:`hyserve.kernels.gdn.decode.gdn_decode_fused`'s, with rows of any length, and
    :func:`~hyserve.kernels.conv.causal_conv1d_verify`'s ``conv_scratch`` and :func:`gdn_verify`'s ``stash``.
    ``head_counts`` (:func:`~hyserve.kernels.gdn.decode.head_counters_for`) lets the launch split each value head over
    its value blocks; ``split`` as :func:`verify_launch` takes it (None: its own choice). ``out``: the contiguous
    ``(T, Hv * Dv)`` buffer the plain output is written into (a mixer's step with rows after its verify rows writes
    both parts into one)."""
    if not x.is_cuda:
        ref = gdn_verify_fused_ref(x, z, b, a, conv_weight, a_log, dt_bias, norm_weight, eps, conv_state, ssm_state,
                                   state_slots, query_start_loc, num_k_heads, conv_scratch, stash, max_query_len)
        if out is not None:
            ref = out.copy_(ref)
        return ref if quant is None else quantize_activation_ref(ref)
    use_split, block_v, warps = verify_launch(state_slots.shape[0], ssm_state.shape[1], split) \
        if head_counts is not None else (False, None, 4)
    return gdn_verify_fused_triton(x, z, b, a, conv_weight, a_log, dt_bias, norm_weight, eps, conv_state, ssm_state,
                                   state_slots, query_start_loc, num_k_heads, conv_scratch, stash, quant, row_counts,
                                   split=use_split, head_counts=head_counts, out=out, block_v=block_v,
                                   num_warps=warps)


# The fused verify's split launch, from the card's sweep (``gdn_verify_bench.py --fused``, one H100, value-major float32
# state, k = 1 and 2; benchmarks/results/h100/seed_2026-12-07d): ahead of the walk at one row of the 27B's 48 value
# heads (1.78-1.88x) and of the 9B's 32 (2.03-2.15x), level or behind from 8 rows (27B 0.99-1.02x, 9B 0.78-0.80x,
# 16-64 rows 0.74-0.82x): split up to VERIFY_SPLIT_UP_TO (row, value head) pairs, in 32-wide value blocks on 4 warps
# (the config ahead at both points, and bit for bit the walk's at the same block there).
VERIFY_SPLIT_UP_TO = 48


def verify_launch(rows: int, num_v_heads: int, split: bool | None = None) -> tuple[bool, int | None, int]:
    """``(split, BV, warps)`` for a fused verify launch of ``rows`` rows: whether each value head is split over
    programs, one a value block (``_gdn_verify_fused_kernel``'s ``SPLIT``), its value block (None: the walk's own)
    and warps. ``split`` None: split up to :data:`VERIFY_SPLIT_UP_TO` (row, value head) pairs, where the card's sweep
    has it ahead (a launch of few programs: one row of 32-48 heads), the walk beyond; True / False forces one
    (``HYSERVE_GDN_VERIFY_SPLIT``), a forced split past the threshold in 64-wide blocks (the sweep's best there)."""
    pairs = rows * num_v_heads
    if split is None:
        split = pairs <= VERIFY_SPLIT_UP_TO
    if not split:
        return (False, None, 4)
    return (True, 32, 4) if pairs <= VERIFY_SPLIT_UP_TO else (True, 64, 4)


def gdn_verify_fused_ref(
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
    conv_scratch: torch.Tensor,
    stash: dict[str, torch.Tensor],
    max_query_len: int,
) -> torch.Tensor:
    """The unfused references in sequence (conv verify, gates, delta-rule verify, gated norm): the op's definition."""
    from hyserve.kernels.conv.reference import causal_conv1d_verify_ref
    from hyserve.kernels.gating.reference import gdn_gating_ref
    from hyserve.kernels.norm.reference import gated_rms_norm_ref

    t = x.shape[0]
    hv, dk, dv = ssm_state.shape[1:]
    key_dim = num_k_heads * dk
    mixed = causal_conv1d_verify_ref(x, conv_weight, conv_state, state_slots, query_start_loc, conv_scratch)
    q, k, v = torch.split(mixed, [key_dim, key_dim, hv * dv], dim=-1)
    g, beta = gdn_gating_ref(a, b, a_log, dt_bias)
    o = gdn_verify_ref(q.reshape(t, num_k_heads, dk), k.reshape(t, num_k_heads, dk), v.reshape(t, hv, dv), g, beta,
                       ssm_state, state_slots, query_start_loc, stash, max_query_len)
    return gated_rms_norm_ref(o.reshape(-1, dv), z.reshape(-1, dv), norm_weight, eps).reshape(t, hv * dv)


def gdn_verify_fused_triton(
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
    conv_scratch: torch.Tensor,
    stash: dict[str, torch.Tensor],
    quant: str | None = None,
    row_counts: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    block_v: int | None = None,
    split: bool = False,
    head_counts: torch.Tensor | None = None,
    num_warps: int = 4,
) -> torch.Tensor | Fp8Activation:
    """Triton :func:`gdn_verify_fused`: one program per (row, value head), no host sync, a fixed-shape launch (also
    runs under ``TRITON_INTERPRET=1``). ``out`` optionally supplies the contiguous ``(T, Hv * Dv)`` output;
    ``block_v`` overrides the value block ``BV`` (a power of two). ``split``: one program per (row, value head,
    value block) instead, which needs ``head_counts`` (:func:`~hyserve.kernels.gdn.decode.head_counters_for`: zeros,
    left at zero; one row a row of the launch); the same values bit for bit."""
    from hyserve.kernels.gdn._triton import _gdn_verify_fused_kernel
    from hyserve.kernels.gdn.decode import as_output, fp8_output, launch_config, quant_block

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
    cs = conv_scratch
    assert cs.dim() == 4 and cs.shape[2:] == conv_state.shape[1:] and cs.shape[0] >= r, \
        "conv_scratch must be (R_max, P_max, conv_dim, K - 1)"
    assert cs.dtype == conv_state.dtype, "conv_scratch must have conv_state's dtype"
    _check_stash(torch.Size((hk, dk)), torch.Size((hv, dv)), r, stash)
    x, z, a, b = (_unit_last(u) for u in (x, z, a, b))
    if out is None:
        out = torch.empty((t, hv * dv), dtype=x.dtype, device=x.device)
    assert out.shape == (t, hv * dv) and out.stride(1) == 1
    q, qs, cnt = fp8_output(out, r, quant, row_counts)
    if r == 0 or t == 0:
        return as_output(out, q, qs, quant)
    cfg = launch_config(dk, dv, kw)
    if block_v is not None:
        assert block_v == next_pow2(block_v), "block_v must be a power of two"
        cfg["BV"] = block_v
    sk, sv, sg, sb = (stash[n] for n in STASH_NAMES)
    if split:
        assert head_counts is not None and head_counts.dtype == torch.int32, "a split launch needs head_counts"
        assert head_counts.shape[0] >= r and head_counts.shape[1] == hv and head_counts.stride(1) == 1, \
            "head_counts must be (>= rows, Hv) int32"
    hc = head_counts if split and head_counts is not None else cnt
    grid = (r, hv * _cdiv(dv, cfg["BV"]) if split else hv)
    _gdn_verify_fused_kernel[grid](
        x, z, b, a, conv_weight, a_log, dt_bias, norm_weight,
        conv_state, ssm_state, state_slots, query_start_loc, out, cs,
        sk, sv, sg, sb, q, qs, cnt, hc,
        x.stride(0), z.stride(0), b.stride(0), a.stride(0), conv_weight.stride(0), conv_weight.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), ssm_state.stride(3),
        out.stride(0), cs.stride(0), cs.stride(1), cs.stride(2), cs.stride(3),
        sk.stride(0), sk.stride(1), sk.stride(2), sv.stride(0), sv.stride(1), sv.stride(2), sg.stride(0), sg.stride(1),
        q.stride(0), hc.stride(0), sk.shape[1], dk**-0.5, float(eps), FP8_MAX, AMAX_EPS,
        HK=hk, DK=dk, DV=dv, GROUP=hv // hk, K=kw, **cfg, QUANT=quant is not None, QBLOCK=quant_block(hv * dv),
        SPLIT=split, num_warps=num_warps,
    )  # fmt: skip
    return as_output(out, q, qs, quant)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def card_values(positions: int = 3, num_k_heads: int = 16, num_v_heads: int = 32, head_dim: int = 128,
                conv_width: int = 4) -> dict[str, int]:
    """The integer arguments of a fused verify launch as the engine passes them on a card (the 9B's heads, MTP with
    two drafts: three positions a row by default), for ``compile_for_sm90``'s ``values``: the decode launch's
    (:func:`hyserve.kernels.gdn.decode.card_values`), the candidate windows' scratch ``(R, P, conv_dim, K - 1)`` and
    the float32 stash ``(R, P, H, D)`` / ``(R, P, Hv)``."""
    from hyserve.kernels.gdn.decode import card_values as decode_values

    out = decode_values(num_k_heads, num_v_heads, head_dim, conv_width)
    window = out["C"] * (conv_width - 1)
    out.update(P=positions, scr_k=1, scr_d=conv_width - 1, scr_p=window, scr_r=positions * window,
               stk_h=head_dim, stk_p=num_k_heads * head_dim, stk_r=positions * num_k_heads * head_dim,
               stv_h=head_dim, stv_p=num_v_heads * head_dim, stv_r=positions * num_v_heads * head_dim,
               stg_p=num_v_heads, stg_r=positions * num_v_heads)
    return out


def compile_variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """The verify and replay kernels' variants and the fused verify's for the Qwen3.5 shapes (Dk = Dv = 128, conv
    width 4; Hv / Hk = 1, 2, 3) in a bf16 model with a float32 state, and with a bf16 state, as ``(name, jit
    function, argument types, constexprs)`` for a compile check without a GPU (``tests/kernels/test_verify_kernels.py``,
    ``tests/kernels/test_gdn_verify_fused.py``)."""
    from hyserve.kernels.gdn._triton import _gdn_replay_kernel, _gdn_verify_fused_kernel, _gdn_verify_kernel
    from hyserve.kernels.gdn.decode import launch_config, quant_block

    out: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = []
    i32 = "i32"
    bk, bv = _tiles(128, 128)
    stash = dict(stk_ptr="*fp32", stv_ptr="*fp32", stg_ptr="*fp32", stb_ptr="*fp32")
    stash_strides = {s: i32 for s in ("stk_r", "stk_p", "stk_h", "stv_r", "stv_p", "stv_h", "stg_r", "stg_p")}
    for state, group in (("fp32", 1), ("fp32", 2), ("fp32", 3), ("bf16", 2)):
        consts = dict(DK=128, DV=128, GROUP=group, BK=bk, BV=bv)
        verify = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", g_ptr="*fp32", beta_ptr="*bf16",
                      state_ptr=f"*{state}", slots_ptr="*i64", qsl_ptr="*i32", out_ptr="*bf16", **stash,
                      **{s: i32 for s in ("sq_t", "sq_h", "sk_t", "sk_h", "sv_t", "sv_h", "sg_t", "sg_h", "sb_t",
                                          "sb_h", "ss_s", "ss_h", "ss_k", "ss_v", "so_t", "so_h")},
                      **stash_strides, P=i32, scale="fp32")
        out.append((f"gdn_verify_g{group}_{state}_state", _gdn_verify_kernel, verify, consts))
        for rows in (False, True):
            replay = dict(state_ptr=f"*{state}", **stash, rows_ptr="*i64", src_ptr="*i64", dst_ptr="*i64",
                          count_ptr="*i64", conv_ptr="*bf16", cscr_ptr="*bf16",
                          **{s: i32 for s in ("ss_s", "ss_h", "ss_k", "ss_v")}, **stash_strides,
                          **{s: i32 for s in ("sc_s", "scr_r", "scr_p", "E")}, P=i32)
            out.append((f"gdn_replay_g{group}_{state}_state{'_rows' if rows else ''}", _gdn_replay_kernel, replay,
                        dict(consts, ROWS=rows, CONV=rows, CBLOCK=256)))
        fused = dict(x_ptr="*bf16", z_ptr="*bf16", b_ptr="*bf16", a_ptr="*bf16", cw_ptr="*bf16", alog_ptr="*fp32",
                     dtb_ptr="*fp32", nw_ptr="*bf16", conv_ptr="*bf16", state_ptr=f"*{state}", slots_ptr="*i64",
                     qsl_ptr="*i32", out_ptr="*bf16", scr_ptr="*bf16", **stash, q_ptr="*fp8e4nv", qs_ptr="*fp32",
                     cnt_ptr="*i32", hcnt_ptr="*i32", shc_r=i32,
                     **{s: i32 for s in ("sx_t", "sz_t", "sb_t", "sa_t", "scw_d", "scw_k", "sc_s", "sc_d", "sc_k",
                                         "ss_s", "ss_h", "ss_k", "ss_v", "so_t", "scr_r", "scr_p", "scr_d", "scr_k")},
                     **stash_strides, sq_t=i32, P=i32, scale="fp32", eps="fp32", fp8_max="fp32", amax_eps="fp32")
        # FP8 out_proj (the seed's 27B shape, Hv / Hk = 3): the output quantized in the launch; the split launch
        # (each head over its value blocks) plain and quantized
        for quant, split in (((False, False), (True, False), (False, True), (True, True))
                             if (state, group) == ("fp32", 3) else ((False, False),)):
            out.append((f"gdn_verify_fused_g{group}_{state}_state{'_fp8' if quant else ''}{'_split' if split else ''}",
                        _gdn_verify_fused_kernel, fused,
                        dict(HK=16, DK=128, DV=128, GROUP=group, K=4, **launch_config(128, 128, 4), QUANT=quant,
                             QBLOCK=quant_block(16 * group * 128), SPLIT=split)))
    return out
