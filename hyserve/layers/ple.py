"""Qwen4-Exp's Per-Layer Embedding (PLE): hashed n-gram embeddings gated by the residual streams, then a causal
dilated depthwise conv (docs/qwen4_exp_facts.md §3.4, §4.1, §5). Plain torch, one code path for the CPU and CUDA:
vectorized over the step's tokens and rows with no host synchronization (no ``nonzero``, ``.item()``, ``.tolist()``,
every shape from the step's host ints), so it runs inside CUDA graph capture (decode and verify graphs). On CUDA
the n-gram hash and gather are one Triton kernel (``hyserve.kernels.ple.ngram_embed``); this formulation is its
reference.

Per token p of a request (``hist`` = the request's tokens; before its first token, ``ngram_size - 1`` copies of
``eos``)::

    t_k    = hist[p - k] if no eos lies in hist[p - k + 1 .. p - 1] (p's segment: an eos is part of its own n-grams,
             the tokens before it read as eos), else eos                      k = 0 .. ngram_size - 1
    x_n    = (t_0 * mult[0]) ^ (t_1 * mult[1]) ^ ... ^ (t_{n-1} * mult[n-1])  int64, n = 2 .. ngram_size
    row_h  = (x_n mod size_h) + offset_h                                      heads h of order n: (n-2) * hpn + i
    E      = concat_h table[row_h]                                            [De]
    Kn     = norm_key(key_proj(E));  Qn = norm_query(X);  V = value_proj(E)   grouped RMSNorms over the S streams
    g      = signed_sqrt(sum_H(Kn * Qn) / sqrt(H));  Gv = sigmoid(g) * V      [S, H] -> [W]
    C      = norm_conv(Gv)
    out    = Gv + silu(dconv(C))     dconv: depthwise, kernel k, dilation ngram_size, causal (taps t-(k-1)d .. t)

``out`` is what the decoder layer adds to its residual. The gate and the conv run in the activation dtype (the conv
accumulates in float32, as cuDNN's, and rounds once); the grouped RMSNorms are float32 inside.

Per-request state (``cache_spec``), in the request's slot:

* ``token_context`` ``(ngram_size - 1,)`` int64: the last ``ngram_size - 1`` token ids of the request, oldest first,
  each stored **XOR eos** (``stored = token ^ eos``). A fresh slot is all zeros (the state pool zero-fills it), which
  decodes to ``ngram_size - 1`` eos tokens: the reference's initial context. A row shorter than the context keeps
  the older entries (the last ``ngram_size - 1`` of ``old context ++ row tokens``).
* ``conv_state`` ``(W, (k - 1) * ngram_size)`` in the model dtype: the last ``(k - 1) * ngram_size`` values of ``C``,
  oldest first (zeros when fresh: the reference's left padding).

Verify rows (speculative decoding, ``StepMetadata.verify``) read the live state and write the state after each of
their positions into ``verify_scratch[name][row, pos]``; the rest rows update their slots. The base class's
``commit_verified`` / ``snapshot_candidates`` then take candidates as for any recurrent layer.

Checkpoint: ``ple_embedding.ngram_embedding.weight`` may be stored whole or as ``split_ngram_parts`` row pieces
``ple_embedding.ngram_embedding.shard_{i}.weight`` (``torch.chunk`` along dim 0; ``checkpoint_parts``). The hash
constants ``ple_embedding.{layer_multipliers, ngram_heads_vocab_sizes, ngram_heads_offsets}`` are computed from the
config; a checkpoint that stores them has them checked, never loaded (``checkpoint_derived``,
``check_checkpoint_buffer``).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from hyserve.cache.specs import RecurrentStateSpec, StateTensorSpec
from hyserve.kernels.moe import uses_triton
from hyserve.kernels.ple import ngram_embed, ple_gate
from hyserve.kernels.varlen import row_index
from hyserve.layers.linear import Linear
from hyserve.layers.norm import GroupedRMSNorm
from hyserve.model.base import RecurrentLayer
from hyserve.model.metadata import StepMetadata

__all__ = [
    "PLEConfig",
    "PerLayerEmbedding",
    "find_primes_from",
    "ngram_head_offsets",
    "ngram_head_sizes",
    "ngram_multipliers",
    "ngram_table_rows",
    "splitmix64",
]

MASK64 = (1 << 64) - 1
GOLDEN64 = 0x9E3779B97F4A7C15
GATE_CLAMP = 1e-6  # the signed sqrt's floor on |g|
# The checkpoint's names of the hash constants (under the layer's ``ple.``), computed here from the config.
DERIVED_NAMES = ("ple_embedding.layer_multipliers", "ple_embedding.ngram_heads_vocab_sizes",
                 "ple_embedding.ngram_heads_offsets")
TABLE_NAME = "ple_embedding.ngram_embedding.weight"


class PLEConfig(Protocol):
    """What the layer reads of the family's config (field names of transformers' ``Qwen4ExpTextConfig``;
    ``ple_eos_token_id``: the first of its ``eos_token_id``)."""

    hidden_size: int
    hc_count: int
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    make_ngram_vocab_size_divisible_by: int
    seed: int
    vocab_size: int
    split_ngram_parts: int
    rms_norm_eps: float
    ple_eos_token_id: int


# ---------------------------------------------------------------------------------------------------------------
# The hash constants (Python ints, mod 2^64; facts §3.4).


def splitmix64(v: int) -> int:
    v = (v + GOLDEN64) & MASK64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & MASK64
    return (v ^ (v >> 31)) & MASK64


def ngram_multipliers(ple_index: int, ngram_size: int, vocab_size: int, seed: int) -> list[int]:
    """The ``ngram_size`` odd hash multipliers of PLE layer ``ple_index``, each ``< 2^63 / vocab_size`` (so that
    ``token * mult`` fits in int64 for a token of the vocabulary)."""
    half = max(1, ((2**63 - 1) // max(vocab_size, 1)) // 2)
    base = seed + 10007 * ple_index
    return [2 * (splitmix64((base + GOLDEN64 * (i + 1)) & MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for every n < 3.3e24)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@lru_cache(maxsize=64)
def find_primes_from(start: int, count: int) -> tuple[int, ...]:
    """The first ``count`` primes ``>= start``."""
    out: list[int] = []
    n = max(start, 2)
    while len(out) < count:
        if _is_prime(n):
            out.append(n)
        n += 1
    return tuple(out)


def ngram_head_sizes(ple_index: int, num_heads: int, vocab_base: int) -> list[int]:
    """Head ``h``'s table size: the ``(ple_index * num_heads + h + 1)``-th prime ``>= vocab_base`` (distinct over the
    heads of every PLE layer)."""
    first = ple_index * num_heads
    return list(find_primes_from(vocab_base, first + num_heads)[first:])


def ngram_head_offsets(sizes: list[int]) -> list[int]:
    """Each head's first row in the table: the sum of the earlier heads' sizes."""
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def ngram_table_rows(sizes: list[int], divisible_by: int) -> int:
    """The table's row count: the heads' total, rounded up to a multiple of ``divisible_by``."""
    total = sum(sizes)
    m = max(divisible_by, 1)
    return -(-total // m) * m


# ---------------------------------------------------------------------------------------------------------------


class NGramEmbedding(nn.Module):
    """Holds the checkpoint's ``ple_embedding.*``: the n-gram table (a parameter) and the hash constants (computed,
    non-persistent buffers: checked against a checkpoint that stores them, not loaded)."""

    def __init__(self, rows: int, dim: int, multipliers: list[int], sizes: list[int], offsets: list[int]) -> None:
        super().__init__()
        self.ngram_embedding = nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
        self.layer_multipliers: torch.Tensor
        self.ngram_heads_vocab_sizes: torch.Tensor
        self.ngram_heads_offsets: torch.Tensor
        self.register_buffer("layer_multipliers", torch.tensor(multipliers, dtype=torch.int64), persistent=False)
        self.register_buffer("ngram_heads_vocab_sizes", torch.tensor(sizes, dtype=torch.int64), persistent=False)
        self.register_buffer("ngram_heads_offsets", torch.tensor(offsets, dtype=torch.int64), persistent=False)


class PerLayerEmbedding(RecurrentLayer):
    """The PLE of one decoder layer (``ple_index``: its position among the PLE layers, which picks its hash
    constants). ``forward`` returns the term the decoder layer adds to its ``(T, W)`` residual."""

    def __init__(self, cfg: PLEConfig, ple_index: int, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.ple_index = ple_index
        self.hidden = h = cfg.hidden_size
        self.streams = s = cfg.hc_count
        self.width = w = s * h
        self.ngram_size = n = cfg.ngram_size
        if n < 2:
            raise ValueError(f"PLE: ngram_size must be at least 2 (got {n})")
        self.heads_per_ngram = cfg.heads_per_ngram
        self.num_heads = g = (n - 1) * cfg.heads_per_ngram
        self.head_dim = d = cfg.ple_embed_dim // g
        if d == 0 or cfg.ple_embed_dim % g:
            raise ValueError(f"PLE: ple_embed_dim {cfg.ple_embed_dim} must be a positive multiple of "
                             f"(ngram_size - 1) x heads_per_ngram = {g}")
        self.embed_dim = de = g * d
        self.kernel = k = cfg.ple_conv_kernel_size
        self.dilation = n
        self.window = (k - 1) * n
        self.eos = int(cfg.ple_eos_token_id)
        if self.eos < 0:
            raise ValueError("PLE: the config has no eos token (ple_eos_token_id), the n-grams' restart token")
        self.split_parts = max(int(cfg.split_ngram_parts), 1)
        mult = ngram_multipliers(ple_index, n, cfg.vocab_size, cfg.seed)
        sizes = ngram_head_sizes(ple_index, g, cfg.ngram_vocab_size_base)
        offsets = ngram_head_offsets(sizes)
        self.table_rows = ngram_table_rows(sizes, cfg.make_ngram_vocab_size_divisible_by)
        self.ple_embedding = NGramEmbedding(self.table_rows, d, mult, sizes, offsets)
        # hyserve Linear layers taking their method from the model's quantization config by name (FP8 where an FP8
        # checkpoint's quantization_config quantizes them); replicated on every rank.
        quant = getattr(cfg, "quantization", None)
        self.key_proj = Linear(de, w, quant=quant, prefix=f"{prefix}.key_proj")
        self.value_proj = Linear(de, h, quant=quant, prefix=f"{prefix}.value_proj")
        self.norm_key = GroupedRMSNorm(w, h, cfg.rms_norm_eps)
        self.norm_query = GroupedRMSNorm(w, h, cfg.rms_norm_eps)
        self.norm_conv = GroupedRMSNorm(w, h, cfg.rms_norm_eps)
        self.conv1d = nn.Conv1d(w, w, k, bias=False, groups=w, dilation=n)

    # -- checkpoint ---------------------------------------------------------------------------------------------

    def checkpoint_parts(self) -> dict[str, tuple[str, torch.Tensor]]:
        """The n-gram table's row pieces as a checkpoint may store them: ``ple_embedding.ngram_embedding.shard_{i}
        .weight`` -> (``ple_embedding.ngram_embedding.weight``, rows of piece i), the pieces of
        ``torch.chunk(table, split_ngram_parts, dim=0)`` (equal pieces of ceil(rows / parts) rows, the last one
        shorter; fewer than ``split_ngram_parts`` pieces where the rows run out first, as ``torch.chunk``)."""
        table = self.ple_embedding.ngram_embedding.weight
        pieces = torch.chunk(table, self.split_parts, dim=0)
        return {f"ple_embedding.ngram_embedding.shard_{i}.weight": (TABLE_NAME, p) for i, p in enumerate(pieces)}

    def checkpoint_derived(self) -> dict[str, torch.Tensor]:
        """The hash constants a checkpoint may store (names under this module), as computed from the config: the
        loader checks a stored one against them (``hyserve.model.loader.checkpoint_derived``)."""
        e = self.ple_embedding
        return dict(zip(DERIVED_NAMES, (e.layer_multipliers, e.ngram_heads_vocab_sizes, e.ngram_heads_offsets),
                        strict=True))

    def check_checkpoint_buffer(self, name: str, tensor: torch.Tensor) -> None:
        """Raise ValueError unless checkpoint tensor ``name`` (relative to this module) equals the value computed
        from the config (KeyError for a name that is not one of the hash constants)."""
        want = self.checkpoint_derived()[name]
        if tensor.shape != want.shape or not torch.equal(tensor.to(want.device, want.dtype), want):
            raise ValueError(f"{self.prefix}.{name} in the checkpoint ({tensor.reshape(-1)[:4].tolist()}, shape "
                             f"{list(tensor.shape)}) differs from what the config gives "
                             f"({want.reshape(-1)[:4].tolist()}, shape {list(want.shape)})")

    # -- state --------------------------------------------------------------------------------------------------

    def cache_spec(self, dtype: torch.dtype) -> RecurrentStateSpec:
        """The token context (last ``ngram_size - 1`` ids XOR eos, int64) and the conv window (last
        ``(k - 1) * ngram_size`` values of C, model dtype), both oldest first; zeros mean a fresh request."""
        return RecurrentStateSpec((
            StateTensorSpec("token_context", (self.ngram_size - 1,), torch.int64),
            StateTensorSpec("conv_state", (self.width, self.window), dtype),
        ))

    # -- forward ------------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """``x`` (T, W) the residual streams, ``input_ids`` (T,) the step's tokens: the (T, W) PLE term."""
        assert "token_context" in self.state and "conv_state" in self.state, "caches not bound"
        ids = input_ids.to(torch.int64)
        vm = meta.verify
        if vm is None:
            return self._rows(x, ids, meta.state_slots, meta.query_start_loc, None)
        assert self.verify_scratch is not None, "verify scratch not bound"
        tv = vm.num_tokens
        parts = [self._rows(x[:tv], ids[:tv], vm.state_slots, vm.query_start_loc, self.verify_scratch)]
        if tv < x.shape[0]:
            parts.append(self._rows(x[tv:], ids[tv:], vm.rest_state_slots, vm.rest_query_start_loc, None))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _rows(self, x: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor, qsl: torch.Tensor,
              scratch: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """One varlen batch of rows: the PLE term; the rows' slots updated (``scratch`` None) or, for verify rows,
        the state after each position written to ``scratch[name][row, pos]`` (the slots only read)."""
        t = x.shape[0]
        ctx_pool, conv_pool = self.state["token_context"], self.state["conv_state"]
        slots = slots.to(torch.int64)
        qsl = qsl.to(torch.int64)
        r = slots.shape[0]
        n1, win = self.ngram_size - 1, self.window
        rows, pos = row_index(qsl, t)
        lens = qsl[1:] - qsl[:-1]
        # Token history: every row's context (decoded: XOR eos) then the step's tokens.
        ctx = torch.bitwise_xor(ctx_pool[slots], self.eos)  # (R, n1)
        tok_buf = torch.cat([ctx.reshape(r * n1), ids])

        rel = pos[:, None] - torch.arange(self.ngram_size, device=x.device)[None, :]  # (T, n): t_0 .. t_{n-1}
        tokens = tok_buf[_src(rows[:, None].expand_as(rel), rel, qsl, r, n1)]
        e = self._embed(tokens)
        gv = self._gate(x, e)
        c = self.norm_conv(gv)

        # Dilated causal conv: tap j reads C at t - (k - 1 - j) * dilation, older values from the slot's window.
        conv_old = conv_pool[slots]  # (R, W, win)
        c_buf = torch.cat([conv_old.transpose(1, 2).reshape(r * win, self.width), c.to(conv_pool.dtype)])
        taps = torch.arange(self.kernel, device=x.device)
        rel_c = pos[:, None] - (self.kernel - 1 - taps)[None, :] * self.dilation  # (T, k)
        taps_c = c_buf[_src(rows[:, None].expand_as(rel_c), rel_c, qsl, r, win)]  # (T, k, W)
        weight = self.conv1d.weight.squeeze(1).t().float()  # (k, W)
        conv = (taps_c.float() * weight[None]).sum(dim=1).to(x.dtype)
        out = gv + F.silu(conv)

        # The state after a position: the last n1 tokens and the last `win` values of C up to it. Sync-free (no
        # `nonzero`, every shape from the step's host ints): every row writes, an empty row's write goes to the
        # slot of the step's first non-empty row with that row's values (an empty row may name a busy slot; equal
        # duplicates keep the scatter deterministic); with no non-empty row each row rewrites its own old state.
        if scratch is None:
            nonempty = lens > 0
            first = torch.argmax(nonempty.to(torch.int32))  # 0 when every row is empty
            src_row = torch.where(nonempty, torch.arange(r, device=x.device), first)  # (R,)
            ends = lens[src_row, None] - 1  # -1 for an empty row: its old window
            new_ctx = tok_buf[_src(src_row[:, None].expand(-1, n1), ends + _tail(n1, x.device), qsl, r, n1)]
            new_conv = c_buf[_src(src_row[:, None].expand(-1, win), ends + _tail(win, x.device), qsl, r, win)]
            dst = slots[src_row]
            ctx_pool[dst] = torch.bitwise_xor(new_ctx, self.eos)
            conv_pool[dst] = new_conv.transpose(1, 2).to(conv_pool.dtype)
        else:
            # Every token writes its position's candidate; a position past the scratch's k + 1 (none in a verify
            # row) rewrites the last one with its own values.
            pp = pos.clamp(max=scratch["token_context"].shape[1] - 1)
            cand_ctx = tok_buf[_src(rows[:, None].expand(-1, n1), pp[:, None] + _tail(n1, x.device), qsl, r, n1)]
            cand_conv = c_buf[_src(rows[:, None].expand(-1, win), pp[:, None] + _tail(win, x.device), qsl, r, win)]
            scratch["token_context"][rows, pp] = torch.bitwise_xor(cand_ctx, self.eos)
            scratch["conv_state"][rows, pp] = cand_conv.transpose(1, 2).to(scratch["conv_state"].dtype)
        return out

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` (T, n): each position's t_0 .. t_{n-1} before the segment rule; the (T, De) n-gram
        embedding."""
        eos = self.eos
        emb = self.ple_embedding
        table = emb.ngram_embedding.weight
        if uses_triton(tokens) and table.device == tokens.device:
            return ngram_embed(tokens, emb.layer_multipliers, emb.ngram_heads_vocab_sizes, emb.ngram_heads_offsets,
                               table, eos, self.heads_per_ngram)
        # An eos among t_1 .. t_{k-1} ends the segment before t_k: t_k reads eos (an eos t_k is eos anyway).
        t = tokens
        if self.ngram_size > 2:
            is_eos = tokens[:, 1:-1] == eos
            cut = torch.cat([torch.zeros_like(tokens[:, :2], dtype=torch.bool), is_eos.cummax(dim=1).values], dim=1)
            t = torch.where(cut, torch.full_like(tokens, eos), tokens)
        prods = t * self.ple_embedding.layer_multipliers[None, :]
        acc = prods[:, 0]
        orders = []
        for i in range(1, self.ngram_size):
            acc = torch.bitwise_xor(acc, prods[:, i])
            orders.append(acc)
        hashes = torch.stack(orders, dim=1).repeat_interleave(self.heads_per_ngram, dim=1)  # (T, G)
        index = torch.remainder(hashes, emb.ngram_heads_vocab_sizes) + emb.ngram_heads_offsets
        out = F.embedding(index.to(table.device), table)  # (T, G, d), on the table's device
        return out.reshape(tokens.shape[0], self.embed_dim).to(tokens.device)

    def _gate(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The gated value Gv (T, W) from the streams ``x`` and the n-gram embedding ``e``, in the activation dtype."""
        t = x.shape[0]
        e = e.to(x.dtype)
        if uses_triton(x):
            return ple_gate(self.norm_key(self.key_proj(e)), self.norm_query(x), self.value_proj(e), self.streams,
                            GATE_CLAMP)
        kn = self.norm_key(self.key_proj(e)).view(t, self.streams, self.hidden)
        qn = self.norm_query(x).view(t, self.streams, self.hidden)
        v = self.value_proj(e)
        g = (kn * qn).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden)
        g = torch.sign(g) * torch.sqrt(torch.clamp(g.abs(), min=GATE_CLAMP))
        return (torch.sigmoid(g) * v[:, None, :]).reshape(t, self.width)


def _tail(n: int, device: torch.device) -> torch.Tensor:
    """Offsets ``1 - n .. 0``: the last ``n`` entries ending at a position."""
    return torch.arange(1 - n, 1, device=device)[None, :]


def _src(rows: torch.Tensor, rel: torch.Tensor, qsl: torch.Tensor, num_rows: int, span: int) -> torch.Tensor:
    """Index into ``cat(every row's old window of `span` entries, the step's values)`` of row ``rows``' entry at
    ``rel``, relative to its first new value (negative: the window's, ``-span <= rel``)."""
    return torch.where(rel >= 0, num_rows * span + qsl[rows] + rel, rows * span + span + rel)
