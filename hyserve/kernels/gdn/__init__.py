"""Gated DeltaNet (gated delta rule) over varlen rows with a slot-indexed state pool (float32, or bf16 / fp16 stored).

Entry points: :func:`gdn_forward`, and its speculative-decoding variant :func:`~hyserve.kernels.gdn.verify.gdn_verify`
(reads the live state, records the state after every token in scratch). Semantics are those of transformers'
``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule`` with ``use_qk_l2norm_in_kernel=True`` (see
:func:`hyserve.kernels.gdn.reference.gdn_forward_ref`, the CPU path and the yardstick).

The package: this module (entry point and dispatch), ``_triton.py`` (the recurrent and verify kernels, which share
one delta-rule step, and the fused decode kernel), ``verify.py`` (the verify variant), ``decode.py`` (the mixer's
whole decode step in one launch: conv, gates, delta rule and gated norm, :func:`~hyserve.kernels.gdn.decode.
gdn_decode_fused`) and ``reference.py`` (the plain-torch references).

Dispatch:

* CPU (or any non-CUDA device): the torch reference.
* CUDA, ``max_query_len <= GDN_RECURRENT_MAX_QUERY_LEN`` (pure decode): hyserve's own Triton kernel
  (:func:`gdn_recurrent_triton`), which reads and writes ``ssm_state[state_slots[r]]`` in place, no gather/scatter,
  no host sync (safe inside a captured CUDA graph).
* CUDA, longer rows: fla-core's ``chunk_gated_delta_rule`` on the non-empty rows (gathered initial states, final
  states scattered back). Given the host's copy of the row offsets it does not synchronise with the host; without
  it, it does.

Invariants: ``ssm_state`` is ``(S, Hv, Dk, Dv)``, float32 or a 16-bit float (every path computes in float32 and
rounds the state where it stores it); slots of non-empty rows are distinct; empty rows and slots
that no row names are left untouched; value head ``h`` uses key head ``h // (Hv // Hk)``.
"""

from __future__ import annotations

from typing import Any

import torch

from hyserve.kernels.gdn.reference import gdn_forward_ref
from hyserve.kernels.gdn.verify import gdn_verify
from hyserve.kernels.norm import l2_norm_heads
from hyserve.kernels.varlen import nonempty_rows
from hyserve.utils import next_pow2

__all__ = ["GDN_RECURRENT_MAX_QUERY_LEN", "SSM_STATE_DTYPES", "gdn_forward", "gdn_forward_fla", "gdn_recurrent_triton",
           "gdn_verify"]

SSM_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Rows up to this length go to the recurrent Triton kernel on CUDA; longer batches go to fla's chunked kernel.
GDN_RECURRENT_MAX_QUERY_LEN = 1


def gdn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    query_start_loc_cpu: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated delta rule from each row's slot state; writes final states back in place. Returns ``(T, Hv, Dv)``.

    Args:
        q, k: ``(T, Hk, Dk)``; v: ``(T, Hv, Dv)`` in the model dtype (the last dim of each must be contiguous).
        g: ``(T, Hv)`` float32 log-decay (``<= 0``); beta: ``(T, Hv)`` float32 or model dtype.
        ssm_state: ``(S, Hv, Dk, Dv)`` pool (float32, bfloat16 or float16), updated in place through
            ``state_slots`` ``(R,)``.
        query_start_loc: ``(R + 1,)`` int32 cumulative token offsets.
        max_query_len: host int ``>=`` the longest row (chooses the path without a device->host sync).
        query_start_loc_cpu: the host's copy of ``query_start_loc`` if it has one (the chunked path then needs no
            device->host sync).
    """
    assert ssm_state.dtype in SSM_STATE_DTYPES, f"ssm_state must be one of {SSM_STATE_DTYPES}"
    if not q.is_cuda:
        return gdn_forward_ref(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, max_query_len)
    # float32 means float32: fla's chunked kernel rounds its float32 dots to TF32 (on an H200 that moved tiny-model
    # logprobs by up to 0.16), so float32 models take the exact recurrent kernel for every row.
    if max_query_len <= GDN_RECURRENT_MAX_QUERY_LEN or q.dtype == torch.float32:
        return gdn_recurrent_triton(q, k, v, g, beta, ssm_state, state_slots, query_start_loc)
    return gdn_forward_fla(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, query_start_loc_cpu)


def gdn_recurrent_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton gated delta rule, token by token within each row (any row lengths; built for decode).

    Each ``(row, value head, BV block)`` program reads its state tile once and writes it once. Runs under
    ``TRITON_INTERPRET=1`` on CPU tensors too. ``out`` optionally supplies the ``(T, Hv, Dv)`` output buffer.
    """
    from hyserve.kernels.gdn._triton import _gdn_recurrent_kernel

    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    R = state_slots.shape[0]
    assert Hv % Hk == 0, "Hv must be a multiple of Hk"
    assert ssm_state.shape[1:] == (Hv, Dk, Dv), "ssm_state must be (S, Hv, Dk, Dv)"
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if out is None:
        out = torch.empty((T, Hv, Dv), dtype=v.dtype, device=v.device)
    assert out.shape == (T, Hv, Dv) and out.stride(2) == 1
    if R == 0 or T == 0:
        return out
    bk = next_pow2(Dk)
    bv = min(next_pow2(Dv), max(16, 4096 // bk))  # keep the fp32 state tile at <= 4096 elements (>= 16 wide)
    grid = (R, Hv, -(-Dv // bv))
    _gdn_recurrent_kernel[grid](
        q, k, v, g, beta, ssm_state, state_slots, query_start_loc, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), ssm_state.stride(3),
        out.stride(0), out.stride(1),
        Dk**-0.5,
        DK=Dk, DV=Dv, GROUP=Hv // Hk, BK=bk, BV=bv,
        num_warps=4,
    )  # fmt: skip
    return out


def _import_fla_chunk() -> Any:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:  # pragma: no cover - depends on the GPU machine's packages
        raise ImportError(
            "hyserve needs fla-core (pip install fla-core==0.6.0) for Gated DeltaNet prefill on CUDA "
            "(rows longer than one token). Decode runs without it."
        ) from e
    return chunk_gated_delta_rule


def gdn_forward_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    query_start_loc_cpu: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunked gated delta rule through fla-core (CUDA only).

    Empty rows are dropped first (fla gets only rows with tokens); their slots are not touched. With
    ``query_start_loc_cpu`` (the host's copy of the row offsets) neither this nor fla waits for the device;
    without it, both do.
    """
    chunk_gated_delta_rule = _import_fla_chunk()
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    if T == 0 or state_slots.shape[0] == 0:
        return torch.empty((T, Hv, Dv), dtype=v.dtype, device=v.device)
    slots, cu_seqlens, qsl_cpu = nonempty_rows(state_slots, query_start_loc, query_start_loc_cpu)
    dt = v.dtype
    # q and k are l2-normed here rather than inside fla: its l2norm kernel autotunes per bucket of token counts, so
    # each new bucket met while serving stalled a step on a benchmark of 25 configurations (measured on an H200).
    q, k = l2_norm_heads(q.to(dt)), l2_norm_heads(k.to(dt))
    grp = Hv // Hk
    if grp > 1:  # fla-core 0.6.0 supports Hv > Hk natively; expanding is the conservative choice
        q = q.repeat_interleave(grp, dim=1)
        k = k.repeat_interleave(grp, dim=1)
    o, final = chunk_gated_delta_rule(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0).contiguous(),
        g.float().unsqueeze(0).contiguous(),
        beta.unsqueeze(0).contiguous(),
        scale=Dk**-0.5,
        initial_state=ssm_state[slots].float(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=qsl_cpu,
    )
    ssm_state[slots] = final.to(ssm_state.dtype)
    return o[0].to(dt)
