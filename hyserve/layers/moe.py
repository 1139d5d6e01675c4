"""The sparse mixture-of-experts block (Qwen3.5-MoE's feed-forward block), in plain torch: the CPU path, and the
yardstick of fused kernels.

    probs   = softmax(x @ router^T)                    float32, over all experts
    w, idx  = top_k(probs)                             w / sum(w) when norm_topk_prob
    y       = sum_j w_j * expert_{idx_j}(x)            expert(x) = down(silu(gate(x)) * up(x))
            + sigmoid(x @ shared_expert_gate^T) * shared_expert(x)

The experts' weights are stacked: ``experts.gate_up_proj`` [E, 2I, H] (gate rows then up rows) and
``experts.down_proj`` [E, H, I], the layout of the fused checkpoints. A checkpoint that stores each expert apart
(``experts.{e}.gate_proj.weight`` [I, H], ``up_proj``, ``down_proj`` [H, I]) loads into views of the same tensors
(``Experts.checkpoint_parts``, read by ``hyserve.model.loader``). Tensor parallel: each rank holds its slice of
every expert's intermediate dimension; the partial outputs are summed over the group. Expert parallel
(``--enable-expert-parallel``, tensor-parallel size T > 1): rank r holds experts [r E/T, (r+1) E/T) whole
(``expert_range``), computes the (token, choice) pairs routed to them and the same sum over the group adds the
ranks' outputs; the router is replicated and the shared expert stays sliced over the ranks, as in the dense MLP.

The routed computation is :func:`hyserve.kernels.moe.fused_experts`: on CUDA two Triton GEMMs over the (token,
choice) pairs sorted by expert (no host sync, so CUDA graphs capture it); elsewhere its reference, batched by expert.
FP8 experts (block or per-channel scales, ``hyserve.layers.quantization.experts``) pass their scales to it. Where
the shared expert can be stacked after the experts (``Experts.can_stack``), decode-sized steps run it in the same
kernels as one more choice of every token (``Experts.attach_shared``, docs/moe.md).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from hyserve.distributed.parallel_state import all_reduce, expert_parallel, shard_range, tp_size
from hyserve.kernels.moe import ExpertScales, fused_experts, route_experts, route_ref, uses_triton
from hyserve.layers.linear import Linear
from hyserve.layers.mlp import MLP
from hyserve.layers.quantization import QuantizationConfig
from hyserve.layers.quantization.base import UNQUANTIZED
from hyserve.layers.quantization.experts import (
    PROJECTIONS,
    UNQUANTIZED_EXPERTS,
    ExpertsMethod,
    Fp8ExpertsMethod,
    experts_method_for,
)
from hyserve.layers.quantization.fp8 import Fp8LinearMethod

# Up to this many tokens a stacked shared expert runs in the experts' kernels (decode: its own four launches cost
# more than its weights); above, its dense GEMMs (a prefill's [T, H] x [H, 2I] is cuBLAS's ground, where the experts'
# tiles are tuned for a few rows per expert). Its parameters are views of the stacked slot, so both paths read the
# same weights.
STACKED_MAX_TOKENS = 64


class MoEConfig(Protocol):
    hidden_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    quantization: QuantizationConfig | None


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, experts)``, each [tokens, top_k]: softmax over the experts in float32, the top k, divided by
    their sum when ``renormalize`` (:func:`hyserve.kernels.moe.route_ref`; the CPU path's routing)."""
    return route_ref(router_logits, top_k, renormalize)


def expert_range(num_experts: int) -> tuple[int, int]:
    """[start, end) of the experts this rank holds: all of them, or under expert parallelism its contiguous share
    (``num_experts`` / T each, in rank order), which must be whole."""
    if not expert_parallel():
        return 0, num_experts
    t = tp_size()
    if num_experts % t:
        raise ValueError(f"expert parallel places whole experts on ranks: num_experts={num_experts} does not split "
                         f"over tensor_parallel_size={t}")
    return shard_range(num_experts)


class Experts(nn.Module):
    """The routed experts' stacked weights (this rank's experts, whole under expert parallelism, else each one's
    slice of the intermediate dimension) and their batched computation. How the weights are kept (model dtype or
    FP8 with scales) is the quantization config's (``hyserve.layers.quantization.experts.experts_method_for``)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, quant: QuantizationConfig | None = None,
                 prefix: str = "experts", method: ExpertsMethod | None = None) -> None:
        super().__init__()
        self.prefix = prefix
        self.num_experts, self.hidden = num_experts, hidden
        self.intermediate_full = intermediate
        self.ep = expert_parallel()
        self.tp_sharded = tp_size() > 1 and not self.ep
        e0, e1 = self.e_range = expert_range(num_experts)
        self.num_local = e1 - e0
        self.i_range = (0, intermediate) if self.ep else shard_range(intermediate)
        self.intermediate = self.i_range[1] - self.i_range[0]
        # ``method``: given by a family whose checkpoints name the experts' projections otherwise
        self.method = experts_method_for(quant, prefix, num_experts) if method is None else method
        self.gate_up_proj: torch.Tensor
        self.down_proj: torch.Tensor
        self.method.create_weights(self)
        # With a shared expert stacked after them (``attach_shared``): [L + 1, 2n, H] and [L + 1, H, n], whose
        # first L are ``gate_up_proj`` / ``down_proj`` and last the shared expert's weights (plain attributes: the
        # parameters are views of them, so nothing counts them twice).
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None
        self.stacked_scales: ExpertScales | None = None

    def can_stack(self, mlp: MLP) -> bool:
        """Whether ``mlp`` (a shared expert) can be stacked after these experts: whole experts of the same widths
        on this rank (not expert parallel: there each rank holds other experts but the shared expert's slice), gate
        and up in one GEMM, no bias, and the same numbers on both paths: the weights in the model dtype on both
        sides, or FP8 of one checkpoint scheme whose activations the experts' kernels quantize as the dense layers
        do (per token with channel or tensor scales, per token and group with block scales; not online FP8)."""
        gemms = mlp.gate_up_proj.gemms
        g, d = gemms[0], mlp.down_proj
        if self.ep or len(gemms) != 1 or g.bias is not None or d.bias is not None:
            return False
        if (tuple(g.weight.shape) != tuple(self.gate_up_proj.shape[1:])
                or tuple(d.weight.shape) != tuple(self.down_proj.shape[1:])
                or not g.weight.dtype == d.weight.dtype == self.gate_up_proj.dtype):
            return False
        if self.method == UNQUANTIZED_EXPERTS:
            return g.method == UNQUANTIZED and d.method == UNQUANTIZED
        if not isinstance(self.method, Fp8ExpertsMethod):
            return False
        s = self.method.scheme
        if s.online or s.activation != ("group" if s.block is not None else "token"):
            return False
        if not g.method == d.method == Fp8LinearMethod(s):
            return False
        scales = self.method.scales(self)  # a slot's scales: the dense layer's, as [...] or [..., 1]
        return all(_attr(dense, s.scale_name).shape[0] == stacked.shape[1]
                   and _attr(dense, s.scale_name).numel() == stacked[0].numel()
                   for stacked, dense in ((scales.w13, g), (scales.w2, d)))

    def attach_shared(self, mlp: MLP) -> None:
        """Stack ``mlp`` after the experts (``can_stack``): one storage each for the gate/up and the down weights
        (and their FP8 scales), the experts' parameters and the shared expert's views of it, so that the fused
        kernels run the shared expert as expert L, which every token chooses with its gate's sigmoid as the weight
        (``route_experts(..., shared_slot=L)``): at decode its four launches (gate/up GEMM, SiLU x up, down GEMM,
        and the gated add) become one more pair in the experts' kernels. The loader fills the views in place."""
        g, d = mlp.gate_up_proj.gemms[0], mlp.down_proj
        big13, big2 = _stack(self.gate_up_proj, _attr(g, "weight")), _stack(self.down_proj, _attr(d, "weight"))
        self.stacked = (big13, big2)
        if isinstance(self.method, Fp8ExpertsMethod):
            s = self.method.scheme
            names = self.method.scale_names
            s13 = _stack(_attr(self, names[0]), _attr(g, s.scale_name))
            s2 = _stack(_attr(self, names[1]), _attr(d, s.scale_name))
            self.stacked_scales = ExpertScales(s13, s2, s.block)

    def checkpoint_parts(self) -> dict[str, tuple[str, torch.Tensor]]:
        """The per-expert layout: ``{e}.gate_proj.weight`` (and ``up_proj``, ``down_proj``, and their scales when
        quantized) -> (the stacked tensor it is a part of, its view there, carrying this rank's shard of the
        expert's tensor); this rank's experts only (the others': ``foreign_parts``)."""
        return self.method.checkpoint_parts(self)

    def foreign_parts(self) -> set[str]:
        """The per-expert pieces of the experts other ranks hold (expert parallel): the loader skips them."""
        e0, e1 = self.e_range
        return {f"{e}.{name}.{suffix}" for e in range(self.num_experts) if not e0 <= e < e1
                for name in PROJECTIONS for suffix in self.method.piece_suffixes()}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [T, H]; ``weights`` (float32) and ``experts`` [T, k]: the routed sum over each token's k choices
        (this rank's partial sum when tensor-parallel: under expert parallelism the choices of its experts alone,
        ``experts`` holding global expert ids), plus ``shared_gate * shared`` when given.
        :func:`hyserve.kernels.moe.fused_experts`: the fused Triton kernels on CUDA (capturable in a CUDA graph),
        the batched-by-expert reference elsewhere; FP8 experts pass their scales."""
        return fused_experts(x, self.gate_up_proj, self.down_proj, weights, experts, self.e_range[0],
                             scales=self.method.scales(self), num_experts=self.num_experts, shared=shared,
                             shared_gate=shared_gate)

    def forward_stacked(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The routed sum with the stacked shared expert (``attach_shared``): ``weights`` and ``experts``
        [T, k + 1], the last column the shared expert's (its gate's sigmoid, expert id L)."""
        assert self.stacked is not None
        big13, big2 = self.stacked
        return fused_experts(x, big13, big2, weights, experts, 0, scales=self.stacked_scales,
                             routed_experts=self.num_local)


def _attr(module: nn.Module, name: str) -> torch.Tensor:
    """A parameter or buffer of ``module`` (typed)."""
    t = getattr(module, name)
    assert isinstance(t, torch.Tensor), name
    return t


def _stack(experts: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """One tensor [L + 1, ...] whose first L are ``experts`` [L, ...] and last ``shared`` (the same elements, as
    ``[...]`` or ``[..., 1]``): both become views of it (their values are not kept: called before loading)."""
    local = experts.shape[0]
    big = torch.empty((local + 1, *experts.shape[1:]), dtype=experts.dtype, device=experts.device)
    experts.data, shared.data = big[:local], big[local].reshape(shared.shape)
    return big


class SparseMoeBlock(nn.Module):
    """``gate`` (the router), ``experts``, ``shared_expert`` and ``shared_expert_gate``: the checkpoint's names.
    Quantized: the experts take the config's experts method, the shared expert (a plain MLP) its linear methods;
    the router and the shared expert's gate stay in the model dtype, as FP8 releases keep them (an FP8 tensor for
    either is refused by the loader)."""

    def __init__(self, cfg: MoEConfig, prefix: str) -> None:
        super().__init__()
        h, quant = cfg.hidden_size, cfg.quantization
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.num_experts = cfg.num_experts
        self.gate = Linear(h, cfg.num_experts, prefix=f"{prefix}.gate")
        self.experts = Experts(cfg.num_experts, h, cfg.moe_intermediate_size, quant, f"{prefix}.experts")
        self.shared_expert = MLP(h, cfg.shared_expert_intermediate_size, quant, f"{prefix}.shared_expert")
        self.shared_expert.down_proj.reduce_results = False  # summed with the routed experts' partial sum
        self.shared_expert_gate = Linear(h, 1, prefix=f"{prefix}.shared_expert_gate")
        # The router's rows and the shared expert's gate row are views of one [E + 1, H] tensor, so that one GEMM
        # gives both (the loader fills the views in place; a plain attribute, not a parameter or buffer, so that
        # nothing counts it twice). Its rows are padded with zeros to a multiple of 8: with E + 1 output columns
        # (257, 513) cuBLAS takes a slow unaligned kernel (292 us against tens for a 10k-token prefill chunk).
        w = self.gate.weight
        rows = -(-(cfg.num_experts + 1) // 8) * 8
        self.router_weight = torch.zeros(rows, h, dtype=w.dtype, device=w.device)
        self.gate.weight.data = self.router_weight[: cfg.num_experts]
        self.shared_expert_gate.weight.data = self.router_weight[cfg.num_experts : cfg.num_experts + 1]
        # The padding rows as a buffer (not in the checkpoint): the planner counts the bytes the model holds.
        self.register_buffer("router_padding", self.router_weight[cfg.num_experts + 1 :], persistent=False)
        # The shared expert stacked after the experts where it can be (the fused kernels' path: CUDA, and the
        # Triton interpreter in tests); elsewhere it runs apart, as the reference computes it.
        if self.experts.can_stack(self.shared_expert):
            self.experts.attach_shared(self.shared_expert)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        # [T, E + 1] in the model dtype, as the reference computes them (the padding's columns left out)
        logits = F.linear(x, self.router_weight)[:, : self.num_experts + 1]
        kernels = uses_triton(x)
        if kernels and self.experts.stacked is not None and x.shape[0] <= STACKED_MAX_TOKENS:
            # the shared expert as expert E: one more choice of every token
            weights, experts, _ = route_experts(logits, self.top_k, self.renormalize, self.num_experts,
                                                shared_slot=self.num_experts)
            out = self.experts.forward_stacked(x, weights, experts)
        else:
            if kernels:  # softmax, top k and the shared gate's sigmoid in one launch
                weights, experts, gate = route_experts(logits, self.top_k, self.renormalize, self.num_experts)
            else:
                weights, experts = route(logits[:, : self.num_experts], self.top_k, self.renormalize)
                gate = torch.sigmoid(logits[:, self.num_experts].float())
            out = self.experts(x, weights, experts, shared=self.shared_expert(x), shared_gate=gate)
        if tp_size() > 1:  # both partial sums (the shared expert's down projection does not reduce): one all-reduce
            out = all_reduce(out)
        return out.reshape(shape)
