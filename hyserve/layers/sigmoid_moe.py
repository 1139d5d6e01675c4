"""Nemotron-H's mixture-of-experts block (the ``E`` blocks of Nemotron 3):

    s      = sigmoid(x W_router^T)                     float32
    choose = s + e_score_correction_bias               used to choose only
    groups = the topk_group groups (of n_group contiguous ones) with the largest sum of their top-2 ``choose``
    idx    = the top-k ``choose`` within those groups
    w      = s[idx] (/ their sum + 1e-20 when norm_topk_prob) * routed_scaling_factor
    y      = fc2_latent(sum_k w_k down_e(relu(up_e(fc1_latent(x)))^2)) + shared(x)

The experts are ungated (``up`` then ``down``, no gate projection) and stacked ``experts.up_proj`` [E, I, L],
``experts.down_proj`` [E, L, I] (transformers' in-memory layout; the checkpoints store one 2-D tensor per expert,
``experts.{e}.up_proj.weight``, loaded into views: ``checkpoint_parts``). ``L`` is ``moe_latent_size`` when the
config sets it (the latent projections ``fc1_latent_proj`` / ``fc2_latent_proj`` around the experts), else the
hidden size. docs/mamba2_facts.md §5.1 gives transformers' code this follows.

Tensor parallel: each rank holds every expert's share of its intermediate channels (``moe_intermediate_size``)
and its share of the shared expert's; the router and the latent projections are whole on every rank. The routed
sum (through ``fc2_latent_proj``, which is linear) and the shared expert's output are then partial sums, added and
summed over the group in one all-reduce. Expert parallel (``--enable-expert-parallel``, T > 1 ranks): rank r holds
experts [r E/T, (r+1) E/T) whole (``hyserve.layers.moe.expert_range``, the Qwen MoE blocks' placement), computes the
(token, choice) pairs routed to them (the routing, on every rank alike, gives global expert ids), and the same
all-reduce adds the ranks' sums; the shared expert stays sliced over the ranks, as in the Qwen MoE blocks.

The router's GEMM is torch's (float32); the choice (sigmoid, bias, groups, top-k, weights) one Triton launch on CUDA
and under the interpreter (:func:`hyserve.kernels.moe.route_sigmoid_experts`), its torch formulation
(:func:`hyserve.kernels.moe.route_sigmoid_ref`) on the CPU; no value goes to the host (a CUDA graph captures it).
A routing with fewer experts in its kept groups than ``num_experts_per_tok`` is refused. The experts' sum: on the
CPU a loop over the experts in transformers' order (each expert's terms accumulated in float32, in expert order); on
CUDA (and under the Triton interpreter: :func:`hyserve.kernels.moe.uses_triton`) the fused MoE kernels
(:func:`hyserve.kernels.moe.fused_experts` with ``activation="relu2"``: the stacked ``up_proj`` is the kernels'
``w13``), fed the router's float32 weights (routed scaling applied) and its expert ids; no host sync. Where the two
round differently (bf16 / fp16; in float32 only the order of the sums differs): the kernels square the float32
``x W_up^T`` before rounding it to ``x.dtype`` (the loop rounds the GEMM's output, then squares in ``x.dtype``),
and round each weighted term ``w * down(...)`` to ``x.dtype`` before the float32 sum over the token's k choices (the
loop rounds ``down(...)`` and multiplies by ``w`` in float32); that sum runs in choice order, not expert order.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn
from torch.nn import functional as F

from hyserve.distributed.parallel_state import all_reduce, expert_parallel, shard_range, tp_size
from hyserve.kernels.fp8 import FP8_DTYPE, fp8_block_linear, fp8_linear
from hyserve.kernels.moe import (
    ExpertScales,
    check_sigmoid_routing,
    fused_experts,
    route_sigmoid_experts,
    uses_triton,
)
from hyserve.layers.linear import Linear
from hyserve.layers.mlp import ReluSquaredMLP
from hyserve.layers.moe import expert_range
from hyserve.layers.quantization import QuantizationConfig
from hyserve.layers.quantization.experts import (
    UNQUANTIZED_EXPERTS,
    ExpertsMethod,
    Fp8ExpertsMethod,
    uniform_experts_method,
)
from hyserve.layers.quantization.fp8 import (
    SCALAR_SHAPES,
    SCALE_DTYPES,
    UNQUANTIZED_DTYPES,
    Fp8Scheme,
    fill_rows,
    quantize_rows_into,
)
from hyserve.layers.sharding import LoadSpec, Shard, set_load_spec, set_shard


class SigmoidMoEConfig(Protocol):
    hidden_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    quantization: QuantizationConfig | None


class UngatedExperts(nn.Module):
    """``E`` experts ``down(relu(up(x)) ** 2)``, stacked: this rank's rows of each ``up`` and columns of each
    ``down`` when tensor-parallel (its output is then a partial sum). Quantized (the config's method for the per-expert
    projections ``{prefix}.{e}.up_proj`` / ``down_proj``, alike for every expert, as the checkpoints name them): FP8
    ``up_proj`` / ``down_proj`` with float32 scales ``up_proj_scale`` [E, I] / ``down_proj_scale`` [E, L] (per
    channel; a per-tensor scale expanded to its rows) or block scales [E, ceil(I / bn), ceil(L / bk)] (named
    ``*_scale_inv`` for Qwen-style block FP8), each expert's input quantized per token (or per token and group)
    before ``up`` and its squared ReLU before ``down``, as the dense FP8 layers do.

    Static input scales (ModelOpt FP8, NVIDIA's Nemotron 3 FP8 releases): each expert's ``{e}.up_proj.input_scale``
    and ``{e}.down_proj.input_scale`` (one value each) load into ``up_proj_input_scale`` / ``down_proj_input_scale``
    [E], and the layer quantizes every token's input to ``up`` with the maximum over its experts of the first and
    every activation before ``down`` with that of the second (``*_input_scale_max``, taken once loaded), whichever
    expert it goes to, as vLLM's ModelOpt FP8 MoE does; each expert keeps its own weight scales. A checkpoint
    lacking some expert's input scale is refused by the loader, naming it.

    Tensor parallel with FP8: per-channel ``up`` scales shard with their rows; per-tensor weight scales (one per
    expert, expanded to its rows) and input scales are whole on every rank, so a static activation scale is the
    same on all ranks; block scales are refused (serve them with tensor_parallel_size 1). Expert parallel: this
    rank's experts whole (``e_range``), their scales with them; the other ranks' per-expert tensors are skipped at
    load (``foreign_parts``), except the input scales: every expert's on every rank, so that the maxima are the
    layer's whatever the placement."""

    def __init__(self, num_experts: int, width: int, intermediate: int, quant: QuantizationConfig | None = None,
                 prefix: str = "experts") -> None:
        super().__init__()
        self.method = _experts_method(quant, prefix, num_experts)
        self.num_experts = num_experts
        self.ep = expert_parallel()
        e0, e1 = self.e_range = expert_range(num_experts)
        self.i_range = i0, i1 = (0, intermediate) if self.ep else shard_range(intermediate)
        self.intermediate_full = intermediate
        self.sharded = tp_size() > 1 and not self.ep  # each expert's channels split over the ranks
        self.scheme: Fp8Scheme | None = self.method.scheme if isinstance(self.method, Fp8ExpertsMethod) else None
        s = self.scheme
        if self.sharded and s is not None and s.block is not None:
            raise ValueError(f"{prefix}: block FP8 experts of Nemotron 3's MoE with tensor_parallel_size > 1 are not "
                             "supported yet (their block scales are not sharded); serve with tensor_parallel_size 1")
        mine, local = i1 - i0, e1 - e0
        dtype = FP8_DTYPE if s is not None else None
        self.up_proj = nn.Parameter(torch.empty(local, mine, width, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(local, width, mine, dtype=dtype), requires_grad=False)
        if self.ep:
            set_shard(self.up_proj, Shard((num_experts, intermediate, width), 0, (self.e_range,)))
            set_shard(self.down_proj, Shard((num_experts, width, intermediate), 0, (self.e_range,)))
        elif self.sharded:
            set_shard(self.up_proj, Shard((num_experts, intermediate, width), 1, (self.i_range,)))
            set_shard(self.down_proj, Shard((num_experts, width, intermediate), 2, (self.i_range,)))
        self.input_scale_names: tuple[str, str] | None = None
        if s is None:
            return
        suffix = "scale_inv" if s.scale_name == "weight_scale_inv" else "scale"
        self.scale_names = (f"up_proj_{suffix}", f"down_proj_{suffix}")
        for name, (n, k) in zip(self.scale_names, ((mine, width), (width, mine)), strict=True):
            shape = (local, n) if s.block is None else (local, _cdiv(n, s.block[0]), _cdiv(k, s.block[1]))
            scale = torch.empty(shape, dtype=torch.float32)
            if s.online:  # computed at load, not a checkpoint tensor
                self.register_buffer(name, scale, persistent=False)
                continue
            param = nn.Parameter(scale, requires_grad=False)
            self.register_parameter(name, param)
            if self.ep:
                set_shard(param, Shard((num_experts, *shape[1:]), 0, (self.e_range,)))
            elif self.sharded and name == self.scale_names[0] and s.weight == "channel":
                set_shard(param, Shard((num_experts, intermediate), 1, (self.i_range,)))
        if s.activation == "tensor":  # every expert's input scale, on every rank; their maximum once loaded
            self.input_scale_names = ("up_proj_input_scale", "down_proj_input_scale")
            for name in self.input_scale_names:
                self.register_parameter(name, nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                           requires_grad=False))
                self.register_buffer(f"{name}_max", torch.empty(1, dtype=torch.float32), persistent=False)

    def checkpoint_parts(self) -> dict[str, tuple[str, torch.Tensor]]:
        """The checkpoints' per-expert tensors (and their scales when quantized), as views of the stacked ones (with
        this rank's shard of each)."""
        out: dict[str, tuple[str, torch.Tensor]] = {}
        s = self.scheme
        full, width = self.intermediate_full, self.up_proj.shape[2]
        e0, e1 = self.e_range
        for e in range(self.num_experts):
            for i, proj in enumerate(("up_proj", "down_proj")):
                if self.input_scale_names is not None:  # every expert's, on every rank
                    name = self.input_scale_names[i]
                    view = cast(torch.Tensor, getattr(self, name)).data[e : e + 1]
                    set_load_spec(view, LoadSpec(SCALE_DTYPES, SCALAR_SHAPES))
                    out[f"{e}.{proj}.input_scale"] = (name, view)
                if not e0 <= e < e1:
                    continue
                weight = cast(torch.Tensor, getattr(self, proj)).data[e - e0]
                shard = (Shard((full, width), 0, (self.i_range,)) if proj == "up_proj"
                         else Shard((width, full), 1, (self.i_range,))) if self.sharded else None
                if shard is not None:
                    set_shard(weight, shard)
                out[f"{e}.{proj}.weight"] = (proj, weight)
                if s is None:
                    continue
                name = self.scale_names[i]
                scale = cast(torch.Tensor, getattr(self, name)).data[e - e0]
                if s.online:
                    set_load_spec(weight, LoadSpec(UNQUANTIZED_DTYPES, load=quantize_rows_into(scale, shard)))
                    continue
                if s.block is None:
                    scale = scale.unsqueeze(-1)
                    if s.weight == "tensor":
                        set_load_spec(scale, LoadSpec(SCALE_DTYPES, SCALAR_SHAPES, load=fill_rows))
                    else:
                        if shard is not None and proj == "up_proj":
                            set_shard(scale, Shard((full, 1), 0, (self.i_range,)))
                        set_load_spec(scale, LoadSpec(SCALE_DTYPES))
                else:
                    set_load_spec(scale, LoadSpec(SCALE_DTYPES))
                out[f"{e}.{proj}.{s.scale_name}"] = (name, scale)
        return out

    def foreign_parts(self) -> set[str]:
        """The per-expert weights and weight scales of the experts other ranks hold (expert parallel): the loader
        skips them (the input scales are every rank's)."""
        e0, e1 = self.e_range
        suffixes = ["weight"]
        if self.scheme is not None and not self.scheme.online:
            suffixes.append(self.scheme.scale_name)
        return {f"{e}.{proj}.{suffix}" for e in range(self.num_experts) if not e0 <= e < e1
                for proj in ("up_proj", "down_proj") for suffix in suffixes}

    def process_weights_after_loading(self) -> None:
        """The static activation scales: the maximum over the experts of each projection's input scales."""
        for name in self.input_scale_names or ():
            cast(torch.Tensor, getattr(self, f"{name}_max")).copy_(cast(torch.Tensor, getattr(self, name)).max())

    def _input_scale(self, i: int) -> torch.Tensor | None:
        """The static activation scale of ``up`` (0) or ``down`` (1); None: dynamic."""
        if self.input_scale_names is None:
            return None
        return cast(torch.Tensor, getattr(self, f"{self.input_scale_names[i]}_max"))

    def _linear(self, x: torch.Tensor, proj: str, e: int) -> torch.Tensor:
        weight = cast(torch.Tensor, getattr(self, proj))[e]
        s = self.scheme
        if s is None:
            return F.linear(x, weight)
        i = int(proj == "down_proj")
        scale = cast(torch.Tensor, getattr(self, self.scale_names[i]))[e]
        if s.block is not None:
            return fp8_block_linear(x, weight, scale, s.block, s.block[1] if s.activation == "group" else None)
        return fp8_linear(x, weight, scale.unsqueeze(-1), self._input_scale(i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``x`` [T, L]; ``weights`` (float32) and ``experts`` [T, k] (global ids): the weighted sum over each
        token's k experts (this rank's alone under expert parallelism), accumulated in float32, in ``x.dtype``: on
        CUDA the fused kernels (no host sync; the module docstring says where they round differently), else
        transformers' order (expert by expert)."""
        if uses_triton(x):
            scales = None
            if self.scheme is not None:
                s13, s2 = (cast(torch.Tensor, getattr(self, n)) for n in self.scale_names)
                scales = ExpertScales(s13, s2, self.scheme.block, self._input_scale(0), self._input_scale(1))
            return fused_experts(x, self.up_proj, self.down_proj, weights, experts, self.e_range[0], scales=scales,
                                 num_experts=self.num_experts, activation="relu2")
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        e0, e1 = self.e_range
        for e in range(e0, e1):  # this rank's experts (global ids), held at e - e0
            tok, slot = torch.where(experts == e)
            if tok.numel() == 0:
                continue
            h = torch.square(F.relu(self._linear(x[tok], "up_proj", e - e0)))
            y = self._linear(h, "down_proj", e - e0) * weights[tok, slot, None]
            out.index_add_(0, tok, y.float())
        return out.to(x.dtype)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _experts_method(quant: QuantizationConfig | None, prefix: str, num_experts: int) -> ExpertsMethod:
    """The method of the per-expert projections ``{prefix}.{e}.up_proj`` / ``down_proj``: the same for all."""
    if quant is None:
        return UNQUANTIZED_EXPERTS
    names = [f"{prefix}.{e}.{p}" for e in range(num_experts) for p in ("up_proj", "down_proj")]
    return uniform_experts_method({n: quant.linear_method(n) for n in names}, prefix, static_inputs=True)


class Router(nn.Module):
    """The router's weight [E, H] and its float32 choice bias ``e_score_correction_bias`` [E] (a checkpoint buffer)."""

    e_score_correction_bias: torch.Tensor

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))


class SigmoidMoE(nn.Module):
    """``prefix``: the block's mixer name (``backbone.layers.3.mixer``)."""

    def __init__(self, cfg: SigmoidMoEConfig, prefix: str) -> None:
        super().__init__()
        e, h = cfg.n_routed_experts, cfg.hidden_size
        check_sigmoid_routing(e, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group)
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, float(cfg.routed_scaling_factor)
        self.gate = Router(e, h)
        latent = cfg.moe_latent_size
        width = latent if latent is not None else h
        self.experts = UngatedExperts(e, width, cfg.moe_intermediate_size, cfg.quantization, f"{prefix}.experts")
        self.shared_experts = ReluSquaredMLP(h, cfg.moe_shared_expert_intermediate_size, cfg.quantization,
                                             f"{prefix}.shared_experts")
        self.shared_experts.down_proj.reduce_results = False  # summed with the routed experts' partial sum
        self.fc1_latent_proj: Linear | None = None
        self.fc2_latent_proj: Linear | None = None
        if latent is not None:
            self.fc1_latent_proj = Linear(h, latent, quant=cfg.quantization, prefix=f"{prefix}.fc1_latent_proj")
            self.fc2_latent_proj = Linear(latent, h, quant=cfg.quantization, prefix=f"{prefix}.fc2_latent_proj")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, k], global expert ids [T, k]) of each token: the router GEMM in float32, then
        :func:`hyserve.kernels.moe.route_sigmoid_experts` (one Triton launch where :func:`uses_triton`, int32 ids;
        its torch formulation on the CPU, int64 ids)."""
        logits = F.linear(x.float(), self.gate.weight.float())
        return route_sigmoid_experts(logits, self.gate.e_score_correction_bias, self.top_k, self.n_group,
                                     self.topk_group, self.norm_topk_prob, self.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.route(x)
        inner = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        routed = self.experts(inner, weights, idx)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return all_reduce(routed + self.shared_experts(x))
