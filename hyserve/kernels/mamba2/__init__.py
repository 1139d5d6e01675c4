"""Mamba2's selective state space scan (SSD) over varlen rows with a slot-indexed state pool (float32, or bf16 /
fp16 stored).

Entry point: :func:`mamba2_scan`, with the signature and semantics of
:func:`~hyserve.kernels.mamba2.reference.mamba2_scan_ref` (the CPU path and the yardstick; its docstring gives the
recurrence), plus ``query_start_loc_cpu``. Given ``stash`` it is a verify step
(:func:`~hyserve.kernels.mamba2.verify.mamba2_verify`: reads the live state, stashes every token's inputs to the
update; :func:`~hyserve.kernels.mamba2.verify.mamba2_replay` rebuilds the accepted state from them).

The package: this module (entry point and dispatch), ``_triton.py`` (the recurrent, verify and replay kernels,
which share one update, and the chunked path's passes before and after fla), ``verify.py`` (the verify variant and
the replay), ``chunked.py
(the fla path) and ``reference.py`` (the plain-torch references).

Dispatch:

* CPU (or any non-CUDA device): the torch reference.
* CUDA, a verify step: the Triton verify kernel (token by token, whatever the row lengths).
* CUDA, ``max_query_len <= MAMBA2_RECURRENT_MAX_QUERY_LEN`` (pure decode), or a float32 model (``x`` float32):
  hyserve's Triton recurrent kernel (:func:`mamba2_recurrent_triton`), which reads and writes
  ``ssm_state[state_slots[r]]`` in place, no gather/scatter, no host sync (safe inside a captured CUDA graph).
* CUDA, longer rows in bf16 / fp16: fla-core's chunked simple GLA (:func:`mamba2_scan_fla`, ``chunked.py``), which
  is Mamba2's SSD with ``q = C``, ``k = B`` (groups expanded to heads), ``v = x * dt``, per-token log-decay
  ``g = dt * A``, ``scale = 1``; one Triton launch prepares fla's inputs and gathers the non-empty rows' states from
  their slots, one after it adds ``D * x`` and stores the final states back. fla-core 0.6.0's ``chunk_fwd_h`` reads
  its chunk count with one ``.item()``: a prefill step through fla waits for the device once, whatever
  ``query_start_loc_cpu`` (which spares the other syncs). Prefill steps are not captured.

Snapshots inside rows (``snapshots``, prefix caching; :class:`hyserve.model.metadata.RowSnapshots`), as in
:mod:`hyserve.kernels.gdn`: the reference records the state during its scan; on CUDA a snapshot starts from the
nearest state the path kept (fla's state before every 64-token chunk of a row, its ``h`` in the model dtype, which
the row's outputs read too; the row's starting state on the recurrent path), and the recurrent kernel runs the
tokens from there to the snapshot's position on a float32 copy (:func:`advance_snapshots`). With snapshots the fla
path calls the two stages of ``chunk_simple_gla``'s forward itself (``chunked.py``, pinned to fla-core 0.6.0).

No path launches anything for ``A = -exp(A_log)``: the kernels read the ``A_log`` weight (a reload is seen at the
next launch) and the reference computes it.

Invariants: ``ssm_state`` is ``(S, H, P, N)``, float32 or a 16-bit float (every path computes in float32 and rounds
the state where it stores it); slots of non-empty rows are distinct; empty rows and slots that no row names are left
untouched; head ``h`` reads B / C group ``h // (H / G)``. The output is float32 on every path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hyserve.kernels.mamba2.chunked import FLA_CHUNK, chunked_tiles, mamba2_scan_fla
from hyserve.kernels.mamba2.reference import mamba2_scan_ref
from hyserve.kernels.mamba2.verify import (
    MAMBA2_STASH_NAMES,
    mamba2_replay,
    mamba2_stash_shapes,
    mamba2_verify,
    mamba2_verify_triton,
    state_tile,
)

if TYPE_CHECKING:
    from hyserve.kernels.varlen import ChunkedRows
    from hyserve.model.metadata import RowSnapshots

__all__ = ["MAMBA2_RECURRENT_MAX_QUERY_LEN", "MAMBA2_STASH_NAMES", "SSM_STATE_DTYPES", "advance_snapshots",
           "compile_variants", "mamba2_recurrent_triton", "mamba2_replay", "mamba2_scan", "mamba2_scan_fla",
           "mamba2_scan_ref", "mamba2_stash_shapes", "mamba2_verify"]

SSM_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Rows up to this length go to the recurrent Triton kernel on CUDA; longer batches (bf16 / fp16) to fla's chunked scan.
MAMBA2_RECURRENT_MAX_QUERY_LEN = 1


def mamba2_scan(
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
    stash: dict[str, torch.Tensor] | None = None,
    query_start_loc_cpu: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    snapshots: RowSnapshots | None = None,
    rows: ChunkedRows | None = None,
) -> torch.Tensor:
    """``y`` (T, H, P) float32 for ``x`` (T, H, P), ``dt`` (T, H) before its bias and softplus, ``A_log`` (H,) (the
    weight itself: every path computes ``A = -exp(A_log)`` in float32 as it reads it), ``B`` and ``C`` (T, G, N),
    ``D`` and ``dt_bias`` (H,); x / B / C's last dims contiguous.

    Without ``stash`` each non-empty row's slot of ``ssm_state`` (``(S, H, P, N)``) ends holding its state after its
    last token. With ``stash`` (a verify step: ``MAMBA2_STASH_NAMES`` -> ``(>= R, k + 1, ...)`` float32) the slots
    are only read and ``stash[name][r, j]`` takes row ``r``'s token ``j``'s inputs to the update, from which
    ``mamba2_replay`` rebuilds a candidate. ``max_query_len``: a host int
    ``>=`` the longest row (it picks the path without a device->host sync); ``query_start_loc_cpu``: the host's copy
    of ``query_start_loc`` if it has one (fla's chunked path then needs fewer syncs). ``out``: a ``(T, H, P)``
    float32 buffer (last dim contiguous) that takes ``y`` and is returned (a verify step's parts write one buffer).
    ``snapshots``: states inside rows to write into pool entries (see the module docstring; not with ``stash``).
    ``rows``: the rows as fla's chunked path takes them, worked out once a step for every layer (the step's
    ``ChunkedRows``; None: worked out here)."""
    assert ssm_state.dtype in SSM_STATE_DTYPES, f"ssm_state must be one of {SSM_STATE_DTYPES}"
    if snapshots is not None and not snapshots.num:
        snapshots = None
    assert snapshots is None or stash is None, "snapshots inside rows are prefill's"
    if stash is not None:
        if not x.is_cuda:
            y = mamba2_verify(x, dt, A_log, B, C, D, dt_bias, dt_limit, ssm_state, state_slots, query_start_loc,
                              max_query_len, stash)
            return y if out is None else out.copy_(y)
        return mamba2_verify_triton(x, dt, A_log, B, C, D, dt_bias, dt_limit, ssm_state, state_slots, query_start_loc,
                                    stash, out=out)
    if not x.is_cuda:
        y = mamba2_scan_ref(x, dt, A_log, B, C, D, dt_bias, dt_limit, ssm_state, state_slots, query_start_loc,
                            max_query_len, None, snapshots)
        return y if out is None else out.copy_(y)
    # float32 means float32: fla's chunked kernels round their float32 dots to TF32 (GDN's lesson on an H200), so
    # float32 models take the exact recurrent kernel for every row.
    if max_query_len <= MAMBA2_RECURRENT_MAX_QUERY_LEN or x.dtype == torch.float32:
        # A snapshot starts from its row's starting state, read before the kernel advances the slot.
        base = ssm_state.index_select(0, snapshots.slots).float() if snapshots is not None else None
        y = mamba2_recurrent_triton(x, dt, A_log, B, C, D, dt_bias, dt_limit, ssm_state, state_slots,
                                    query_start_loc, out=out)
        if snapshots is not None and base is not None:
            advance_snapshots(x, dt, A_log, B, C, D, dt_bias, dt_limit, base, snapshots, 0, ssm_state)
        return y
    if snapshots is None:
        return mamba2_scan_fla(x, dt, A_log, B, C, D, dt_bias, dt_limit, ssm_state, state_slots, query_start_loc,
                               query_start_loc_cpu, out=out, rows=rows)
    y, h = mamba2_scan_fla(x, dt, A_log, B, C, D, dt_bias, dt_limit, ssm_state, state_slots, query_start_loc,
                           query_start_loc_cpu, out=out, keep_chunk_states=True, rows=rows)
    # fla's chunks are the non-empty rows' back to back: RowSnapshots.tails' chunk layout (see hyserve.kernels.gdn).
    assert h is not None
    base = h[0].index_select(0, snapshots.tails(FLA_CHUNK).chunk_index).float()
    advance_snapshots(x, dt, A_log, B, C, D, dt_bias, dt_limit, base, snapshots, FLA_CHUNK, ssm_state)
    return y


def advance_snapshots(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      D: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float], base: torch.Tensor,
                      snapshots: RowSnapshots, chunk: int, ssm_state: torch.Tensor) -> None:
    """Write each snapshot's state into its entry of ``ssm_state``: ``base[i]`` (float32 ``(n, H, P, N)``, advanced
    in place) is snapshot i's row state at its last ``chunk`` boundary (``chunk`` 0: the row's start); the recurrent
    kernel runs the tokens from there to the snapshot's position over it (``RowSnapshots.tails``) and the result is
    rounded into the entry. ``x`` .. ``C`` are the call's inputs (prefill rows' tokens)."""
    tails = snapshots.tails(chunk)
    if tails.max_len:
        idx = tails.tokens
        rows = snapshots.numbered
        mamba2_recurrent_triton(x.index_select(0, idx), dt.index_select(0, idx), A_log, B.index_select(0, idx),
                                C.index_select(0, idx), D, dt_bias, dt_limit, base, rows, tails.query_start_loc)
    ssm_state.index_copy_(0, snapshots.entries, base.to(ssm_state.dtype))


def mamba2_recurrent_triton(
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
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton Mamba2 scan, token by token within each row (any row lengths; built for decode).

    Each ``(row, head, BP block)`` program reads its ``(BP, N)`` state tile once and writes it once. Runs under
    ``TRITON_INTERPRET=1`` on CPU tensors too. ``out`` optionally supplies the ``(T, H, P)`` float32 output buffer.
    """
    from hyserve.kernels.mamba2._triton import _mamba2_recurrent_kernel

    t, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    r = state_slots.shape[0]
    assert h % g == 0, "the head count must be a multiple of the group count"
    assert ssm_state.shape[1:] == (h, p, n), "ssm_state must be (S, H, P, N)"
    x, B, C = (v if v.stride(-1) == 1 else v.contiguous() for v in (x, B, C))
    if out is None:
        out = torch.empty((t, h, p), dtype=torch.float32, device=x.device)
    assert out.shape == (t, h, p) and out.stride(2) == 1
    if r == 0 or t == 0:
        return out
    bp, bn = state_tile(p, n)
    ss = ssm_state
    _mamba2_recurrent_kernel[(r, h, -(-p // bp))](
        x, dt, A_log, B, C, D, dt_bias, ss, state_slots, query_start_loc, out,
        x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        ss.stride(0), ss.stride(1), ss.stride(2), ss.stride(3), out.stride(0), out.stride(1),
        float(dt_limit[0]), float(dt_limit[1]),
        P=p, N=n, HEADS_PER_GROUP=h // g, BP=bp, BN=bn,
        num_warps=4,
    )  # fmt: skip
    return out


def compile_variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """The variants of this package's Triton kernels that its launchers make for Nemotron-H's shapes (head dim 64,
    state size 128, 8 heads a group), float32 and bf16 models with float32 or bf16 states, decode and verify, and the
    chunked path's passes for bf16 / fp16 models, as ``(name, jit function, argument types, constexprs)``, for a
    compile check without a GPU (``tests/kernels/test_mamba2_kernels_compile.py``)."""
    from hyserve.kernels.mamba2._triton import (
        _mamba2_chunked_inputs_kernel,
        _mamba2_chunked_output_kernel,
        _mamba2_recurrent_kernel,
        _mamba2_replay_kernel,
        _mamba2_verify_kernel,
    )

    out: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = []
    i32, f32 = "i32", "fp32"
    h, p, n, rep = 128, 64, 128, 8
    bp, bn = state_tile(p, n)
    consts = dict(P=p, N=n, HEADS_PER_GROUP=rep, BP=bp, BN=bn)
    strides = dict(sx_t=i32, sx_h=i32, sdt_t=i32, sdt_h=i32, sb_t=i32, sb_g=i32, sc_t=i32, sc_g=i32,
                   ss_s=i32, ss_h=i32, ss_p=i32, ss_n=i32, so_t=i32, so_h=i32, dt_lo=f32, dt_hi=f32)
    for act, state in (("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16"), ("fp16", "fp16")):
        ptrs = dict(x_ptr=f"*{act}", dt_ptr=f"*{act}", alog_ptr=f"*{act}", b_ptr=f"*{act}", c_ptr=f"*{act}",
                    d_ptr=f"*{act}", dtb_ptr=f"*{act}", state_ptr=f"*{state}", slots_ptr="*i64", qsl_ptr="*i32",
                    out_ptr="*fp32")
        out.append((f"mamba2_recurrent_{act}_{state}_state", _mamba2_recurrent_kernel, {**ptrs, **strides}, consts))
        stash_strides = {s: i32 for s in ("stx_r", "stx_j", "stx_h", "stb_r", "stb_j", "stb_g", "std_r", "std_j")}
        stash = dict(stx_ptr="*fp32", stb_ptr="*fp32", std_ptr="*fp32", **stash_strides, NPOS=i32)
        out.append((f"mamba2_verify_{act}_{state}_state", _mamba2_verify_kernel, {**ptrs, **strides, **stash},
                    consts))
        for rows in (False, True):
            replay = dict(state_ptr=f"*{state}", alog_ptr=f"*{act}", stx_ptr="*fp32", stb_ptr="*fp32",
                          std_ptr="*fp32", rows_ptr="*i64", src_ptr="*i64", dst_ptr="*i64", count_ptr="*i64",
                          conv_ptr=f"*{act}", cscr_ptr=f"*{act}", ss_s=i32, ss_h=i32, ss_p=i32, ss_n=i32,
                          **stash_strides, sc_s=i32, scr_r=i32, scr_p=i32, E=i32, NPOS=i32)
            out.append((f"mamba2_replay_{act}_{state}_state{'_rows' if rows else ''}", _mamba2_replay_kernel, replay,
                        dict(consts, ROWS=rows, CONV=rows, CBLOCK=256)))
        if act == "fp32":  # float32 models take the recurrent kernel for every row
            continue
        bt, cbp, cbn, sp = chunked_tiles(p, n)
        tiles = dict(H=h, P=p, N=n, BT=bt, BP=cbp, BN=cbn, SP=sp)
        state_strides = dict(T=i32, ss_s=i32, ss_h=i32, ss_p=i32, ss_n=i32)
        inputs = dict(x_ptr=f"*{act}", dt_ptr=f"*{act}", alog_ptr=f"*{act}", dtb_ptr=f"*{act}", b_ptr=f"*{act}",
                      c_ptr=f"*{act}", state_ptr=f"*{state}", slots_ptr="*i64", q_ptr=f"*{act}", k_ptr=f"*{act}",
                      v_ptr=f"*{act}", g_ptr="*fp32", h0_ptr=f"*{state}", sx_t=i32, sx_h=i32, sdt_t=i32, sdt_h=i32,
                      sb_t=i32, sb_g=i32, sc_t=i32, sc_g=i32, dt_lo=f32, dt_hi=f32, **state_strides)
        out.append((f"mamba2_chunked_inputs_{act}_{state}_state", _mamba2_chunked_inputs_kernel, inputs,
                    {**tiles, "HEADS_PER_GROUP": rep}))
        outputs = dict(o_ptr=f"*{act}", x_ptr=f"*{act}", d_ptr=f"*{act}", ht_ptr="*fp32", state_ptr=f"*{state}",
                       slots_ptr="*i64", y_ptr="*fp32", sx_t=i32, sx_h=i32, **state_strides)
        out.append((f"mamba2_chunked_output_{act}_{state}_state", _mamba2_chunked_output_kernel, outputs, tiles))
    return out
