"""The Qwen3.5 dense text model: Gated DeltaNet and gated full-attention layers over paged KV and slot-owned state.

Parameter names are exactly those of transformers' ``Qwen3_5ForCausalLM`` so that checkpoints load by name.

The layers keep no per-request state of their own. Attention layers write K/V into the paged cache through
``slot_mapping`` and read it through ``block_tables``; GDN layers read and write the conv window and the float32 SSM
state of ``state_slots[r]`` for each row r. The cache tensors are bound once by the model runner (``bind_caches``).
"""

from __future__ import annotations

import torch
from torch import nn

from hyserve.cache.specs import AttentionSpec, RecurrentStateSpec, StateTensorSpec
from hyserve.config import FULL_ATTENTION, ModelConfig
from hyserve.distributed.parallel_state import (
    is_first_stage,
    is_last_stage,
    shard_range,
    stage_layers,
    tp_rank,
    tp_size,
)
from hyserve.kernels import causal_conv1d_varlen, gdn_forward, paged_attention, store_kv
from hyserve.kernels.commit import commit_verified
from hyserve.kernels.conv import causal_conv1d_verify
from hyserve.kernels.gating import gdn_gating
from hyserve.kernels.gdn import gdn_verify
from hyserve.kernels.norm import silu_mul
from hyserve.layers.linear import Linear, MergedLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from hyserve.layers.norm import GatedRMSNorm, RMSNorm
from hyserve.layers.quantization import QuantizationConfig
from hyserve.layers.rotary import RotaryEmbedding
from hyserve.layers.sharding import Shard, set_shard
from hyserve.model.base import CausalLM, KVCacheLayer, RecurrentLayer
from hyserve.model.metadata import StepMetadata
from hyserve.model.mrope import text_rotary, with_image_rows
from hyserve.model.vision import VisionModel


class GatedDeltaNet(RecurrentLayer):
    """Causal conv over [q | k | v], then the gated delta rule with l2-normed q/k, then a gated RMSNorm.
    ``prefix``: the module's name (``model.layers.0.linear_attn``), which names its projections for quantization."""

    def __init__(self, cfg: ModelConfig, prefix: str) -> None:
        super().__init__()
        tp = tp_size()
        # Tensor parallel: this rank's key heads and value heads, with their channels of [q | k | v], z, b, a,
        # their conv channels, gates and SSM states.
        (k0, k1), (v0, v1) = shard_range(cfg.linear_num_key_heads), shard_range(cfg.linear_num_value_heads)
        self.num_k_heads = k1 - k0
        self.num_v_heads = v1 - v0
        self.head_k_dim = dk = cfg.linear_key_head_dim
        self.head_v_dim = dv = cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * dk
        self.value_dim = self.num_v_heads * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        kernel = cfg.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, bias=False, groups=self.conv_dim,
                                padding=kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(cfg.linear_value_dim, cfg.hidden_size, (v0 * dv, v1 * dv),
                                          sharded=tp > 1, quant=cfg.quantization, prefix=f"{prefix}.out_proj")
        shards: dict[str, Shard] = {}
        if tp > 1:
            fk, h = cfg.linear_key_dim, cfg.hidden_size
            qkv = ((k0 * dk, k1 * dk), (fk + k0 * dk, fk + k1 * dk), (2 * fk + v0 * dv, 2 * fk + v1 * dv))
            heads = ((v0, v1),)
            shards = {"in_proj_qkv": Shard((cfg.conv_dim, h), 0, qkv),
                      "in_proj_z": Shard((cfg.linear_value_dim, h), 0, ((v0 * dv, v1 * dv),)),
                      "in_proj_b": Shard((cfg.linear_num_value_heads, h), 0, heads),
                      "in_proj_a": Shard((cfg.linear_num_value_heads, h), 0, heads)}
            set_shard(self.conv1d.weight, Shard((cfg.conv_dim, 1, kernel), 0, qkv))
            set_shard(self.dt_bias, Shard((cfg.linear_num_value_heads,), 0, heads))
            set_shard(self.A_log, Shard((cfg.linear_num_value_heads,), 0, heads))
        # One GEMM for the checkpoint's four input projections (filled part by part by the loader).
        self.in_proj = MergedLinear(cfg.hidden_size, [("in_proj_qkv", self.conv_dim), ("in_proj_z", self.value_dim),
                                                      ("in_proj_b", self.num_v_heads),
                                                      ("in_proj_a", self.num_v_heads)], shards,
                                   quant=cfg.quantization, prefix=prefix)
        self.conv_state: torch.Tensor | None = None  # (S, conv_dim, K-1), model dtype
        self.ssm_state: torch.Tensor | None = None  # (S, Hv, Dk, Dv), float32
        # Speculative decoding: per verify row and position, the candidate conv window / SSM state.
        self.conv_scratch: torch.Tensor | None = None  # (R, k+1, conv_dim, K-1)
        self.ssm_scratch: torch.Tensor | None = None  # (R, k+1, Hv, Dk, Dv), float32

    def cache_spec(self, dtype: torch.dtype) -> RecurrentStateSpec:
        """The conv window (the last K - 1 inputs of [q | k | v], oldest first) in the model dtype, and the SSM
        state (Hv, Dk, Dv) in float32 (the delta rule accumulates over the whole sequence)."""
        k = self.conv1d.kernel_size[0]
        return RecurrentStateSpec((
            StateTensorSpec("conv_state", (self.conv_dim, k - 1), dtype),
            StateTensorSpec("ssm_state", (self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32),
        ))

    def bind_state(self, tensors: dict[str, torch.Tensor]) -> None:
        super().bind_state(tensors)
        self.conv_state, self.ssm_state = tensors["conv_state"], tensors["ssm_state"]

    def bind_verify_scratch(self, tensors: dict[str, torch.Tensor]) -> None:
        super().bind_verify_scratch(tensors)
        self.conv_scratch, self.ssm_scratch = tensors["conv_state"], tensors["ssm_state"]

    def commit_verified(self, state_slots: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Both tensors in one fused kernel (``hyserve.kernels.commit.commit_verified``)."""
        assert self.conv_state is not None and self.ssm_state is not None, "caches not bound"
        assert self.conv_scratch is not None and self.ssm_scratch is not None, "verify scratch not bound"
        commit_verified(self.conv_state, self.ssm_state, state_slots, self.conv_scratch, self.ssm_scratch,
                        num_accepted)

    def forward(self, x: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        assert self.conv_state is not None and self.ssm_state is not None, "caches not bound"
        t = x.shape[0]
        weight = self.conv1d.weight.squeeze(1)
        mixed_in, z, b, a = self.in_proj.split(self.in_proj(x))  # strided views of one output
        vm = meta.verify
        if vm is None:
            mixed = causal_conv1d_varlen(mixed_in, weight, self.conv_state, meta.state_slots, meta.query_start_loc,
                                         meta.max_query_len)
        else:
            assert self.conv_scratch is not None, "verify scratch not bound"
            parts = [causal_conv1d_verify(mixed_in[: vm.num_tokens], weight, self.conv_state, vm.state_slots,
                                          vm.query_start_loc, self.conv_scratch, vm.max_query_len)]
            if vm.num_tokens < t:
                parts.append(causal_conv1d_varlen(mixed_in[vm.num_tokens :], weight, self.conv_state,
                                                  vm.rest_state_slots, vm.rest_query_start_loc,
                                                  vm.rest_max_query_len))
            mixed = torch.cat(parts) if len(parts) > 1 else parts[0]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        g, beta = gdn_gating(a, b, self.A_log, self.dt_bias)
        q = q.reshape(t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(t, self.num_v_heads, self.head_v_dim)
        if vm is None:
            out = gdn_forward(q, k, v, g, beta, self.ssm_state, meta.state_slots, meta.query_start_loc,
                              meta.max_query_len, meta.query_start_loc_cpu)
        else:
            assert self.ssm_scratch is not None, "verify scratch not bound"
            tv = vm.num_tokens
            outs = [gdn_verify(q[:tv], k[:tv], v[:tv], g[:tv], beta[:tv], self.ssm_state, vm.state_slots,
                               vm.query_start_loc, self.ssm_scratch, vm.max_query_len)]
            if tv < t:
                outs.append(gdn_forward(q[tv:], k[tv:], v[tv:], g[tv:], beta[tv:], self.ssm_state,
                                        vm.rest_state_slots, vm.rest_query_start_loc, vm.rest_max_query_len,
                                        vm.rest_query_start_loc_cpu))
            out = torch.cat(outs) if len(outs) > 1 else outs[0]
        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(t, self.value_dim))


class Attention(KVCacheLayer):
    """Gated full attention: q_proj yields [q | gate] per head, q/k RMSNorm per head, partial RoPE. ``prefix``: the
    module's name (``model.layers.3.self_attn``)."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, prefix: str) -> None:
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


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, quant: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        i0, i1 = shard_range(intermediate)
        shards: dict[str, Shard] = {}
        if tp_size() > 1:
            shards = {name: Shard((intermediate, hidden), 0, ((i0, i1),)) for name in ("gate_proj", "up_proj")}
        self.gate_up_proj = MergedLinear(hidden, [("gate_proj", i1 - i0), ("up_proj", i1 - i0)], shards,
                                         quant=quant, prefix=prefix)
        self.down_proj = RowParallelLinear(intermediate, hidden, (i0, i1), sharded=tp_size() > 1, quant=quant,
                                           prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(*self.gate_up_proj.split(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    """``prefix``: the layer's name in the text model's naming (``model.layers.3``, ``mtp.layers.0``)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, prefix: str) -> None:
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        self.mixer: GatedDeltaNet | Attention
        if self.layer_type == FULL_ATTENTION:
            self.self_attn = Attention(cfg, rotary, f"{prefix}.self_attn")
            self.mixer = self.self_attn
        else:
            self.linear_attn = GatedDeltaNet(cfg, f"{prefix}.linear_attn")
            self.mixer = self.linear_attn
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.quantization, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, meta: StepMetadata,
                pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the residual stream; ``pending``: the previous layer's MLP output, not yet added (its add is fused
        into this layer's first norm). Returns ``(residual, this layer's MLP output)``, the MLP output pending."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add(x, pending)
        x, h = self.post_attention_layernorm.add(x, self.mixer(h, meta))
        return x, self.mlp(h)


class MissingLayer(nn.Module):
    """A decoder layer that another pipeline stage holds (keeps the indices of the checkpoint's names)."""


# Between pipeline stages: (residual stream, the last layer's MLP output whose add is fused into the next norm).
Intermediate = tuple[torch.Tensor, torch.Tensor]


class TextModel(nn.Module):
    """The decoder, or with pipeline parallelism the layers of this process's stage: the first stage embeds, the
    last applies the final norm (and also holds the embedding when the LM head is tied to it or the MTP head reads
    it); the others take and return ``Intermediate``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.start, self.end = stage_layers(cfg.num_hidden_layers)
        self.is_first, self.is_last = is_first_stage(), is_last_stage()
        self.rotary = text_rotary(cfg.rotary_dim, cfg.rope_theta, cfg.multimodal)
        self.embed_tokens: VocabParallelEmbedding | None = None
        if self.is_first or (self.is_last and (cfg.tie_word_embeddings or cfg.mtp_num_hidden_layers > 0)):
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i, self.rotary, f"model.layers.{i}")
                                     if self.start <= i < self.end else MissingLayer()
                                     for i in range(cfg.num_hidden_layers)])
        self._own_layers = list(self.layers)[self.start : self.end]  # a plain list: no ModuleList slice per step
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last else None

    def forward(self, input_ids: torch.Tensor, meta: StepMetadata,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        pending: torch.Tensor | None
        if intermediate is None:
            assert self.embed_tokens is not None and self.is_first, "a later stage needs the previous one's output"
            x, pending = with_image_rows(self.embed_tokens(input_ids), meta), None
        else:
            x, pending = intermediate
        self.rotary.prepare(meta.rotary_positions)
        for layer in self._own_layers:
            x, pending = layer(x, meta, pending)
        if self.norm is None:
            assert pending is not None
            return x, pending
        return self.norm(x) if pending is None else self.norm.add(x, pending)[1]

    def holds(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` (the model's naming) belongs to this stage."""
        if name.startswith("model.layers."):
            return self.start <= int(name.split(".")[2]) < self.end
        if name.startswith("model.embed_tokens."):
            return self.embed_tokens is not None
        if name.startswith(("model.norm.", "lm_head.", "mtp.")):
            return self.is_last
        return True


class Qwen3_5ForCausalLM(CausalLM):
    """Returns post-final-norm hidden states (the MTP head consumes them); ``compute_logits`` applies lm_head. With
    pipeline parallelism a stage other than the last returns ``Intermediate`` and has no lm_head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = TextModel(cfg)
        # The vision tower: every tensor-parallel rank holds it whole, on the first pipeline stage (the images'
        # embeddings) and on the last when the MTP head may read image rows (dropped by drop_unused_embedding
        # without a draft head).
        self.visual: VisionModel | None = None
        if cfg.multimodal is not None and (self.model.is_first or
                                           (self.model.is_last and cfg.mtp_num_hidden_layers > 0)):
            self.visual = VisionModel.from_config_dict(cfg.multimodal.vision_config)
        if self.model.is_last:
            self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)
            if cfg.tie_word_embeddings:
                assert self.model.embed_tokens is not None
                self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, meta: StepMetadata,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        return self.model(input_ids, meta, intermediate)

    def holds(self, name: str) -> bool:
        if name.startswith("visual."):
            return self.visual is not None or self.model.is_first
        return self.model.holds(name)

    def drop_unused_embedding(self, draft_head: bool) -> None:
        """A last pipeline stage keeps the input embedding only for a tied LM head or the draft head's inputs."""
        if not self.model.is_first and not self.config.tie_word_embeddings and not draft_head:
            self.model.embed_tokens = None
        if not self.model.is_first and not draft_head:
            self.visual = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        logits = head(hidden)
        return (head.gather(logits) if isinstance(head, ParallelLMHead) else logits).float()

    def input_embeddings(self) -> nn.Embedding:
        assert self.model.embed_tokens is not None, "this pipeline stage holds no embedding"
        return self.model.embed_tokens

    def activation_width(self) -> int:
        cfg = self.config
        return max(cfg.hidden_size, cfg.intermediate_size, cfg.conv_dim + cfg.linear_value_dim,
                   2 * cfg.num_attention_heads * cfg.head_dim)

    def gdn_layers(self) -> list[GatedDeltaNet]:
        return [m for m in self.recurrent_layers() if isinstance(m, GatedDeltaNet)]
