"""Plain-torch references of :mod:`hyserve.kernels.gdn` (the CPU path and the yardstick for the Triton kernels).

:func:`gdn_forward_ref` defines the op: the gated delta rule over the rows of the flat varlen layout
(:mod:`hyserve.kernels.varlen`), token by token, float32 throughout, each row's ``(Hv, Dk, Dv)`` state kept in its
slot of ``ssm_state``; rows are grouped by length (see :mod:`hyserve.kernels.varlen`). :func:`gdn_verify_ref` is its
verify variant (:mod:`hyserve.kernels.gdn.verify`), the same scan (:func:`gdn_scan`): it leaves the pool alone and
stashes every position's inputs; :func:`gdn_replay_ref` advances a slot's state over stashed positions with the
scan's own step (:func:`gdn_step`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hyserve.kernels.commit.reference import replay_ref
from hyserve.kernels.varlen import group_tokens, length_groups

if TYPE_CHECKING:
    from hyserve.model.metadata import RowSnapshots

__all__ = ["STASH_NAMES", "gdn_forward_ref", "gdn_replay_ref", "gdn_scan", "gdn_step", "gdn_verify_ref", "l2norm"]

# The verify stash's tensors (hyserve.kernels.gdn.verify), in the kernels' argument order.
STASH_NAMES = ("k", "v", "g", "beta")


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x*x) + eps)`` (the FLA / transformers convention)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def gdn_step(state: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, g_t: torch.Tensor,
             b_t: torch.Tensor) -> torch.Tensor:
    """One token's state update, float32: ``state`` (R, Hv, Dk, Dv), ``k_t`` l2-normalised (R, Hv, Dk), ``v_t``
    (R, Hv, Dv), ``g_t`` / ``b_t`` (R, Hv). S *= exp(g); S += k (beta (v - S^T k))^T."""
    s = state * g_t.exp()[..., None, None]
    kv_mem = (s * k_t[..., None]).sum(dim=-2)  # (R, Hv, Dv)
    delta = (v_t - kv_mem) * b_t[..., None]
    return s + k_t[..., None] * delta[..., None, :]


def gdn_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    qsl: torch.Tensor,
    max_query_len: int,
    on_step: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over varlen rows, advanced in lockstep one position per step, float32 throughout.

    ``state`` is the rows' starting states (R, Hv, Dk, Dv) (a gathered copy: no pool is touched here).
    ``on_step(i, active, s)`` sees each step's states (the forward reference takes snapshots inside rows there).
    Returns the outputs (T + 1, Hv, Dv) float32 (row T is a sink) and the final states.
    """
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    grp = Hv // Hk
    qf = l2norm(q.float(), eps=1e-6) * (Dk**-0.5)
    kf = l2norm(k.float(), eps=1e-6)
    if grp > 1:
        qf = qf.repeat_interleave(grp, dim=1)
        kf = kf.repeat_interleave(grp, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    starts, lens = qsl[:-1], qsl[1:] - qsl[:-1]
    # Row T of `obuf` is a sink for rows that are past their end at step i (so the loop needs no host sync).
    obuf = torch.empty((T + 1, Hv, Dv), dtype=torch.float32, device=v.device)
    for i in range(max_query_len):
        active = lens > i  # (R,)
        tok = torch.where(active, starts + i, T)
        tok_c = tok.clamp(max=T - 1)
        q_t, k_t, v_t = qf[tok_c], kf[tok_c], vf[tok_c]  # (R, Hv, D*)
        g_t, b_t = gf[tok_c], bf[tok_c]  # (R, Hv)
        s = gdn_step(state, k_t, v_t, g_t, b_t)
        obuf[tok] = (s * q_t[..., None]).sum(dim=-2)
        state = torch.where(active[:, None, None, None], s, state)
        if on_step is not None:
            on_step(i, active, s)
    return obuf, state


def gdn_forward_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    snapshots: RowSnapshots | None = None,
) -> torch.Tensor:
    """Gated delta rule, token by token (rows advanced in lockstep), float32 throughout.

    Args:
        q, k: ``(T, Hk, Dk)``; v: ``(T, Hv, Dv)`` (model dtype); ``Hv % Hk == 0`` and value head ``h`` uses key head
            ``h // (Hv // Hk)``.
        g: ``(T, Hv)`` log-decay (``<= 0``); beta: ``(T, Hv)``.
        ssm_state: ``(S, Hv, Dk, Dv)`` float32 pool, updated in place through ``state_slots``.
        max_query_len: host int ``>=`` the longest row.
        snapshots: states inside rows to write into pool entries (``RowSnapshots``: row ``rows[i]``'s state after
            ``offsets[i]`` of its tokens into ``ssm_state[entries[i]]``, rounded to the pool's dtype).

    Per token (q, k l2-normalised with eps 1e-6, q scaled by ``Dk ** -0.5``)::

        S = S * exp(g);  S += k (beta * (v - S^T k))^T;  o = S^T q

    Returns ``(T, Hv, Dv)`` in ``v.dtype``.
    """
    T = q.shape[0]
    Hv, Dv = v.shape[1], v.shape[2]
    R = state_slots.shape[0]
    out = torch.empty((T, Hv, Dv), dtype=v.dtype, device=v.device)
    slots = state_slots.to(torch.int64)
    if R == 0 or T == 0:
        return out
    qsl_host = query_start_loc.tolist()
    snaps: list[tuple[int, int, int]] = []  # (row, offset, entry)
    if snapshots is not None:
        snaps = list(zip(snapshots.rows, snapshots.offsets, snapshots.entries.tolist(), strict=True))
    # Rows advance in lockstep, so each length group runs only as many steps as its own longest row (see
    # hyserve.kernels.varlen); empty rows are in no group and keep their state.
    for rows in length_groups(query_start_loc):
        tok, sub_qsl = group_tokens(qsl_host, rows, q.device)
        n_max = max(qsl_host[r + 1] - qsl_host[r] for r in rows)
        group_slots = slots[torch.tensor(rows, dtype=torch.int64, device=slots.device)]
        at: dict[int, list[tuple[int, int]]] = {}  # group position -> [(scan step, entry)]
        for r, off, entry in snaps:
            if r in rows:
                at.setdefault(rows.index(r), []).append((off - 1, entry))

        def record(i: int, active: torch.Tensor, s: torch.Tensor, at: dict[int, list[tuple[int, int]]] = at
                   ) -> None:
            for gi, points in at.items():
                for step, entry in points:
                    if step == i:
                        ssm_state[entry] = s[gi].to(ssm_state.dtype)

        # a key-major copy: the same sums (and bits) whatever the pool's layout (HYSERVE_GDN_STATE_LAYOUT)
        start = ssm_state[group_slots].float().contiguous()
        obuf, state = gdn_scan(q[tok], k[tok], v[tok], g[tok], beta[tok], start, sub_qsl, n_max, record if at else None)
        out[tok] = obuf[: tok.shape[0]].to(out.dtype)
        ssm_state[group_slots] = state.to(ssm_state.dtype)
    return out


def gdn_verify_ref(
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
    """Reference :func:`~hyserve.kernels.gdn.verify.gdn_verify`: the scan over a gathered copy of the live states
    (the pool is never written), and each row's first ``P_max`` tokens' inputs into the stash."""
    T = q.shape[0]
    Hv, Dv = v.shape[1], v.shape[2]
    R = state_slots.shape[0]
    out = torch.empty((T, Hv, Dv), dtype=v.dtype, device=v.device)
    slots = state_slots.to(torch.int64)
    qsl = query_start_loc.to(torch.int64)
    if R == 0 or T == 0:
        return out
    P = stash["k"].shape[1]
    j = torch.arange(P, device=q.device)
    tok = qsl[:-1, None] + j  # (R, P)
    rr, jj = torch.nonzero(j < (qsl[1:] - qsl[:-1])[:, None], as_tuple=True)
    t = tok[rr, jj]
    for name, x in zip(STASH_NAMES, (k, v, g, beta), strict=True):
        stash[name][rr, jj] = x[t].float()
    obuf, _ = gdn_scan(q, k, v, g, beta, ssm_state[slots].float().contiguous(), qsl, max_query_len)
    out.copy_(obuf[:T])
    return out


def gdn_replay_ref(
    ssm_state: torch.Tensor,
    stash: dict[str, torch.Tensor],
    rows: torch.Tensor | None,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    counts: torch.Tensor,
) -> None:
    """Reference :func:`~hyserve.kernels.gdn.verify.gdn_replay`: the entries advanced in lockstep over the stash's
    positions with :func:`gdn_step` (the scan's update; :func:`~hyserve.kernels.commit.reference.replay_ref`)."""

    def make_update(idx: torch.Tensor, steps: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
        sk, sv, sg, sb = (stash[name][idx, :steps] for name in STASH_NAMES)  # (n, steps, ...) gathered once
        grp = sv.shape[2] // sk.shape[2]
        kn = l2norm(sk, eps=1e-6)
        if grp > 1:
            kn = kn.repeat_interleave(grp, dim=2)
        return lambda state, j: gdn_step(state, kn[:, j], sv[:, j], sg[:, j], sb[:, j])

    replay_ref(ssm_state, rows, src_slots, dst_slots, counts, stash["k"].shape[1], make_update)
