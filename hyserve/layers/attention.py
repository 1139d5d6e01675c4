"""The gated full-attention mixer over the paged KV cache: it writes K/V through ``slot_mapping`` and reads them
through ``block_tables`` (the cache tensors bound once by the model runner)."""

from __future__ import annotations

from typing import Protocol

import torch

from hyserve.cache.specs import AttentionSpec
from hyserve.distributed.parallel_state import shard_range, tp_rank, tp_size
from hyserve.kernels import paged_attention, store_kv
from hyserve.layers.linear import Linear, RowParallelLinear
from hyserve.layers.norm import RMSNorm
from hyserve.layers.quantization import QuantizationConfig
from hyserve.layers.rotary import RotaryEmbedding
from hyserve.layers.sharding import Shard
from hyserve.model.base import KVCacheLayer
from hyserve.model.metadata import StepMetadata


class AttentionConfig(Protocol):
    """What the layer reads of a family's config."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rms_norm_eps: float
    quantization: QuantizationConfig | None


class Attention(KVCacheLayer):
    """Gated full attention: q_proj yields [q | gate] per head, q/k RMSNorm per head, partial RoPE. ``prefix``: the
    module's name (``model.layers.3.self_attn``)."""

    def __init__(self, cfg: AttentionConfig, rotary: RotaryEmbedding, prefix: str) -> None:
        super().__init__()
        tp, rank = tp_size(), tp_rank()
        h0, h1 = shard_range(cfg.num_attention_heads)
        hkv = cfg.num_key_value_heads
        if hkv % tp == 0:
            kv0, kv1 = shard_range(hkv)
        elif tp % hkv == 0:  # more ranks than KV heads: each rank keeps the one its query heads read
            kv0 = rank // (tp // hkv)
            kv1 = kv0 + 1
        else:
            raise ValueError(f"num_key_value_heads={hkv} and tensor_parallel_size={tp}: neither divides the other")
        self.num_heads = h1 - h0
        self.num_kv_heads = kv1 - kv0
        self.kv_head_range, self.num_kv_heads_total = (kv0, kv1), hkv
        self.head_dim = d = cfg.head_dim
        self.scale = self.head_dim**-0.5
        bias, quant, hidden = cfg.attention_bias, cfg.quantization, cfg.hidden_size
        # Tensor parallel: rows per query head are [q | gate], so a rank's heads are one run of rows.
        q_rows, kv_rows = (h0 * 2 * d, h1 * 2 * d), (kv0 * d, kv1 * d)
        q_shard = Shard((cfg.num_attention_heads * 2 * d, hidden), 0, (q_rows,)) if tp > 1 else None
        kv_shard = Shard((hkv * d, hidden), 0, (kv_rows,)) if tp > 1 else None
        self.q_proj = Linear(hidden, self.num_heads * d * 2, bias=bias, quant=quant, prefix=f"{prefix}.q_proj",
                             shard=q_shard)
        self.k_proj = Linear(hidden, self.num_kv_heads * d, bias=bias, quant=quant, prefix=f"{prefix}.k_proj",
                             shard=kv_shard)
        self.v_proj = Linear(hidden, self.num_kv_heads * d, bias=bias, quant=quant, prefix=f"{prefix}.v_proj",
                             shard=kv_shard)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, hidden, (h0 * d, h1 * d), bias=bias,
                                        sharded=tp > 1, quant=quant, prefix=f"{prefix}.o_proj")
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = [rotary]  # a list, so the shared module is not registered once per layer
        self.k_cache: torch.Tensor | None = None  # (num_blocks, block_size, Hkv, D)
        self.v_cache: torch.Tensor | None = None

    def cache_spec(self, dtype: torch.dtype) -> AttentionSpec:
        return AttentionSpec(self.num_kv_heads, self.head_dim, dtype)

    def forward(self, x: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        assert self.k_cache is not None and self.v_cache is not None, "caches not bound"
        t = x.shape[0]
        q, gate = torch.chunk(self.q_proj(x).view(t, self.num_heads, 2 * self.head_dim), 2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary[0](meta.positions, q, k)
        store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        out = paged_attention(q.contiguous(), self.k_cache, self.v_cache, meta.block_tables, meta.query_start_loc,
                              meta.seq_lens, self.scale, meta.max_query_len, meta.max_seq_len, self.k_scale,
                              self.v_scale)
        out = out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)
