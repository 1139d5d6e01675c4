"""Qwen4-Exp's indexed (QSA sparse) attention over the paged KV cache, in plain torch. docs/qwen4_exp_facts.md §3.6
gives the formulas this follows. Two formulations of the same result:

* ``indexed_attention_ref``: per row, host lengths (``.tolist()``), the whole context per query: the reference.
* ``indexed_attention`` (what the layer runs, CPU and CUDA): batched over the step's tokens with no host
  synchronization and static shapes from host ints (``max_seq_len``, the token and row counts), so it runs inside
  CUDA graph capture; each query gathers only the at most ``budget + c - 1`` positions it attends to.

The layer is Qwen3.5's gated attention (:class:`hyserve.layers.attention.Attention`: [q | gate] per head, q/k
RMSNorm, partial RoPE, GQA, output gate) whose queries each see only a selection of their causal context, chosen by
a small indexer:

* ``index_qk_proj(x)`` gives ``indexer_n_heads`` query heads and one raw key per token, ``indexer_head_dim`` wide.
  The query is ``q_layernorm``-ed (zero-centred RMSNorm) and rotated at its position; the raw key is stored as is
  (no norm, no RoPE) in the layer's **paged index cache** ``(num_blocks, block_size, index_dim)``, through the
  step's ``slot_mapping`` like K and V. The index keys live in the KV's blocks and slots, so prefix caching,
  preemption and speculative rollback treat them exactly as they treat the KV.
* A query at position ``p`` sees the ``nb = (p + 1) // c`` complete blocks ``[j*c, (j+1)*c)`` of its row
  (``c = indexer_compress_ratio``). Each block's key is ``RoPE(k_layernorm(mean_fp32(raw keys).to(dtype)),
  position j*c)`` (the first ``rotary_dim`` channels, the attention's rotary frequencies). Its score is
  ``sum_heads relu(q_h . K_j) / sqrt(indexer_head_dim)`` in float32.
* The query attends (ordinary softmax, float32) to the tokens of the ``budget // c`` best-scoring complete blocks
  (equal scores go to the earlier block, whatever else the step holds; transformers' ``torch.topk`` leaves their
  order to its algorithm, so a test against it keeps exact ties rare: several indexer heads) and to the incomplete tail
  ``[nb*c, p]``, which is always kept. With ``nb <= budget // c`` it attends to everything (dense). A query that
  completes a block is not guaranteed to see itself: its block is scored like the others.

Blocks are re-pooled from the raw keys every step (as transformers does); nothing but the raw keys is cached.

With images (M-RoPE, the VLM form) a token's rotary position is three positions (time, height, width), and a block
key turns at its first token's three (transformers keeps the whole position history for this). Only the step that
computed a token knows them, so a layer whose rotary is M-RoPE also keeps each token's three positions (int32) in
a **positions' store** ``(num_blocks, block_size, 3)`` of the same blocks and slots as the index keys, written with
them; pooling (in torch and in the scores kernel) reads each block's first token's from there. Prefix caching,
preemption and speculative rollback treat it as they treat the KV. Queries turn at the step's own positions (the
rotary's cos/sin of the step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from hyserve.cache.specs import INDEX_POSITION_AXES, AttentionSpec
from hyserve.kernels import store_kv
from hyserve.kernels.attention import paged_attention
from hyserve.kernels.attention.qsa import (
    qsa_attention,
    qsa_block_scores,
    qsa_pool_scores,
    qsa_positions,
    store_index_keys,
)
from hyserve.kernels.attention.reference import ATTENTION_SCORE_ELEMENTS, dequantize_kv
from hyserve.kernels.fp8 import Fp8Activation
from hyserve.kernels.gemv import DeferredInput
from hyserve.kernels.moe import uses_triton
from hyserve.kernels.rope import apply_rope
from hyserve.kernels.varlen import row_index
from hyserve.layers.attention import Attention, AttentionConfig
from hyserve.layers.linear import Linear
from hyserve.layers.norm import RMSNorm
from hyserve.layers.rotary import RotaryEmbedding
from hyserve.model.metadata import StepMetadata

__all__ = [
    "IndexedAttention",
    "IndexedAttentionConfig",
    "QSAIndexer",
    "indexed_attention",
    "indexed_attention_ref",
    "pool_block_keys",
    "rope_at",
    "select_tokens",
    "store_index_keys_ref",
]


class IndexedAttentionConfig(AttentionConfig, Protocol):
    """What the layer reads of a family's config: the attention's fields and the indexer's."""

    indexer_n_heads: int
    indexer_head_dim: int
    indexer_budget: int
    indexer_compress_ratio: int


class QSAIndexer(nn.Module):
    """``self_attn.indexer``: ``index_qk_proj`` ((n_heads + 1) * head_dim rows: the query heads, then the one key
    head), ``q_layernorm`` and ``k_layernorm`` (zero-centred RMSNorm over ``head_dim``). Replicated on every
    tensor-parallel rank (each rank selects the same tokens)."""

    def __init__(self, cfg: IndexedAttentionConfig, prefix: str) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.indexer_n_heads, cfg.indexer_head_dim
        self.index_qk_proj = Linear(cfg.hidden_size, (self.n_heads + 1) * self.head_dim, bias=False,
                                    quant=cfg.quantization, prefix=f"{prefix}.index_qk_proj")
        self.q_layernorm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_layernorm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> (the normed, not yet rotated queries (T, n_heads, head_dim), raw keys (T, head_dim))."""
        qk = self.index_qk_proj(x).view(x.shape[0], self.n_heads + 1, self.head_dim)
        return self.q_layernorm(qk[:, :self.n_heads]), qk[:, self.n_heads]


class IndexedAttention(Attention):
    """Gated attention whose queries attend to the indexer's selection (see the module docstring). ``prefix``: the
    module's name (``model.layers.3.self_attn``); the indexer is ``{prefix}.indexer``."""

    def __init__(self, cfg: IndexedAttentionConfig, rotary: RotaryEmbedding, prefix: str) -> None:
        super().__init__(cfg, rotary, prefix)
        c, budget, idd = cfg.indexer_compress_ratio, cfg.indexer_budget, cfg.indexer_head_dim
        if c <= 0 or budget <= 0 or budget % c:
            raise ValueError(f"indexer_budget={budget} must be a positive multiple of indexer_compress_ratio={c}")
        if idd < rotary.rotary_dim:
            raise ValueError(f"indexer_head_dim={idd} is below the rotary dim {rotary.rotary_dim}")
        if cfg.indexer_n_heads <= 0:
            raise ValueError(f"indexer_n_heads={cfg.indexer_n_heads} must be positive")
        self.indexer = QSAIndexer(cfg, f"{prefix}.indexer")
        self.index_dim = idd
        self.compress_ratio = c
        self.budget = budget
        # M-RoPE (a model with images): a block key turns at its first token's three positions, which only that
        # token's step knows, so each token's positions are kept in the KV's blocks and slots beside its index key.
        self.keeps_positions = rotary.multi_axis
        self.position_cache: torch.Tensor | None = None
        self.position_axes: torch.Tensor | None = None  # each frequency's axis, on the caches' device

    def cache_spec(self, dtype: torch.dtype) -> AttentionSpec:
        # The raw index keys stay in the model dtype when the runner puts the KV in FP8 (it replaces only dtype).
        return AttentionSpec(self.num_kv_heads, self.head_dim, dtype, index_dim=self.index_dim, index_dtype=dtype,
                             index_positions=self.keeps_positions)

    def bind_index_cache(self, index_cache: torch.Tensor) -> None:
        """The index keys' cache, and (M-RoPE) the positions' store of the same blocks and slots, made here: its
        bytes are in ``cache_spec``'s, so the planner counted them."""
        super().bind_index_cache(index_cache)
        if self.keeps_positions:
            nb, bs, _ = index_cache.shape
            self.position_cache = torch.zeros((nb, bs, INDEX_POSITION_AXES), dtype=torch.int32,
                                              device=index_cache.device)
            # Made on the device now, not in a step: a copy from the host there would synchronize (and break a
            # graph capture); the shared rotary keeps them too, for its M-RoPE steps.
            self.position_axes = self.rotary[0].axes(index_cache.device)

    def fp8_input(self) -> str | None:
        """Plain: the indexer reads the layer's input too."""
        return None

    def takes_deferred(self) -> bool:
        """No: the indexer reads the layer's input too."""
        return False

    def forward(self, x: torch.Tensor | Fp8Activation | DeferredInput, meta: StepMetadata) -> torch.Tensor:
        assert isinstance(x, torch.Tensor), "QSA's input is plain (fp8_input, takes_deferred)"
        assert self.k_cache is not None and self.v_cache is not None, "caches not bound"
        assert self.index_cache is not None, "index cache not bound (bind_caches' index_caches)"
        t = x.shape[0]
        qg, k, v = self.project_qkv(x)
        q, gate = torch.chunk(qg.view(t, self.num_heads, 2 * self.head_dim), 2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary[0](meta.positions, q, k)
        store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        iq, kraw = self.indexer(x)
        rotary = self.rotary[0]
        inv_freq = rotary.inv_freq(x.device)
        iq = rotary.rotate(iq)  # at the step's positions: M-RoPE's three where the step has them
        store = store_index_keys if uses_triton(kraw) else store_index_keys_ref
        store(kraw, self.index_cache, meta.slot_mapping)
        if self.position_cache is not None:
            store(token_positions(meta.rotary_positions), self.position_cache, meta.slot_mapping)
        out = indexed_attention(
            q, iq, self.k_cache, self.v_cache, self.index_cache, meta.block_tables, meta.query_start_loc,
            meta.seq_lens, self.scale, self.indexer.k_layernorm, inv_freq, self.budget, self.compress_ratio,
            meta.max_seq_len, self.k_scale, self.v_scale, max_query_len=meta.max_query_len,
            position_cache=self.position_cache, axes=self.position_axes)
        out = out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)


# ------------------------------------------------------------------------------------------------ the reference


def rope_at(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``x`` (N, H, D) rotated at ``positions`` (N,) on its first ``2 * len(inv_freq)`` channels (NeoX halves):
    float32 angles, cos/sin cast to ``x.dtype`` (``apply_rope``), as the model's rotary does."""
    freqs = positions.to(inv_freq.device).float().unsqueeze(1) * inv_freq.unsqueeze(0)
    return apply_rope(x.contiguous(), freqs.cos(), freqs.sin())


def token_positions(positions: torch.Tensor) -> torch.Tensor:
    """A step's (T, 3) int32 M-RoPE positions, for the positions' store: from its (3, T) ones, or text positions
    (T,) on every axis."""
    if positions.dim() == 1:
        return positions.to(torch.int32)[:, None].expand(-1, INDEX_POSITION_AXES).contiguous()
    return positions.t().to(torch.int32).contiguous()


def rope_at_axes(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, axes: torch.Tensor
                 ) -> torch.Tensor:
    """``rope_at`` with three positions a row: ``x`` (N, H, D) rotated at ``positions`` (N, 3), frequency ``i``
    turning with axis ``axes[i]`` (M-RoPE, ``hyserve.model.mrope``), in float32 as the model's rotary does."""
    per_freq = positions.to(inv_freq.device).index_select(1, axes.to(inv_freq.device)).float()
    freqs = per_freq * inv_freq.unsqueeze(0)
    return apply_rope(x.contiguous(), freqs.cos(), freqs.sin())


def store_index_keys_ref(keys: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write raw index keys ``keys`` (T, index_dim) into ``index_cache`` (num_blocks, block_size, index_dim) at
    ``slot_mapping`` (T,) (``-1``: skip the token), cast to the cache's dtype.

    No host sync (CUDA-graph safe): a skipped token writes the same slot and value as the step's first written token
    (equal duplicates keep the scatter deterministic); with no written token every token rewrites slot 0's value."""
    t = keys.shape[0]
    if t == 0:
        return
    nb, bs, d = index_cache.shape
    flat = index_cache.view(nb * bs, d)
    sm = slot_mapping.to(torch.int64)
    keep = sm >= 0
    first = torch.argmax(keep.to(torch.int32))
    src = torch.where(keep, torch.arange(t, device=sm.device), first)
    dst = sm[src].clamp(min=0)
    vals = torch.where(keep.any(), keys[src].to(index_cache.dtype), flat[0].expand(t, d))
    flat[dst] = vals


def pool_block_keys(raw: torch.Tensor, c: int, k_norm: Callable[[torch.Tensor], torch.Tensor],
                    inv_freq: torch.Tensor, positions: torch.Tensor | None = None,
                    axes: torch.Tensor | None = None) -> torch.Tensor:
    """The block keys of the complete blocks of one row's raw keys ``raw`` (L, D), in ``raw.dtype``: block ``j``
    (positions ``[j*c, (j+1)*c)``) is ``RoPE(k_norm(mean_fp32(raw[blk]).to(raw.dtype)), j*c)``. (L // c, D).
    M-RoPE: ``positions`` (L, 3) the row's tokens' positions and ``axes`` the frequencies' axes; block ``j`` turns
    at its first token's ``positions[j*c]``."""
    nb = raw.shape[0] // c
    pooled = raw[:nb * c].view(nb, c, raw.shape[-1]).float().mean(dim=1).to(raw.dtype)
    pooled = k_norm(pooled)
    if positions is not None:
        assert axes is not None
        return rope_at_axes(pooled.unsqueeze(1), positions[: nb * c : c], inv_freq, axes).squeeze(1)
    starts = torch.arange(nb, device=raw.device, dtype=torch.int64) * c
    return rope_at(pooled.unsqueeze(1), starts, inv_freq).squeeze(1)


def select_tokens(iq: torch.Tensor, block_keys: torch.Tensor, qpos: torch.Tensor, ctx_len: int, budget: int,
                  c: int) -> torch.Tensor:
    """Which context positions each query attends to: (N, ctx_len) bool.

    ``iq`` (N, Hi, D) rotated indexer queries at positions ``qpos`` (N,) of one row; ``block_keys`` (nbk, D) that
    row's block keys (at least the complete blocks of ``qpos.max() + 1`` tokens). Query ``i`` sees ``nb = (qpos[i]
    + 1) // c`` complete blocks; with ``nb <= budget // c`` every position ``<= qpos[i]``, else the tokens of the
    ``budget // c`` best-scoring of its blocks and the tail ``[nb*c, qpos[i]]``.
    """
    dev = iq.device
    pos = torch.arange(ctx_len, device=dev, dtype=torch.int64)
    qpos = qpos.to(torch.int64)
    causal = pos[None, :] <= qpos[:, None]
    top = budget // c
    visible = (qpos + 1) // c  # (N,) complete blocks each query sees
    sparse_rows = visible > top
    if not bool(sparse_rows.any()):
        return causal
    nbk = int(visible.max())
    keys = block_keys[:nbk].float()
    scores = torch.relu(torch.einsum("nhd,jd->nhj", iq.float(), keys)).sum(dim=1) / math.sqrt(iq.shape[-1])
    blocks = torch.arange(nbk, device=dev, dtype=torch.int64)
    scores = scores.masked_fill(blocks[None, :] >= visible[:, None], float("-inf"))
    chosen = torch.zeros(scores.shape, dtype=torch.bool, device=dev)
    # Equal scores (relu makes every block whose head dot products are all negative score exactly 0) go to the
    # earlier block: a stable sort, so a query's choice never depends on the other queries of its step (torch.topk
    # orders ties as its algorithm happens to, and differently for another vector length).
    best = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :top]
    chosen.scatter_(1, best, True)  # sparse rows: > top finite scores each
    complete_end = visible * c  # (N,) first position of each query's tail
    in_blocks = pos[None, :] < complete_end[:, None]
    token_chosen = chosen[:, (pos // c).clamp(max=nbk - 1)] & in_blocks
    tail = ~in_blocks & causal
    return torch.where(sparse_rows[:, None], token_chosen | tail, causal)


def indexed_attention_ref(
    q: torch.Tensor,
    iq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_norm: Callable[[torch.Tensor], torch.Tensor],
    inv_freq: torch.Tensor,
    budget: int,
    c: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    query_start_loc_cpu: torch.Tensor | None = None,
    position_cache: torch.Tensor | None = None,
    axes: torch.Tensor | None = None,
) -> torch.Tensor:
    """QSA attention of varlen queries over the paged caches (already holding this step's K, V and index keys).

    ``q`` (T, Hq, D) rotated attention queries; ``iq`` (T, Hi, Di) rotated indexer queries; caches
    (num_blocks, block_size, Hkv, D) and (num_blocks, block_size, Di); ``block_tables``, ``query_start_loc``,
    ``seq_lens`` as in ``paged_attention_ref`` (the ``i``-th of row ``r``'s ``n_r`` tokens sits at ``seq_lens[r] -
    n_r + i``). Per row: gather its raw index keys and K/V through its block table, pool its complete blocks
    (``pool_block_keys``), select per query (``select_tokens``), and attend with a float32 softmax over the
    selection (query head ``h`` reads kv head ``h // (Hq // Hkv)``). Tokens outside every row come back as zeros.
    M-RoPE: ``position_cache`` (num_blocks, block_size, 3) each token's positions, ``axes`` the frequencies' axes
    (``pool_block_keys``). Returns (T, Hq, D) in ``q.dtype``.
    """
    _, Hq, D = q.shape
    nblocks, bs, Hkv, _ = k_cache.shape
    grp = Hq // Hkv
    out = torch.zeros_like(q)
    qsl = (query_start_loc_cpu if query_start_loc_cpu is not None else query_start_loc).tolist()
    lens = seq_lens.tolist()
    dev = q.device
    flat_k = k_cache.view(nblocks * bs, Hkv, D)
    flat_v = v_cache.view(nblocks * bs, Hkv, D)
    flat_i = index_cache.view(nblocks * bs, index_cache.shape[-1])
    for r in range(len(lens)):
        s0, s1, ctx = int(qsl[r]), int(qsl[r + 1]), int(lens[r])
        n = s1 - s0
        if n <= 0 or ctx <= 0:
            continue
        pos = torch.arange(ctx, device=dev, dtype=torch.int64)
        slots = block_tables[r, pos // bs].to(torch.int64) * bs + pos % bs
        kctx = dequantize_kv(flat_k[slots], k_scale)  # (L, Hkv, D) float32
        vctx = dequantize_kv(flat_v[slots], v_scale)
        row_positions = None if position_cache is None else position_cache.view(nblocks * bs, -1)[slots]
        block_keys = pool_block_keys(flat_i[slots], c, k_norm, inv_freq, row_positions, axes)
        tile = max(1, ATTENTION_SCORE_ELEMENTS // max(Hq * ctx, 1))
        for a in range(0, n, tile):
            b = min(n, a + tile)
            qpos = torch.arange(ctx - n + a, ctx - n + b, device=dev, dtype=torch.int64)
            allowed = select_tokens(iq[s0 + a:s0 + b], block_keys, qpos, ctx, budget, c)  # (m, L)
            qt = q[s0 + a:s0 + b].float().view(b - a, Hkv, grp, D)
            scores = torch.einsum("mhgd,lhd->mhgl", qt, kctx) * scale
            scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            o = torch.einsum("mhgl,lhd->mhgd", probs, vctx).reshape(b - a, Hq, D)
            out[s0 + a:s0 + b] = o.to(q.dtype)
    return out


# ------------------------------------------------------------------------------------------ the batched device path

# Per tile, at most about this many elements in the largest per-token temporary (the gathered K and V of the
# selection, the gathered block keys, the raw keys pooled per row): the number of tiles follows from host ints only.
QSA_TILE_ELEMENTS = 1 << 25
# Steps whose rows have at most this many tokens (decode, verify) pool the block keys inside the scores kernel.
POOL_IN_KERNEL_MAX_QUERY = 8


def _tile(per_item: int, count: int) -> int:
    """Items per tile so that a tile holds at most ``QSA_TILE_ELEMENTS`` elements (at least one item)."""
    return max(1, min(count, QSA_TILE_ELEMENTS // max(per_item, 1)))


def pool_block_keys_batched(index_cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int, c: int,
                            k_norm: Callable[[torch.Tensor], torch.Tensor], inv_freq: torch.Tensor,
                            position_cache: torch.Tensor | None = None, axes: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """The first ``num_blocks`` block keys of every row (``pool_block_keys`` of its raw keys, read through its block
    table): (R, num_blocks, index_dim) in the cache's dtype. Blocks past a row's context hold whatever the cache has
    there (the caller masks them). M-RoPE: each block turns at its first token's positions in ``position_cache``."""
    nblocks, bs, di = index_cache.shape
    r = block_tables.shape[0]
    dev = index_cache.device
    flat = index_cache.view(nblocks * bs, di)
    span = num_blocks * c
    slots = _paged_slots(block_tables, torch.arange(span, device=dev)[None, :].expand(r, span), bs, nblocks)
    starts = torch.arange(num_blocks, device=dev, dtype=torch.int64) * c
    parts = []
    step = _tile(span * di, r)
    for a in range(0, r, step):
        b = min(r, a + step)
        raw = flat[slots[a:b]].view(b - a, num_blocks, c, di)
        pooled = k_norm(raw.float().mean(dim=2).to(raw.dtype))  # (m, nb, di)
        flat_pooled = pooled.reshape((b - a) * num_blocks, 1, di)
        if position_cache is not None:
            assert axes is not None
            first = position_cache.view(nblocks * bs, -1)[slots[a:b, ::c]]  # (m, nb, 3): each block's first token
            rot = rope_at_axes(flat_pooled, first.reshape(-1, first.shape[-1]), inv_freq, axes)
        else:
            rot = rope_at(flat_pooled, starts.repeat(b - a), inv_freq)
        parts.append(rot.view(b - a, num_blocks, di))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _paged_slots(block_tables: torch.Tensor, pos: torch.Tensor, bs: int, nblocks: int,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
    """Flat cache slots of positions ``pos`` (N, S) of block-table rows ``rows`` (N,) (None: table row i for line
    i). Columns and block ids are clamped into range, so that a position past a row's blocks reads some slot of the
    cache (masked by the caller) instead of faulting."""
    col = (pos // bs).clamp(max=block_tables.shape[1] - 1)
    table = block_tables.to(torch.int64)
    blocks = torch.gather(table, 1, col) if rows is None else table[rows[:, None], col]
    return blocks.clamp(0, nblocks - 1) * bs + pos % bs


def indexed_attention(
    q: torch.Tensor,
    iq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_norm: Callable[[torch.Tensor], torch.Tensor],
    inv_freq: torch.Tensor,
    budget: int,
    c: int,
    max_seq_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    max_query_len: int | None = None,
    kernels: bool | None = None,
    position_cache: torch.Tensor | None = None,
    axes: torch.Tensor | None = None,
) -> torch.Tensor:
    """``indexed_attention_ref``'s result without a host synchronization: every shape and loop bound comes from host
    ints (the token count, the row count, ``max_seq_len`` >= every row's context), so the same code runs on the CPU,
    eagerly on CUDA and inside CUDA graph capture.

    * Each token's row and position come from ``query_start_loc`` on the device (``row_index``).
    * Every row's first ``max_seq_len // c`` blocks are pooled at once (``pool_block_keys_batched``); a query scores
      them all (float32, as the reference), blocks it does not see completely masked to ``-inf``, and a stable
      descending sort picks its ``budget // c`` best (equal scores: the earlier block, whatever else the step holds).
    * A query attends to at most ``budget + c - 1`` positions (its chosen blocks and its tail, or its whole causal
      prefix when it sees at most ``budget // c`` complete blocks), ``S = min(budget + c - 1, max_seq_len)`` lanes
      per token, with a float32 softmax over them.
    * When no query of the step can see more than ``budget // c`` complete blocks (``max_seq_len // c <= budget //
      c``) every query attends to its whole causal prefix: ordinary paged attention
      (:func:`hyserve.kernels.attention.paged_attention`, given ``max_query_len``).

    ``kernels`` (default: :func:`hyserve.kernels.moe.uses_triton`, CUDA or the Triton interpreter): the
    scores and the attention in Triton kernels (``qsa_block_scores``, ``qsa_attention``), which read the block keys,
    K and V in place; in steps of at most ``POOL_IN_KERNEL_MAX_QUERY`` tokens a row with an ``RMSNorm`` key norm
    the scores kernel pools the blocks each token sees itself (``qsa_pool_scores``: no pass over every row's
    ``max_seq_len // c`` blocks, which a decode graph sizes for the model's length); otherwise in torch, gathering
    each token's block keys, K and V. Tokens are processed in tiles of a static size (``QSA_TILE_ELEMENTS``), so a
    step never materializes tokens x max_seq_len x heads at once.
    """
    t, hq, d = q.shape
    nblocks, bs, hkv, _ = k_cache.shape
    grp = hq // hkv
    r = seq_lens.shape[0]
    if t == 0 or r == 0 or max_seq_len <= 0:
        return torch.zeros_like(q)
    dev = q.device
    di = iq.shape[-1]
    top = budget // c
    nbk = max_seq_len // c  # the most complete blocks any query of the step sees
    sparse_possible = nbk > top
    if not sparse_possible and max_query_len is not None:
        return paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len,
                               max_seq_len, k_scale=k_scale, v_scale=v_scale)
    use_kernels = uses_triton(q) if kernels is None else kernels
    # Decode and verify steps (few tokens a row; their graphs sized for the model's length): each token pools the
    # blocks it sees inside the scores kernel, instead of every row's max_seq_len // c blocks pooled first.
    pool_in_kernel = (use_kernels and sparse_possible and isinstance(k_norm, RMSNorm) and max_query_len is not None
                      and max_query_len <= POOL_IN_KERNEL_MAX_QUERY)
    span = min(budget + c - 1, max_seq_len)
    flat_k = k_cache.view(nblocks * bs, hkv, d)
    flat_v = v_cache.view(nblocks * bs, hkv, d)

    qsl = query_start_loc.to(torch.int64)
    rows, ipos = row_index(qsl, t)
    n_new = qsl[1:] - qsl[:-1]
    qpos = seq_lens.to(torch.int64)[rows] - n_new[rows] + ipos  # (T,) each query's position
    visible = (qpos + 1) // c
    block_keys = (pool_block_keys_batched(index_cache, block_tables, nbk, c, k_norm, inv_freq, position_cache, axes)
                  if sparse_possible and not pool_in_kernel else None)
    if use_kernels:  # per token: the scores, the sort's values and indices, the lanes
        per_token = 4 * max(nbk, span)
    else:  # per token: the gathered K and V, the logits, the gathered block keys
        per_token = max(2 * span * hkv * d, hq * span, nbk * max(di, iq.shape[1]))
    step = _tile(per_token, t)
    parts = []
    positions = torch.empty((t, span), dtype=torch.int32, device=dev) if use_kernels else None
    for a in range(0, t, step):
        b = min(t, a + step)
        m = b - a
        qp, rt, vis = qpos[a:b], rows[a:b], visible[a:b]
        if positions is not None:  # the kernels: scores, the sort, then one launch for the lanes
            best = None
            if sparse_possible:
                if pool_in_kernel:
                    assert isinstance(k_norm, RMSNorm)
                    scores = qsa_pool_scores(iq[a:b], index_cache, block_tables, rt, vis, k_norm.weight, k_norm.eps,
                                             inv_freq, c, nbk, position_cache, axes)
                else:
                    assert block_keys is not None
                    scores = qsa_block_scores(iq[a:b], block_keys, rt, vis)
                best = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :top]
            positions[a:b] = qsa_positions(best, qp, vis, span, top, c)
            continue
        # Dense: the causal prefix (at most `span` positions when the query sees <= top complete blocks).
        lanes = torch.arange(span, device=dev, dtype=torch.int64)
        in_block = torch.arange(c, device=dev, dtype=torch.int64)
        pos = lanes[None, :].expand(m, span)
        valid = pos <= qp[:, None]
        if sparse_possible:
            assert block_keys is not None
            keys = block_keys[rt].float()  # (m, nbk, di)
            scores = torch.relu(torch.einsum("mhd,mjd->mhj", iq[a:b].float(), keys)).sum(dim=1) / math.sqrt(di)
            blocks = torch.arange(nbk, device=dev, dtype=torch.int64)
            scores = scores.masked_fill(blocks[None, :] >= vis[:, None], float("-inf"))
            best = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :top]
            best = torch.sort(best, dim=1).values  # ascending: the positions in order
            chosen = (best[:, :, None] * c + in_block[None, None, :]).reshape(m, top * c)
            tail = vis[:, None] * c + in_block[None, :c - 1]  # [nb*c, qpos]: at most c - 1 positions
            sp_pos = torch.cat([chosen, tail], dim=1)
            sp_valid = torch.cat([torch.ones_like(chosen, dtype=torch.bool), tail <= qp[:, None]], dim=1)
            sparse = (vis > top)[:, None]
            pos = torch.where(sparse, sp_pos, pos)
            valid = torch.where(sparse, sp_valid, valid)
        # Masked lanes read the query's own (just written) slot: finite values with zero weight.
        pos = torch.where(valid, pos, qp[:, None])
        slots = _paged_slots(block_tables, pos, bs, nblocks, rt)
        kk = dequantize_kv(flat_k[slots], k_scale)  # (m, S, Hkv, D) float32
        vv = dequantize_kv(flat_v[slots], v_scale)
        qt = q[a:b].float().view(m, hkv, grp, d)
        att = torch.einsum("mhgd,mshd->mhgs", qt, kk) * scale
        att = att.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(att, dim=-1)
        o = torch.einsum("mhgs,mshd->mhgd", probs, vv).reshape(m, hq, d)
        parts.append(o.to(q.dtype))
    if positions is not None:
        return qsa_attention(q, k_cache, v_cache, block_tables, rows, positions, scale, k_scale, v_scale)
    return parts[0] if len(parts) == 1 else torch.cat(parts)
