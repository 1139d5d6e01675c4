"""Mamba2's prefill through fla-core's chunked simple GLA (CUDA, bf16 / fp16 models): :func:`mamba2_scan_fla`.

Mamba2's SSD is fla's ``chunk_simple_gla`` with ``q = C``, ``k = B`` (groups expanded to heads), ``v = x * dt``,
per-token log-decay ``g = dt * A``, ``scale = 1``, and the state ``(.., P, N)`` (``state_v_first``, the pool's own
layout); then ``y = o + D * x``. The elementwise work around fla is two Triton launches
(``_triton.py``), whatever the model:

* before (:func:`mamba2_chunked_inputs`): ``step = clamp(softplus(dt + dt_bias))``, ``A = -exp(A_log)``, ``q``,
  ``k``, ``v``, ``g`` written contiguous as fla reads them (its ``input_guard`` would copy anything else), and the
  non-empty rows' states gathered from their slots (in the pool's dtype: fla's kernel reads its initial state as
  float32 whatever its dtype);
* after (:func:`mamba2_chunked_output`): ``y = o + D * x`` in float32, and fla's final states stored into the slots.

The torch formulation of both (``reference.py``'s ``mamba2_chunked_inputs_ref`` / ``mamba2_chunked_output_ref``) is
what this path did in some twenty launches (softplus, clamp, casts, two ``repeat_interleave``, the gather and
scatter, the skip); the kernels round as it does, and the tests hold them to it under the interpreter.

Why ``k`` and ``q`` are expanded to heads: fla-core 0.6.0's ``chunk_fwd_h`` takes its head count from ``k`` and reads
``v`` with it (one key head a value head), and ``chunk_fwd_o`` reads ``q`` and ``k`` with one head count, so neither
can read B / C per group; the expansion is written once, by the input pass.

fla-core 0.6.0's ``chunk_fwd_h`` reads its chunk count with one ``.item()``: through fla's public entry each Mamba2
layer of a prefill step waits for the device there, whatever ``query_start_loc_cpu``. With the pinned fla-core and
the host's offsets, the path runs fla's stages itself (:func:`fla_simple_gla_with_states`) and launches
``chunk_fwd_h``'s kernel with the count worked out on the host (``ChunkedRows.num_chunks``): no sync. Prefill steps
are not captured.
"""

from __future__ import annotations

from typing import Any

import torch

from hyserve.kernels.fla_stages import FLA_CHUNK, FLA_PINNED_VERSION, fla_row_snapshots_unavailable, require_pinned_fla
from hyserve.kernels.mamba2.verify import state_tile
from hyserve.kernels.varlen import ChunkedRows
from hyserve.utils import next_pow2

__all__ = ["FLA_CHUNK", "FLA_PINNED_VERSION", "chunked_tiles", "fla_simple_gla_with_states", "mamba2_chunked_inputs",
           "mamba2_chunked_output", "mamba2_scan_fla"]


def chunked_tiles(p: int, n: int) -> tuple[int, int, int, int]:
    """``(BT, BP, BN, SP)`` of the passes around fla: ``BT`` tokens a program (a ``(BT, max(BP, BN))`` tile of at
    most 4096 elements), all of ``P`` and ``N`` at once, and the state tile's ``SP`` head channels."""
    bp, bn = next_pow2(p), next_pow2(n)
    return max(1, min(64, 4096 // max(bp, bn))), bp, bn, state_tile(p, n)[0]


def mamba2_chunked_inputs(
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
    """``(q, k, v, g, h0)`` as ``mamba2_chunked_inputs_ref`` defines them, in one Triton launch (CUDA, or CPU
    tensors under the interpreter). ``x`` (T, H, P), ``dt`` (T, H), ``B`` / ``C`` (T, G, N) may be strided views
    (last dims contiguous); ``slots`` (R,) the rows' slots of ``ssm_state`` (S, H, P, N)."""
    from hyserve.kernels.mamba2._triton import _mamba2_chunked_inputs_kernel

    t, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    r = slots.shape[0]
    assert h % g == 0, "the head count must be a multiple of the group count"
    assert ssm_state.shape[1:] == (h, p, n), "ssm_state must be (S, H, P, N)"
    x, B, C = (u if u.stride(-1) == 1 else u.contiguous() for u in (x, B, C))
    dev, dtype = x.device, x.dtype
    q = torch.empty((t, h, n), dtype=dtype, device=dev)
    k = torch.empty((t, h, n), dtype=dtype, device=dev)
    v = torch.empty((t, h, p), dtype=dtype, device=dev)
    gl = torch.empty((t, h), dtype=torch.float32, device=dev)
    h0 = torch.empty((r, h, p, n), dtype=ssm_state.dtype, device=dev)
    bt, bp, bn, sp = chunked_tiles(p, n)
    programs = -(-t // bt) + r
    if programs and h:
        ss = ssm_state
        _mamba2_chunked_inputs_kernel[(programs, h)](
            x, dt, A_log, dt_bias, B, C, ss, slots, q, k, v, gl, h0,
            t, x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), C.stride(0),
            C.stride(1), ss.stride(0), ss.stride(1), ss.stride(2), ss.stride(3),
            float(dt_limit[0]), float(dt_limit[1]),
            H=h, P=p, N=n, HEADS_PER_GROUP=h // g, BT=bt, BP=bp, BN=bn, SP=sp,
            num_warps=4,
        )  # fmt: skip
    return q, k, v, gl, h0


def mamba2_chunked_output(o: torch.Tensor, x: torch.Tensor, D: torch.Tensor, final: torch.Tensor,
                          ssm_state: torch.Tensor, slots: torch.Tensor, *,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """``y = o + D * x`` (float32, (T, H, P)) and ``ssm_state[slots] = final`` (rounded to the pool's dtype), as
    ``mamba2_chunked_output_ref`` defines them, in one Triton launch. ``o`` contiguous (T, H, P) (fla's output),
    ``final`` contiguous float32 (R, H, P, N) (fla's final states), ``x`` as :func:`mamba2_chunked_inputs` takes it;
    ``out`` optionally the contiguous float32 (T, H, P) buffer for ``y``."""
    from hyserve.kernels.mamba2._triton import _mamba2_chunked_output_kernel

    t, h, p = x.shape
    n = ssm_state.shape[3]
    r = slots.shape[0]
    assert o.shape == (t, h, p) and o.is_contiguous(), "o must be contiguous (T, H, P)"
    assert final.shape == (r, h, p, n) and final.is_contiguous(), "final must be contiguous (R, H, P, N)"
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((t, h, p), dtype=torch.float32, device=x.device) if out is None else out
    assert y.shape == (t, h, p) and y.dtype == torch.float32 and y.is_contiguous(), "out: contiguous float32"
    bt, bp, bn, sp = chunked_tiles(p, n)
    programs = -(-t // bt) + r
    if programs and h:
        ss = ssm_state
        _mamba2_chunked_output_kernel[(programs, h)](
            o, x, D, final, ss, slots, y,
            t, x.stride(0), x.stride(1), ss.stride(0), ss.stride(1), ss.stride(2), ss.stride(3),
            H=h, P=p, N=n, BT=bt, BP=bp, BN=bn, SP=sp,
            num_warps=4,
        )  # fmt: skip
    return y


def _import_fla_simple_gla() -> Any:
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as e:  # pragma: no cover - depends on the GPU machine's packages
        raise ImportError(
            "hyserve needs fla-core (pip install fla-core==0.6.0) for Mamba2 prefill of bf16 / fp16 models on CUDA "
            "(rows longer than one token). Decode, verify and float32 models run without it."
        ) from e
    return chunk_simple_gla


def mamba2_scan_fla(
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
    query_start_loc_cpu: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    keep_chunk_states: bool = False,
    rows: ChunkedRows | None = None,
) -> Any:
    """Chunked Mamba2 scan through fla-core's ``chunk_simple_gla`` (CUDA only; ``x`` in bf16 / fp16), arguments as
    :func:`hyserve.kernels.mamba2.mamba2_scan`'s.

    Empty rows are dropped first (fla gets only rows with tokens); their slots are not touched. Without
    ``query_start_loc_cpu`` picking the non-empty rows waits for the device too. ``keep_chunk_states``: returns
    ``(y, h)``, ``h`` fla's per-chunk states (``fla_simple_gla_with_states``; None for an empty step). ``rows``: the
    non-empty rows worked out once a step (the same objects for every layer: fla-core's memo of its chunk indices
    serves them all); None: worked out here. With the host's offsets and the pinned fla-core, fla's stages run
    here without a sync (the module docstring); otherwise through fla's public entry."""
    t, h, p = x.shape
    if t == 0 or state_slots.shape[0] == 0:
        y = torch.zeros((t, h, p), dtype=torch.float32, device=x.device) if out is None else out.zero_()
        return (y, None) if keep_chunk_states else y
    if rows is None:
        rows = ChunkedRows.of(state_slots, query_start_loc, query_start_loc_cpu)
    slots, cu_seqlens, qsl_cpu = rows.slots, rows.cu_seqlens, rows.cu_seqlens_cpu
    q, k, v, g, h0 = mamba2_chunked_inputs(x, dt, A_log, B, C, dt_bias, dt_limit, ssm_state, slots)
    num_chunks = rows.num_chunks(FLA_CHUNK)
    if keep_chunk_states or (num_chunks is not None and fla_row_snapshots_unavailable() is None):
        res = fla_simple_gla_with_states(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g=g.unsqueeze(0), scale=1.0, initial_state=h0,
            output_final_state=True, state_v_first=True, cu_seqlens=cu_seqlens, cu_seqlens_cpu=qsl_cpu,
            num_chunks=num_chunks, chunk_indices=rows.chunk_indices(FLA_CHUNK),
        )  # fmt: skip
    else:
        res = _import_fla_simple_gla()(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g=g.unsqueeze(0), scale=1.0, initial_state=h0,
            output_final_state=True, state_v_first=True, cu_seqlens=cu_seqlens, cu_seqlens_cpu=qsl_cpu,
        )  # fmt: skip
    y = mamba2_chunked_output(res[0][0], x, D, res[1], ssm_state, slots, out=out)
    return (y, res[2]) if keep_chunk_states else y


def fla_simple_gla_with_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor, scale: float,
                               initial_state: torch.Tensor, output_final_state: bool, state_v_first: bool,
                               cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None,
                               num_chunks: int | None = None, chunk_indices: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fla-core 0.6.0's ``chunk_simple_gla`` forward (``ChunkSimpleGLAFunction.forward``: chunk indices, the gate's
    chunk-local cumsum in log2, ``chunk_simple_gla_fwd``'s ``chunk_fwd_h`` and ``chunk_fwd_o``) stage by stage,
    returning the per-chunk states too: ``(o, final_state, h)``, ``h`` ``(1, NT, H, P, N)`` (``state_v_first``) in
    ``k``'s dtype, chunk ``chunk_offsets[n] + j`` holding sequence n's state before its token ``j * 64``. Refuses any
    other fla-core version: these are internal functions whose signatures change between releases. ``num_chunks``:
    the rows' chunk count ``NT`` from the host, with which ``chunk_fwd_h``'s kernel is launched here without the
    ``.item()`` its wrapper reads it with (:func:`_fla_chunk_fwd_h`); None: through the wrapper. ``chunk_indices``:
    fla's chunk indices made by the caller (``ChunkedRows.chunk_indices``, no sync); None: fla's own."""
    require_pinned_fla()
    from fla.ops.common.chunk_h import chunk_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices
    from fla.ops.utils.constant import RCP_LN2

    assert output_final_state and state_v_first
    q, k, v, g = (t.contiguous() for t in (q, k, v, g))
    bt = FLA_CHUNK
    if chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, bt, cu_seqlens_cpu=cu_seqlens_cpu)
    g = chunk_local_cumsum(g, chunk_size=bt, scale=RCP_LN2, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    if num_chunks is not None:
        h, final = _fla_chunk_fwd_h(k, v, g, initial_state.contiguous(), cu_seqlens, num_chunks, bt)
    else:
        h, final = chunk_fwd_h(k=k, v=v, g=g, g_gamma=None, gk=None, gv=None, h0=initial_state.contiguous(),
                               output_final_state=True, cu_seqlens=cu_seqlens, chunk_size=bt, states_in_fp32=False,
                               state_v_first=True)
    o = chunk_fwd_o(q=q, k=k, v=v, g=g, g_gamma=None, h=h, scale=scale, cu_seqlens=cu_seqlens, chunk_size=bt,
                    chunk_indices=chunk_indices, state_v_first=True)
    return o, final, h


def _fla_chunk_fwd_h(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, h0: torch.Tensor, cu_seqlens: torch.Tensor,
                     num_chunks: int, bt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fla-core 0.6.0's ``chunk_fwd_h`` as :func:`fla_simple_gla_with_states` calls it (varlen rows, the gate ``g``
    alone, states ``(V, K)`` in ``k``'s dtype, the final states float32), its kernel launched with the chunk count
    ``num_chunks`` from the host instead of the wrapper's ``split_offsets[-1].item()`` (a device sync a layer). The
    rest is the wrapper's, line for line (``fla/ops/common/chunk_h.py``; on NVIDIA its dispatch has no other
    backend for it)."""
    import triton
    from fla.ops.common.chunk_h import chunk_fwd_kernel_h
    from fla.ops.utils import prepare_chunk_offsets

    b, t, h, kd, vd = *k.shape, v.shape[-1]
    split_offsets = prepare_chunk_offsets(cu_seqlens, bt)
    n = len(cu_seqlens) - 1
    states = k.new_empty(b, num_chunks, h, vd, kd, dtype=k.dtype)
    final = k.new_empty(n, h, vd, kd, dtype=torch.float)

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(kd, meta["BK"]) * triton.cdiv(vd, meta["BV"]) * n * h,)

    chunk_fwd_kernel_h[grid](
        k=k, v=v, h=states, g=g, g_gamma=None, gk=None, gv=None, h0=h0, ht=final, cu_seqlens=cu_seqlens,
        split_offsets=split_offsets, T=t, H=h, K=kd, V=vd, BT=bt, BS=bt, USE_G=True, USE_G_GAMMA=False,
        USE_GK=False, USE_GV=False, STATE_V_FIRST=True,
    )  # fmt: skip
    return states, final
