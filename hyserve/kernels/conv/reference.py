"""Plain-torch references of :mod:`hyserve.kernels.conv` (the CPU path and the yardstick for the Triton kernels).

:func:`causal_conv1d_varlen_ref` defines the op: depthwise causal conv1d (optional bias) + SiLU over the rows of the
flat varlen layout (:mod:`hyserve.kernels.varlen`), each row's rolling window of the last ``K - 1`` inputs kept in
its slot of ``conv_state``. :func:`causal_conv1d_verify_ref` is its verify variant (:mod:`hyserve.kernels.conv.verify`),
with the same arithmetic, op for op: it leaves the pool alone and records the window after every token in scratch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyserve.kernels.varlen import row_index

__all__ = ["causal_conv1d_varlen_ref", "causal_conv1d_verify_ref"]


def _nonempty_rows(query_start_loc: torch.Tensor) -> torch.Tensor:
    """Indices of the rows that own at least one token (a host sync on CUDA; free on CPU)."""
    lens = query_start_loc[1:] - query_start_loc[:-1]
    return torch.nonzero(lens > 0).squeeze(1)


def _biased(acc: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The float32 accumulation plus the conv's bias, where it has one."""
    return acc if bias is None else acc + bias.float()


def causal_conv1d_varlen_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv1d (``bias``: ``(D,)`` added before the SiLU, as Mamba2's conv has) + SiLU over varlen
    rows, with the rolling window kept in ``conv_state``.

    Args:
        x: ``(T, D)`` inputs in the model dtype.
        weight: ``(D, K)`` depthwise taps (``conv1d.weight.squeeze(1)``).
        conv_state: ``(S, D, K - 1)`` pool, same dtype as ``x``; slot ``s`` holds the previous ``K - 1`` inputs of its
            request, oldest first (zeros for a fresh request). Updated in place: afterwards the slot of each
            non-empty row holds the last ``K - 1`` inputs of ``old window ++ row tokens``.
        state_slots: ``(R,)`` slot of each row.
        query_start_loc: ``(R + 1,)`` cumulative token offsets.

    Returns:
        ``(T, D)`` in ``x.dtype``: ``out[t] = silu(sum_k weight[:, k] * window_t[k])`` computed in float32, where
        ``window_t`` holds the ``K`` inputs ending at ``t`` (older ones from the state).
    """
    T, D = x.shape
    K = weight.shape[1]
    km1 = K - 1
    R = state_slots.shape[0]
    slots = state_slots.to(torch.int64)
    qsl = query_start_loc.to(torch.int64)
    if km1 == 0:
        out = x.float() * weight[:, 0].float()
        return F.silu(_biased(out, bias)).to(x.dtype)

    # One buffer holding every row's old window (row r at [r*km1, (r+1)*km1)) followed by all the new tokens.
    old = conv_state[slots]  # (R, D, km1)
    buf = torch.cat([old.transpose(1, 2).reshape(R * km1, D), x.to(conv_state.dtype)], dim=0)  # (R*km1 + T, D)

    def _src(rows: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
        # rel: position relative to the row's first new token; negative values index the old window.
        return torch.where(rel >= 0, R * km1 + qsl[rows] + rel, rows * km1 + km1 + rel)

    taps = torch.arange(K, device=x.device, dtype=torch.int64)
    if T > 0:
        rows, pos = row_index(qsl, T)
        rel = pos[:, None] - km1 + taps[None, :]  # (T, K)
        win = buf[_src(rows[:, None].expand(T, K), rel)]  # (T, K, D)
        acc = (win.float() * weight.t().float()[None]).sum(dim=1)
        out = F.silu(_biased(acc, bias)).to(x.dtype)
    else:
        out = x.new_empty((0, D))

    # New windows: the last km1 entries of (old window ++ row tokens).
    lens = qsl[1:] - qsl[:-1]
    r_idx = torch.arange(R, device=x.device, dtype=torch.int64)
    rel_s = lens[:, None] - km1 + taps[None, :km1]  # (R, km1)
    new = buf[_src(r_idx[:, None].expand(R, km1), rel_s)]  # (R, km1, D)
    keep = _nonempty_rows(qsl)
    conv_state[slots[keep]] = new[keep].transpose(1, 2).to(conv_state.dtype)
    return out


def causal_conv1d_verify_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    conv_scratch: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference :func:`~hyserve.kernels.conv.verify.causal_conv1d_verify`, vectorised over all tokens at once (no
    loop).

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
        return F.silu(_biased(out, bias)).to(x.dtype)
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
    out = F.silu(_biased(acc, bias)).to(x.dtype)

    rec = pos < conv_scratch.shape[1]
    conv_scratch[rows[rec], pos[rec]] = win[rec, 1:].transpose(1, 2).to(conv_scratch.dtype)
    return out
