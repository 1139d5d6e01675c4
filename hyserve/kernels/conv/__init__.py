"""Depthwise causal conv1d (optional bias) + SiLU over varlen rows with a slot-indexed rolling state (GDN's short
convolution, Mamba2's conv).

Entry points: :func:`causal_conv1d_varlen`, and its speculative-decoding variant
:func:`~hyserve.kernels.conv.verify.causal_conv1d_verify` (reads the live windows, records the window after every
token in scratch). On CUDA they run the Triton kernels of ``_triton.py``; elsewhere the plain-torch references of
``reference.py`` (:func:`~hyserve.kernels.conv.reference.causal_conv1d_varlen_ref` defines the semantics).

Invariants (see :mod:`hyserve.kernels.varlen` for the layout):

* ``conv_state[s]`` holds the previous ``K - 1`` inputs of slot ``s``'s request, oldest first (zeros when fresh).
* After the call the slot of each non-empty row holds the last ``K - 1`` inputs of ``old window ++ row tokens``;
  empty rows and slots no row names are not touched.
* Slots of non-empty rows are distinct. Arithmetic is float32; the output has ``x``'s dtype.

Kernel design: ``_conv1d_fwd_kernel`` computes a ``(BLOCK_T, BLOCK_D)`` output tile of one row per program, reading
older inputs from the old window. When one token block covers every row (decode, short chunks), the same program
then rolls the window (``FUSE_STATE``; a block-wide barrier separates the reads of the old window from the writes).
Otherwise ``_conv1d_state_kernel`` rolls the windows in a second launch, after every program has read them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hyserve.kernels.conv.reference import causal_conv1d_varlen_ref
from hyserve.kernels.conv.verify import causal_conv1d_verify
from hyserve.kernels.norm.reference import l2_norm_heads_ref
from hyserve.utils import next_pow2

if TYPE_CHECKING:
    from hyserve.model.metadata import RowSnapshots

__all__ = ["causal_conv1d_split", "causal_conv1d_split_triton", "causal_conv1d_varlen", "causal_conv1d_varlen_triton",
           "causal_conv1d_verify", "compile_variants", "snapshot_conv_windows"]


def snapshot_conv_windows(x: torch.Tensor, conv_state: torch.Tensor, snaps: RowSnapshots) -> None:
    """Pool entry ``snaps.entries[i]`` takes the conv window at a position inside a row: the ``K - 1`` inputs before
    token ``snaps.ends[i]`` of ``x`` (oldest first), that row's ``snaps.offsets_t[i]``-th token; where the offset is
    shorter than the window, its older part comes from the window of the row's slot ``snaps.slots[i]`` before the
    row. Must run before the conv rolls the slots' windows. Plain torch gathers (no host sync) through the step's
    index vectors (``RowSnapshots.conv_windows``: built by the first layer, taken by the rest); entries are not any
    row's slot."""
    if snaps.entries.numel() == 0:
        return
    w = conv_state.shape[-1]
    index = snaps.conv_windows(w)
    from_x = x.index_select(0, index.x_rows).view(-1, w, x.shape[-1])
    old = conv_state.index_select(0, snaps.slots)  # (n, C, K - 1)
    from_old = old.gather(2, index.old_cols.expand(-1, old.shape[1], -1))
    window = torch.where(index.take_x, from_x.transpose(1, 2).to(conv_state.dtype), from_old)
    conv_state.index_copy_(0, snaps.entries, window)


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv1d (with an optional bias) + SiLU, rolling ``conv_state`` in place; returns ``(T, D)`` in
    ``x.dtype``.

    Args:
        x: ``(T, D)``; may be a strided view (the last dim need not be contiguous).
        weight: ``(D, K)``.
        conv_state: ``(S, D, K - 1)`` pool, dtype of ``x``, updated in place.
        state_slots: ``(R,)`` int32/int64 slot per row.
        query_start_loc: ``(R + 1,)`` int32 cumulative token offsets.
        max_query_len: optional host int ``>=`` the longest row; on CUDA it sizes the launch grid (``T`` if None).
        bias: optional ``(D,)``, added to the float32 sum before the SiLU (Mamba2's conv has one, GDN's none).
    """
    if x.is_cuda:
        return causal_conv1d_varlen_triton(x, weight, conv_state, state_slots, query_start_loc, max_query_len,
                                           bias=bias)
    return causal_conv1d_varlen_ref(x, weight, conv_state, state_slots, query_start_loc, bias)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def causal_conv1d_varlen_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int | None = None,
    *,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_t: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Triton implementation of :func:`causal_conv1d_varlen` (also runs under ``TRITON_INTERPRET=1`` on CPU).

    ``out`` optionally supplies the contiguous ``(T, D)`` output buffer (e.g. NaN-poisoned in tests); ``block_t``
    the tokens a program computes (a power of two; default: 32 for rows longer than 16 tokens, else the longest
    row's length rounded up) and ``num_warps`` its warps, for benchmarks (``conv_prefill_bench.py --sweep``)."""
    T, D = x.shape
    if out is None:
        out = torch.empty((T, D), dtype=x.dtype, device=x.device)
    assert out.shape == (T, D) and out.stride(1) == 1
    _launch(x, weight, conv_state, state_slots, query_start_loc, max_query_len, bias, out, None, block_t,
            num_warps=num_warps)
    return out


def causal_conv1d_split(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    split: int,
    max_query_len: int | None = None,
    bias: torch.Tensor | None = None,
    norm_dim: int | None = None,
    parts: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_conv1d_varlen` with its output as two tensors: channels ``[0, split)`` and ``[split, D)``, the
    second contiguous (GDN: ``[q | k]`` and ``v``, ``v`` as fla's chunked kernel reads it, which would copy a view).
    ``norm_dim``: the first part comes l2-normalised over each ``norm_dim`` channels of a token (GDN's q and k
    heads, as fla's chunked path takes them; ``l2_norm_heads`` over the rounded output). ``parts``: the first
    tensor as ``(parts, T, split // parts)``, each part contiguous (GDN's q and k apart: fla copies a strided
    view). On CUDA the launch writes each part where it goes (:func:`causal_conv1d_split_triton`); on the CPU the
    reference's output, copied into that layout."""
    assert 0 < split < x.shape[1], "split must cut the channels in two"
    assert split % parts == 0 and (norm_dim is None or (split // parts) % norm_dim == 0), \
        "the parts must be whole heads of norm_dim channels"
    if x.is_cuda:
        return causal_conv1d_split_triton(x, weight, conv_state, state_slots, query_start_loc, split, max_query_len,
                                          bias, norm_dim=norm_dim, parts=parts)
    y = causal_conv1d_varlen_ref(x, weight, conv_state, state_slots, query_start_loc, bias)
    t = y.shape[0]
    first = y[:, :split]
    if norm_dim is not None:
        first = l2_norm_heads_ref(first.reshape(t, split // norm_dim, norm_dim)).reshape(-1, split)
    if parts > 1:
        first = first.reshape(t, parts, split // parts).transpose(0, 1).contiguous()
    return first, y[:, split:].contiguous()


def causal_conv1d_split_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    split: int,
    max_query_len: int | None = None,
    bias: torch.Tensor | None = None,
    *,
    norm_dim: int | None = None,
    outs: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_t: int | None = None,
    num_warps: int = 4,
    parts: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`causal_conv1d_split` (also under ``TRITON_INTERPRET=1``): one launch writing channels below
    ``split`` into the first buffer (l2-normalised per ``norm_dim`` channels where given; ``(parts, T, split //
    parts)`` when ``parts`` > 1) and the rest into the second (``outs``: the two, e.g. NaN-poisoned in tests);
    ``block_t`` and ``num_warps`` as :func:`causal_conv1d_varlen_triton` takes them."""
    T, D = x.shape
    assert 0 < split < D, "split must cut the channels in two"
    assert norm_dim is None or (split % norm_dim == 0 and norm_dim == next_pow2(norm_dim)), \
        "norm_dim must be a power of two dividing split"
    assert split % parts == 0, "parts must divide split"
    width = split // parts
    first = (T, split) if parts == 1 else (parts, T, width)
    if outs is None:
        outs = (torch.empty(first, dtype=x.dtype, device=x.device),
                torch.empty((T, D - split), dtype=x.dtype, device=x.device))
    assert outs[0].shape == first and outs[1].shape == (T, D - split)
    assert outs[0].stride(-1) == 1 and outs[1].stride(1) == 1
    part = (split, 0) if parts == 1 else (width, outs[0].stride(0))
    _launch(x, weight, conv_state, state_slots, query_start_loc, max_query_len, bias, outs[0], (outs[1], split),
            block_t, norm_dim, num_warps, part)
    return outs


def _launch(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor,
            query_start_loc: torch.Tensor, max_query_len: int | None, bias: torch.Tensor | None, out: torch.Tensor,
            second: tuple[torch.Tensor, int] | None, block_t: int | None, norm_dim: int | None = None,
            num_warps: int = 4, part: tuple[int, int] | None = None) -> None:
    """The forward launch (and the window roll where it is a second one); ``second``: ``(out2, split)``, channels
    from ``split`` on written to ``out2``; ``norm_dim``: the channels below ``split`` l2-normed per that many (a
    channel block is then one such group); ``part``: ``out`` in parts of that many channels, that many elements
    apart (None: one part, plain rows)."""
    from hyserve.kernels.conv._triton import _conv1d_fwd_kernel, _conv1d_state_kernel

    T, D = x.shape
    K = weight.shape[1]
    R = state_slots.shape[0]
    assert conv_state.shape[1] == D and conv_state.shape[2] == K - 1, "conv_state must be (S, D, K-1)"
    assert K >= 2, "kernel size must be at least 2"
    assert bias is None or bias.shape == (D,), "bias must be (D,)"
    if R == 0:
        return
    mql = T if max_query_len is None else min(int(max_query_len), T)
    # Prefill blocks of 32 tokens (most of them read no window: ``_taps_inside_row``); shorter rows keep their own.
    if block_t is None:
        block_t = 32 if mql > 16 else next_pow2(max(mql, 1))
    assert block_t == next_pow2(block_t), "block_t must be a power of two"
    n_tblocks = max(1, -(-mql // block_t))
    block_d = 256 if block_t <= 4 else 128
    block_d = min(block_d, next_pow2(D))
    out2, split = second if second is not None else (out, 0)
    if second is not None:
        block_d = min(block_d, split & -split)  # a power of two dividing split: a block lies on one side of it
    if norm_dim is not None:
        block_d = norm_dim  # one head a block: its norm is the block's, per token
    part_width, part_stride = part if part is not None else (D, 0)
    if part is not None:
        block_d = min(block_d, part_width & -part_width)  # a block lies in one part
    km1_pad = next_pow2(K - 1)
    fuse = n_tblocks == 1
    w = weight
    qsl = query_start_loc
    grid = (n_tblocks * _cdiv(D, block_d), R)
    _conv1d_fwd_kernel[grid](
        x, w, w if bias is None else bias, conv_state, state_slots, qsl, out, out2,
        D, split, part_width,
        x.stride(0), x.stride(1),
        w.stride(0), w.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        out.stride(-2), out2.stride(0), part_stride,
        K=K, KM1_PAD=km1_pad, BLOCK_T=block_t, BLOCK_D=block_d, FUSE_STATE=fuse, HAS_BIAS=bias is not None,
        SPLIT_OUT=second is not None, NORM_FIRST=norm_dim is not None,
        num_warps=num_warps,
    )  # fmt: skip
    if not fuse:
        _conv1d_state_kernel[(R, _cdiv(D, block_d))](
            x, conv_state, state_slots, qsl,
            D,
            x.stride(0), x.stride(1),
            conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
            K=K, KM1_PAD=km1_pad, BLOCK_D=block_d,
            num_warps=4,
        )  # fmt: skip


def compile_variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """The conv kernels' variants a bf16 or float32 Nemotron-H makes (conv width 4, a bias; decode, a long prefill,
    verify) and GDN's prefill with its output split (no bias), as ``(name, jit function, argument types,
    constexprs)``, for a compile check without a GPU (``tests/kernels/test_mamba2_kernels_compile.py``)."""
    from hyserve.kernels.conv._triton import _conv1d_fwd_kernel, _conv1d_state_kernel, _conv1d_verify_kernel

    out: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = []
    i32 = "i32"
    for act in ("bf16", "fp32"):
        ptrs = dict(x_ptr=f"*{act}", w_ptr=f"*{act}", b_ptr=f"*{act}", state_ptr=f"*{act}", slots_ptr="*i64",
                    qsl_ptr="*i32", out_ptr=f"*{act}")
        strides = dict(D=i32, sx_t=i32, sx_d=i32, sw_d=i32, sw_k=i32, ss_s=i32, ss_d=i32, ss_k=i32, so_t=i32)
        fwd = {**ptrs, "out2_ptr": f"*{act}", **strides, "SPLIT": i32, "PART": i32, "so2_t": i32, "so_p": i32}
        for name, block_t, block_d, fuse, bias, split, norm in (
                ("bias_decode", 1, 256, True, True, False, False), ("bias_prefill", 32, 128, False, True, False, False),
                ("split_prefill", 32, 128, False, False, True, False),
                ("split_normed_prefill", 32, 128, False, False, True, True)):
            out.append((f"conv_fwd_{name}_{act}", _conv1d_fwd_kernel, fwd,
                        dict(K=4, KM1_PAD=4, BLOCK_T=block_t, BLOCK_D=block_d, FUSE_STATE=fuse, HAS_BIAS=bias,
                             SPLIT_OUT=split, NORM_FIRST=norm)))
        out.append((f"conv_state_{act}", _conv1d_state_kernel,
                     dict(x_ptr=f"*{act}", state_ptr=f"*{act}", slots_ptr="*i64", qsl_ptr="*i32", D=i32, sx_t=i32,
                          sx_d=i32, ss_s=i32, ss_d=i32, ss_k=i32),
                     dict(K=4, KM1_PAD=4, BLOCK_D=128)))
        out.append((f"conv_verify_bias_{act}", _conv1d_verify_kernel,
                    {**ptrs, "scr_ptr": f"*{act}", **strides, "P": i32, "sc_r": i32, "sc_p": i32, "sc_d": i32,
                     "sc_k": i32},
                    dict(K=4, BLOCK_T=4, BLOCK_D=256, HAS_BIAS=True)))
    return out
