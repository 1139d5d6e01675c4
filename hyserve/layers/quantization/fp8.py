"""The FP8 linear method: float8_e4m3fn weights with float32 scales, activations quantized as the scheme says.

What a layer keeps (whatever the checkpoint format):

* ``weight``: ``(out, in)`` float8_e4m3fn, this rank's rows and columns;
* per-channel scales ``weight_scale`` ``(out, 1)`` float32: a checkpoint's per-channel scales as they are, a
  per-tensor scale expanded to its tensor's rows. This is how merged projections whose parts have different
  per-tensor scales keep each part's own scale exactly (no requantization to a common scale; each part's rows of
  the one GEMM are scaled by their own value);
* or block scales ``(ceil(out / bn), ceil(in / bk))`` float32 under the checkpoint's name (``weight_scale`` in
  compressed-tensors, ``weight_scale_inv`` in Qwen's releases); in a merged projection every part but the last of a
  GEMM has a multiple of ``bn`` rows, so each part's scales are whole rows of blocks;
* static activations: the parts' ``input_scale`` (one each) and their maximum, the one scale of the GEMM (as vLLM
  does; calibration gives parts that read the same input the same scale).

Tensor parallelism (and any row re-order, ``Shard`` ranges in any order): per-channel scales shard with their rows;
block scales with their blocks, and a shard boundary not on a block boundary is refused when the layer is built,
unless the checkpoint tensor is one row of blocks (at most ``bn`` rows, as Qwen3.5's ``in_proj_b`` and Qwen3-Next's
``in_proj_ba``): every row, whichever a rank keeps and in whatever order, takes that one row of scales.
Per-tensor and input scales are whole on every rank. A row-parallel layer's rank quantizes its slice of the input
per token on its own, as vLLM does (no collective for a common amax; the result is as close to the checkpoint's
per-token scheme as a finer grouping is); activation groups of block weights do not change, a rank's slice being
whole groups.

Online FP8 (``Fp8Scheme.online``): the checkpoint holds the weight in bf16/fp32, quantized per output channel as it
loads (over the whole checkpoint row, so every tensor-parallel layout quantizes alike); the scale is not a
checkpoint tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from hyserve.kernels.fp8 import (
    AMAX_EPS,
    FP8_DTYPE,
    FP8_MAX,
    fp8_block_linear,
    fp8_linear,
    prepare_device,
    quantize_fp8,
)
from hyserve.layers.quantization.base import GemmLayer, LinearMethod
from hyserve.layers.sharding import LoadSpec, Shard, set_load_spec, set_shard

# Safetensors dtypes a scale may be stored in (compressed-tensors stores the observed weight's dtype, docs/fp8_facts.md
# section 4) and those an online-quantized weight may come in.
SCALE_DTYPES = ("F32", "BF16", "F16")
UNQUANTIZED_DTYPES = ("F32", "BF16", "F16")
SCALAR_SHAPES = ((1,), ())

WEIGHT_STRATEGIES = ("channel", "tensor", "block")
ACTIVATION_STRATEGIES = ("token", "tensor", "group")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """One layer's FP8 scheme: what the checkpoint stores for the weight (``channel``: ``(out, 1)`` scales;
    ``tensor``: one scale; ``block``: ``block = (bn, bk)`` tiles) under ``scale_name``, and how activations are
    quantized (``token``: dynamic per token; ``tensor``: static, ``input_scale``; ``group``: dynamic per token and
    ``bk``-wide group). ``online``: the checkpoint weight is unquantized (per channel at load)."""

    weight: str
    activation: str
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    online: bool = False

    def __post_init__(self) -> None:
        assert self.weight in WEIGHT_STRATEGIES and self.activation in ACTIVATION_STRATEGIES, self
        assert (self.weight == "block") == (self.block is not None), self
        assert self.activation != "group" or self.weight == "block", self

    def describe(self) -> str:
        if self.online:
            weights = "bf16 weights quantized per channel at load"
        elif self.block is not None:
            weights = f"weights in {self.block[0]}x{self.block[1]} blocks"
        else:
            weights = f"weights per {self.weight}"
        acts = {"token": "activations dynamic per token", "tensor": "activations static per tensor",
                "group": f"activations dynamic per token and {self.block[1] if self.block else 0}-group"}
        return f"{weights}, {acts[self.activation]}"


@dataclass(frozen=True, slots=True)
class Fp8LinearMethod(LinearMethod):
    scheme: Fp8Scheme

    quantized = True

    @property
    def row_alignment(self) -> int:  # type: ignore[override]
        return self.scheme.block[0] if self.scheme.block is not None else 1

    def describe(self) -> str:
        return f"FP8 ({self.scheme.describe()})"

    def takes_fp8_activation(self) -> bool:
        """Channel or tensor weights with activations quantized per token on the fly (compressed-tensors'
        FP8_DYNAMIC, online FP8): the producer may quantize them. Block weights (128-wide activation groups, laid
        out per GEMM backend) and static input scales quantize in the GEMM's own launch."""
        return self.scheme.block is None and self.scheme.activation == "token"

    # ------------------------------------------------------------------ weights

    def create_weights(self, layer: GemmLayer) -> None:
        s = self.scheme
        n, k = layer.out_features, layer.in_features
        if s.block is not None:
            self._check_block_shards(layer)
        layer.weight = nn.Parameter(torch.empty(n, k, dtype=FP8_DTYPE), requires_grad=False)
        if s.block is not None:
            bn, bk = s.block
            layer.register_parameter(s.scale_name, nn.Parameter(
                torch.empty(_cdiv(n, bn), _cdiv(k, bk), dtype=torch.float32), requires_grad=False))
        elif s.online:  # computed at load, not a checkpoint tensor: outside the state dict
            layer.register_buffer("weight_scale", torch.empty(n, 1, dtype=torch.float32), persistent=False)
        else:
            layer.register_parameter("weight_scale", nn.Parameter(torch.empty(n, 1, dtype=torch.float32),
                                                                  requires_grad=False))
        if s.activation == "tensor":
            layer.register_parameter("input_scale", nn.Parameter(torch.empty(len(layer.parts), dtype=torch.float32),
                                                                 requires_grad=False))
            layer.register_buffer("input_scale_max", torch.empty(1, dtype=torch.float32), persistent=False)
        if layer.parts[0].name is None:
            self._describe_part(layer, 0, 0, whole=True)

    def part_tensors(self, layer: GemmLayer, index: int, row_offset: int) -> dict[str, torch.Tensor]:
        return self._describe_part(layer, index, row_offset, whole=False)

    def _describe_part(self, layer: GemmLayer, index: int, row_offset: int, whole: bool) -> dict[str, torch.Tensor]:
        """Part ``index``'s checkpoint tensors (the parameters themselves when ``whole``, else views of its rows)
        with their shards and load specs attached."""
        s = self.scheme
        part = layer.parts[index]
        rows = slice(row_offset, row_offset + part.size)
        shard = part.shard
        by_rows = shard is not None and shard.dim == 0
        weight = layer.weight if whole else layer.weight[rows]
        out: dict[str, torch.Tensor] = {"weight": weight}
        if shard is not None:
            set_shard(weight, shard)
        if s.block is not None:
            bn, bk = s.block
            full = _tensor(layer, s.scale_name)
            scale = full if whole else full[row_offset // bn : row_offset // bn + _cdiv(part.size, bn)]
            if shard is not None:
                n_full, k_full = shard.full_shape
                step = bn if by_rows else bk
                if by_rows and n_full <= bn:  # one row of blocks: the scales of every row
                    blocks: tuple[tuple[int, int], ...] = ((0, 1),)
                else:
                    blocks = tuple((a // step, _cdiv(b, step)) for a, b in shard.ranges)
                set_shard(scale, Shard((_cdiv(n_full, bn), _cdiv(k_full, bk)), shard.dim, blocks))
            set_load_spec(scale, LoadSpec(SCALE_DTYPES))
            out[s.scale_name] = scale
        else:
            channel = _tensor(layer, "weight_scale")
            scale = channel if whole else channel[rows]
            if s.online:
                set_load_spec(weight, LoadSpec(UNQUANTIZED_DTYPES, load=quantize_rows_into(scale, shard)))
            else:
                if s.weight == "tensor":
                    set_load_spec(scale, LoadSpec(SCALE_DTYPES, SCALAR_SHAPES, load=fill_rows))
                else:
                    if by_rows:
                        assert shard is not None
                        set_shard(scale, Shard((shard.full_shape[0], 1), 0, shard.ranges))
                    set_load_spec(scale, LoadSpec(SCALE_DTYPES))
                out["weight_scale"] = scale
        if s.activation == "tensor":
            every = _tensor(layer, "input_scale")  # a single part loads into the parameter itself (``whole``)
            input_scale = every if whole else every[index : index + 1]
            set_load_spec(input_scale, LoadSpec(SCALE_DTYPES, SCALAR_SHAPES))
            out["input_scale"] = input_scale
        return out

    def _check_block_shards(self, layer: GemmLayer) -> None:
        """Tensor parallelism: every range of a shard starts on a block and ends on one (or at the tensor's end)."""
        assert self.scheme.block is not None
        bn, bk = self.scheme.block
        for part in layer.parts:
            if part.shard is None:
                continue
            step = bn if part.shard.dim == 0 else bk
            what = "rows" if part.shard.dim == 0 else "columns"
            end = part.shard.full_shape[part.shard.dim]
            if part.shard.dim == 0 and end <= bn:  # one row of blocks, whatever rows this rank keeps
                continue
            for a, b in part.shard.ranges:
                if a % step or (b % step and b != end):
                    name = layer.part_name(part)
                    raise ValueError(
                        f"{name}: this tensor-parallel rank's {what} [{a}, {b}) of {end} do not start and end on "
                        f"the checkpoint's {bn}x{bk} FP8 blocks; use a --tensor-parallel-size that splits this "
                        f"layer on {step}-{what[:-1]} boundaries")

    def process_weights_after_loading(self, layer: GemmLayer) -> None:
        prepare_device(layer.weight.device)  # the GEMM's split-K locks exist before any graph capture
        if self.scheme.activation == "tensor":
            _tensor(layer, "input_scale_max").copy_(_tensor(layer, "input_scale").max().reshape(1))

    # ------------------------------------------------------------------ forward

    def apply(self, layer: GemmLayer, x: torch.Tensor) -> torch.Tensor:
        s = self.scheme
        if s.block is not None:
            group = s.block[1] if s.activation == "group" else None
            return fp8_block_linear(x, layer.weight, _tensor(layer, s.scale_name), s.block, group)
        input_scale = _tensor(layer, "input_scale_max") if s.activation == "tensor" else None
        return fp8_linear(x, layer.weight, _tensor(layer, "weight_scale"), input_scale)


def _tensor(layer: GemmLayer, name: str) -> torch.Tensor:
    """A parameter or buffer the method registered on ``layer`` (typed: ``nn.Module``'s lookup is not)."""
    return cast(torch.Tensor, getattr(layer, name))


def fill_rows(target: torch.Tensor, scale: torch.Tensor) -> None:
    """A per-tensor scale into its tensor's rows of a per-channel scale."""
    target.copy_(scale.reshape(1, 1).expand(target.shape))


def _quantize_rows(target: torch.Tensor, scale: torch.Tensor, full: torch.Tensor, shard: Shard | None) -> None:
    w = full.to(device=target.device, dtype=torch.float32)
    s = w.abs().amax(dim=-1, keepdim=True).clamp_(min=AMAX_EPS) / FP8_MAX
    q = quantize_fp8(w, s)
    if shard is not None:
        q = shard.take(q)
        if shard.dim != w.dim() - 1:
            s = shard.take(s)
    target.copy_(q)
    scale.copy_(s.reshape(scale.shape))


def quantize_rows_into(scale: torch.Tensor, shard: Shard | None) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """The load of an online-quantized weight: per-channel FP8 over the whole checkpoint rows (the last dimension),
    then this rank's part; the scales go into ``scale``. A stacked [E, N, K] tensor is quantized one expert at a
    time (this rank's experts under expert parallelism), bounding the float32 copy to one expert."""

    def load(target: torch.Tensor, full: torch.Tensor) -> None:
        if full.dim() < 3:
            _quantize_rows(target, scale, full, shard)
            return
        by_expert = shard is not None and shard.dim == 0
        e0, e1 = shard.ranges[0] if shard is not None and by_expert else (0, full.shape[0])
        inner = Shard(shard.full_shape[1:], shard.dim - 1, shard.ranges) if shard is not None and not by_expert \
            else None
        for j, e in enumerate(range(e0, e1)):
            _quantize_rows(target[j], scale[j], full[e], inner)

    return load
