"""Plain-torch references of :mod:`hyserve.kernels.moe` (the CPU path and the yardstick of the Triton kernels).

They define the semantics of the routed experts' sum for one token ``x`` and its ``k`` choices ``(w_j, e_j)``::

    a_j = silu(x W13_gate[e_j]^T) * (x W13_up[e_j]^T)      float32 accumulation, stored in x.dtype
        (activation "relu2", ungated experts: a_j = relu(x W13[e_j]^T)^2, W13 the up weight alone [E, I, H])
    y   = sum_j w_j * (a_j W2[e_j]^T)                       each term rounded to x.dtype, the sum in float32
        (+ g * shared, a shared expert's output and its gate, in the same float32 sum)

The routing (``route_ref``): softmax over the router logits in float32, the top k (descending), divided by their sum
when renormalizing. Nemotron 3's sigmoid routing (``route_sigmoid_ref``): transformers' ``NemotronHTopkRouter``
(DeepSeek-V3's rule), the choice biased, the weights not.

With FP8 experts (``ExpertScales``) the weights are dequantized (``w = w_fp8 * scale``, per output channel or per
block) and the activations quantized the way :mod:`hyserve.kernels.fp8` does it: per token for channel-scaled
weights, per token and ``bk``-wide group of K for block-scaled ones; ``x`` before the first GEMM, ``a_j`` before the
second; or, with static input scales (``ExpertScales.input13`` / ``input2``, ModelOpt FP8), every token with the
one scale of its GEMM (``x`` with ``input13``, ``a_j`` with ``input2``). Expert parallelism: only the choices of
experts ``[expert_start, expert_start + E_local)`` count (the others are another rank's), and the weights hold those
experts alone.

The computation is batched by expert: the (token, choice) pairs are sorted by expert and each expert that received
pairs runs one GEMM over all of them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn import functional as F

from hyserve.kernels.fp8.reference import (
    dequantize_block_weight,
    quantize_fp8,
    quantize_per_token,
    quantize_per_token_group,
)

__all__ = ["ExpertScales", "dequantize_experts", "fused_experts_ref", "quantize_dequantize", "route_ref",
           "route_sigmoid_ref"]


class ExpertScales(NamedTuple):
    """FP8 experts' scales: ``w13`` [E, 2I] and ``w2`` [E, H] per output channel (``block`` None), or per
    ``block = (bn, bk)`` block, [E, ceil(2I / bn), ceil(H / bk)] and [E, ceil(H / bn), ceil(I / bk)]. Activations
    are quantized per token (or per token and ``bk``-group), unless ``input13`` / ``input2`` hold static scales (one
    float32 element each, channel scales only): then every token's input to ``w13`` takes ``input13`` and every
    activation before ``w2`` takes ``input2`` (ModelOpt FP8: the maximum over the layer's experts of each one's
    ``input_scale``, as vLLM does), whichever expert it goes to."""

    w13: torch.Tensor
    w2: torch.Tensor
    block: tuple[int, int] | None = None
    input13: torch.Tensor | None = None
    input2: torch.Tensor | None = None


def dequantize_experts(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """The float32 [E, N, K] weights of FP8 experts."""
    if block is None:
        return weight.float() * scale.float().unsqueeze(-1)
    return torch.stack([dequantize_block_weight(w, s, block) for w, s in zip(weight, scale, strict=True)])


def quantize_dequantize(x: torch.Tensor, block: tuple[int, int] | None,
                        static_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 activations as the FP8 GEMM sees them: per token, per token and ``bk``-wide group, or with the
    one ``static_scale``."""
    if static_scale is not None:
        s = static_scale.float().reshape(1, 1)
        return quantize_fp8(x, s).float() * s
    if block is None:
        q, s = quantize_per_token(x)
        return q.float() * s
    q, s = quantize_per_token_group(x, block[1])
    return q.float() * s.repeat_interleave(block[1], dim=1)[:, : x.shape[1]]


def route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, experts)``, each [tokens, top_k]: softmax over the experts in float32, the top k, divided by
    their sum when ``renormalize``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def route_sigmoid_ref(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                      renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights float32, experts)``, each [tokens, top_k] (transformers' ``NemotronHTopkRouter``)::

        s      = sigmoid(logits)                             float32
        choose = s + bias                                    used to choose only
        groups = the topk_group groups (of n_group contiguous ones) with the largest sum of their top-2 ``choose``
        idx    = the top-k ``choose`` within those groups, descending (torch.topk's order)
        w      = s[idx] (/ their sum + 1e-20 when ``renormalize``) * scaling

    With one group nothing is masked. torch.topk promises no order among exact ties."""
    scores = torch.sigmoid(router_logits.float())
    choose = scores + bias.float()
    t, e = choose.shape
    if n_group > 1:
        grouped = choose.view(t, n_group, e // n_group)
        best = grouped.topk(2, dim=-1).values.sum(-1)  # (T, n_group)
        keep = torch.zeros_like(best).scatter_(1, best.topk(topk_group, dim=-1).indices, 1.0)
        mask = keep.bool()[:, :, None].expand(t, n_group, e // n_group).reshape(t, e)
        choose = choose.masked_fill(~mask, float("-inf"))
    idx = choose.topk(top_k, dim=-1).indices
    w = scores.gather(1, idx)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scaling, idx


def fused_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, expert_start: int = 0, scales: ExpertScales | None = None,
                      shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
                      activation: str = "silu") -> torch.Tensor:
    """``x`` [T, H]; ``w13`` [E_local, 2I, H] (``activation="silu"``) or the up weight [E_local, I, H]
    (``"relu2"``: ``relu(x W13^T)^2``, the square in float32 before the rounding to ``x.dtype``); ``w2``
    [E_local, H, I]; ``topk_weights`` (float32) and ``topk_ids`` (global expert ids) [T, k]. Returns the routed
    sum [T, H] in ``x.dtype``, plus ``shared_gate * shared`` (the shared expert's output [T, H] and its float32 gate
    [T]) when given, added in float32."""
    t, k = topk_ids.shape
    num_local, inter = w13.shape[0], w2.shape[2]
    local = topk_ids.reshape(-1).long() - expert_start
    mine = ((local >= 0) & (local < num_local)).nonzero().squeeze(1)
    order = mine[torch.argsort(local[mine], stable=True)]
    counts = torch.bincount(local[order], minlength=num_local).tolist()
    token = order // k
    xs = x[token].float()
    if scales is not None:
        xs = quantize_dequantize(xs, scales.block, scales.input13)
    pair_out = torch.zeros(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        seg = slice(start, start + c)
        start += c
        up_w, down_w = (w13[e].float(), w2[e].float()) if scales is None else (
            dequantize_experts(w13[e : e + 1], scales.w13[e : e + 1], scales.block)[0],
            dequantize_experts(w2[e : e + 1], scales.w2[e : e + 1], scales.block)[0])
        if activation == "relu2":
            act = torch.square(F.relu(F.linear(xs[seg], up_w))).to(x.dtype).float()
        else:
            gate, up = F.linear(xs[seg], up_w).split(inter, dim=-1)
            act = (F.silu(gate) * up).to(x.dtype).float()
        if scales is not None:
            act = quantize_dequantize(act, scales.block, scales.input2)
        pairs = order[seg]
        pair_out[pairs] = (F.linear(act, down_w) * topk_weights.reshape(-1)[pairs].float().unsqueeze(-1)).to(x.dtype)
    out = pair_out.view(t, k, x.shape[1]).sum(dim=1, dtype=torch.float32)
    if shared is not None:
        assert shared_gate is not None
        out += shared.float() * shared_gate.float().view(t, 1)
    return out.to(x.dtype)
