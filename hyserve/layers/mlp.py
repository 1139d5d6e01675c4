"""Feed-forward blocks a family's decoder layer composes."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from hyserve.distributed.parallel_state import shard_range, tp_size
from hyserve.kernels.activation import relu_squared
from hyserve.kernels.fp8 import Fp8Activation
from hyserve.kernels.gemv import DeferredInput, SwigluInput, deferrable
from hyserve.kernels.norm import silu_mul
from hyserve.layers.linear import Linear, MergedLinear, RowParallelLinear
from hyserve.layers.quantization import QuantizationConfig
from hyserve.layers.sharding import Shard


class MLP(nn.Module):
    """The gated SiLU MLP: ``down(silu(gate(x)) * up(x))``, gate and up in one GEMM. Falcon-H1's muP multipliers:
    ``gate_multiplier`` scales the gate's output before the SiLU, ``down_multiplier`` the block's output."""

    def __init__(self, hidden: int, intermediate: int, quant: QuantizationConfig | None, prefix: str, *,
                 gate_multiplier: float = 1.0, down_multiplier: float = 1.0) -> None:
        super().__init__()
        self.gate_multiplier, self.down_multiplier = float(gate_multiplier), float(down_multiplier)
        i0, i1 = shard_range(intermediate)
        shards: dict[str, Shard] = {}
        if tp_size() > 1:
            shards = {name: Shard((intermediate, hidden), 0, ((i0, i1),)) for name in ("gate_proj", "up_proj")}
        self.gate_up_proj = MergedLinear(hidden, [("gate_proj", i1 - i0), ("up_proj", i1 - i0)], shards,
                                         quant=quant, prefix=prefix)
        self.down_proj = RowParallelLinear(intermediate, hidden, (i0, i1), sharded=tp_size() > 1, quant=quant,
                                           prefix=f"{prefix}.down_proj")
        self.down_quant = self.down_proj.fp8_input()
        self.down_deferred = self.down_proj.takes_deferred() and self.gate_multiplier == 1.0

    def takes_deferred(self) -> bool:
        """Whether the block's input may come as its norm deferred into ``gate_up_proj``'s prologue."""
        return self.gate_up_proj.takes_deferred()

    def fp8_input(self) -> str | None:
        """The form the block's input comes in from its norm (``hyserve.kernels.norm.QUANT_MODES``): quantized per
        token where ``gate_up_proj`` takes it so."""
        return self.gate_up_proj.fp8_input()

    def forward(self, x: torch.Tensor | Fp8Activation | DeferredInput) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        if self.gate_multiplier != 1.0:
            gate = gate * self.gate_multiplier
        # The SwiGLU writes down_proj's input quantized when down_proj is FP8 per token (one launch, not two), or
        # goes into its prologue at a decode step (hyserve.kernels.gemv).
        act: torch.Tensor | Fp8Activation | SwigluInput
        if self.down_deferred and deferrable(gate):
            act = SwigluInput(gate, up)
        else:
            act = silu_mul(gate, up, self.down_quant)
        out = self.down_proj(act)
        return out if self.down_multiplier == 1.0 else out * self.down_multiplier


class GeluMLP(nn.Module):
    """The non-gated GELU MLP: ``down(gelu(up(x)))`` (exact GELU)."""

    def __init__(self, hidden: int, intermediate: int, quant: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        i0, i1 = shard_range(intermediate)
        shard = Shard((intermediate, hidden), 0, ((i0, i1),)) if tp_size() > 1 else None
        self.up_proj = Linear(hidden, i1 - i0, quant=quant, prefix=f"{prefix}.up_proj", shard=shard)
        self.down_proj = RowParallelLinear(intermediate, hidden, (i0, i1), sharded=tp_size() > 1, quant=quant,
                                           prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class ReluSquaredMLP(GeluMLP):
    """``GeluMLP``'s layout with ``relu(x) ** 2`` (Nemotron-H's ``relu2``): ``down(relu(up(x)) ** 2)``, the
    activation one launch where the Triton kernels run (``hyserve.kernels.activation``: transformers' rounding
    exactly; an FP8 ``down_proj`` quantizes its output as it would torch's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu_squared(self.up_proj(x)))
