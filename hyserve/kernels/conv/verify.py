"""The conv's speculative-decoding variant: verify draft tokens without touching the live conv windows.

docs/design.md invariant 2: drafts never touch live state. Verifying ``k`` draft tokens of a request is a row of
``n_r <= k + 1`` tokens; :func:`causal_conv1d_verify` computes the same outputs as
:func:`~hyserve.kernels.conv.causal_conv1d_varlen` but only READS ``conv_state``, and writes the window after each
position into scratch. After acceptance, :func:`~hyserve.kernels.commit.commit_verified` copies one candidate per row
into the row's slot.

Scratch (indexed by ROW ``r``, not by slot; allocate once for the largest verify batch): ``conv_scratch``
``(R_max, P_max, D, K - 1)`` in ``conv_state``'s dtype; ``conv_scratch[r, j]`` is the window after row ``r``'s token
``j`` (the last ``K - 1`` inputs of ``old window ++ row tokens 0..j``, oldest first). Only entries ``(r, j)`` with
``j < n_r`` (and ``j < P_max``) are written; every other scratch entry, the live pool and all slots are left
bit-identical. An empty row writes nothing. Rows must satisfy ``R <= R_max`` and should have ``n_r <= P_max``: a
longer row still gets correct outputs, but its positions ``>= P_max`` are not recorded.

Dispatch: CUDA tensors run ``_conv1d_verify_kernel`` (``_triton.py``: no host sync, fixed-shape launches: safe to
capture in a CUDA graph); everything else runs :func:`~hyserve.kernels.conv.reference.causal_conv1d_verify_ref` (the
CPU path and the yardstick), the arithmetic of :func:`~hyserve.kernels.conv.reference.causal_conv1d_varlen_ref`.
"""

from __future__ import annotations

import torch

from hyserve.kernels.conv.reference import causal_conv1d_verify_ref
from hyserve.utils import next_pow2

__all__ = ["causal_conv1d_verify", "causal_conv1d_verify_ref", "causal_conv1d_verify_triton"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_conv_scratch(x: torch.Tensor, conv_state: torch.Tensor, rows: int, conv_scratch: torch.Tensor) -> None:
    assert conv_scratch.dim() == 4, "conv_scratch must be (R_max, P_max, D, K-1)"
    assert conv_scratch.shape[2:] == conv_state.shape[1:], "conv_scratch must be (R_max, P_max, D, K-1)"
    assert conv_scratch.shape[0] >= rows, "conv_scratch has fewer rows than the batch"
    assert conv_scratch.dtype == conv_state.dtype, "conv_scratch must have conv_state's dtype"
    assert conv_state.shape[1] == x.shape[1], "conv_state must be (S, D, K-1)"


def causal_conv1d_verify(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    conv_scratch: torch.Tensor,
    max_query_len: int | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~hyserve.kernels.conv.causal_conv1d_varlen` that leaves ``conv_state`` alone and records every window.

    Args:
        x: ``(T, D)`` (may be a strided view); weight: ``(D, K)``.
        conv_state: ``(S, D, K - 1)`` live pool (read only).
        state_slots: ``(R,)`` slot per row; query_start_loc: ``(R + 1,)`` cumulative token offsets.
        conv_scratch: ``(R_max, P_max, D, K - 1)``, ``conv_state``'s dtype; ``conv_scratch[r, j]`` receives the window
            after row ``r``'s token ``j`` (``j < n_r``).
        max_query_len: optional host int ``>=`` the longest row; on CUDA it sizes the launch grid (``T`` if None).
        bias: optional ``(D,)`` conv bias, as :func:`~hyserve.kernels.conv.causal_conv1d_varlen` takes it.

    Returns ``(T, D)`` in ``x.dtype``, equal to what ``causal_conv1d_varlen`` returns.
    """
    _check_conv_scratch(x, conv_state, state_slots.shape[0], conv_scratch)
    if x.is_cuda:
        return causal_conv1d_verify_triton(
            x, weight, conv_state, state_slots, query_start_loc, conv_scratch, max_query_len, bias=bias
        )
    return causal_conv1d_verify_ref(x, weight, conv_state, state_slots, query_start_loc, conv_scratch, bias)


def causal_conv1d_verify_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    conv_scratch: torch.Tensor,
    max_query_len: int | None = None,
    *,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton :func:`causal_conv1d_verify`: one launch, no host sync. ``out`` optionally supplies the ``(T, D)``
    output buffer (last dim contiguous)."""
    from hyserve.kernels.conv._triton import _conv1d_verify_kernel

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
    assert bias is None or bias.shape == (D,), "bias must be (D,)"
    _conv1d_verify_kernel[grid](
        x, w, w if bias is None else bias, conv_state, state_slots, query_start_loc, out, cs,
        D, cs.shape[1],
        x.stride(0), x.stride(1),
        w.stride(0), w.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        out.stride(0),
        cs.stride(0), cs.stride(1), cs.stride(2), cs.stride(3),
        K=K, BLOCK_T=block_t, BLOCK_D=block_d, HAS_BIAS=bias is not None,
        num_warps=4,
    )  # fmt: skip
    return out
