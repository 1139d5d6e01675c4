"""Plain-torch reference implementations of hyserve's kernels (the CPU path and the yardstick for the fast paths).

Layout shared by every function here (the "flat varlen" layout):

* A step's tokens from ``R`` rows (requests) are concatenated: ``T`` tokens in all.
* ``query_start_loc`` (``qsl``) is an int tensor of shape ``(R + 1,)``, non-decreasing, ``qsl[0] == 0`` and
  ``qsl[R] == T``: row ``r`` owns tokens ``[qsl[r], qsl[r + 1])``. A row may be empty (padding).
* Recurrent state lives in pools indexed by *slot*, never by row: ``state_slots[r]`` is the slot that row ``r``
  reads and writes. Slots of non-empty rows must be distinct. Empty rows never write their slot (whatever it is),
  and pool entries whose slot no non-empty row names are left bit-identical.
* ``max_query_len`` / ``max_seq_len`` are host ints supplied by the caller (upper bounds, so that no device-to-host
  synchronisation is needed to size loops or padded tensors).

All arithmetic is float32; outputs come back in the model dtype given by the documented input.
These functions are written for clarity and vectorised across rows; they need no GPU and no Triton.

Cost follows tokens. A step may mix one long prefill chunk with many one-token decode rows; padding every row to the
longest (rows x chunk x context attention scores, rows x chunk recurrent steps) made such a step cost, in memory and
time, rows times what its tokens cost. So the attention and the gated delta rule group rows by query length (a power
of two bucket: padding within a group at most doubles its work), pad each group only to its own bounds, and tile
the attention's queries so that a score tensor stays under ``ATTENTION_SCORE_ELEMENTS``. Grouping reads the row
lengths on the host (free on the CPU, the path these run on in production; a sync on CUDA, where they are yardsticks).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = [
    "FP8_KV_DTYPES",
    "causal_conv1d_varlen_ref",
    "dequantize_kv",
    "gdn_forward_ref",
    "l2norm",
    "paged_attention_ref",
    "quantize_kv",
    "row_index",
    "store_kv_ref",
]


def row_index(query_start_loc: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token row id and position within its row, computed on device without a host sync.

    Returns ``(rows, pos)`` (both int64, shape ``(num_tokens,)``) with ``qsl[rows[t]] <= t < qsl[rows[t] + 1]`` and
    ``pos[t] = t - qsl[rows[t]]``. Empty rows own no token, so they never appear in ``rows``.
    """
    qsl = query_start_loc.to(torch.int64)
    t = torch.arange(num_tokens, device=qsl.device, dtype=torch.int64)
    rows = torch.searchsorted(qsl[1:], t, right=True)
    pos = t - qsl[rows]
    return rows, pos


# Largest (rows, Hq, query tile, context) score tensor the attention reference builds at once (float32 elements).
ATTENTION_SCORE_ELEMENTS = 1 << 22
# KV cache element types stored scaled (kv_cache_dtype="fp8").
FP8_KV_DTYPES = (torch.float8_e4m3fn,)


def length_groups(query_start_loc: torch.Tensor) -> list[list[int]]:
    """The non-empty rows grouped by query length (same power-of-two bucket), each group in row order."""
    qsl = query_start_loc.tolist()
    groups: defaultdict[int, list[int]] = defaultdict(list)
    for r in range(len(qsl) - 1):
        n = qsl[r + 1] - qsl[r]
        if n > 0:
            groups[(n - 1).bit_length()].append(r)
    return [groups[b] for b in sorted(groups)]


def _group_tokens(qsl: list[int], rows: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token indices of ``rows`` (in row order) and their own query_start_loc over those tokens."""
    idx: list[int] = []
    sub = [0]
    for r in rows:
        idx.extend(range(qsl[r], qsl[r + 1]))
        sub.append(len(idx))
    return (torch.tensor(idx, dtype=torch.int64, device=device),
            torch.tensor(sub, dtype=torch.int64, device=device))


def _nonempty_rows(query_start_loc: torch.Tensor) -> torch.Tensor:
    """Indices of the rows that own at least one token (a host sync on CUDA; free on CPU)."""
    lens = query_start_loc[1:] - query_start_loc[:-1]
    return torch.nonzero(lens > 0).squeeze(1)


# --------------------------------------------------------------------------------------------------------------------
# Depthwise causal conv1d with a slot-indexed rolling state
# --------------------------------------------------------------------------------------------------------------------


def causal_conv1d_varlen_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> torch.Tensor:
    """Depthwise causal conv1d (no bias) + SiLU over varlen rows, with the rolling window kept in ``conv_state``.

    Args:
        x: ``(T, D)`` inputs in the model dtype.
        weight: ``(D, K)`` depthwise taps (``conv1d.weight.squeeze(1)``).
        conv_state: ``(S, D, K - 1)`` pool, same dtype as ``x``; slot ``s`` holds the previous ``K - 1`` inputs of its
            request, oldest first (zeros for a fresh request). Updated in place: afterwards the slot of each
            non-empty row holds the last ``K - 1`` inputs of ``old window ++ row tokens``.
        state_slots: ``(R,)`` slot of each row.
        query_start_loc: ``(R + 1,)`` cumulative token offsets.

    Returns:
        ``(T, D)`` in ``x.dtype``: ``out[t] = silu(sum_k weight[:, k] * window_t[k])`` computed in float32, where
        ``window_t`` holds the ``K`` inputs ending at ``t`` (older ones from the state).
    """
    T, D = x.shape
    K = weight.shape[1]
    km1 = K - 1
    R = state_slots.shape[0]
    slots = state_slots.to(torch.int64)
    qsl = query_start_loc.to(torch.int64)
    if km1 == 0:
        out = x.float() * weight[:, 0].float()
        return F.silu(out).to(x.dtype)

    # One buffer holding every row's old window (row r at [r*km1, (r+1)*km1)) followed by all the new tokens.
    old = conv_state[slots]  # (R, D, km1)
    buf = torch.cat([old.transpose(1, 2).reshape(R * km1, D), x.to(conv_state.dtype)], dim=0)  # (R*km1 + T, D)

    def _src(rows: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
        # rel: position relative to the row's first new token; negative values index the old window.
        return torch.where(rel >= 0, R * km1 + qsl[rows] + rel, rows * km1 + km1 + rel)

    taps = torch.arange(K, device=x.device, dtype=torch.int64)
    if T > 0:
        rows, pos = row_index(qsl, T)
        rel = pos[:, None] - km1 + taps[None, :]  # (T, K)
        win = buf[_src(rows[:, None].expand(T, K), rel)]  # (T, K, D)
        acc = (win.float() * weight.t().float()[None]).sum(dim=1)
        out = F.silu(acc).to(x.dtype)
    else:
        out = x.new_empty((0, D))

    # New windows: the last km1 entries of (old window ++ row tokens).
    lens = qsl[1:] - qsl[:-1]
    r_idx = torch.arange(R, device=x.device, dtype=torch.int64)
    rel_s = lens[:, None] - km1 + taps[None, :km1]  # (R, km1)
    new = buf[_src(r_idx[:, None].expand(R, km1), rel_s)]  # (R, km1, D)
    keep = _nonempty_rows(qsl)
    conv_state[slots[keep]] = new[keep].transpose(1, 2).to(conv_state.dtype)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Gated DeltaNet (gated delta rule) with a slot-indexed float32 state
# --------------------------------------------------------------------------------------------------------------------


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x*x) + eps)`` (the FLA / transformers convention)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def gdn_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    qsl: torch.Tensor,
    max_query_len: int,
    on_step: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over varlen rows, advanced in lockstep one position per step, float32 throughout.

    ``state`` is the rows' starting states (R, Hv, Dk, Dv) (a gathered copy: no pool is touched here).
    ``on_step(i, active, s)`` sees each step's candidate states (the verify reference records them).
    Returns the outputs (T + 1, Hv, Dv) float32 (row T is a sink) and the final states.
    """
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    grp = Hv // Hk
    qf = l2norm(q.float(), eps=1e-6) * (Dk**-0.5)
    kf = l2norm(k.float(), eps=1e-6)
    if grp > 1:
        qf = qf.repeat_interleave(grp, dim=1)
        kf = kf.repeat_interleave(grp, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    starts, lens = qsl[:-1], qsl[1:] - qsl[:-1]
    # Row T of `obuf` is a sink for rows that are past their end at step i (so the loop needs no host sync).
    obuf = torch.empty((T + 1, Hv, Dv), dtype=torch.float32, device=v.device)
    for i in range(max_query_len):
        active = lens > i  # (R,)
        tok = torch.where(active, starts + i, T)
        tok_c = tok.clamp(max=T - 1)
        q_t, k_t, v_t = qf[tok_c], kf[tok_c], vf[tok_c]  # (R, Hv, D*)
        g_t, b_t = gf[tok_c], bf[tok_c]  # (R, Hv)
        s = state * g_t.exp()[..., None, None]
        kv_mem = (s * k_t[..., None]).sum(dim=-2)  # (R, Hv, Dv)
        delta = (v_t - kv_mem) * b_t[..., None]
        s = s + k_t[..., None] * delta[..., None, :]
        obuf[tok] = (s * q_t[..., None]).sum(dim=-2)
        state = torch.where(active[:, None, None, None], s, state)
        if on_step is not None:
            on_step(i, active, s)
    return obuf, state


def gdn_forward_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
) -> torch.Tensor:
    """Gated delta rule, token by token (rows advanced in lockstep), float32 throughout.

    Args:
        q, k: ``(T, Hk, Dk)``; v: ``(T, Hv, Dv)`` (model dtype); ``Hv % Hk == 0`` and value head ``h`` uses key head
            ``h // (Hv // Hk)``.
        g: ``(T, Hv)`` log-decay (``<= 0``); beta: ``(T, Hv)``.
        ssm_state: ``(S, Hv, Dk, Dv)`` float32 pool, updated in place through ``state_slots``.
        max_query_len: host int ``>=`` the longest row.

    Per token (q, k l2-normalised with eps 1e-6, q scaled by ``Dk ** -0.5``)::

        S = S * exp(g);  S += k (beta * (v - S^T k))^T;  o = S^T q

    Returns ``(T, Hv, Dv)`` in ``v.dtype``.
    """
    T = q.shape[0]
    Hv, Dv = v.shape[1], v.shape[2]
    R = state_slots.shape[0]
    out = torch.empty((T, Hv, Dv), dtype=v.dtype, device=v.device)
    slots = state_slots.to(torch.int64)
    if R == 0 or T == 0:
        return out
    qsl_host = query_start_loc.tolist()
    # Rows advance in lockstep, so each length group runs only as many steps as its own longest row (see the
    # module docstring); empty rows are in no group and keep their state.
    for rows in length_groups(query_start_loc):
        tok, sub_qsl = _group_tokens(qsl_host, rows, q.device)
        n_max = max(qsl_host[r + 1] - qsl_host[r] for r in rows)
        group_slots = slots[torch.tensor(rows, dtype=torch.int64, device=slots.device)]
        obuf, state = gdn_scan(q[tok], k[tok], v[tok], g[tok], beta[tok], ssm_state[group_slots].float(), sub_qsl,
                               n_max)
        out[tok] = obuf[: tok.shape[0]].to(out.dtype)
        ssm_state[group_slots] = state.to(ssm_state.dtype)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Paged KV cache and attention
# --------------------------------------------------------------------------------------------------------------------


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
        tok, sub_qsl = _group_tokens(qsl_host, rows, q.device)
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
