"""The Mamba2 mixer (NemotronH, Granite-4.0-H, Falcon-H1): an input projection to [z | x B C | dt], a causal
depthwise conv with bias and SiLU over [x | B | C], the selective state space scan over each request's SSM state
(``hyserve.kernels.mamba2``), a gated RMSNorm per group (``x * silu(z)`` first, then the norm), the output
projection. Falcon-H1's options (constructor arguments; the defaults are Nemotron-H's): its muP multipliers, one on
the input and one per segment [z | x | B | C | dt] of the input projection's output (before the conv, so the conv
window holds multiplied values), the gated norm absent (``y * silu(z)``) or normalising before the gate, and a bias
on the output projection of its own (``projectors_bias``).

Per request it keeps, in the slot the runner binds (``bind_state``), the conv window (the last K - 1 inputs of
[x | B | C], model dtype) and the SSM state (heads x head_dim x state size, float32 unless
``--mamba-ssm-cache-dtype``). docs/mamba2_facts.md gives transformers' formulas this follows.

A verify step (speculative decoding) reads the live states; it keeps the candidate conv window after every position
and, in place of the candidate SSM state, each position's inputs to the update (``hyserve.kernels.mamba2.verify``:
the stash, 37 KB a position on the 8B shape against a 4.2 MB state). The commit copies the accepted window and
advances the SSM state in its slot over the accepted positions (``mamba2_replay``); a candidate snapshot advances the
slot's state into its entry, before the commit. A rejected draft never reaches the live state or a snapshot. Verify
rows of one token each (a step at speculation length 0) have no draft: they advance their slots in place, as decode
rows do (``verifies_one_token_rows_in_place``).

Tensor parallel (``mamba2_group_range``): each rank holds ``mamba_num_heads / tp`` heads, with their rows of z, x
and dt, their ``dt_bias`` / ``A_log`` / ``D``, their channels of the conv and of the gated norm, and their input
columns of ``out_proj`` (row-parallel, summed over the group). B and C are sharded by group when
``tp`` divides ``n_groups`` (the rank's heads read exactly its groups), and otherwise, when ``n_groups`` divides
``tp``, every rank keeps the one group its heads read (a group shared by ``tp / n_groups`` ranks, as attention's
KV heads); other pairs are refused (``check_mamba2_tensor_parallel``). A gated-norm group that spans ranks (one
group over the whole width: Granite-4.0-H, or ``n_groups`` = 1) sums its squares over the group with one
all-reduce; a group that spans some ranks but not all is refused.

The conv and the scan dispatch on the device (``hyserve.kernels.conv``, ``hyserve.kernels.mamba2``): the plain-torch
references on the CPU, Triton kernels (and fla-core's chunked scan for bf16 / fp16 prefill) on CUDA, where a decode
or verify step makes no host sync and can be captured in a CUDA graph. The scan reads the ``A_log`` weight itself
(``A = -exp(A_log)`` costs no launch of its own). The gated norm (or the gate alone) is one
Triton launch where ``hyserve.kernels.moe.uses_triton`` (``hyserve.kernels.norm.grouped_gated_rms_norm``: float32
inside, written in the output projection's input dtype; a group spanning ranks takes a sum-of-squares launch, the
all-reduce and the norm's launch), the plain-torch reference elsewhere.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from hyserve.cache.specs import RecurrentStateSpec, StateTensorSpec
from hyserve.distributed.parallel_state import all_reduce, shard_range, tp_rank, tp_size
from hyserve.kernels.conv import causal_conv1d_varlen, causal_conv1d_verify, snapshot_conv_windows
from hyserve.kernels.mamba2 import MAMBA2_STASH_NAMES, mamba2_replay, mamba2_scan, mamba2_stash_shapes
from hyserve.kernels.norm import gated_sum_squares, grouped_gated_rms_norm, silu_gate
from hyserve.kernels.varlen import ChunkedRows
from hyserve.layers.linear import Linear, RowParallelLinear
from hyserve.layers.quantization import QuantizationConfig
from hyserve.layers.replayed_state import ReplayedStateLayer
from hyserve.layers.sharding import Shard, set_shard
from hyserve.model.metadata import StepMetadata


class Mamba2Config(Protocol):
    """What the layer reads of a family's config (transformers' ``NemotronHConfig`` names)."""

    hidden_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    n_groups: int
    ssm_state_size: int
    conv_kernel: int
    use_conv_bias: bool
    use_bias: bool
    layer_norm_epsilon: float
    time_step_limit: tuple[float, float]
    quantization: QuantizationConfig | None
    ssm_state_dtype: str


def check_mamba2_tensor_parallel(num_heads: int, head_dim: int, n_groups: int, tp: int,
                                 norm_group_size: int | None) -> None:
    """Refuse, naming the fields, a tensor-parallel size that does not split the Mamba2 heads, whose groups are
    neither split nor shared whole (``tp`` must divide ``n_groups`` or ``n_groups`` divide ``tp``), or whose gated
    norm has a group spanning some ranks but not all (``norm_group_size``: its width in channels; ``None``: no
    gated norm)."""
    if tp == 1:
        return
    if num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the Mamba2 heads (mamba_num_heads={num_heads}) "
                         "of this checkpoint; use a --tensor-parallel-size that divides it")
    if n_groups % tp and tp % n_groups:
        raise ValueError(f"tensor_parallel_size={tp} and the Mamba2 groups (n_groups={n_groups}): one must divide "
                         "the other (groups sharded, or each group's heads on ranks of their own); use a "
                         "--tensor-parallel-size that does")
    width, local, group = num_heads * head_dim, num_heads * head_dim // tp, norm_group_size
    if group is not None and local % group and group != width:
        raise ValueError(f"tensor_parallel_size={tp}: the Mamba2 gated norm's groups of {group} channels would span "
                         f"some of the ranks' {local} channels but not all (mamba_num_heads={num_heads}, "
                         f"mamba_head_dim={head_dim}, n_groups={n_groups})")


def mamba2_group_range(num_heads: int, n_groups: int, rank: int | None = None,
                       size: int | None = None) -> tuple[int, int]:
    """[start, end) of the B/C groups rank's heads read: its share of the groups when ``size`` divides
    ``n_groups``, else (``n_groups`` divides ``size``) the one group holding all of its heads."""
    rank = tp_rank() if rank is None else rank
    size = tp_size() if size is None else size
    if n_groups % size == 0:
        return shard_range(n_groups, rank, size)
    if size % n_groups:
        raise ValueError(f"n_groups={n_groups} and tensor_parallel_size={size}: one must divide the other")
    h0, _ = shard_range(num_heads, rank, size)
    g = h0 // (num_heads // n_groups)
    return g, g + 1


class GroupedGatedRMSNorm(nn.Module):
    """``w * rmsnorm_per_group(x * silu(z))`` over groups of ``group_size`` channels, in float32, the result cast to
    the input's dtype before the weight multiplies it (transformers' ``Zamba2RMSNormGated``, gate before norm). With
    ``norm_before_gate`` (Falcon-H1's default): ``(w * rmsnorm_per_group(x)) * silu(z)``. The mixer hands it the
    scan's float32 output, so the weight multiplies in float32 either way, as both of transformers' norms do then.

    ``width`` is this rank's channels; ``spans_ranks``: one group over the whole width of every rank (tensor
    parallel), whose mean square sums the ranks' squares with an all-reduce (``group_size`` the full width).
    ``hyserve.kernels.norm.grouped_gated_rms_norm`` computes it (one launch where ``uses_triton``) and writes it in
    ``out_dtype`` (default ``x``'s), as the output projection reads it."""

    def __init__(self, width: int, group_size: int, eps: float, norm_before_gate: bool = False,
                 spans_ranks: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.group_size = group_size
        self.eps = eps
        self.norm_before_gate = norm_before_gate
        self.spans_ranks = spans_ranks

    def forward(self, x: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        sum_squares = all_reduce(gated_sum_squares(x, z, self.norm_before_gate)) if self.spans_ranks else None
        return grouped_gated_rms_norm(x, z, self.weight, self.group_size, self.eps, self.norm_before_gate,
                                      x.dtype if out_dtype is None else out_dtype, sum_squares)


class Mamba2Mixer(ReplayedStateLayer):
    """``prefix``: the module's name (``backbone.layers.0.mixer``), naming its projections for quantization.

    Falcon-H1's options: ``in_multiplier`` scales the input; ``segment_multipliers`` (five: z, x, B, C, dt) scale
    the input projection's output segments; ``gated_norm=False`` gates without a norm (no ``norm`` weight);
    ``norm_before_gate`` orders the gated norm; ``out_proj_bias`` (default: ``cfg.use_bias``) the output bias.
    ``norm_group_size``: the gated norm's group width, by default one group per B/C group (Nemotron-H's
    ``inner / n_groups``; Granite-4.0-H normalises the whole width at once). Takes prefix-cache snapshots inside
    prefill rows (``StepMetadata.row_snapshots``): the conv window from the step's pre-conv inputs, the SSM state
    from the scan's own pass (``hyserve.kernels.mamba2``)."""

    supports_row_snapshots = True
    verifies_one_token_rows_in_place = True  # (RecurrentLayer): a step at speculation length 0 is a decode step here

    def __init__(self, cfg: Mamba2Config, prefix: str, *, in_multiplier: float = 1.0,
                 segment_multipliers: tuple[float, ...] | None = None, gated_norm: bool = True,
                 norm_before_gate: bool = False, out_proj_bias: bool | None = None,
                 norm_group_size: int | None = None) -> None:
        super().__init__()
        full_h, p, full_g = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups
        self.state_size = n = cfg.ssm_state_size
        if full_h % full_g:
            raise ValueError(f"mamba_num_heads={full_h} is not a multiple of n_groups={full_g}")
        full_i = full_h * p
        full_group = full_i // full_g if norm_group_size is None else norm_group_size
        if full_i % full_group:
            raise ValueError(f"the gated norm's group width {full_group} does not divide the Mamba2 width {full_i}")
        tp = tp_size()
        check_mamba2_tensor_parallel(full_h, p, full_g, tp, full_group if gated_norm else None)
        # This rank's heads and the B/C groups they read (all of them with one rank).
        (h0, h1), (g0, g1) = shard_range(full_h), mamba2_group_range(full_h, full_g)
        self.num_heads = h = h1 - h0
        self.head_dim = p
        self.n_groups = g = g1 - g0
        self.intermediate = i = h * p
        self.conv_dim = i + 2 * g * n
        k = cfg.conv_kernel
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, k, bias=cfg.use_conv_bias, groups=self.conv_dim,
                                padding=k - 1)
        # Rows of the checkpoint's [x | B | C] (the conv's channels) and [z | x | B | C | dt] (in_proj's output).
        gn = full_g * n
        xbc = ((h0 * p, h1 * p), (full_i + g0 * n, full_i + g1 * n), (full_i + gn + g0 * n, full_i + gn + g1 * n))
        self.conv_rows = xbc
        self.in_proj_rows = ((h0 * p, h1 * p), *((full_i + a, full_i + b) for a, b in xbc),
                             (2 * full_i + 2 * gn + h0, 2 * full_i + 2 * gn + h1))
        sharded = tp > 1
        full_conv, full_proj = full_i + 2 * gn, 2 * full_i + 2 * gn + full_h
        in_shard = Shard((full_proj, cfg.hidden_size), 0, self.in_proj_rows) if sharded else None
        self.in_proj = Linear(cfg.hidden_size, i + self.conv_dim + h, bias=cfg.use_bias, quant=cfg.quantization,
                              prefix=f"{prefix}.in_proj", shard=in_shard)
        self.dt_bias = nn.Parameter(torch.ones(h))
        self.A_log = nn.Parameter(torch.zeros(h))
        self.D = nn.Parameter(torch.ones(h))
        # A norm group spanning ranks is the whole width (check_mamba2_tensor_parallel refuses the rest).
        spans = sharded and full_group > i
        self.norm = GroupedGatedRMSNorm(i, full_group, cfg.layer_norm_epsilon, norm_before_gate, spans) \
            if gated_norm else None
        self.out_proj = RowParallelLinear(full_i, cfg.hidden_size, (h0 * p, h1 * p),
                                          bias=cfg.use_bias if out_proj_bias is None else out_proj_bias,
                                          sharded=sharded, quant=cfg.quantization, prefix=f"{prefix}.out_proj")
        if sharded:
            set_shard(self.conv1d.weight, Shard((full_conv, 1, k), 0, xbc))
            if self.conv1d.bias is not None:
                set_shard(self.conv1d.bias, Shard((full_conv,), 0, xbc))
            for param in (self.dt_bias, self.A_log, self.D):
                set_shard(param, Shard((full_h,), 0, ((h0, h1),)))
            if self.norm is not None:
                set_shard(self.norm.weight, Shard((full_i,), 0, ((h0 * p, h1 * p),)))
        self.in_multiplier = float(in_multiplier)
        if segment_multipliers is not None and len(segment_multipliers) != 5:
            raise ValueError(f"segment_multipliers needs 5 values (z, x, B, C, dt), got {len(segment_multipliers)}")
        self.segment_multipliers = None if segment_multipliers is None else tuple(map(float, segment_multipliers))
        # The per-channel vector of segment_multipliers, made on first use: a plain attribute, not a buffer (no
        # checkpoint holds it, and a model built on the meta device must not keep a meta copy).
        self._segment_scale: torch.Tensor | None = None
        self.dt_limit = (float(cfg.time_step_limit[0]), float(cfg.time_step_limit[1]))
        self.ssm_dtype: torch.dtype = getattr(torch, cfg.ssm_state_dtype)
        # Speculative decoding: the update's inputs per verify row and position (MAMBA2_STASH_NAMES, float32).
        self.stash: dict[str, torch.Tensor] | None = None

    def cache_spec(self, dtype: torch.dtype) -> RecurrentStateSpec:
        k = self.conv1d.kernel_size[0]
        return RecurrentStateSpec((
            StateTensorSpec("conv_state", (self.conv_dim, k - 1), dtype),
            StateTensorSpec("ssm_state", (self.num_heads, self.head_dim, self.state_size), self.ssm_dtype),
        ))

    def verify_scratch_spec(self, dtype: torch.dtype) -> RecurrentStateSpec:
        """Per verify position: the candidate conv window (small), and the update's inputs in place of the candidate
        SSM state (``hyserve.kernels.mamba2.verify``)."""
        k = self.conv1d.kernel_size[0]
        shapes = mamba2_stash_shapes(self.num_heads, self.head_dim, self.n_groups, self.state_size)
        return RecurrentStateSpec((StateTensorSpec("conv_state", (self.conv_dim, k - 1), dtype),
                                   *(StateTensorSpec(n, shapes[n], torch.float32) for n in MAMBA2_STASH_NAMES)))

    def bind_verify_scratch(self, tensors: dict[str, torch.Tensor]) -> None:
        super().bind_verify_scratch(tensors)
        self.stash = {n: tensors[n] for n in MAMBA2_STASH_NAMES}

    def replay_state(self, rows: torch.Tensor | None, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                     counts: torch.Tensor) -> None:
        """(ReplayedStateLayer) The candidate window's copy and ``mamba2_replay`` over the stash of the update's
        inputs, one launch on CUDA."""
        assert self.stash is not None and self.verify_scratch is not None, "verify scratch not bound"
        mamba2_replay(self.state["ssm_state"], self.A_log, self.stash, rows, src_slots, dst_slots, counts,
                      conv=(self.state["conv_state"], self.verify_scratch["conv_state"]))

    def segment_scale(self, like: torch.Tensor) -> torch.Tensor:
        """``segment_multipliers`` per channel of the input projection's output [z | x | B | C | dt], computed in
        float32 and kept in ``like``'s dtype (transformers' ``mup_vector`` follows the model's dtype)."""
        assert self.segment_multipliers is not None
        held = self._segment_scale
        if held is None or held.device != like.device or held.dtype != like.dtype:
            gn = self.n_groups * self.state_size
            widths = (self.intermediate, self.intermediate, gn, gn, self.num_heads)
            held = torch.cat([torch.full((w,), m, dtype=torch.float32, device=like.device)
                              for w, m in zip(widths, self.segment_multipliers, strict=True)]).to(like.dtype)
            self._segment_scale = held
        return held

    def project_in(self, x: torch.Tensor) -> torch.Tensor:
        """The input projection's output [z | x B C | dt], with Falcon-H1's multipliers where it has them."""
        if self.in_multiplier != 1.0:
            x = x * self.in_multiplier
        zxbcdt = self.in_proj(x)
        return zxbcdt if self.segment_multipliers is None else zxbcdt * self.segment_scale(zxbcdt)

    def gate(self, y: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The scan's float32 output gated by ``z`` (float32 inside, as transformers' scan output reaches its norm),
        returned in ``out_dtype``: the gated norm, or ``y * silu(z)`` without one."""
        return self.norm(y, z, out_dtype) if self.norm is not None else silu_gate(y, z, out_dtype)

    def forward(self, x: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        conv_state, ssm_state = self.state["conv_state"], self.state["ssm_state"]
        t = x.shape[0]
        z, xbc, dt = self.project_in(x).split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        weight = self.conv1d.weight.squeeze(1)
        bias = self.conv1d.bias
        vm = meta.verify
        # (token range, rows' slots, offsets, longest row, verify?, the host's offsets or None, the rows as the
        # chunked path takes them or None) of the step's parts: a verify step's verify rows, then its other rows.
        parts: list[tuple[int, int, torch.Tensor, torch.Tensor, int, bool, torch.Tensor | None,
                          ChunkedRows | None]] = []
        if vm is None:
            assert meta.max_query_len is not None
            parts.append((0, t, meta.state_slots, meta.query_start_loc, meta.max_query_len, False,
                          meta.query_start_loc_cpu, meta.chunked_rows))
        else:
            # Verify rows of one token each (no drafts) advance their slots in place (verifies_one_token_rows_in_place).
            in_place = vm.max_query_len == 1
            parts.append((0, vm.num_tokens, vm.state_slots, vm.query_start_loc, vm.max_query_len, not in_place, None,
                          None))
            if vm.num_tokens < t:
                parts.append((vm.num_tokens, t, vm.rest_state_slots, vm.rest_query_start_loc,
                              vm.rest_max_query_len, False, vm.rest_query_start_loc_cpu, vm.rest_chunked_rows))
        # A step of two parts has them write one output (no concatenation after).
        y = None if len(parts) == 1 else torch.empty((t, self.num_heads, self.head_dim), dtype=torch.float32,
                                                      device=x.device)
        for lo, hi, slots, qsl, longest, verify, qsl_cpu, rows in parts:
            snaps = meta.row_snapshots if vm is None or lo > 0 else None  # (the prefill rows' part)
            if verify:
                assert self.verify_scratch is not None, "verify scratch not bound"
                mixed = causal_conv1d_verify(xbc[lo:hi], weight, conv_state, slots, qsl,
                                             self.verify_scratch["conv_state"], longest, bias)
            else:
                if snaps is not None:  # windows inside prefill rows, before the conv rolls the slots' windows
                    snapshot_conv_windows(xbc[lo:hi], conv_state, snaps)
                mixed = causal_conv1d_varlen(xbc[lo:hi], weight, conv_state, slots, qsl, longest, bias)
            m = hi - lo
            xs, bs, cs = mixed.split([self.intermediate, self.n_groups * self.state_size,
                                      self.n_groups * self.state_size], dim=-1)
            part = mamba2_scan(xs.reshape(m, self.num_heads, self.head_dim), dt[lo:hi], self.A_log,
                               bs.reshape(m, self.n_groups, self.state_size),
                               cs.reshape(m, self.n_groups, self.state_size), self.D, self.dt_bias, self.dt_limit,
                               ssm_state, slots, qsl, longest,
                               self.stash if verify else None,
                               query_start_loc_cpu=qsl_cpu, out=None if y is None else y[lo:hi], snapshots=snaps,
                               rows=rows)
            y = part if y is None else y
        assert y is not None
        return self.out_proj(self.gate(y.reshape(t, self.intermediate), z, x.dtype))
