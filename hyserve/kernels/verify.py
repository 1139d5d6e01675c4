"""Kernels for speculative decoding: verify draft tokens without touching live recurrent state, then commit.

docs/design.md invariant 2: drafts never touch live state. Verifying ``k`` draft tokens of a request is a row of
``n_r <= k + 1`` tokens; the verify kernels compute the same outputs as :func:`~hyserve.kernels.causal_conv1d_varlen`
/ :func:`~hyserve.kernels.gdn_forward` but only READ the live pools, and write the candidate state after each
position into scratch. After acceptance, :func:`commit_verified` copies one candidate per row into the row's slot.

Scratch (indexed by ROW ``r``, not by slot; allocate once for the largest verify batch):

* ``conv_scratch``: ``(R_max, P_max, D, K - 1)`` in ``conv_state``'s dtype; ``conv_scratch[r, j]`` is the window
  after row ``r``'s token ``j`` (the last ``K - 1`` inputs of ``old window ++ row tokens 0..j``, oldest first).
* ``ssm_scratch``: ``(R_max, P_max, Hv, Dk, Dv)`` float32; ``ssm_scratch[r, j]`` is the state after token ``j``.

Only entries ``(r, j)`` with ``j < n_r`` (and ``j < P_max``) are written; every other scratch entry, the live pools,
and all slots are left bit-identical. An empty row writes nothing. Rows must satisfy ``R <= R_max`` and should have
``n_r <= P_max``: a longer row still gets correct outputs, but its positions ``>= P_max`` are not recorded.

Dispatch: CUDA tensors run the Triton kernels of ``_triton_verify.py`` (no host sync, fixed-shape launches: safe to
capture in a CUDA graph); everything else runs the plain-torch references below (the CPU path and the yardstick),
which reuse the exact arithmetic of :mod:`hyserve.kernels.reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyserve.kernels.reference import gdn_scan, row_index
from hyserve.utils import next_pow2

__all__ = [
    "causal_conv1d_verify",
    "causal_conv1d_verify_ref",
    "causal_conv1d_verify_triton",
    "commit_verified",
    "commit_verified_ref",
    "commit_verified_triton",
    "gdn_verify",
    "gdn_verify_ref",
    "gdn_verify_triton",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_conv_scratch(x: torch.Tensor, conv_state: torch.Tensor, rows: int, conv_scratch: torch.Tensor) -> None:
    assert conv_scratch.dim() == 4, "conv_scratch must be (R_max, P_max, D, K-1)"
    assert conv_scratch.shape[2:] == conv_state.shape[1:], "conv_scratch must be (R_max, P_max, D, K-1)"
    assert conv_scratch.shape[0] >= rows, "conv_scratch has fewer rows than the batch"
    assert conv_scratch.dtype == conv_state.dtype, "conv_scratch must have conv_state's dtype"
    assert conv_state.shape[1] == x.shape[1], "conv_state must be (S, D, K-1)"


def _check_ssm_scratch(v: torch.Tensor, ssm_state: torch.Tensor, rows: int, ssm_scratch: torch.Tensor) -> None:
    assert ssm_state.dtype == torch.float32 and ssm_scratch.dtype == torch.float32, "SSM states must be float32"
    assert ssm_scratch.dim() == 5, "ssm_scratch must be (R_max, P_max, Hv, Dk, Dv)"
    assert ssm_scratch.shape[2:] == ssm_state.shape[1:], "ssm_scratch must be (R_max, P_max, Hv, Dk, Dv)"
    assert ssm_scratch.shape[0] >= rows, "ssm_scratch has fewer rows than the batch"
    assert ssm_state.shape[1] == v.shape[1] and ssm_state.shape[3] == v.shape[2], "ssm_state must be (S, Hv, Dk, Dv)"


# --------------------------------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------------------------------


def causal_conv1d_verify(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    conv_scratch: torch.Tensor,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """:func:`~hyserve.kernels.causal_conv1d_varlen` that leaves ``conv_state`` alone and records every window.

    Args:
        x: ``(T, D)`` (may be a strided view); weight: ``(D, K)``.
        conv_state: ``(S, D, K - 1)`` live pool (read only).
        state_slots: ``(R,)`` slot per row; query_start_loc: ``(R + 1,)`` cumulative token offsets.
        conv_scratch: ``(R_max, P_max, D, K - 1)``, ``conv_state``'s dtype; ``conv_scratch[r, j]`` receives the window
            after row ``r``'s token ``j`` (``j < n_r``).
        max_query_len: optional host int ``>=`` the longest row; on CUDA it sizes the launch grid (``T`` if None).

    Returns ``(T, D)`` in ``x.dtype``, equal to what ``causal_conv1d_varlen`` returns.
    """
    _check_conv_scratch(x, conv_state, state_slots.shape[0], conv_scratch)
    if x.is_cuda:
        return causal_conv1d_verify_triton(
            x, weight, conv_state, state_slots, query_start_loc, conv_scratch, max_query_len
        )
    return causal_conv1d_verify_ref(x, weight, conv_state, state_slots, query_start_loc, conv_scratch)


def gdn_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    ssm_scratch: torch.Tensor,
    max_query_len: int,
) -> torch.Tensor:
    """:func:`~hyserve.kernels.gdn_forward` that leaves ``ssm_state`` alone and records the state after every token.

    Args:
        q, k: ``(T, Hk, Dk)``; v: ``(T, Hv, Dv)`` in the model dtype; g: ``(T, Hv)`` log-decay; beta: ``(T, Hv)``.
        ssm_state: ``(S, Hv, Dk, Dv)`` float32 live pool (read only).
        ssm_scratch: ``(R_max, P_max, Hv, Dk, Dv)`` float32; ``ssm_scratch[r, j]`` receives the state after row
            ``r``'s token ``j`` (``j < n_r``).
        max_query_len: host int ``>=`` the longest row.

    Returns ``(T, Hv, Dv)`` in ``v.dtype``. On CUDA this is always the exact token-by-token recurrence (the recurrent
    kernel's math), whatever the row lengths.
    """
    _check_ssm_scratch(v, ssm_state, state_slots.shape[0], ssm_scratch)
    if q.is_cuda:
        return gdn_verify_triton(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, ssm_scratch)
    return gdn_verify_ref(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, ssm_scratch, max_query_len)


def commit_verified(
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    conv_scratch: torch.Tensor,
    ssm_scratch: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Row ``r`` with ``a = num_accepted[r] >= 0`` commits candidate ``a`` to its slot; rows with ``a < 0`` do nothing.

    ``conv_state[state_slots[r]] = conv_scratch[r, a]`` and ``ssm_state[state_slots[r]] = ssm_scratch[r, a]``.
    ``a`` counts the accepted tokens of the row minus one (the live slot takes the state after position ``a``), so
    it must name a written candidate: ``a < min(n_r, P_max)``. Slots of committing rows must be distinct.
    ``num_accepted`` is an int tensor ``(R,)`` on the pools' device; nothing here syncs with the host on CUDA.
    """
    assert num_accepted.shape == state_slots.shape, "num_accepted must be (R,) like state_slots"
    assert conv_scratch.dtype == conv_state.dtype and conv_scratch.shape[2:] == conv_state.shape[1:]
    assert ssm_scratch.dtype == ssm_state.dtype and ssm_scratch.shape[2:] == ssm_state.shape[1:]
    if conv_state.is_cuda:
        commit_verified_triton(conv_state, ssm_state, state_slots, conv_scratch, ssm_scratch, num_accepted)
    else:
        commit_verified_ref(conv_state, ssm_state, state_slots, conv_scratch, ssm_scratch, num_accepted)


# --------------------------------------------------------------------------------------------------------------------
# Plain-torch references (CPU path). Same arithmetic, op for op, as causal_conv1d_varlen_ref / gdn_forward_ref.
# --------------------------------------------------------------------------------------------------------------------


def causal_conv1d_verify_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    conv_scratch: torch.Tensor,
) -> torch.Tensor:
    """Reference :func:`causal_conv1d_verify`, vectorised over all tokens at once (no loop).

    The window after token ``t`` is the last ``K - 1`` taps of the ``K``-input window the output at ``t`` reads, so
    each token's candidate is a slice of the gathered windows, scattered to ``conv_scratch[row(t), pos(t)]``.
    """
    T, D = x.shape
    K = weight.shape[1]
    km1 = K - 1
    R = state_slots.shape[0]
    slots = state_slots.to(torch.int64)
    qsl = query_start_loc.to(torch.int64)
    if km1 == 0:  # no window: nothing to record
        out = x.float() * weight[:, 0].float()
        return F.silu(out).to(x.dtype)
    if T == 0 or R == 0:
        return x.new_empty((T, D))

    old = conv_state[slots]  # (R, D, km1): a gathered copy, the pool is never written
    buf = torch.cat([old.transpose(1, 2).reshape(R * km1, D), x.to(conv_state.dtype)], dim=0)  # (R*km1 + T, D)
    rows, pos = row_index(qsl, T)
    rows_k = rows[:, None].expand(T, K)
    taps = torch.arange(K, device=x.device, dtype=torch.int64)
    rel = pos[:, None] - km1 + taps[None, :]  # (T, K): position relative to the row's first new token
    src = torch.where(rel >= 0, R * km1 + qsl[rows_k] + rel, rows_k * km1 + km1 + rel)
    win = buf[src]  # (T, K, D)
    acc = (win.float() * weight.t().float()[None]).sum(dim=1)
    out = F.silu(acc).to(x.dtype)

    rec = pos < conv_scratch.shape[1]
    conv_scratch[rows[rec], pos[rec]] = win[rec, 1:].transpose(1, 2).to(conv_scratch.dtype)
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
    ssm_scratch: torch.Tensor,
    max_query_len: int,
) -> torch.Tensor:
    """Reference :func:`gdn_verify`: rows advanced in lockstep, one position per step, float32 throughout."""
    T = q.shape[0]
    Hv, Dv = v.shape[1], v.shape[2]
    R = state_slots.shape[0]
    P = ssm_scratch.shape[1]
    out = torch.empty((T, Hv, Dv), dtype=v.dtype, device=v.device)
    slots = state_slots.to(torch.int64)
    qsl = query_start_loc.to(torch.int64)
    if R == 0 or T == 0:
        return out

    def record(i: int, active: torch.Tensor, s: torch.Tensor) -> None:
        if i < P:
            act = torch.nonzero(active).squeeze(1)
            ssm_scratch[act, i] = s[act]

    # A gathered copy of the live states: the pool is never written.
    obuf, _ = gdn_scan(q, k, v, g, beta, ssm_state[slots].float(), qsl, max_query_len, record)
    out.copy_(obuf[:T])
    return out


def commit_verified_ref(
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    conv_scratch: torch.Tensor,
    ssm_scratch: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Reference :func:`commit_verified`: one advanced-index gather + scatter per pool (a host sync on CUDA)."""
    acc = num_accepted.to(torch.int64)
    keep = torch.nonzero(acc >= 0).squeeze(1)
    a = acc[keep]
    dst = state_slots.to(torch.int64)[keep]
    conv_state[dst] = conv_scratch[keep, a]
    ssm_state[dst] = ssm_scratch[keep, a]


# --------------------------------------------------------------------------------------------------------------------
# Triton (CUDA; also runs under TRITON_INTERPRET=1 on CPU tensors)
# --------------------------------------------------------------------------------------------------------------------


def causal_conv1d_verify_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    conv_scratch: torch.Tensor,
    max_query_len: int | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton :func:`causal_conv1d_verify`: one launch, no host sync. ``out`` optionally supplies the ``(T, D)``
    output buffer (last dim contiguous)."""
    from hyserve.kernels._triton_verify import _conv1d_verify_kernel

    T, D = x.shape
    K = weight.shape[1]
    R = state_slots.shape[0]
    assert K >= 2, "kernel size must be at least 2"
    _check_conv_scratch(x, conv_state, R, conv_scratch)
    if out is None:
        out = torch.empty((T, D), dtype=x.dtype, device=x.device)
    assert out.shape == (T, D) and out.stride(1) == 1
    if R == 0 or T == 0:
        return out
    mql = T if max_query_len is None else min(int(max_query_len), T)
    block_t = min(16, next_pow2(max(mql, 1)))
    n_tblocks = max(1, _cdiv(mql, block_t))
    block_d = min(256 if block_t <= 4 else 128, next_pow2(D))
    w, cs = weight, conv_scratch
    grid = (n_tblocks, R, _cdiv(D, block_d))
    _conv1d_verify_kernel[grid](
        x, w, conv_state, state_slots, query_start_loc, out, cs,
        D, cs.shape[1],
        x.stride(0), x.stride(1),
        w.stride(0), w.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        out.stride(0),
        cs.stride(0), cs.stride(1), cs.stride(2), cs.stride(3),
        K=K, BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=4,
    )  # fmt: skip
    return out


def gdn_verify_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    ssm_scratch: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton :func:`gdn_verify`: one program per (row, value head, ``BV`` block), any row lengths, no host sync.

    ``out`` optionally supplies the ``(T, Hv, Dv)`` output buffer (last dim contiguous)."""
    from hyserve.kernels._triton_verify import _gdn_verify_kernel

    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    R = state_slots.shape[0]
    assert Hv % Hk == 0, "Hv must be a multiple of Hk"
    assert ssm_state.shape[1:] == (Hv, Dk, Dv), "ssm_state must be (S, Hv, Dk, Dv)"
    _check_ssm_scratch(v, ssm_state, R, ssm_scratch)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if out is None:
        out = torch.empty((T, Hv, Dv), dtype=v.dtype, device=v.device)
    assert out.shape == (T, Hv, Dv) and out.stride(2) == 1
    if R == 0 or T == 0:
        return out
    bk = next_pow2(Dk)
    bv = min(next_pow2(Dv), max(16, 4096 // bk))  # fp32 state tile of <= 4096 elements (>= 16 wide), as in gdn.py
    ss, sc = ssm_state, ssm_scratch
    grid = (R, Hv, _cdiv(Dv, bv))
    _gdn_verify_kernel[grid](
        q, k, v, g, beta, ss, state_slots, query_start_loc, out, sc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        ss.stride(0), ss.stride(1), ss.stride(2), ss.stride(3),
        out.stride(0), out.stride(1),
        sc.stride(0), sc.stride(1), sc.stride(2), sc.stride(3), sc.stride(4),
        sc.shape[1], Dk**-0.5,
        DK=Dk, DV=Dv, GROUP=Hv // Hk, BK=bk, BV=bv,
        num_warps=4,
    )  # fmt: skip
    return out


def _entries_contiguous(t: torch.Tensor, lead: int) -> bool:
    """Whether each entry ``t[i_0, ..., i_{lead-1}]`` is one contiguous block (row-major)."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape[lead:], t.stride()[lead:]))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


_COMMIT_BLOCK = 1024


def commit_verified_triton(
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    conv_scratch: torch.Tensor,
    ssm_scratch: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Triton :func:`commit_verified`: one masked copy launch per pool, no host sync (graph-capturable).

    Pool and scratch entries must each be contiguous (as ``StatePool`` and ``torch.empty`` allocate them)."""
    from hyserve.kernels._triton_verify import _commit_kernel

    R = state_slots.shape[0]
    if R == 0:
        return
    for pool, scratch in ((conv_state, conv_scratch), (ssm_state, ssm_scratch)):
        assert _entries_contiguous(pool, 1) and _entries_contiguous(scratch, 2), "entries must be contiguous"
        n = pool[0].numel() if pool.shape[0] > 0 else 0
        if n == 0:
            continue
        _commit_kernel[(R, _cdiv(n, _COMMIT_BLOCK))](
            scratch, pool, state_slots, num_accepted,
            n, scratch.stride(0), scratch.stride(1), pool.stride(0),
            BLOCK=_COMMIT_BLOCK,
            num_warps=4,
        )  # fmt: skip
