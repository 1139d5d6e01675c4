"""Plain-torch reference of :mod:`hyserve.kernels.attention` (the CPU path and the yardstick for the Triton kernels).

Paged KV cache writes (:func:`store_kv_ref`, an FP8 cache holding values divided by their kv head's scale) and
causal attention of varlen queries over the paged cache (:func:`paged_attention_ref`), in the flat varlen layout of
:mod:`hyserve.kernels.varlen`. Softmax in float32. Rows are grouped by query length and padded only to their group's
bounds, queries in tiles of at most ``ATTENTION_SCORE_ELEMENTS`` scores (see :mod:`hyserve.kernels.varlen`).
"""

from __future__ import annotations

import torch

from hyserve.kernels.varlen import group_tokens, length_groups, row_index

__all__ = [
    "ATTENTION_SCORE_ELEMENTS",
    "FP8_KV_DTYPES",
    "dequantize_kv",
    "paged_attention_ref",
    "quantize_kv",
    "store_kv_ref",
]

# Largest (rows, Hq, query tile, context) score tensor the attention reference builds at once (float32 elements).
ATTENTION_SCORE_ELEMENTS = 1 << 22
# KV cache element types stored scaled (kv_cache_dtype="fp8").
FP8_KV_DTYPES = (torch.float8_e4m3fn,)


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``k``/``v`` ``(T, Hkv, D)`` into the paged caches ``(num_blocks, block_size, Hkv, D)`` in place.

    ``slot_mapping[t] = block_id * block_size + offset``; ``-1`` skips token ``t``. FP8 caches store the values
    divided by ``k_scale`` / ``v_scale`` (``quantize_kv``).
    """
    nb, bs, hkv, d = k_cache.shape
    keep = slot_mapping >= 0
    idx = slot_mapping[keep].to(torch.int64)
    k_cache.view(nb * bs, hkv, d)[idx] = quantize_kv(k[keep], k_cache.dtype, k_scale)
    v_cache.view(nb * bs, hkv, d)[idx] = quantize_kv(v[keep], v_cache.dtype, v_scale)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``(T, Hkv, D)`` as the cache stores it: an FP8 cache holds ``x / scale`` (``scale`` per kv head, ``(Hkv,)``
    float32, None = 1) rounded to nearest and clamped to the format's finite range; other caches hold ``x`` cast."""
    if dtype not in FP8_KV_DTYPES:
        return x.to(dtype)
    y = x.float()
    if scale is not None:
        y = y / scale.float()[None, :, None]
    fmax = torch.finfo(dtype).max
    return y.clamp(-fmax, fmax).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Float32 values of cache entries ``x`` ``(..., Hkv, D)`` (FP8 entries times their kv head's scale)."""
    y = x.float()
    if x.dtype in FP8_KV_DTYPES and scale is not None:
        y = y * scale.float()[:, None]
    return y


def paged_attention_ref(
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
    """Causal attention of varlen queries over a paged KV cache (already holding this step's keys/values).

    FP8 caches are read as their entries times ``k_scale`` / ``v_scale`` (``dequantize_kv``).

    Args:
        q: ``(T, Hq, D)``; caches: ``(num_blocks, block_size, Hkv, D)``; ``Hq % Hkv == 0``, query head ``h`` uses
            kv head ``h // (Hq // Hkv)``.
        block_tables: ``(R, max_blocks)`` int; position ``p`` of row ``r`` lives at
            ``block_tables[r, p // block_size] * block_size + p % block_size``.
        seq_lens: ``(R,)`` context length of each row *including* this step's ``n_r`` tokens.
        max_query_len, max_seq_len: host ints bounding ``n_r`` and ``seq_lens``.

    The ``i``-th token of row ``r`` sits at ``seq_lens[r] - n_r + i`` and attends to positions ``[0, that]``.
    Softmax in float32; returns ``(T, Hq, D)`` in ``q.dtype``. Vectorised over the rows of each length group, padded
    to that group's bounds, queries in tiles (see the module docstring).
    """
    T = q.shape[0]
    R = block_tables.shape[0]
    out = torch.empty_like(q)
    if T == 0 or R == 0:
        return out
    qsl_host = query_start_loc.tolist()
    sl_host = seq_lens.tolist()
    for rows in length_groups(query_start_loc):
        tok, sub_qsl = group_tokens(qsl_host, rows, q.device)
        idx = torch.tensor(rows, dtype=torch.int64, device=block_tables.device)
        Q = max(qsl_host[r + 1] - qsl_host[r] for r in rows)
        L = min(max(sl_host[r] for r in rows), max(int(max_seq_len), 1))
        out[tok] = _attend_padded(q[tok], k_cache, v_cache, block_tables[idx], sub_qsl, seq_lens[idx].to(torch.int64),
                                  scale, Q, max(L, 1), k_scale, v_scale)
    return out


def _attend_padded(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    qsl: torch.Tensor,
    sl: torch.Tensor,
    scale: float,
    Q: int,
    L: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_attention_ref`` for rows padded to ``Q`` queries and ``L`` context positions, queries in tiles."""
    T, Hq, D = q.shape
    nb, bs, Hkv, _ = k_cache.shape
    R = block_tables.shape[0]
    dev = q.device
    grp = Hq // Hkv
    lens = qsl[1:] - qsl[:-1]

    # Gather each row's context through its block table: (R, L, Hkv, D).
    pos = torch.arange(L, device=dev, dtype=torch.int64)
    nblk = min(block_tables.shape[1], (L + bs - 1) // bs)
    bt = block_tables[:, :nblk].to(torch.int64)
    blk_idx = (pos // bs).clamp(max=nblk - 1)
    flat = (bt[:, blk_idx] * bs + (pos % bs)[None, :]).clamp(0, nb * bs - 1)  # (R, L)
    kctx = dequantize_kv(k_cache.view(nb * bs, Hkv, D)[flat], k_scale)
    vctx = dequantize_kv(v_cache.view(nb * bs, Hkv, D)[flat], v_scale)

    out = torch.empty_like(q)
    rows, p_in_row = row_index(qsl, T)
    tile = max(1, min(Q, ATTENTION_SCORE_ELEMENTS // max(R * Hq * L, 1)))
    for q0 in range(0, Q, tile):
        # Pad the queries per row: (R, tile, Hq, D); token of (r, i) is qsl[r] + i when i < n_r.
        qi = torch.arange(q0, min(q0 + tile, Q), device=dev, dtype=torch.int64)
        tok = (qsl[:-1, None] + qi[None, :]).clamp(max=T - 1)
        qpad = q[tok].float().view(R, qi.shape[0], Hkv, grp, D)

        scores = torch.einsum("rqhgd,rlhd->rhgql", qpad, kctx) * scale  # (R, Hkv, grp, tile, L)
        qpos = (sl - lens)[:, None] + qi[None, :]  # (R, tile) absolute position of each query
        allowed = (pos[None, None, :] <= qpos[:, :, None]) & (pos[None, None, :] < sl[:, None, None])
        scores = scores.masked_fill_(~allowed[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # fully masked (padding) query rows -> 0
        o = torch.einsum("rhgql,rlhd->rqhgd", probs, vctx).reshape(R, qi.shape[0], Hq, D)
        mine = (p_in_row >= q0) & (p_in_row < q0 + tile)
        out[mine] = o[rows[mine], p_in_row[mine] - q0].to(q.dtype)
    return out
