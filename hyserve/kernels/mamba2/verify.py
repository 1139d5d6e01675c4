"""Mamba2's scan in a verify step (speculative decoding): draft tokens through the scan without touching the live
SSM state.

docs/design.md invariant 2: drafts never touch live state. Verifying ``k`` draft tokens of a request is a row of
``n_r <= k + 1`` tokens; :func:`mamba2_verify` computes the outputs :func:`~hyserve.kernels.mamba2.mamba2_scan`
computes but only READS ``ssm_state``, and writes the candidate state after each position into scratch, exactly as
:func:`~hyserve.kernels.mamba2.reference.mamba2_scan_ref` does when given ``scratch``. After acceptance,
:func:`~hyserve.kernels.commit.commit_verified` copies one candidate per row into the row's slot.

Scratch (indexed by ROW ``r``, not by slot): ``(R_max, P_max, H, P, N)`` in the pool's dtype; ``scratch[r, j]`` is
the state after row ``r``'s token ``j``. Only entries ``(r, j)`` with ``j < n_r`` (and ``j < P_max``) are written;
every other scratch entry, the live pool and all slots are left bit-identical. An empty row writes nothing.

Dispatch: CUDA tensors run ``_mamba2_verify_kernel`` (``_triton.py``: the recurrent kernel's step, no host sync,
fixed-shape launches: safe to capture in a CUDA graph); everything else runs the reference.
"""

from __future__ import annotations

import torch

from hyserve.kernels.mamba2.reference import mamba2_scan_ref
from hyserve.utils import next_pow2

__all__ = ["mamba2_verify", "mamba2_verify_triton", "state_tile"]


def state_tile(p: int, n: int) -> tuple[int, int]:
    """``(BP, BN)``: the float32 state tile a program keeps in registers, all of ``N`` and at most 4096 elements
    (at least 16 head channels)."""
    bn = next_pow2(n)
    return min(next_pow2(p), max(16, 4096 // bn)), bn


def mamba2_verify(
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
    scratch: torch.Tensor,
) -> torch.Tensor:
    """:func:`~hyserve.kernels.mamba2.mamba2_scan` with ``scratch``: ``ssm_state`` only read, ``scratch[r, j]`` the
    state after row ``r``'s token ``j``. Returns ``(T, H, P)`` float32."""
    if x.is_cuda:
        return mamba2_verify_triton(x, dt, A_log, B, C, D, dt_bias, dt_limit, ssm_state, state_slots, query_start_loc,
                                    scratch)
    return mamba2_scan_ref(x, dt, A_log, B, C, D, dt_bias, dt_limit, ssm_state, state_slots, query_start_loc,
                           max_query_len, scratch)


def mamba2_verify_triton(
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
    scratch: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton :func:`mamba2_verify`: one program per (row, head, ``BP`` block of head channels), any row lengths,
    no host sync. Runs under ``TRITON_INTERPRET=1`` on CPU tensors too. ``out`` optionally supplies the
    ``(T, H, P)`` float32 output buffer (last dim contiguous)."""
    from hyserve.kernels.mamba2._triton import _mamba2_verify_kernel

    t, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    r = state_slots.shape[0]
    assert h % g == 0, "the head count must be a multiple of the group count"
    assert ssm_state.shape[1:] == (h, p, n), "ssm_state must be (S, H, P, N)"
    assert scratch.dim() == 5 and scratch.shape[2:] == ssm_state.shape[1:], "scratch must be (R_max, P_max, H, P, N)"
    assert scratch.shape[0] >= r and scratch.dtype == ssm_state.dtype, "scratch: >= R rows, the pool's dtype"
    x, B, C = (v if v.stride(-1) == 1 else v.contiguous() for v in (x, B, C))
    if out is None:
        out = torch.empty((t, h, p), dtype=torch.float32, device=x.device)
    assert out.shape == (t, h, p) and out.stride(2) == 1
    if r == 0 or t == 0:
        return out
    bp, bn = state_tile(p, n)
    ss, sk = ssm_state, scratch
    _mamba2_verify_kernel[(r, h, -(-p // bp))](
        x, dt, A_log, B, C, D, dt_bias, ss, state_slots, query_start_loc, out, sk,
        x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        ss.stride(0), ss.stride(1), ss.stride(2), ss.stride(3), out.stride(0), out.stride(1),
        sk.stride(0), sk.stride(1), sk.stride(2), sk.stride(3), sk.stride(4),
        sk.shape[1], float(dt_limit[0]), float(dt_limit[1]),
        P=p, N=n, HEADS_PER_GROUP=h // g, BP=bp, BN=bn,
        num_warps=4,
    )  # fmt: skip
    return out
