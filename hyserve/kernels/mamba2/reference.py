"""Mamba2's selective state space scan over varlen rows with slot-indexed states, in plain torch (the CPU path of
:func:`hyserve.kernels.mamba2.mamba2_scan` and the yardstick of its kernels).

Per head ``h`` (``H`` heads of ``P`` channels, their ``B`` / ``C`` from group ``h // (H / G)``) and token ``t`` of a
row, with the row's state ``S`` (``(H, P, N)``, float32 arithmetic)::

    dt_t = clamp(softplus(dt[t, h] + dt_bias[h]), *dt_limit)
    S    = exp(dt_t * A[h]) * S + dt_t * x[t, h] (outer) B[t, g]      A = -exp(A_log) (float32), one scalar a head
    y[t, h] = S @ C[t, g] + D[h] * x[t, h]

This is transformers' ``mamba2_chunk_scan`` (NemotronH, Granite-4.0-H, Falcon-H1) token by token; its chunked form
sums the same terms in another order. The clamp applies at every token, prefill and decode alike (transformers' own
single-token update leaves it out; its default lower limit, 1e-3, is below softplus of any realistic input).

Layout as :mod:`hyserve.kernels.varlen`: ``query_start_loc`` (R + 1) row offsets, ``state_slots`` (R) each row's slot
in ``ssm_state`` (``(S, H, P, N)``, stored in its own dtype, float32 by default). The loop bound is
``max_query_len``, a host int; storing the final states picks the rows with tokens on the host, as the conv's
reference does: this is the CPU path (CUDA takes the kernels of ``_triton.py`` and fla-core's chunked scan).

``mamba2_chunked_inputs_ref`` and ``mamba2_chunked_output_ref``: the torch formulation of what the chunked (fla) path
hands fla and makes of its result, the yardstick of ``_triton.py``'s passes before and after fla.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from hyserve.kernels.commit.reference import replay_ref

if TYPE_CHECKING:
    from hyserve.model.metadata import RowSnapshots

__all__ = ["MAMBA2_STASH_NAMES", "mamba2_chunked_inputs_ref", "mamba2_chunked_output_ref", "mamba2_replay_ref",
           "mamba2_scan_ref", "mamba2_verify_ref", "ssd_update"]

# What a verify step keeps per (row, position) to rebuild a state (hyserve.kernels.mamba2.verify), float32: the
# head's input x (H, P), the group's B (G, N) and the time step dt after its bias, softplus and clamp (H,).
MAMBA2_STASH_NAMES = ("x", "B", "dt")


def ssd_update(state: torch.Tensor, step: torch.Tensor, a: torch.Tensor, x: torch.Tensor,
               b: torch.Tensor) -> torch.Tensor:
    """One token of the recurrence for a batch of states ``(n, H, P, N)`` float32: ``exp(step a) S + (step x) B^T``
    with ``step`` ``(n, H)``, ``a`` ``(H,)``, ``x`` ``(n, H, P)``, ``b`` ``(n, H, N)`` (groups expanded to heads).
    The scan and the replay share it, so a replayed state is the scan's bit for bit."""
    return (torch.exp(step * a)[:, :, None, None] * state
            + (step[:, :, None] * x)[:, :, :, None] * b[:, :, None, :])


def mamba2_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scratch: torch.Tensor | None = None,
    snapshots: RowSnapshots | None = None,
) -> torch.Tensor:
    """``y`` (T, H, P) in float32 for ``x`` (T, H, P), ``dt`` (T, H) before its bias and softplus, ``A_log`` (H,),
    ``B`` and ``C`` (T, G, N), ``D`` and ``dt_bias`` (H,).

    Without ``scratch`` each non-empty row's slot ends holding its state after its last token. With ``scratch``
    (``(>= R, k + 1, H, P, N)``: a verify step) the slots are only read, and ``scratch[r, j]`` takes row ``r``'s state
    after its ``j``-th token (``j <= k``), the candidates a commit or a snapshot copies. ``snapshots`` (not with
    ``scratch``): row ``rows[i]``'s state after ``offsets[i]`` of its tokens into ``ssm_state[entries[i]]``, rounded
    to the pool's dtype (prefix-cache snapshots inside rows)."""
    t, h, p = x.shape
    r = state_slots.shape[0]
    g = B.shape[1]
    dev = x.device
    y = torch.zeros((t + 1, h, p), dtype=torch.float32, device=dev)  # row t: where absent tokens write
    if t == 0 or r == 0:
        return y[:t]
    rep = h // g
    slots = state_slots.to(torch.int64)
    qsl = query_start_loc.to(torch.int64)
    lens = qsl[1:] - qsl[:-1]
    state = ssm_state.index_select(0, slots).float()  # (R, H, P, N)
    a = -torch.exp(A_log.float())
    xs, dts = x.float(), dt.float()
    bs = B.float().repeat_interleave(rep, dim=1)  # (T, H, N)
    cs = C.float().repeat_interleave(rep, dim=1)
    at: dict[int, list[tuple[int, int]]] = {}  # scan step -> [(row, entry)]
    if snapshots is not None:
        assert scratch is None, "snapshots inside rows are prefill's"
        for row, off, entry in zip(snapshots.rows, snapshots.offsets, snapshots.entries.tolist(), strict=True):
            at.setdefault(off - 1, []).append((row, entry))
    for j in range(max_query_len):
        here = j < lens  # (R,)
        tok = torch.where(here, qsl[:-1] + j, torch.full_like(lens, t))
        src = tok.clamp(max=t - 1)
        step = F.softplus(dts[src] + dt_bias.float()).clamp(dt_limit[0], dt_limit[1])  # (R, H)
        xt = xs[src]  # (R, H, P)
        new = ssd_update(state, step, a, xt, bs[src])
        state = torch.where(here[:, None, None, None], new, state)
        for row, entry in at.get(j, ()):
            ssm_state[entry] = state[row].to(ssm_state.dtype)
        out = (state * cs[src][:, :, None, :]).sum(-1) + D.float()[None, :, None] * xt
        y.index_copy_(0, tok, torch.where(here[:, None, None], out, y.index_select(0, tok)))
        if scratch is not None and j < scratch.shape[1]:  # the scratch may hold more rows than the step's
            col = scratch[:r, j]
            scratch[:r, j] = torch.where(here[:, None, None, None], state.to(scratch.dtype), col)
    if scratch is None:  # only rows with tokens write (an empty row's slot may be another row's)
        keep = torch.nonzero(lens > 0).squeeze(1)  # a host sync: this is the CPU path
        ssm_state.index_copy_(0, slots[keep], state[keep].to(ssm_state.dtype))
    return y[:t]


def mamba2_chunked_inputs_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v, g, h0)``, what fla's ``chunk_simple_gla`` takes for Mamba2's SSD: ``q = C``, ``k = B`` (groups
    expanded to heads, head ``h`` reading group ``h // (H / G)``, ``(T, H, N)`` in ``x``'s dtype), ``v = x * step``
    (``(T, H, P)``, rounded to ``x``'s dtype), ``g = step * A`` (``(T, H)`` float32), ``step = clamp(softplus(dt +
    dt_bias), *dt_limit)``, and the rows' states ``h0 = ssm_state[slots]`` (the pool's dtype)."""
    dtype = x.dtype
    step = F.softplus(dt.float() + dt_bias.float()).clamp(dt_limit[0], dt_limit[1])  # (T, H) float32
    rep = x.shape[1] // B.shape[1]
    q = C.to(dtype).repeat_interleave(rep, dim=1)
    k = B.to(dtype).repeat_interleave(rep, dim=1)
    v = (x.float() * step[:, :, None]).to(dtype)
    g = step * -torch.exp(A_log.float())[None, :]
    return q, k, v, g, ssm_state[slots]


def mamba2_chunked_output_ref(o: torch.Tensor, x: torch.Tensor, D: torch.Tensor, final: torch.Tensor,
                              ssm_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``y = o + D * x`` float32 ``(T, H, P)`` from fla's output ``o`` ``(T, H, P)``; the rows' final states
    ``final`` (float32 ``(R, H, P, N)``) stored into their slots of ``ssm_state``, rounded to its dtype."""
    ssm_state[slots] = final.to(ssm_state.dtype)
    return o.float() + D.float()[None, :, None] * x.float()


def mamba2_verify_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    stash: dict[str, torch.Tensor],
) -> torch.Tensor:
    """Reference :func:`~hyserve.kernels.mamba2.verify.mamba2_verify`: the outputs of :func:`mamba2_scan_ref` over
    the rows' states without writing them; ``stash[name][r, j]`` takes row ``r``'s token ``j``'s inputs
    (``MAMBA2_STASH_NAMES``, ``j < min(n_r, P_max)``), every other stash entry left as it was."""
    r = state_slots.shape[0]
    qsl = query_start_loc.to(torch.int64)
    npos = stash["x"].shape[1]
    j = torch.arange(npos, device=x.device)
    rr, jj = torch.nonzero(j < (qsl[1:] - qsl[:-1])[:, None], as_tuple=True)
    tok = (qsl[:-1, None] + j)[rr, jj]
    step = F.softplus(dt.float() + dt_bias.float()).clamp(dt_limit[0], dt_limit[1])
    for name, v in zip(MAMBA2_STASH_NAMES, (x.float(), B.float(), step), strict=True):
        stash[name][rr, jj] = v[tok]
    own = ssm_state.index_select(0, state_slots.to(torch.int64))  # the rows' states, copied: the pool is only read
    return mamba2_scan_ref(x, dt, A_log, B, C, D, dt_bias, dt_limit, own, torch.arange(r, device=x.device),
                           query_start_loc, max_query_len)


def mamba2_replay_ref(
    ssm_state: torch.Tensor,
    A_log: torch.Tensor,
    stash: dict[str, torch.Tensor],
    rows: torch.Tensor | None,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    counts: torch.Tensor,
) -> None:
    """Reference :func:`~hyserve.kernels.mamba2.verify.mamba2_replay`: the entries advanced in lockstep over the
    stash's positions with :func:`ssd_update` (the scan's; :func:`~hyserve.kernels.commit.reference.replay_ref`)."""
    a = -torch.exp(A_log.float())

    def make_update(idx: torch.Tensor, steps: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
        sx, sb, sdt = (stash[name][idx, :steps] for name in MAMBA2_STASH_NAMES)  # (n, steps, ...) gathered once
        sb = sb.repeat_interleave(sx.shape[2] // sb.shape[2], dim=2)  # groups expanded to heads
        return lambda state, j: ssd_update(state, sdt[:, j], a, sx[:, j], sb[:, j])

    replay_ref(ssm_state, rows, src_slots, dst_slots, counts, stash["x"].shape[1], make_update)
