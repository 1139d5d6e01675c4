"""Triton launchers for Qwen4-Exp's indexed (QSA) attention: the two steps of
:func:`hyserve.layers.qsa.indexed_attention` that dominate its cost in torch (each token's block scores, and the
attention over each token's selection).

* :func:`qsa_block_scores`: ``(T, nbk)`` float32, token ``t``'s score of block ``j`` of its row, ``sum_h relu(iq[t, h]
  . block_keys[rows[t], j]) / sqrt(Di)``, ``-inf`` where ``j >= visible[t]``. The torch formulation gathers each
  token's row of block keys (``T x nbk x Di`` floats); the kernel reads them in place.
* :func:`qsa_pool_scores`: the same scores with each block key made on the fly from the raw index keys in the paged
  cache (pooled, normed, rotated), reading only the blocks each token sees: for steps of few tokens a row (decode,
  verify), whose graphs are sized for the model's length; ``qsa_block_scores`` over once-pooled keys is cheaper
  for long prefill chunks (each token would pool its whole context again).
* :func:`qsa_positions`: each token's attention lanes from its chosen blocks (or its causal prefix), one launch.
* :func:`store_index_keys`: the step's raw index keys into the paged index cache, one launch.
* :func:`qsa_attention`: token ``t`` attends to the cache positions ``positions[t]`` of block-table row ``rows[t]``
  (``-1``: an unused lane), float32 online softmax, GQA, FP8 caches as :func:`hyserve.kernels.attention.paged_attention`
  reads them. Few tokens (decode, verify): each token's lanes split across programs and reduced, as the paged decode
  kernel does. The torch formulation gathers each token's K and V (``T x S x Hkv x D`` floats).

No host synchronization and shapes from host ints only, so both run inside CUDA graph capture. On the CPU they run
under the Triton interpreter (tests); the layer calls them when :func:`hyserve.kernels.moe.uses_triton` (CUDA, or
the interpreter).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hyserve.kernels.attention import FP8_KV_DTYPES, fit_tiles, kv_scales, reduce_splits, split_partials
from hyserve.utils import next_pow2

__all__ = ["compile_variants", "qsa_attention", "qsa_block_scores", "qsa_pool_scores", "qsa_positions",
           "store_index_keys"]

_LOG2E = 1.4426950408889634
# Below this many (token, kv head) programs a token's lanes are split across programs (decode and verify steps).
_SPLIT_BELOW = 256
_MAX_SPLITS = 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def qsa_block_scores(iq: torch.Tensor, block_keys: torch.Tensor, rows: torch.Tensor,
                     visible: torch.Tensor) -> torch.Tensor:
    """``iq`` (T, Hi, Di) rotated indexer queries; ``block_keys`` (R, nbk, Di) each row's pooled block keys; ``rows``
    (T,) each token's row; ``visible`` (T,) the complete blocks each token sees. Returns (T, nbk) float32."""
    from hyserve.kernels.attention._triton import _qsa_scores_kernel

    t, hi, di = iq.shape
    nbk = block_keys.shape[1]
    out = torch.empty((t, nbk), dtype=torch.float32, device=iq.device)
    if t == 0 or nbk == 0:
        return out
    if iq.stride(-1) != 1:
        iq = iq.contiguous()
    if block_keys.stride(-1) != 1:
        block_keys = block_keys.contiguous()
    if block_keys.dtype != iq.dtype:
        block_keys = block_keys.to(iq.dtype)
    block_j = 64
    _qsa_scores_kernel[(t, _cdiv(nbk, block_j))](
        iq, block_keys, rows, visible, out,
        iq.stride(0), iq.stride(1), block_keys.stride(0), block_keys.stride(1), out.stride(0), math.sqrt(di),
        nbk, HI=hi, HI_PAD=max(16, next_pow2(hi)), DI=di, BLOCK_DI=max(16, next_pow2(di)), BLOCK_J=block_j,
        PRECISION="ieee" if iq.dtype == torch.float32 else "tf32",
        num_warps=4,
    )  # fmt: skip
    return out


def qsa_pool_scores(iq: torch.Tensor, index_cache: torch.Tensor, block_tables: torch.Tensor, rows: torch.Tensor,
                    visible: torch.Tensor, k_norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor, c: int,
                    num_blocks: int, position_cache: torch.Tensor | None = None,
                    axes: torch.Tensor | None = None) -> torch.Tensor:
    """``iq`` (T, Hi, Di); ``index_cache`` (num_cache_blocks, block_size, Di) the raw index keys; ``block_tables``
    (R, max_blocks); ``rows``, ``visible`` (T,); ``k_norm_weight`` (Di,) the zero-centred key norm's weight;
    ``inv_freq`` (R2,) the rotary frequencies (the first ``2 * R2`` channels rotate); ``c`` tokens a block;
    ``num_blocks`` the score columns (``max_seq_len // c``). M-RoPE: ``position_cache`` (num_cache_blocks,
    block_size, 3) each token's positions and ``axes`` (R2,) each frequency's axis; a block turns at its first
    token's. Returns (T, num_blocks) float32."""
    from hyserve.kernels.attention._triton import _qsa_pool_scores_kernel

    t, hi, di = iq.shape
    out = torch.empty((t, num_blocks), dtype=torch.float32, device=iq.device)
    if t == 0 or num_blocks == 0:
        return out
    assert index_cache.stride(-1) == 1, "the index cache must be contiguous in its last dim"
    if iq.stride(-1) != 1:
        iq = iq.contiguous()
    block_di = max(16, next_pow2(di))
    block_j = 16 if block_di >= 128 else 32  # about eight (BLOCK_J, BLOCK_DI) float32 tiles live at once
    mrope = position_cache is not None
    if mrope:
        assert axes is not None and position_cache is not None and position_cache.stride(-1) == 1
        pc, ax = position_cache, axes.to(torch.int32).contiguous()
    else:
        pc, ax = index_cache, rows  # not read
    _qsa_pool_scores_kernel[(t, _cdiv(num_blocks, block_j))](
        iq, index_cache, block_tables, rows, visible, k_norm_weight, inv_freq.float().contiguous(), out, pc, ax,
        iq.stride(0), iq.stride(1), index_cache.stride(0), index_cache.stride(1), block_tables.stride(0),
        out.stride(0), pc.stride(0), pc.stride(1), math.sqrt(di), eps,
        num_blocks, HI=hi, HI_PAD=max(16, next_pow2(hi)), DI=di, BLOCK_DI=block_di,
        R2=inv_freq.shape[0], C=c, BS=index_cache.shape[1], BLOCK_J=block_j, MROPE=mrope,
        PRECISION="ieee" if index_cache.dtype == torch.float32 else "tf32",
        num_warps=4,
    )  # fmt: skip
    return out


def qsa_positions(best: torch.Tensor | None, qpos: torch.Tensor, visible: torch.Tensor, span: int, top: int,
                  c: int) -> torch.Tensor:
    """``best`` (T, top) each token's chosen block indices (None: no token can be sparse); ``qpos``, ``visible``
    (T,). Returns (T, span) int32 positions, ``-1`` unused: a token seeing more than ``top`` complete blocks attends
    to its chosen blocks' tokens and its tail ``[visible * c, qpos]``, any other to ``[0, qpos]``."""
    from hyserve.kernels.attention._triton import _qsa_positions_kernel

    t = qpos.shape[0]
    out = torch.empty((t, span), dtype=torch.int32, device=qpos.device)
    if t == 0 or span == 0:
        return out
    block_s = min(1024, next_pow2(span))
    b = best if best is not None else qpos
    _qsa_positions_kernel[(t, _cdiv(span, block_s))](
        b, qpos, visible, out, b.stride(0), out.stride(0), span,
        TOP=top, C=c, SPARSE=best is not None, BLOCK_S=block_s, num_warps=4,
    )  # fmt: skip
    return out


def store_index_keys(keys: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``keys`` (T, Di) into ``index_cache`` (num_blocks, block_size, Di) at ``slot_mapping`` (T,), ``-1`` skipped
    (``hyserve.layers.qsa.store_index_keys_ref``'s result)."""
    from hyserve.kernels.attention._triton import _store_index_keys_kernel

    t, d = keys.shape
    if t == 0:
        return
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    assert index_cache.stride(-1) == 1
    _store_index_keys_kernel[(t,)](
        keys, index_cache, slot_mapping, keys.stride(0), index_cache.stride(0), index_cache.stride(1),
        D=d, BLOCK_D=max(16, next_pow2(d)), BS=index_cache.shape[1], num_warps=1,
    )  # fmt: skip


def qsa_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    part: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q`` (T, Hq, D) rotated queries; caches (num_blocks, block_size, Hkv, D); ``block_tables`` (R, max_blocks);
    ``rows`` (T,) each token's table row; ``positions`` (T, S) int32 the positions each token attends to (``-1``:
    unused; a token with none gives zeros). ``part`` (tests) forces the lanes per split. Returns (T, Hq, D) in
    ``q.dtype``."""
    from hyserve.kernels.attention._triton import _qsa_attend_kernel

    t, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    assert hq % hkv == 0, "Hq must be a multiple of Hkv"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches must be contiguous in the head dim"
    if q.stride(-1) != 1:
        q = q.contiguous()
    if positions.stride(-1) != 1:
        positions = positions.contiguous()
    if out is None:
        out = torch.empty_like(q)
    s = positions.shape[1]
    if t == 0 or s == 0:
        return out.zero_()
    group = hq // hkv
    fp8 = k_cache.dtype in FP8_KV_DTYPES
    ks, vs = kv_scales(k_cache, k_scale, v_scale, hkv)
    block_d = max(16, next_pow2(d))
    block_n = 64 if block_d <= 128 else 32
    _, block_n, stages = fit_tiles(16, block_n, 3, block_d, q.element_size())
    if part is None:
        part = s if t * hkv >= _SPLIT_BELOW else max(block_n, _cdiv(s, _MAX_SPLITS))
    part = block_n * _cdiv(part, block_n)
    splits = _cdiv(s, part)
    single = splits == 1
    po, pml, po_strides, pml_strides = split_partials(out, t, splits)
    _qsa_attend_kernel[(t, hkv, splits)](
        q, k_cache, v_cache, block_tables, rows, positions, out, po, pml, ks, vs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), positions.stride(0), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *po_strides, *pml_strides,
        float(scale) * _LOG2E, s,
        GROUP=group, G_PAD=max(16, next_pow2(group)), D=d, BLOCK_D=block_d, BS=bs, BLOCK_N=block_n, PART=part,
        SINGLE=single, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8=fp8,
        num_warps=4, num_stages=stages,
    )  # fmt: skip
    if not single:  # the reduction's rows are the tokens
        reduce_splits(po, pml, torch.arange(t + 1, dtype=torch.int32, device=q.device), out)
    return out


def compile_variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """The variants of this package's Triton kernels that the QSA launchers make for a bf16 Qwen4-Exp model, as
    ``(name, jit function, argument types, constexprs)``, for a compile check without a GPU
    (``tests/kernels/test_qwen4_exp_kernels_compile.py``)."""
    from hyserve.kernels.attention._triton import (
        _qsa_attend_kernel,
        _qsa_pool_scores_kernel,
        _qsa_positions_kernel,
        _qsa_scores_kernel,
        _store_index_keys_kernel,
    )

    out: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = []
    bf = "*bf16"
    i32 = "i32"
    out.append(("qsa_scores", _qsa_scores_kernel,
                dict(iq_ptr=bf, bk_ptr=bf, rows_ptr="*i64", vis_ptr="*i64", out_ptr="*fp32", siq_t=i32, siq_h=i32,
                     sbk_r=i32, sbk_j=i32, so_t=i32, sqrt_d="fp32", NBK=i32),
                dict(HI=16, HI_PAD=16, DI=128, BLOCK_DI=128, BLOCK_J=64, PRECISION="tf32")))
    for mrope in (False, True):
        out.append((f"qsa_pool_scores{'_mrope' if mrope else ''}", _qsa_pool_scores_kernel,
                    dict(iq_ptr=bf, ic_ptr=bf, bt_ptr="*i32", rows_ptr="*i64", vis_ptr="*i64", kw_ptr=bf,
                         invf_ptr="*fp32", out_ptr="*fp32", pc_ptr="*i32" if mrope else bf,
                         ax_ptr="*i32" if mrope else "*i64", siq_t=i32, siq_h=i32, sic_b=i32, sic_o=i32, sbt_r=i32,
                         so_t=i32, spc_b=i32, spc_o=i32, sqrt_d="fp32", eps="fp32", NBK=i32),
                    dict(HI=16, HI_PAD=16, DI=128, BLOCK_DI=128, R2=32, C=4, BS=16, BLOCK_J=16, MROPE=mrope,
                         PRECISION="tf32")))
    out.append(("qsa_positions", _qsa_positions_kernel,
                dict(best_ptr="*i64", qpos_ptr="*i64", vis_ptr="*i64", pos_ptr="*i32", sb_t=i32, sp_t=i32, S=i32),
                dict(TOP=512, C=4, SPARSE=True, BLOCK_S=1024)))
    out.append(("store_index_keys", _store_index_keys_kernel,
                dict(k_ptr=bf, c_ptr=bf, slot_ptr="*i64", sk_t=i32, sc_b=i32, sc_o=i32),
                dict(D=128, BLOCK_D=128, BS=16)))
    out.append(("store_index_positions", _store_index_keys_kernel,  # M-RoPE: each token's three positions
                dict(k_ptr="*i32", c_ptr="*i32", slot_ptr="*i64", sk_t=i32, sc_b=i32, sc_o=i32),
                dict(D=3, BLOCK_D=16, BS=16)))
    attend = dict(bt_ptr="*i32", rows_ptr="*i64", pos_ptr="*i32", po_ptr="*fp32", pml_ptr="*fp32", ks_ptr="*fp32",
                  vs_ptr="*fp32", qk_scale="fp32", S=i32,
                  **{k: i32 for k in ("sq_t", "sq_h", "so_t", "so_h", "sp_t", "sbt_r", "skc_b", "skc_o", "skc_h",
                                      "svc_b", "svc_o", "svc_h", "spo_r", "spo_h", "spo_s", "spml_r", "spml_h",
                                      "spml_s")})
    for q, kv, single in (("bf16", "bf16", True), ("bf16", "bf16", False), ("bf16", "fp8e4nv", False),
                          ("fp32", "fp32", True)):
        out.append((f"qsa_attend_{q}_{kv}_{'single' if single else 'splits'}", _qsa_attend_kernel,
                    dict(attend, q_ptr=f"*{q}", kc_ptr=f"*{kv}", vc_ptr=f"*{kv}", out_ptr=f"*{q}"),
                    dict(GROUP=8, G_PAD=16, D=256, BLOCK_D=256, BS=16, BLOCK_N=32, PART=160, SINGLE=single,
                         PRECISION="ieee" if q == "fp32" else "tf32", FP8=kv == "fp8e4nv")))
    return out
