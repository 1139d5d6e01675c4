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
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from hyserve.distributed.parallel_state import all_reduce, expert_parallel, shard_range, tp_size
from hyserve.kernels.moe import fused_experts
from hyserve.layers.linear import Linear
from hyserve.layers.mlp import MLP
from hyserve.layers.quantization import QuantizationConfig
from hyserve.layers.sharding import Shard, set_shard


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
    their sum when ``renormalize``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


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
    slice of the intermediate dimension) and their batched computation."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts, self.hidden = num_experts, hidden
        self.intermediate_full = intermediate
        self.ep = expert_parallel()
        e0, e1 = self.e_range = expert_range(num_experts)
        self.num_local = local = e1 - e0
        i0, i1 = (0, intermediate) if self.ep else shard_range(intermediate)
        self.i_range = (i0, i1)
        n = i1 - i0
        self.intermediate = n
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * n, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(local, hidden, n), requires_grad=False)
        if self.ep:
            set_shard(self.gate_up_proj, Shard((num_experts, 2 * intermediate, hidden), 0, ((e0, e1),)))
            set_shard(self.down_proj, Shard((num_experts, hidden, intermediate), 0, ((e0, e1),)))
        elif tp_size() > 1:
            set_shard(self.gate_up_proj, Shard((num_experts, 2 * intermediate, hidden), 1,
                                               ((i0, i1), (intermediate + i0, intermediate + i1))))
            set_shard(self.down_proj, Shard((num_experts, hidden, intermediate), 2, ((i0, i1),)))

    def checkpoint_parts(self) -> dict[str, tuple[str, torch.Tensor]]:
        """The per-expert layout: ``{e}.gate_proj.weight`` (and ``up_proj``, ``down_proj``) -> (the stacked
        tensor it is a part of, its view there, carrying this rank's shard of the expert's tensor); this rank's
        experts only (the others': ``foreign_parts``)."""
        n, (i0, i1), full, h = self.intermediate, self.i_range, self.intermediate_full, self.hidden
        sharded = tp_size() > 1 and not self.ep
        e0, e1 = self.e_range
        out: dict[str, tuple[str, torch.Tensor]] = {}
        for e in range(e0, e1):
            j = e - e0
            views = {"gate_proj": ("gate_up_proj", self.gate_up_proj.data[j, :n], Shard((full, h), 0, ((i0, i1),))),
                     "up_proj": ("gate_up_proj", self.gate_up_proj.data[j, n:], Shard((full, h), 0, ((i0, i1),))),
                     "down_proj": ("down_proj", self.down_proj.data[j], Shard((h, full), 1, ((i0, i1),)))}
            for name, (whole, view, shard) in views.items():
                if sharded:
                    set_shard(view, shard)
                out[f"{e}.{name}.weight"] = (whole, view)
        return out

    def foreign_parts(self) -> set[str]:
        """The per-expert pieces of the experts other ranks hold (expert parallel): the loader skips them."""
        e0, e1 = self.e_range
        return {f"{e}.{name}.weight" for e in range(self.num_experts) if not e0 <= e < e1
                for name in ("gate_proj", "up_proj", "down_proj")}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``x`` [T, H]; ``weights`` (float32) and ``experts`` [T, k]: the routed sum over each token's k choices
        (this rank's partial sum when tensor-parallel: under expert parallelism the choices of its experts alone,
        ``experts`` holding global expert ids). :func:`hyserve.kernels.moe.fused_experts`: the fused Triton kernels
        on CUDA (capturable in a CUDA graph), the batched-by-expert reference elsewhere."""
        return fused_experts(x, self.gate_up_proj, self.down_proj, weights, experts, self.e_range[0],
                             num_experts=self.num_experts)


class SparseMoeBlock(nn.Module):
    """``gate`` (the router), ``experts``, ``shared_expert`` and ``shared_expert_gate``: the checkpoint's names."""

    def __init__(self, cfg: MoEConfig, prefix: str) -> None:
        super().__init__()
        if cfg.quantization is not None:
            raise ValueError(f"quantized mixture-of-experts layers are not supported yet ({prefix})")
        h = cfg.hidden_size
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(h, cfg.num_experts, prefix=f"{prefix}.gate")
        self.experts = Experts(cfg.num_experts, h, cfg.moe_intermediate_size)
        self.shared_expert = MLP(h, cfg.shared_expert_intermediate_size, None, f"{prefix}.shared_expert")
        self.shared_expert_gate = Linear(h, 1, prefix=f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = F.linear(x.float(), self.gate.weight.float())
        weights, experts = route(logits, self.top_k, self.renormalize)
        routed = self.experts(x, weights, experts)
        if tp_size() > 1:
            routed = all_reduce(routed)
        shared = self.shared_expert(x) * torch.sigmoid(self.shared_expert_gate(x))
        return (routed + shared).reshape(shape)
