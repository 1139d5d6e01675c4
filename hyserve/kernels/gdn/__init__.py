"""Gated DeltaNet (gated delta rule) over varlen rows with a slot-indexed state pool (float32, or bf16 / fp16 stored).

Entry points: :func:`gdn_forward`, and its speculative-decoding variant :func:`~hyserve.kernels.gdn.verify.gdn_verify`
(reads the live state, stashes every token's inputs; ``gdn_replay`` rebuilds the accepted state from them). Semantics
are those of transformers' ``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule`` with
``use_qk_l2norm_in_kernel=True`` (see :func:`hyserve.kernels.gdn.reference.gdn_forward_ref`, the CPU path and the
yardstick).

The package: this module (entry point and dispatch), ``_triton.py`` (the recurrent, verify and replay kernels, which
share one delta-rule update, and the fused decode kernel), ``verify.py`` (the verify variant and the replay),
``decode.py`` (the mixer's whole decode step in one launch: conv, gates, delta rule and gated norm,
:func:`~hyserve.kernels.gdn.decode.gdn_decode_fused`) and ``reference.py`` (the plain-torch references).

Dispatch:

* CPU (or any non-CUDA device): the torch reference.
* CUDA, ``max_query_len <= GDN_RECURRENT_MAX_QUERY_LEN`` (pure decode): hyserve's own Triton kernel
  (:func:`gdn_recurrent_triton`), which reads and writes ``ssm_state[state_slots[r]]`` in place, no gather/scatter,
  no host sync (safe inside a captured CUDA graph).
* CUDA, longer rows: fla-core's ``chunk_gated_delta_rule`` on the non-empty rows (gathered initial states, final
  states scattered back). Given the host's copy of the row offsets it does not synchronise with the host; without
  it, it does.

Snapshots inside rows (``snapshots``, prefix caching; :class:`hyserve.model.metadata.RowSnapshots`): the state after
a given number of a row's tokens is written into a pool entry. The reference records it during its scan. On CUDA a
snapshot starts from the nearest state the path kept, rounded to no precision below the path's own: fla's chunked
kernel keeps the state before every 64-token chunk of a row (its ``h``, in the model dtype, which the row's own
outputs read too), the recurrent kernel only the row's starting state (float32); the tokens from there to the
snapshot's position are run through the recurrent kernel on a float32 copy (:func:`advance_snapshots`), and the
result is rounded into the entry. fla-core's public entry does not return ``h``: with snapshots the chunked path
calls the four stages of its forward itself (:func:`fla_chunk_forward_with_states`, pinned to fla-core 0.6.0).

Invariants: ``ssm_state`` is ``(S, Hv, Dk, Dv)``, float32 or a 16-bit float (every path computes in float32 and
rounds the state where it stores it); slots of non-empty rows are distinct; empty rows and slots
that no row names are left untouched; value head ``h`` uses key head ``h // (Hv // Hk)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hyserve.kernels.fla_stages import FLA_CHUNK, FLA_PINNED_VERSION, require_pinned_fla
from hyserve.kernels.gdn.reference import gdn_forward_ref
from hyserve.kernels.gdn.verify import gdn_verify
from hyserve.kernels.norm import l2_norm_heads
from hyserve.kernels.varlen import ChunkedRows
from hyserve.utils import next_pow2

if TYPE_CHECKING:
    from hyserve.model.metadata import RowSnapshots

__all__ = [
    "FLA_CHUNK",
    "FLA_PINNED_VERSION",
    "GDN_RECURRENT_MAX_QUERY_LEN",
    "SSM_STATE_DTYPES",
    "advance_snapshots",
    "fla_chunk_forward_with_states",
    "gdn_forward",
    "gdn_forward_fla",
    "gdn_recurrent_triton",
    "gdn_takes_chunked",
    "gdn_verify",
]

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
    snapshots: RowSnapshots | None = None,
    rows: ChunkedRows | None = None,
    qk_normed: bool = False,
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
        snapshots: states inside rows to write into pool entries of ``ssm_state`` (see the module docstring).
        rows: the same rows as the chunked path takes them, worked out once a step for every layer (the step's
            ``ChunkedRows``); None: worked out here.
        qk_normed: q and k come l2-normalised per head in the model dtype (the conv's launch normed them, as the
            chunked path would: ``causal_conv1d_split``'s ``norm_dim``); only where the chunked path runs
            (:func:`gdn_takes_chunked`).
    """
    assert ssm_state.dtype in SSM_STATE_DTYPES, f"ssm_state must be one of {SSM_STATE_DTYPES}"
    if snapshots is not None and not snapshots.num:
        snapshots = None
    assert not qk_normed or gdn_takes_chunked(q, max_query_len), "normed q and k are the chunked path's"
    if not q.is_cuda:
        return gdn_forward_ref(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, max_query_len, snapshots)
    if not gdn_takes_chunked(q, max_query_len):
        # A snapshot starts from its row's starting state, read before the kernel advances the slot.
        base = ssm_state.index_select(0, snapshots.slots).float() if snapshots is not None else None
        out = gdn_recurrent_triton(q, k, v, g, beta, ssm_state, state_slots, query_start_loc)
        if snapshots is not None and base is not None:
            advance_snapshots(q, k, v, g, beta, base, snapshots, 0, ssm_state)
        return out
    return gdn_forward_fla(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, query_start_loc_cpu,
                           snapshots, rows, qk_normed)


def gdn_takes_chunked(q: torch.Tensor, max_query_len: int) -> bool:
    """Whether :func:`gdn_forward` runs fla's chunked path for these rows: CUDA, 16-bit, a row longer than a token.
    float32 means float32: fla's chunked kernel rounds its float32 dots to TF32 (on an H200 that moved tiny-model
    logprobs by up to 0.16), so float32 models take the exact recurrent kernel for every row."""
    return q.is_cuda and max_query_len > GDN_RECURRENT_MAX_QUERY_LEN and q.dtype != torch.float32


def advance_snapshots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      base: torch.Tensor, snapshots: RowSnapshots, chunk: int, ssm_state: torch.Tensor,
                      qk_normed: bool = False) -> None:
    """Write each snapshot's state into its entry of ``ssm_state``: ``base[i]`` (float32, ``(n, Hv, Dk, Dv)``,
    advanced in place) is snapshot i's row state at its last ``chunk`` boundary (``chunk`` 0: the row's start); the
    recurrent kernel runs the tokens from there to the snapshot's position over it (``RowSnapshots.tails``), and
    the result is rounded into the entry. ``q`` .. ``beta`` are the call's inputs (prefill rows' tokens);
    ``qk_normed``: q and k come l2-normalised (the chunked path's own keys, not normalised again)."""
    tails = snapshots.tails(chunk)
    if tails.max_len:
        idx = tails.tokens
        rows = snapshots.numbered
        gdn_recurrent_triton(q.index_select(0, idx), k.index_select(0, idx), v.index_select(0, idx),
                             g.index_select(0, idx), beta.index_select(0, idx), base, rows, tails.query_start_loc,
                             qk_normed=qk_normed)
    ssm_state.index_copy_(0, snapshots.entries, base.to(ssm_state.dtype))


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
    qk_normed: bool = False,
) -> torch.Tensor:
    """Triton gated delta rule, token by token within each row (any row lengths; built for decode).

    Each ``(row, value head, BV block)`` program reads its state tile once and writes it once. Runs under
    ``TRITON_INTERPRET=1`` on CPU tensors too. ``out`` optionally supplies the ``(T, Hv, Dv)`` output buffer;
    ``qk_normed``: q and k come l2-normalised per head (not normalised again).
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
        DK=Dk, DV=Dv, GROUP=Hv // Hk, BK=bk, BV=bv, QK_NORMED=qk_normed,
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
    snapshots: RowSnapshots | None = None,
    rows: ChunkedRows | None = None,
    qk_normed: bool = False,
) -> torch.Tensor:
    """Chunked gated delta rule through fla-core (CUDA only).

    Empty rows are dropped first (fla gets only rows with tokens); their slots are not touched. With
    ``query_start_loc_cpu`` (the host's copy of the row offsets) neither this nor fla waits for the device;
    without it, both do. With ``snapshots`` the per-chunk states are kept (``fla_chunk_forward_with_states``) and
    each snapshot is advanced from the one before its position (``advance_snapshots``). ``rows``: the non-empty
    rows worked out once a step (the same objects for every layer, so that fla-core's memo of its chunk indices
    serves them all); None: worked out here. ``qk_normed``: q and k come l2-normalised (the conv's launch normed
    them); else they are normed here.
    """
    chunk_gated_delta_rule = _import_fla_chunk() if snapshots is None else fla_chunk_forward_with_states
    T, Dk = q.shape[0], q.shape[2]
    Hv, Dv = v.shape[1], v.shape[2]
    if T == 0 or state_slots.shape[0] == 0:
        return torch.empty((T, Hv, Dv), dtype=v.dtype, device=v.device)
    if rows is None:
        rows = ChunkedRows.of(state_slots, query_start_loc, query_start_loc_cpu)
    slots, cu_seqlens, qsl_cpu = rows.slots, rows.cu_seqlens, rows.cu_seqlens_cpu
    dt = v.dtype
    # q and k are l2-normed here rather than inside fla: its l2norm kernel autotunes per bucket of token counts, so
    # each new bucket met while serving stalled a step on a benchmark of 25 configurations (measured on an H200).
    qn, kn = (q, k) if qk_normed else (l2_norm_heads(q.to(dt)), l2_norm_heads(k.to(dt)))
    # Hv > Hk: fla-core (0.6.0 on) reads key head h // (Hv // Hk) for value head h, the convention here, so q and k
    # go in unexpanded (expanded, they were written Hv / Hk times over and read back apart).
    res = chunk_gated_delta_rule(
        qn.unsqueeze(0),
        kn.unsqueeze(0),
        v.unsqueeze(0).contiguous(),
        g.float().unsqueeze(0).contiguous(),
        beta.unsqueeze(0).contiguous(),
        scale=Dk**-0.5,
        initial_state=ssm_state[slots].float().contiguous(),  # fla reads (N, Hv, Dk, Dv) in that order
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=qsl_cpu,
        chunk_indices=rows.chunk_indices(FLA_CHUNK),
    )
    o, final = res[0], res[1]
    if snapshots is not None:
        # fla's chunks of a row are those of the non-empty rows back to back: a snapshot row is not empty, and an
        # empty row has no chunk, so RowSnapshots.tails' chunk layout is fla's.
        h = res[2]
        base = h[0].index_select(0, snapshots.tails(FLA_CHUNK).chunk_index).float()
        advance_snapshots(q, k, v, g, beta, base, snapshots, FLA_CHUNK, ssm_state, qk_normed)
    ssm_state[slots] = final.to(ssm_state.dtype)
    return o[0].to(dt)


def fla_chunk_forward_with_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, *, scale: float, initial_state: torch.Tensor,
                                  output_final_state: bool, use_qk_l2norm_in_kernel: bool,
                                  cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None,
                                  chunk_indices: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fla-core 0.6.0's ``chunk_gated_delta_rule`` forward (``ChunkGatedDeltaRuleFunction.forward`` ->
    ``chunk_gated_delta_rule_fwd`` without the gate, l2norm or beta-sigmoid options, state ``[K, V]``), stage by
    stage, returning the per-chunk states ``h`` too: ``(o, final_state, h)``, ``h`` of shape ``(1, NT, Hv, Dk, Dv)``
    in ``k``'s dtype, chunk ``chunk_offsets[n] + j`` holding sequence n's state before its token ``j * 64``.
    Refuses any other fla-core version: these are internal functions whose signatures change between releases.
    ``chunk_indices``: fla's chunk indices made by the caller (``ChunkedRows.chunk_indices``); None: fla's own."""
    require_pinned_fla()
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices, prepare_chunk_offsets
    from fla.ops.utils.constant import RCP_LN2

    assert not use_qk_l2norm_in_kernel and output_final_state
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    initial_state = initial_state.contiguous()
    bt = FLA_CHUNK
    if chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, bt, cu_seqlens_cpu=cu_seqlens_cpu)
    # Given explicitly: fla's alternative fwd_h backends (intra-card context parallel) then decline the call, and
    # h keeps the layout above.
    chunk_offsets = prepare_chunk_offsets(cu_seqlens, bt)
    g = chunk_local_cumsum(g, chunk_size=bt, scale=RCP_LN2, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens,
                                               chunk_indices=chunk_indices, chunk_size=bt)
    h, v_new, final = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, initial_state=initial_state,
                                                   output_final_state=True, chunk_size=bt, state_v_first=False,
                                                   cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                                                   chunk_offsets=chunk_offsets)
    o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=scale, state_v_first=False, cu_seqlens=cu_seqlens,
                    chunk_size=bt, chunk_indices=chunk_indices)
    return o.to(q.dtype), final, h
