"""Paged KV cache writes and causal paged attention for the full-attention layers.

Entry points: :func:`store_kv` and :func:`paged_attention`. On CUDA they run the Triton kernels of ``_triton.py``;
elsewhere the plain-torch references of ``reference.py``, which define the semantics.

Invariants:

* Caches are ``(num_blocks, block_size, Hkv, D)``; a flat cache slot is ``block_id * block_size + offset``;
  ``slot_mapping[t] == -1`` skips token ``t`` (padding); slots not named are never written.
* ``seq_lens[r]`` counts row ``r``'s whole context *including* this step's ``n_r`` tokens, which ``store_kv`` has
  already written. Query ``i`` of row ``r`` sits at ``seq_lens[r] - n_r + i`` and attends causally to ``[0, that]``.
* GQA: query head ``h`` reads kv head ``h // (Hq // Hkv)``. Softmax is float32; the output has ``q``'s dtype.
* ``max_query_len`` / ``max_seq_len`` are host ints bounding ``n_r`` / ``seq_lens`` (no device->host sync). The decode
  path (``max_query_len <= 1``, or rows short enough for its lanes: :func:`short_row_lanes`) never syncs and
  allocates only fixed-shape scratch, so it can be graph-captured: the number of context splits is fixed at capture
  time by the rows and KV heads (about :data:`_DECODE_PROGRAMS` programs) and the key tiles of ``max_seq_len``,
  which must bound every later ``seq_lens``; each row divides its own context over them in whole key tiles, so a
  short row in a graph sized for a long model still spreads its work.
"""

from __future__ import annotations

from typing import Any

import torch

from hyserve.kernels.attention.reference import FP8_KV_DTYPES, paged_attention_ref, store_kv_ref
from hyserve.utils import next_pow2

__all__ = ["decode_splits", "paged_attention", "paged_attention_triton", "reduce_splits", "short_row_lanes",
           "split_partials", "store_kv", "store_kv_triton"]

# Decode: the programs a launch aims at (rows x KV heads x splits; about eight per SM of an H100 / H200) and the most
# splits per row.
_DECODE_PROGRAMS = 1024
_DECODE_MAX_SPLITS = 64
_LOG2E = 1.4426950408889634
_FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448: FP8 cache entries are clamped to it
# Rows of several tokens (verify rows: k + 1; the MTP head's pass over a verify row's accepted positions) take the
# split-context kernel while their tokens times the GQA group fit this many lanes of a program: one read of each key
# tile a kv head and the context spread over splits, where the prefill kernel reads it once a query head, in one
# program a (row, query head).
SHORT_ROW_MAX_LANES = 64
# Prefill kernel (BLOCK_M, BLOCK_N, num_warps, num_stages).
PREFILL_CONFIG = (128, 64, 8, 2)  # best of a sweep on H200 at D=256 (n=4096): ~2x SDPA time
# Shared memory a kernel's tiles may take (Hopper allows 227 KiB per block): float32 tiles at D=256 take twice
# what bf16 ones do, so the block sizes shrink for them (the bf16 configurations fit unchanged).
SMEM_BUDGET = 200 * 1024


def fit_tiles(block_m: int, block_n: int, num_stages: int, block_d: int, elem: int) -> tuple[int, int, int]:
    """Shrink (stages, then BLOCK_M, then BLOCK_N) until a Q tile plus ``num_stages`` K and V tiles fit."""
    def smem(bm: int, bn: int, st: int) -> int:
        return (bm * block_d + st * 2 * bn * block_d) * elem

    while smem(block_m, block_n, num_stages) > SMEM_BUDGET:
        if num_stages > 1:
            num_stages -= 1
        elif block_m > 32:
            block_m //= 2
        elif block_n > 16:
            block_n //= 2
        else:
            break
    return block_m, block_n, num_stages


def short_row_lanes(max_query_len: int, group: int) -> int | None:
    """The lanes of the split-context kernel's program for rows of at most ``max_query_len`` tokens and ``group``
    query heads a kv head (a power of two, at least 16 for ``tl.dot``), or None where they would pass
    :data:`SHORT_ROW_MAX_LANES`: rows that long take the prefill kernel."""
    lanes = max(16, next_pow2(max(1, max_query_len) * group))
    return lanes if max_query_len <= 1 or lanes <= SHORT_ROW_MAX_LANES else None


def decode_splits(rows: int, kv_heads: int, tiles: int) -> int:
    """The context splits of a decode launch over ``rows`` rows of ``kv_heads`` KV heads whose contexts span at most
    ``tiles`` key tiles: about :data:`_DECODE_PROGRAMS` programs in all, at most one tile each and at most
    :data:`_DECODE_MAX_SPLITS`. Each row divides its own context over them (whole tiles), so the work spreads with the
    rows' lengths, not the model's: a batch-1 row of 600 positions takes 19 programs a head, and batch 64 four."""
    return max(1, min(_DECODE_MAX_SPLITS, tiles, _cdiv(_DECODE_PROGRAMS, max(1, rows * kv_heads))))


def compile_variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """The split-context decode kernel's variants at the Qwen3.5 9B layer's heads (16 query, 4 KV, head dim 256): a
    bf16 cache with each row's own split (``PART`` 0) over one split and several, an FP8 cache with a fixed one; and
    verify rows of 3 tokens (MTP k = 2) at the 27B layer's heads (24 query, 4 KV: 18 lanes in 32) and of 8 at the
    9B's (32 lanes), over several splits; as ``(name, jit function, argument types, constexprs)``
    for a compile check without a GPU (``tests/kernels/test_attention_compile.py``)."""
    from hyserve.kernels.attention._triton import _paged_decode_kernel

    i32, f32 = "i32", "fp32"
    ints = ["sq_t", "sq_h", "so_t", "so_h", "sbt_r", "skc_b", "skc_o", "skc_h", "svc_b", "svc_o", "svc_h", "spo_r",
            "spo_h", "spo_s", "spml_r", "spml_h", "spml_s"]
    out: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = []
    for cache in ("bf16", "fp8e4nv"):
        sig = {**dict.fromkeys(ints, i32), "q_ptr": "*bf16", "kc_ptr": f"*{cache}", "vc_ptr": f"*{cache}",
               "bt_ptr": "*i32", "qsl_ptr": "*i32", "seqlen_ptr": "*i32", "out_ptr": "*bf16", "po_ptr": "*fp32",
               "pml_ptr": "*fp32", "ks_ptr": "*fp32", "vs_ptr": "*fp32", "qk_scale": f32}
        for part, single in (((0, False), (0, True)) if cache == "bf16" else ((512, False),)):
            consts = dict(GROUP=4, G_PAD=16, QMAX=1, D=256, BLOCK_D=256, BS=16, BLOCK_N=32, PART=part, SINGLE=single,
                          PRECISION="tf32", FP8=cache != "bf16")
            name = f"decode_{cache}_{'rows' if part == 0 else 'fixed'}_{'single' if single else 'splits'}"
            out.append((name, _paged_decode_kernel, sig, consts))
    sig = {**dict.fromkeys(ints, i32), "q_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "bt_ptr": "*i32",
           "qsl_ptr": "*i32", "seqlen_ptr": "*i32", "out_ptr": "*bf16", "po_ptr": "*fp32", "pml_ptr": "*fp32",
           "ks_ptr": "*fp32", "vs_ptr": "*fp32", "qk_scale": f32}
    for name, group, qmax in (("verify_27b_q3", 6, 3), ("verify_9b_q8", 4, 8)):
        lanes = short_row_lanes(qmax, group)
        assert lanes is not None
        consts = dict(GROUP=group, G_PAD=lanes, QMAX=qmax, D=256, BLOCK_D=256, BS=16, BLOCK_N=32, PART=0,
                      SINGLE=False, PRECISION="tf32", FP8=False)
        out.append((name, _paged_decode_kernel, sig, consts))
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``k``, ``v`` ``(T, Hkv, D)`` into the paged caches at ``slot_mapping`` ``(T,)`` (``-1`` = skip); an FP8
    cache stores them divided by ``k_scale`` / ``v_scale`` (``(Hkv,)`` float32, None = 1)."""
    if k.is_cuda:
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Triton :func:`store_kv`: one program per token, no host sync."""
    from hyserve.kernels.attention._triton import _store_kv_kernel

    T, Hkv, D = k.shape
    if T == 0:
        return
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches must be contiguous in the head dim"
    fp8 = k_cache.dtype in FP8_KV_DTYPES
    ks, vs = kv_scales(k_cache, k_scale, v_scale, Hkv)
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, ks, vs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HKV=Hkv, D=D, BLOCK_H=next_pow2(Hkv), BLOCK_D=next_pow2(D), BS=k_cache.shape[1],
        FP8=fp8, FP8_MAX=_FP8_MAX if fp8 else 0.0,
        num_warps=4,
    )  # fmt: skip


def kv_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
               num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' per-kv-head scale vectors: the given ones, or ones (an unscaled FP8 cache); the cache itself as
    a never-read placeholder for a cache in the model's dtype."""
    if k_cache.dtype not in FP8_KV_DTYPES:
        return k_cache, k_cache
    ones = None
    if k_scale is None or v_scale is None:
        ones = torch.ones(num_kv_heads, dtype=torch.float32, device=k_cache.device)
    ks = k_scale if k_scale is not None else ones
    vs = v_scale if v_scale is not None else ones
    assert ks is not None and vs is not None
    return ks, vs


def split_partials(out: torch.Tensor, rows: int, splits: int
                   ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int], tuple[int, int, int]]:
    """A split-context launch's float32 partial buffers for ``rows`` partial rows of ``out``'s (T, Hq, D): sums
    (rows, Hq, splits, D) and (max, sum) (rows, Hq, splits, 2), with their strides; with one split, ``out`` as a
    placeholder (the kernel writes the output itself)."""
    if splits == 1:
        return out, out, (0, 0, 0), (0, 0, 0)
    _, hq, d = out.shape
    po = torch.empty((rows, hq, splits, d), dtype=torch.float32, device=out.device)
    pml = torch.empty((rows, hq, splits, 2), dtype=torch.float32, device=out.device)
    return po, pml, (po.stride(0), po.stride(1), po.stride(2)), (pml.stride(0), pml.stride(1), pml.stride(2))


def reduce_splits(po: torch.Tensor, pml: torch.Tensor, query_start_loc: torch.Tensor | None, out: torch.Tensor
                  ) -> None:
    """Combine ``split_partials``' buffers into ``out``: partial row ``r`` is the output token ``qsl[r]`` (rows with
    no token skipped), or with ``query_start_loc`` None the output token ``r``."""
    from hyserve.kernels.attention._triton import _paged_decode_reduce_kernel

    rows, hq, splits, d = po.shape
    _paged_decode_reduce_kernel[(rows, hq)](
        po, pml, po if query_start_loc is None else query_start_loc, out,
        out.stride(0), out.stride(1), po.stride(0), po.stride(1), po.stride(2),
        pml.stride(0), pml.stride(1), pml.stride(2),
        NUM_SPLITS=splits, S_PAD=next_pow2(splits), D=d, BLOCK_D=max(16, next_pow2(d)),
        BY_TOKEN=query_start_loc is None,
        num_warps=4,
    )  # fmt: skip


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the varlen queries ``q`` ``(T, Hq, D)`` over the paged caches; returns ``(T, Hq, D)``.

    Args:
        q: ``(T, Hq, D)`` (head dim contiguous).
        k_cache, v_cache: ``(num_blocks, block_size, Hkv, D)``, already holding this step's keys/values.
        block_tables: ``(R, max_blocks)`` int32.
        query_start_loc: ``(R + 1,)`` int32; seq_lens: ``(R,)`` int32 (context including this step's tokens).
        scale: softmax scale (usually ``D ** -0.5``).
        max_query_len, max_seq_len: host ints bounding the row lengths and ``seq_lens``.
        k_scale, v_scale: an FP8 cache's per-kv-head scales ``(Hkv,)`` float32 (None = 1): entries read times them.
    """
    if q.is_cuda:
        return paged_attention_triton(
            q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len, max_seq_len,
            k_scale=k_scale, v_scale=v_scale,
        )
    return paged_attention_ref(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len, max_seq_len,
        k_scale, v_scale,
    )


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    decode_partition: int | None = None,
    prefill_config: tuple[int, int, int, int] | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    short_rows: bool = True,
) -> torch.Tensor:
    """Triton :func:`paged_attention`: the split-context decode kernel when ``max_query_len <= 1`` or the rows are
    short enough for its lanes (:func:`short_row_lanes`: verify rows; ``short_rows`` False, for benchmarks, sends
    rows of several tokens to the prefill kernel whatever their length), the varlen prefill kernel otherwise.
    ``decode_partition`` (tests) fixes the context positions per decode split (instead of each row's context
    divided over :func:`decode_splits`);
    ``prefill_config`` (tuning) overrides the prefill kernel's ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``;
    ``out`` optionally supplies the ``(T, Hq, D)`` output buffer."""
    from hyserve.kernels.attention._triton import _paged_decode_kernel, _paged_prefill_kernel

    T, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    R = block_tables.shape[0]
    assert Hq % Hkv == 0, "Hq must be a multiple of Hkv"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches must be contiguous in the head dim"
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1
    if T == 0 or R == 0:
        return out
    group = Hq // Hkv
    fp8 = k_cache.dtype in FP8_KV_DTYPES
    ks, vs = kv_scales(k_cache, k_scale, v_scale, Hkv)
    block_d = max(16, next_pow2(D))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    qk_scale = float(scale) * _LOG2E
    common = (
        block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
    )  # fmt: skip

    elem = q.element_size()
    qmax = max(1, max_query_len)
    lanes = short_row_lanes(qmax, group) if short_rows or qmax == 1 else None
    if lanes is not None:
        block_n = 64 if block_d <= 128 else 32
        _, block_n, decode_stages = fit_tiles(lanes, block_n, 3, block_d, elem)
        max_seq = max(int(max_seq_len), 1)
        if decode_partition is not None:  # tests: force several splits on short contexts
            block_n = max(16, min(block_n, next_pow2(decode_partition)))
            part = block_n * _cdiv(decode_partition, block_n)
            splits = _cdiv(max_seq, part)
        else:
            part = 0  # each row's own context over the splits
            splits = decode_splits(R, Hkv, _cdiv(max_seq, block_n))
        single = splits == 1
        # Partial rows: the rows (one token each at most), or the tokens of rows of several.
        po, pml, po_strides, pml_strides = split_partials(out, R if qmax == 1 else T, splits)
        _paged_decode_kernel[(R, Hkv, splits)](
            q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, po, pml, ks, vs,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            *common, *po_strides, *pml_strides,
            qk_scale,
            GROUP=group, G_PAD=lanes, QMAX=qmax, D=D, BLOCK_D=block_d, BS=bs,
            BLOCK_N=block_n, PART=part, SINGLE=single, PRECISION=precision, FP8=fp8,
            num_warps=4 if qmax == 1 or lanes <= 32 else 8, num_stages=decode_stages,  # decode rows: as measured
        )  # fmt: skip
        if not single:
            reduce_splits(po, pml, query_start_loc if qmax == 1 else None, out)
        return out

    if prefill_config is not None:
        block_m, block_n, num_warps, num_stages = prefill_config
    else:
        block_m, block_n, num_warps, num_stages = PREFILL_CONFIG
    block_m = min(block_m, max(16, next_pow2(max_query_len)))
    block_m, block_n, num_stages = fit_tiles(block_m, block_n, num_stages, block_d, elem)
    grid = (_cdiv(max_query_len, block_m), R, Hq)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, ks, vs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *common,
        qk_scale,
        GROUP=group, D=D, BLOCK_D=block_d, BS=bs, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision, FP8=fp8,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
