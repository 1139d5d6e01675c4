"""The gated full-attention mixer over the paged KV cache: it writes K/V through ``slot_mapping`` and reads them
through ``block_tables`` (the cache tensors bound once by the model runner)."""

from __future__ import annotations

from typing import Protocol

import torch

from hyserve.cache.specs import AttentionSpec
from hyserve.distributed.parallel_state import shard_range, tp_rank, tp_size
from hyserve.kernels import paged_attention, store_kv
from hyserve.kernels.attention.reference import FP8_KV_DTYPES
from hyserve.kernels.attention.sdpa import (
    SDPA_MIN_QUERIES,
    RowPlan,
    paged_attention_rows,
    prefill_attention_mode,
    sdpa_takes,
)
from hyserve.kernels.fp8 import Fp8Activation
from hyserve.kernels.gemv import DeferredInput
from hyserve.kernels.norm import sigmoid_mul
from hyserve.layers.linear import Linear, MergedLinear, RowParallelLinear, fp8_input_of
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


def kv_heads_of_rank(hkv: int) -> tuple[int, int]:
    """This tensor-parallel rank's kv heads ``[first, last)``: its share, or where there are more ranks than kv
    heads the one its query heads read."""
    tp, rank = tp_size(), tp_rank()
    if hkv % tp == 0:
        return shard_range(hkv)
    if tp % hkv == 0:
        kv0 = rank // (tp // hkv)
        return kv0, kv0 + 1
    raise ValueError(f"num_key_value_heads={hkv} and tensor_parallel_size={tp}: neither divides the other")


def attend_paged(layer: Attention | PlainAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: StepMetadata) -> torch.Tensor:
    """The step's K and V written into ``layer``'s paged cache through ``slot_mapping``, then its queries' softmax
    attention over each row's cached context at ``layer.scale`` (``(T, Hq, D)``)."""
    assert layer.k_cache is not None and layer.v_cache is not None, "caches not bound"
    store_kv(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping, layer.k_scale, layer.v_scale)
    qsl_cpu, seq_cpu = meta.query_start_loc_cpu, meta.seq_lens_cpu
    if (qsl_cpu is not None and seq_cpu is not None and meta.max_query_len >= SDPA_MIN_QUERIES
            and sdpa_takes(prefill_attention_mode(), q, layer.k_cache,
                           layer.k_scale is not None or layer.k_cache.dtype in FP8_KV_DTYPES)):
        # long prefill rows through SDPA (FlashAttention on CUDA), the others through the paged kernel, as the
        # step's plan says (worked out by its first attention layer, taken by the others)
        group = q.shape[1] // layer.k_cache.shape[2]
        plan = meta.attention_plans.get((group, SDPA_MIN_QUERIES))
        if plan is None:
            plan = meta.attention_plans[(group, SDPA_MIN_QUERIES)] = RowPlan.of(
                qsl_cpu.tolist(), seq_cpu.tolist(), group, SDPA_MIN_QUERIES, q.device)
        return paged_attention_rows(q, k, v, layer.k_cache, layer.v_cache, meta.block_tables, meta.seq_lens,
                                    layer.scale, plan)
    return paged_attention(q.contiguous(), layer.k_cache, layer.v_cache, meta.block_tables, meta.query_start_loc,
                           meta.seq_lens, layer.scale, meta.max_query_len, meta.max_seq_len, layer.k_scale,
                           layer.v_scale)


def output_projection(cfg: AttentionConfig, prefix: str, heads: tuple[int, int]) -> RowParallelLinear:
    """``o_proj``: the input columns of this rank's query ``heads``."""
    h0, h1 = heads
    return RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, (h0 * cfg.head_dim,
                             h1 * cfg.head_dim), bias=cfg.attention_bias, sharded=tp_size() > 1,
                             quant=cfg.quantization, prefix=f"{prefix}.o_proj")


class QKVAttention(KVCacheLayer):
    """An attention layer's q, k and v projections: one GEMM (``qkv_proj``, a ``MergedLinear`` of the checkpoint's
    ``q_proj``, ``k_proj`` and ``v_proj``: one launch a step instead of three, the small k and v rows riding on
    q's), or three (``q_proj``, ``k_proj``, ``v_proj``) where they carry biases, which a merged projection has
    not."""

    qkv_proj: MergedLinear | None
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear

    def make_qkv(self, cfg: AttentionConfig, prefix: str, q_size: int, q_shard: Shard | None,
                 kv_heads: tuple[int, int]) -> None:
        """``q_size`` rows of ``q_proj`` on this rank (``q_shard``: which, tensor-parallel), ``kv_heads``' of k and
        v."""
        d, hidden, hkv = cfg.head_dim, cfg.hidden_size, cfg.num_key_value_heads
        kv0, kv1 = kv_heads
        kv_shard = Shard((hkv * d, hidden), 0, ((kv0 * d, kv1 * d),)) if tp_size() > 1 else None
        kv_size, quant = (kv1 - kv0) * d, cfg.quantization
        if cfg.attention_bias:
            self.qkv_proj = None
            self.q_proj = Linear(hidden, q_size, bias=True, quant=quant, prefix=f"{prefix}.q_proj", shard=q_shard)
            self.k_proj = Linear(hidden, kv_size, bias=True, quant=quant, prefix=f"{prefix}.k_proj", shard=kv_shard)
            self.v_proj = Linear(hidden, kv_size, bias=True, quant=quant, prefix=f"{prefix}.v_proj", shard=kv_shard)
            return
        shards = {name: sh for name, sh in (("q_proj", q_shard), ("k_proj", kv_shard), ("v_proj", kv_shard))
                  if sh is not None}
        self.qkv_proj = MergedLinear(hidden, [("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)],
                                     shards, quant=quant, prefix=prefix)

    def project_qkv(self, x: torch.Tensor | Fp8Activation | DeferredInput
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The q, k and v projections' outputs (views of one output where merged)."""
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj.split(self.qkv_proj(x))
            return q, k, v
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def fp8_input(self) -> str | None:
        """The form the layer's input comes in from its norm (``hyserve.kernels.norm.QUANT_MODES``): quantized per
        token where the q, k and v projections take it so."""
        if self.qkv_proj is not None:
            return self.qkv_proj.fp8_input()
        return fp8_input_of([self.q_proj, self.k_proj, self.v_proj])

    def takes_deferred(self) -> bool:
        """Whether the layer's input may come as its norm deferred into the projections' GEMM prologue (merged: one
        GEMM computes it; three: each does, the residual add's result written by each, the same values)."""
        if self.qkv_proj is not None:
            return self.qkv_proj.takes_deferred()
        return all(p.takes_deferred() for p in (self.q_proj, self.k_proj, self.v_proj))


class Attention(QKVAttention):
    """Gated full attention: q_proj yields [q | gate] per head, q/k RMSNorm per head, partial RoPE. ``prefix``: the
    module's name (``model.layers.3.self_attn``)."""

    def __init__(self, cfg: AttentionConfig, rotary: RotaryEmbedding, prefix: str) -> None:
        super().__init__()
        tp = tp_size()
        h0, h1 = shard_range(cfg.num_attention_heads)
        hkv = cfg.num_key_value_heads
        kv0, kv1 = kv_heads_of_rank(hkv)
        self.num_heads = h1 - h0
        self.num_kv_heads = kv1 - kv0
        self.kv_head_range, self.num_kv_heads_total = (kv0, kv1), hkv
        self.head_dim = d = cfg.head_dim
        self.scale = self.head_dim**-0.5
        hidden = cfg.hidden_size
        # Tensor parallel: rows per query head are [q | gate], so a rank's heads are one run of rows.
        q_rows = (h0 * 2 * d, h1 * 2 * d)
        q_shard = Shard((cfg.num_attention_heads * 2 * d, hidden), 0, (q_rows,)) if tp > 1 else None
        self.make_qkv(cfg, prefix, self.num_heads * d * 2, q_shard, (kv0, kv1))
        self.o_proj = output_projection(cfg, prefix, (h0, h1))
        self.o_quant = self.o_proj.fp8_input()  # the output gate's form (FP8 per token where o_proj takes it)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = [rotary]  # a list, so the shared module is not registered once per layer
        self.k_cache: torch.Tensor | None = None  # (num_blocks, block_size, Hkv, D)
        self.v_cache: torch.Tensor | None = None

    def cache_spec(self, dtype: torch.dtype) -> AttentionSpec:
        return AttentionSpec(self.num_kv_heads, self.head_dim, dtype)

    def forward(self, x: torch.Tensor | Fp8Activation | DeferredInput, meta: StepMetadata) -> torch.Tensor:
        assert self.k_cache is not None and self.v_cache is not None, "caches not bound"
        t = x.shape[0]
        qg, k, v = self.project_qkv(x)
        q, gate = torch.chunk(qg.view(t, self.num_heads, 2 * self.head_dim), 2, dim=-1)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        # q / k head norms and the rotation of both: one launch on CUDA.
        q, k = self.rotary[0].norm_rotate(q, self.q_norm.weight, k, self.k_norm.weight, self.q_norm.eps)
        out = attend_paged(self, q, k, v, meta)
        # The output gate in one launch (reading the gate where q_proj wrote it), quantized there for an FP8 o_proj.
        return self.o_proj(sigmoid_mul(out.reshape(t, -1), gate, self.o_quant))


class PlainAttention(QKVAttention):
    """Multi-head attention with no gate and no q/k norm: q, k, v projections, softmax over the paged KV at
    ``scale`` (default ``head_dim ** -0.5``), the output projection. No position embedding (Nemotron-H's, Granite's
    by default: the Mamba2 layers carry the order) unless given ``rotary`` (Granite's ``position_embedding_type:
    rope``, Falcon-H1's: NeoX RoPE over the whole head, its cos/sin prepared once a step by the model);
    ``key_multiplier`` (Falcon-H1's) scales k before the rotation. ``prefix``: the module's name
    (``backbone.layers.3.mixer``)."""

    def __init__(self, cfg: AttentionConfig, prefix: str, scale: float | None = None,
                 rotary: RotaryEmbedding | None = None, key_multiplier: float = 1.0) -> None:
        super().__init__()
        tp = tp_size()
        h0, h1 = shard_range(cfg.num_attention_heads)
        hkv = cfg.num_key_value_heads
        kv0, kv1 = kv_heads_of_rank(hkv)
        self.num_heads, self.num_kv_heads = h1 - h0, kv1 - kv0
        self.kv_head_range, self.num_kv_heads_total = (kv0, kv1), hkv
        self.head_dim = d = cfg.head_dim
        self.scale = d**-0.5 if scale is None else scale
        q_shard = Shard((cfg.num_attention_heads * d, cfg.hidden_size), 0, ((h0 * d, h1 * d),)) if tp > 1 else None
        self.make_qkv(cfg, prefix, self.num_heads * d, q_shard, (kv0, kv1))
        self.o_proj = output_projection(cfg, prefix, (h0, h1))
        self.rotary = [rotary] if rotary is not None else []  # a list: the shared module is not registered per layer
        self.key_multiplier = float(key_multiplier)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def cache_spec(self, dtype: torch.dtype) -> AttentionSpec:
        return AttentionSpec(self.num_kv_heads, self.head_dim, dtype)

    def forward(self, x: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        assert self.k_cache is not None and self.v_cache is not None, "caches not bound"
        t = x.shape[0]
        q, k, v = self.project_qkv(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.key_multiplier != 1.0:
            k = k * self.key_multiplier
        if self.rotary:
            q, k = self.rotary[0](meta.positions, q, k)
        return self.o_proj(attend_paged(self, q, k, v, meta).reshape(t, -1))
