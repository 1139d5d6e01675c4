"""The gated delta rule's speculative-decoding variant: verify draft tokens without touching the live SSM state.

docs/design.md invariant 2: drafts never touch live state. Verifying ``k`` draft tokens of a request is a row of
``n_r <= k + 1`` tokens; :func:`gdn_verify` computes the same outputs as :func:`~hyserve.kernels.gdn.gdn_forward` but
only READS ``ssm_state``, and writes the candidate state after each position into scratch. After acceptance,
:func:`~hyserve.kernels.commit.commit_verified` copies one candidate per row into the row's slot.

Scratch (indexed by ROW ``r``, not by slot; allocate once for the largest verify batch): ``ssm_scratch`` ``(R_max,
P_max, Hv, Dk, Dv)`` in the pool's dtype; ``ssm_scratch[r, j]`` is the state after row ``r``'s token ``j``. Only entries
``(r, j)`` with ``j < n_r`` (and ``j < P_max``) are written; every other scratch entry, the live pool and all slots are
left bit-identical. An empty row writes nothing. Rows must satisfy ``R <= R_max`` and should have ``n_r <= P_max``: a
longer row still gets correct outputs, but its positions ``>= P_max`` are not recorded.

Dispatch: CUDA tensors run ``_gdn_verify_kernel`` (``_triton.py``: the recurrent kernel's delta-rule step, no host
sync, fixed-shape launches: safe to capture in a CUDA graph); everything else runs
:func:`~hyserve.kernels.gdn.reference.gdn_verify_ref` (the CPU path and the yardstick), the scan of
:func:`~hyserve.kernels.gdn.reference.gdn_forward_ref`.
"""

from __future__ import annotations

import torch

from hyserve.kernels.gdn.reference import gdn_verify_ref
from hyserve.utils import next_pow2

__all__ = ["gdn_verify", "gdn_verify_ref", "gdn_verify_triton"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_ssm_scratch(v: torch.Tensor, ssm_state: torch.Tensor, rows: int, ssm_scratch: torch.Tensor) -> None:
    assert ssm_state.dtype == ssm_scratch.dtype, "the verify scratch holds states in the pool's dtype"
    assert ssm_scratch.dim() == 5, "ssm_scratch must be (R_max, P_max, Hv, Dk, Dv)"
    assert ssm_scratch.shape[2:] == ssm_state.shape[1:], "ssm_scratch must be (R_max, P_max, Hv, Dk, Dv)"
    assert ssm_scratch.shape[0] >= rows, "ssm_scratch has fewer rows than the batch"
    assert ssm_state.shape[1] == v.shape[1] and ssm_state.shape[3] == v.shape[2], "ssm_state must be (S, Hv, Dk, Dv)"


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
        ssm_state: ``(S, Hv, Dk, Dv)`` live pool (read only; float32 or a 16-bit float).
        ssm_scratch: ``(R_max, P_max, Hv, Dk, Dv)`` in the pool's dtype; ``ssm_scratch[r, j]`` receives the state
            after row ``r``'s token ``j`` (``j < n_r``).
        max_query_len: host int ``>=`` the longest row.

    Returns ``(T, Hv, Dv)`` in ``v.dtype``. On CUDA this is always the exact token-by-token recurrence (the recurrent
    kernel's math), whatever the row lengths.
    """
    _check_ssm_scratch(v, ssm_state, state_slots.shape[0], ssm_scratch)
    if q.is_cuda:
        return gdn_verify_triton(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, ssm_scratch)
    return gdn_verify_ref(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, ssm_scratch, max_query_len)


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
    from hyserve.kernels.gdn._triton import _gdn_verify_kernel

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
    bv = min(next_pow2(Dv), max(16, 4096 // bk))  # the state tile gdn_recurrent_triton takes
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
