"""Granite-4.0-H's feed-forward blocks (transformers' ``GraniteMoeHybridMoE`` and ``GraniteMoeHybridMLP``):

    w, idx = softmax over the top-k router logits         = the full softmax's top k, renormalised
    moe(x) = sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))  the experts: hyserve.layers.moe.Experts
    mlp(x) = output_linear(silu(gate) * up), [gate | up] = input_linear(x)

Both fuse gate and up, gate rows first: the experts as ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]
(the releases' ``block_sparse_moe.input_linear`` / ``output_linear``, renamed by the config's ``checkpoint_name``),
the shared MLP as ``input_linear`` [2I, H] / ``output_linear`` [H, I]. The router (``block_sparse_moe.router.layer``
on disk) has no bias, no scaling and no groups. docs/mamba2_facts.md section 5.2 has transformers' code.

Tensor parallel: the experts (``Experts``) and the shared MLP hold their share of the intermediate channels (the
gate rows and the up rows of it), the router is whole on every rank; both blocks' outputs are partial sums, which
the layer adds and sums over the group in one all-reduce (``GraniteMoeHybridLayer``).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from hyserve.distributed.parallel_state import shard_range, tp_size
from hyserve.kernels.norm import silu_mul
from hyserve.layers.linear import Linear, RowParallelLinear
from hyserve.layers.moe import Experts, route
from hyserve.layers.quantization import QuantizationConfig
from hyserve.layers.quantization.experts import UNQUANTIZED_EXPERTS, ExpertsMethod, uniform_experts_method
from hyserve.layers.sharding import Shard


class GraniteMoEConfig(Protocol):
    hidden_size: int
    intermediate_size: int
    shared_intermediate_size: int
    num_local_experts: int
    num_experts_per_tok: int
    quantization: QuantizationConfig | None


class SharedMLP(nn.Module):
    """``output_linear(silu(gate) * up)`` with ``[gate | up] = input_linear(x)``. ``prefix``: its name
    (``model.layers.0.shared_mlp``). Tensor parallel: this rank's channels of gate and of up, ``output_linear``
    row-parallel (``output_linear.reduce_results = False``: the caller sums the partial output)."""

    def __init__(self, hidden: int, intermediate: int, quant: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        tp = tp_size()
        i0, i1 = shard_range(intermediate)
        self.intermediate = i1 - i0
        shard = Shard((2 * intermediate, hidden), 0, ((i0, i1), (intermediate + i0, intermediate + i1))) \
            if tp > 1 else None
        self.input_linear = Linear(hidden, 2 * self.intermediate, quant=quant, prefix=f"{prefix}.input_linear",
                                   shard=shard)
        self.output_linear = RowParallelLinear(intermediate, hidden, (i0, i1), sharded=tp > 1, quant=quant,
                                               prefix=f"{prefix}.output_linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).split(self.intermediate, dim=-1)
        return self.output_linear(silu_mul(gate, up))


def granite_experts_method(quant: QuantizationConfig | None, prefix: str) -> ExpertsMethod:
    """The experts' method by the checkpoint's names of their two fused projections (``{prefix}.input_linear``,
    ``{prefix}.output_linear``: llm-compressor's Granite-4 recipe quantizes them as linear layers, the ``Linear``
    target matching them; an ignore entry for either keeps the experts in the model dtype), alike for both."""
    if quant is None:
        return UNQUANTIZED_EXPERTS
    names = (f"{prefix}.input_linear", f"{prefix}.output_linear")
    return uniform_experts_method({n: quant.linear_method(n) for n in names}, f"{prefix}.experts")


class SoftmaxTopKMoE(nn.Module):
    """The routed experts with a top-k softmax router. ``prefix``: its name (``model.layers.0.block_sparse_moe``).
    Tensor parallel: its output is this rank's partial sum (the caller reduces it)."""

    def __init__(self, cfg: GraniteMoEConfig, prefix: str) -> None:
        super().__init__()
        e, h = cfg.num_local_experts, cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.router = Linear(h, e, prefix=f"{prefix}.router")
        self.experts = Experts(e, h, cfg.intermediate_size, cfg.quantization, f"{prefix}.experts",
                               method=granite_experts_method(cfg.quantization, prefix))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # logits in the model dtype, the softmax in float32 (transformers' router)
        weights, experts = route(self.router(x), self.top_k, renormalize=True)
        return self.experts(x, weights, experts)
