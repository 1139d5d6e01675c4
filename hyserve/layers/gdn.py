"""The Gated DeltaNet mixer: a causal conv over [q | k | v], then the gated delta rule over the SSM state of the
request's slot (stored in float32 unless --mamba-ssm-cache-dtype), then a gated RMSNorm. It keeps no per-request
state of its own: ``state_slots[r]`` names row r's conv window and SSM state in the tensors the model runner binds
(``bind_state``).

A pure decode step (every row one token, no verify rows) takes one fused launch on CUDA for everything between the
two projections (:func:`hyserve.kernels.gdn.decode.gdn_decode_fused`); other steps, and every step off CUDA, the
sequence of conv, gates, delta rule and gated norm."""

from __future__ import annotations

import os
from typing import Protocol

import torch
from torch import nn

from hyserve.cache.specs import RecurrentStateSpec, StateTensorSpec
from hyserve.distributed.parallel_state import shard_range, tp_size
from hyserve.kernels import causal_conv1d_varlen, gdn_forward
from hyserve.kernels.conv import causal_conv1d_split, causal_conv1d_verify, snapshot_conv_windows
from hyserve.kernels.fp8 import Fp8Activation
from hyserve.kernels.gating import gdn_gating
from hyserve.kernels.gdn import gdn_takes_chunked, gdn_verify
from hyserve.kernels.gdn.decode import arrivals_for, gdn_decode_fused, head_counters_for, row_counters_for
from hyserve.kernels.gdn.verify import STASH_NAMES, gdn_replay, gdn_stash_shapes, gdn_verify_fused
from hyserve.kernels.gemv import DeferredInput
from hyserve.kernels.varlen import ChunkedRows
from hyserve.layers.linear import MergedLinear, RowParallelLinear
from hyserve.layers.norm import GatedRMSNorm
from hyserve.layers.quantization import QuantizationConfig
from hyserve.layers.replayed_state import ReplayedStateLayer
from hyserve.layers.sharding import Shard, set_shard
from hyserve.model.metadata import RowSnapshots, StepMetadata, VerifyMetadata


def fused_switch() -> bool:
    """``HYSERVE_GDN_FUSED``: 1 (the default) or 0, the unfused kernels on CUDA too (to measure, or to tell a fused
    kernel's fault apart); any other value is refused."""
    value = os.environ.get("HYSERVE_GDN_FUSED", "1")
    if value not in ("0", "1"):
        raise ValueError(f"HYSERVE_GDN_FUSED={value!r}: 1 (the default) or 0")
    return value == "1"


FUSED = fused_switch()


def output_quant_switch() -> bool:
    """``HYSERVE_GDN_FUSED_QUANT``: 0 (the default) or 1, the fused decode and verify launches quantizing an FP8
    ``out_proj``'s input per token themselves (the last of a row's programs quantizes it, counted per row). On an
    H100 at the 27B's heads that took 13.9 / 20.5 / 110 / 211 us at batch 1 / 8 / 32 / 64 where the plain launch and
    the GEMM's own quantization took 13.2 / 19.7 / 103 / 196 (``benchmarks/fp8_quant_bench.py``, 2026-12-05), so
    it is off unless asked for; any other value is refused."""
    value = os.environ.get("HYSERVE_GDN_FUSED_QUANT", "0")
    if value not in ("0", "1"):
        raise ValueError(f"HYSERVE_GDN_FUSED_QUANT={value!r}: 0 (the default) or 1")
    return value == "1"


def _three_way(var: str) -> bool | None:
    """Environment variable ``var``: unset (None: the launch's own choice), 0 (False) or 1 (True); any other value
    refused."""
    value = os.environ.get(var)
    if value not in (None, "0", "1"):
        raise ValueError(f"{var}={value!r}: unset (the launch's own choice), 0 or 1")
    return None if value is None else value == "1"


def decode_split_switch() -> bool | None:
    """``HYSERVE_GDN_DECODE_SPLIT``: unset (each launch as :func:`~hyserve.kernels.gdn.decode.decode_launch` says), 0
    (every fused decode launch walks each head in one program) or 1 (every launch splits each head over its value
    blocks); any other value is refused. For benchmarks that compare the two launches in one engine."""
    return _three_way("HYSERVE_GDN_DECODE_SPLIT")


def decode_upfront_switch() -> bool | None:
    """``HYSERVE_GDN_DECODE_UPFRONT``: unset (each launch as :func:`~hyserve.kernels.gdn.decode.decode_launch` says),
    0 (the walk as it is) or 1 (every walk in its UPFRONT form: the head's whole state one tile, every load that waits
    only on the slot issued before the q / k prologue, the gated norm from registers); any other value is refused, and
    1 with ``HYSERVE_GDN_DECODE_SPLIT=1`` too (a split launch has no such form). For benchmarks that compare the two
    forms in one engine."""
    value = _three_way("HYSERVE_GDN_DECODE_UPFRONT")
    if value and decode_split_switch():
        raise ValueError("HYSERVE_GDN_DECODE_UPFRONT=1 is a form of the walk; HYSERVE_GDN_DECODE_SPLIT=1 forces the "
                         "split launch: set one of them")
    return value


def decode_persist_switch() -> bool | None:
    """``HYSERVE_GDN_DECODE_PERSIST``: unset (the persistent launch where :func:`~hyserve.kernels.gdn.decode.persists`
    says: a value-major pool, unquantized, from 1,024 (row, value head) pairs), 0 (never: each launch as
    :func:`~hyserve.kernels.gdn.decode.decode_launch` says) or 1 (every fused decode step as the persistent launch:
    the walk's UPFRONT form on a fixed grid of two programs an SM, each looping over the (row, value head) pairs; the
    conv windows rolled in a second launch). Any other value is refused, and 1 beside ``HYSERVE_GDN_DECODE_SPLIT=1``
    (a split launch), ``HYSERVE_GDN_DECODE_UPFRONT=0`` (it is that form) or ``HYSERVE_GDN_FUSED_QUANT=1`` (it does
    not quantize)."""
    value = _three_way("HYSERVE_GDN_DECODE_PERSIST")
    if value:
        clash = [name for name, on in (("HYSERVE_GDN_DECODE_SPLIT=1", decode_split_switch() is True),
                                       ("HYSERVE_GDN_DECODE_UPFRONT=0", decode_upfront_switch() is False),
                                       ("HYSERVE_GDN_FUSED_QUANT=1", output_quant_switch())) if on]
        if clash:
            raise ValueError(f"HYSERVE_GDN_DECODE_PERSIST=1 (the persistent UPFRONT walk, unquantized) beside "
                             f"{', '.join(clash)}: set one of them")
    return value


def verify_split_switch() -> bool | None:
    """``HYSERVE_GDN_VERIFY_SPLIT``: unset (each fused verify launch as
    :func:`~hyserve.kernels.gdn.verify.verify_launch` says), 0 (every launch walks each value head in one program) or
    1 (every launch splits each value head over its value blocks); any other value is refused. For benchmarks that
    compare the two launches in one engine."""
    return _three_way("HYSERVE_GDN_VERIFY_SPLIT")


def state_layout_switch() -> str:
    """``HYSERVE_GDN_STATE_LAYOUT``: ``value`` (the default: each head's ``(Dk, Dv)`` SSM state stored transposed,
    row by value, as fla's ``state_v_first`` kernels keep it: a decode program's ``(Dk, BV)`` tile is one contiguous
    run of memory instead of ``Dk`` runs of ``BV``; one GDN layer's decode 1.14-1.61x faster on an H100,
    ``benchmarks/results/h100/gdn_layout_2026-12-06``) or ``key`` (row by key, as transformers' rule writes it); any
    other value is refused. Every kernel takes the pool's strides, so only the access pattern changes; ``key`` is
    for benchmarks and checks that compare the two layouts in one engine."""
    value = os.environ.get("HYSERVE_GDN_STATE_LAYOUT", "value")
    if value not in ("key", "value"):
        raise ValueError(f"HYSERVE_GDN_STATE_LAYOUT={value!r}: value (the default) or key")
    return value


def uses_fused_decode(x: torch.Tensor) -> bool:
    """Whether a pure decode step takes the fused kernel: on CUDA (the CPU keeps the unfused references)."""
    return x.is_cuda and FUSED


def uses_fused_verify(x: torch.Tensor) -> bool:
    """Whether a step's verify rows of drafts take the fused kernel: on CUDA (the CPU keeps the unfused
    references)."""
    return x.is_cuda and FUSED


class GDNConfig(Protocol):
    """What the layer reads of a family's config (field names of transformers' ``Qwen3_5TextConfig``)."""

    hidden_size: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    quantization: QuantizationConfig | None
    ssm_state_dtype: str  # the SSM state's stored element type (ModelConfig; float32 by default)


class GatedDeltaNet(ReplayedStateLayer):
    """Causal conv over [q | k | v], then the gated delta rule with l2-normed q/k, then a gated RMSNorm.
    ``prefix``: the module's name (``model.layers.0.linear_attn``), which names its projections for quantization.
    Takes prefix-cache snapshots inside prefill rows (``StepMetadata.row_snapshots``): the conv window from the
    step's pre-conv inputs, the SSM state from the delta rule's own pass (``hyserve.kernels.gdn``)."""

    supports_row_snapshots = True

    def __init__(self, cfg: GDNConfig, prefix: str) -> None:
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
        # The checkpoint's (all ranks') widths.
        full_k, full_v = cfg.linear_num_key_heads * dk, cfg.linear_num_value_heads * dv
        full_conv = 2 * full_k + full_v
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, bias=False, groups=self.conv_dim,
                                padding=kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(full_v, cfg.hidden_size, (v0 * dv, v1 * dv),
                                          sharded=tp > 1, quant=cfg.quantization, prefix=f"{prefix}.out_proj")
        # The fused decode and verify launches quantize out_proj's input per token where an FP8 out_proj takes it
        # and HYSERVE_GDN_FUSED_QUANT=1 asks for it (off by default: slower than the GEMM's own quantization);
        # their per-row counters (zeros between launches) say which of a row's programs finishes last.
        self.out_quant = self.out_proj.fp8_input() if output_quant_switch() else None
        self.row_counts: torch.Tensor | None = None  # (S,) int32, with out_quant
        self.k_range, self.v_range = (k0, k1), (v0, v1)
        if tp > 1:
            heads = ((v0, v1),)
            set_shard(self.conv1d.weight, Shard((full_conv, 1, kernel), 0, self.conv_rows(cfg)))
            set_shard(self.dt_bias, Shard((cfg.linear_num_value_heads,), 0, heads))
            set_shard(self.A_log, Shard((cfg.linear_num_value_heads,), 0, heads))
        # One GEMM for the checkpoint's input projections, whose output is [q | k | v | z | b | a] of this rank's
        # heads (filled part by part by the loader).
        self.in_proj = self.make_in_proj(cfg, prefix)
        self.in_proj_sizes = [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]
        # The SSM state is computed in float32 and stored in ssm_dtype (float32 unless --mamba-ssm-cache-dtype).
        self.ssm_dtype: torch.dtype = getattr(torch, cfg.ssm_state_dtype)
        self.conv_state: torch.Tensor | None = None  # (S, conv_dim, K-1), model dtype
        self.ssm_state: torch.Tensor | None = None  # (S, Hv, Dk, Dv), ssm_dtype
        # The fused decode kernel's counters (zeros between launches): per (slot, key head), and per (row, value
        # head) for a launch that splits each head over its value blocks (decode_launch).
        self.arrivals: torch.Tensor | None = None  # (S, Hk) int32
        self.head_counts: torch.Tensor | None = None  # (S, Hv) int32
        self.decode_split = decode_split_switch()
        self.decode_upfront = decode_upfront_switch()
        self.decode_persist = decode_persist_switch()
        self.verify_split = verify_split_switch()
        # Speculative decoding: per verify row and position, the candidate conv window, and the delta rule's inputs
        # from which the commit rebuilds the SSM state (hyserve.kernels.gdn.verify: the stash).
        self.conv_scratch: torch.Tensor | None = None  # (R, k+1, conv_dim, K-1)
        self.stash: dict[str, torch.Tensor] | None = None  # STASH_NAMES -> (R, k+1, *gdn_stash_shapes), float32

    def conv_rows(self, cfg: GDNConfig) -> tuple[tuple[int, int], ...]:
        """This rank's rows of [q | k | v] (the conv channels, ``in_proj_qkv``): its key heads' of q and of k,
        its value heads' of v."""
        (k0, k1), (v0, v1) = self.k_range, self.v_range
        dk, dv, fk = self.head_k_dim, self.head_v_dim, cfg.linear_num_key_heads * self.head_k_dim
        return (k0 * dk, k1 * dk), (fk + k0 * dk, fk + k1 * dk), (2 * fk + v0 * dv, 2 * fk + v1 * dv)

    def make_in_proj(self, cfg: GDNConfig, prefix: str) -> MergedLinear:
        """Qwen3.5's four checkpoint projections ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``
        (a family whose checkpoint fuses them otherwise overrides this, keeping the output's order)."""
        shards: dict[str, Shard] = {}
        if tp_size() > 1:
            dv, h, nv = self.head_v_dim, cfg.hidden_size, cfg.linear_num_value_heads
            full_conv = 2 * cfg.linear_num_key_heads * self.head_k_dim + nv * dv
            v0, v1 = self.v_range
            shards = {"in_proj_qkv": Shard((full_conv, h), 0, self.conv_rows(cfg)),
                      "in_proj_z": Shard((nv * dv, h), 0, ((v0 * dv, v1 * dv),)),
                      "in_proj_b": Shard((nv, h), 0, ((v0, v1),)),
                      "in_proj_a": Shard((nv, h), 0, ((v0, v1),))}
        return MergedLinear(cfg.hidden_size, [("in_proj_qkv", self.conv_dim), ("in_proj_z", self.value_dim),
                                              ("in_proj_b", self.num_v_heads), ("in_proj_a", self.num_v_heads)],
                            shards, quant=cfg.quantization, prefix=prefix)

    def cache_spec(self, dtype: torch.dtype) -> RecurrentStateSpec:
        """The conv window (the last K - 1 inputs of [q | k | v], oldest first) in the model dtype, and the SSM
        state (Hv, Dk, Dv) in ``ssm_dtype``: float32 by default (the delta rule accumulates over the whole
        sequence), bf16 / fp16 with ``--mamba-ssm-cache-dtype`` (half the bytes each decode step reads and writes),
        stored as ``HYSERVE_GDN_STATE_LAYOUT`` says (:func:`state_layout_switch`)."""
        k = self.conv1d.kernel_size[0]
        return RecurrentStateSpec((
            StateTensorSpec("conv_state", (self.conv_dim, k - 1), dtype),
            StateTensorSpec("ssm_state", (self.num_v_heads, self.head_k_dim, self.head_v_dim), self.ssm_dtype,
                            None if state_layout_switch() == "key" else (0, 2, 1)),
        ))

    def bind_state(self, tensors: dict[str, torch.Tensor]) -> None:
        super().bind_state(tensors)
        self.conv_state, self.ssm_state = tensors["conv_state"], tensors["ssm_state"]
        self.arrivals = arrivals_for(self.ssm_state.shape[0], self.num_k_heads, self.num_v_heads,
                                     self.ssm_state.device, split=True)
        self.head_counts = head_counters_for(self.ssm_state.shape[0], self.num_v_heads, self.ssm_state.device)
        if self.out_quant is not None:
            self.row_counts = row_counters_for(self.ssm_state.shape[0], self.ssm_state.device)

    verifies_one_token_rows_in_place = True  # (RecurrentLayer): a step at speculation length 0 is a decode step here

    def verify_scratch_spec(self, dtype: torch.dtype) -> RecurrentStateSpec:
        """Per verify position: the candidate conv window (small), and the delta rule's inputs in place of the
        candidate SSM state (``hyserve.kernels.gdn.verify``: a few kilobytes against the state's megabytes)."""
        k = self.conv1d.kernel_size[0]
        shapes = gdn_stash_shapes(self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim)
        return RecurrentStateSpec((StateTensorSpec("conv_state", (self.conv_dim, k - 1), dtype),
                                   *(StateTensorSpec(n, shapes[n], torch.float32) for n in STASH_NAMES)))

    def bind_verify_scratch(self, tensors: dict[str, torch.Tensor]) -> None:
        super().bind_verify_scratch(tensors)
        self.conv_scratch = tensors["conv_state"]
        self.stash = {n: tensors[n] for n in STASH_NAMES}

    def replay_state(self, rows: torch.Tensor | None, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                     counts: torch.Tensor) -> None:
        """(ReplayedStateLayer) The candidate window's copy and ``gdn_replay`` over the stash of the delta rule's
        inputs, one launch on CUDA."""
        assert self.ssm_state is not None and self.stash is not None, "caches or verify scratch not bound"
        assert self.conv_state is not None and self.conv_scratch is not None
        gdn_replay(self.ssm_state, self.stash, rows, src_slots, dst_slots, counts,
                   conv=(self.conv_state, self.conv_scratch))

    def fp8_input(self) -> str | None:
        """The form the layer's input comes in from its norm (``hyserve.kernels.norm.QUANT_MODES``): quantized per
        token where ``in_proj`` takes it so."""
        return self.in_proj.fp8_input()

    def takes_deferred(self) -> bool:
        """Whether the layer's input may come as its norm deferred into ``in_proj``'s prologue."""
        return self.in_proj.takes_deferred()

    def forward(self, x: torch.Tensor | Fp8Activation | DeferredInput, meta: StepMetadata) -> torch.Tensor:
        assert self.conv_state is not None and self.ssm_state is not None, "caches not bound"
        t = x.shape[0]
        weight = self.conv1d.weight.squeeze(1)
        # strided views of the projection's output (of each GEMM's where the checkpoint keeps a part in bf16)
        mixed_in, z, b, a = self.in_proj.forward_split(x, self.in_proj_sizes)
        vm = meta.verify
        # Verify rows of one token each (no drafts) advance their slots in place (verifies_one_token_rows_in_place);
        # with no other rows the step is a decode step.
        in_place = vm is not None and vm.max_query_len == 1
        if in_place and vm is not None and vm.num_tokens == t:
            vm = None
        if vm is None and meta.max_query_len == 1 and uses_fused_decode(mixed_in):
            out = gdn_decode_fused(mixed_in, z, b, a, weight, self.A_log, self.dt_bias, self.norm.weight,
                                   self.norm.eps, self.conv_state, self.ssm_state, meta.state_slots,
                                   meta.query_start_loc, self.num_k_heads, self.arrivals,
                                   quant=self.out_quant, row_counts=self.row_counts, head_counts=self.head_counts,
                                   split=self.decode_split, upfront=self.decode_upfront, persist=self.decode_persist)
            return self.out_proj(out)
        snaps = meta.row_snapshots
        if snaps is not None:  # windows inside prefill rows, before the conv rolls the slots' windows
            rest = mixed_in if vm is None else mixed_in[vm.num_tokens :]
            snapshot_conv_windows(rest, self.conv_state, snaps)
        if vm is not None and not in_place and uses_fused_verify(mixed_in):
            return self.out_proj(self.fused_verify(mixed_in, z, b, a, meta))
        if vm is not None and in_place and uses_fused_decode(mixed_in):
            # one-token verify rows (a step at speculation length 0) before prefill rows: a decode launch for them
            tv = vm.num_tokens
            head = gdn_decode_fused(mixed_in[:tv], z[:tv], b[:tv], a[:tv], weight, self.A_log, self.dt_bias,
                                    self.norm.weight, self.norm.eps, self.conv_state, self.ssm_state,
                                    vm.state_slots, vm.query_start_loc, self.num_k_heads, self.arrivals,
                                    head_counts=self.head_counts, split=self.decode_split,
                                    upfront=self.decode_upfront, persist=self.decode_persist)
            assert isinstance(head, torch.Tensor)  # (plain: prefill rows follow)
            return self.out_proj(torch.cat([head, self.rest_rows(mixed_in, z, b, a, meta)]))
        if vm is None:
            return self.out_proj(self.prefill_rows(mixed_in, z, b, a, meta.state_slots, meta.query_start_loc,
                                                   meta.max_query_len, meta.query_start_loc_cpu, snaps,
                                                   meta.chunked_rows))
        # Off CUDA: the verify rows on the unfused kernels, then the rows after them (chunked prefill).
        tv = vm.num_tokens
        head = self.verify_rows(mixed_in[:tv], z[:tv], b[:tv], a[:tv], vm, in_place)
        if tv == t:
            return self.out_proj(head)
        return self.out_proj(torch.cat([head, self.rest_rows(mixed_in, z, b, a, meta)]))

    def prefill_rows(self, mixed_in: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                     slots: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
                     query_start_loc_cpu: torch.Tensor | None, snaps: RowSnapshots | None,
                     chunked_rows: ChunkedRows | None, dst: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of any length advancing their slots in place (prefill, chunks, decode off the fused path): the conv
        with q, k and v apart, each contiguous (as fla's chunked kernel reads them; on the chunked path q and k come
        l2-normed from the same launch), the gates, the delta rule (with the snapshots inside rows), the gated norm;
        out_proj's input (written into ``dst`` where given)."""
        assert self.conv_state is not None and self.ssm_state is not None
        n = mixed_in.shape[0]
        qk_normed = gdn_takes_chunked(mixed_in, max_query_len)
        # q and k in two contiguous parts: fla's chunked kernel copies a strided view (its input guard)
        qk, v = causal_conv1d_split(mixed_in, self.conv1d.weight.squeeze(1), self.conv_state, slots,
                                    query_start_loc, 2 * self.key_dim, max_query_len,
                                    norm_dim=self.head_k_dim if qk_normed else None, parts=2)
        q, k = qk[0], qk[1]
        g, beta = gdn_gating(a, b, self.A_log, self.dt_bias)
        out = gdn_forward(q.reshape(n, self.num_k_heads, self.head_k_dim),
                          k.reshape(n, self.num_k_heads, self.head_k_dim),
                          v.reshape(n, self.num_v_heads, self.head_v_dim), g, beta, self.ssm_state, slots,
                          query_start_loc, max_query_len, query_start_loc_cpu, snaps, chunked_rows, qk_normed)
        return self.gated_norm(out, z, dst)

    def verify_rows(self, mixed_in: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                    vm: VerifyMetadata, in_place: bool) -> torch.Tensor:
        """A step's verify rows on the unfused kernels (the CPU path): one-token rows (speculation length 0)
        advance their slots in place; rows of drafts write their candidate conv windows to the scratch and the
        delta rule's inputs to the stash, the live state only read. out_proj's input for them."""
        assert self.conv_state is not None and self.ssm_state is not None
        assert self.conv_scratch is not None and self.stash is not None, "verify scratch not bound"
        t = mixed_in.shape[0]
        weight = self.conv1d.weight.squeeze(1)
        if in_place:
            mixed = causal_conv1d_varlen(mixed_in, weight, self.conv_state, vm.state_slots, vm.query_start_loc, 1)
        else:
            mixed = causal_conv1d_verify(mixed_in, weight, self.conv_state, vm.state_slots, vm.query_start_loc,
                                         self.conv_scratch, vm.max_query_len)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(t, self.num_v_heads, self.head_v_dim)
        g, beta = gdn_gating(a, b, self.A_log, self.dt_bias)
        if in_place:
            out = gdn_forward(q, k, v, g, beta, self.ssm_state, vm.state_slots, vm.query_start_loc, 1)
        else:
            out = gdn_verify(q, k, v, g, beta, self.ssm_state, vm.state_slots, vm.query_start_loc, self.stash,
                             vm.max_query_len)
        return self.gated_norm(out, z)

    def gated_norm(self, out: torch.Tensor, z: torch.Tensor, dst: torch.Tensor | None = None) -> torch.Tensor:
        """The output norm of the delta rule's ``(T, Hv, Dv)`` output under z, as ``(T, Hv * Dv)`` (written into
        ``dst`` where given); z is read as ``(T, Hv, Dv)`` heads of its strided view, where in_proj wrote it (no
        copy)."""
        t = out.shape[0]
        normed = self.norm(out.reshape(t, self.num_v_heads, self.head_v_dim),
                           z.view(t, self.num_v_heads, self.head_v_dim), dst)
        return normed.reshape(t, self.value_dim)

    def fused_verify(self, mixed_in: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                     meta: StepMetadata) -> torch.Tensor | Fp8Activation:
        """A step with verify rows of drafts on CUDA: the verify rows in one launch (``gdn_verify_fused``: the
        candidate windows and the stash written, the live state only read), the rows after them (chunked prefill)
        as a step of their own; returns out_proj's input."""
        vm = meta.verify
        assert vm is not None and self.conv_state is not None and self.ssm_state is not None
        assert self.conv_scratch is not None and self.stash is not None, "verify scratch not bound"
        tv, t = vm.num_tokens, mixed_in.shape[0]
        # Verify rows alone: their output comes quantized for an FP8 out_proj (with prefill rows after them, plain,
        # and both parts written into one buffer: no copy to join them)
        quant = self.out_quant if tv == t else None
        buf = None if tv == t else torch.empty((t, self.value_dim), dtype=mixed_in.dtype, device=mixed_in.device)
        head = gdn_verify_fused(mixed_in[:tv], z[:tv], b[:tv], a[:tv], self.conv1d.weight.squeeze(1), self.A_log,
                                self.dt_bias, self.norm.weight, self.norm.eps, self.conv_state, self.ssm_state,
                                vm.state_slots, vm.query_start_loc, self.num_k_heads, self.conv_scratch, self.stash,
                                vm.max_query_len, quant=quant, row_counts=self.row_counts,
                                head_counts=self.head_counts, split=self.verify_split,
                                out=None if buf is None else buf[:tv])
        if buf is None:
            return head
        self.rest_rows(mixed_in, z, b, a, meta, buf[tv:])
        return buf

    def rest_rows(self, mixed_in: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                  meta: StepMetadata, dst: torch.Tensor | None = None) -> torch.Tensor:
        """The rows after a step's verify rows (prefill chunks) as a step of their own (``prefill_rows``);
        out_proj's input for them (written into ``dst`` where given)."""
        vm = meta.verify
        assert vm is not None
        rest = slice(vm.num_tokens, mixed_in.shape[0])
        return self.prefill_rows(mixed_in[rest], z[rest], b[rest], a[rest], vm.rest_state_slots,
                                 vm.rest_query_start_loc, vm.rest_max_query_len, vm.rest_query_start_loc_cpu,
                                 meta.row_snapshots, vm.rest_chunked_rows, dst)
