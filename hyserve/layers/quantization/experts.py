"""How a mixture-of-experts layer's stacked experts keep their weights: the analogue of ``LinearMethod`` for
``hyserve.layers.moe.Experts`` (``QuantizationConfig.experts_method``).

What the experts keep (whatever the checkpoint layout), ``L`` this rank's experts, ``n`` its intermediate width:

* ``gate_up_proj`` [L, 2n, H] (each expert's gate rows, then its up rows) and ``down_proj`` [L, H, n], in the model
  dtype (unquantized) or float8_e4m3fn;
* FP8 per channel: ``gate_up_proj_scale`` [L, 2n] and ``down_proj_scale`` [L, H] float32 (a per-tensor scale expanded
  to its tensor's rows, as the dense FP8 layers do), activations quantized per token;
* FP8 blocks ``(bn, bk)``: ``gate_up_proj_scale_inv`` [L, ceil(2n / bn), ceil(H / bk)] and ``down_proj_scale_inv``
  [L, ceil(H / bn), ceil(n / bk)] float32, activations quantized per token and ``bk``-group
  (:class:`hyserve.kernels.moe.ExpertScales`).

Checkpoint layouts, both loaded: fused, the stacked tensors under those names (transformers' FP8 experts name
their block scales ``gate_up_proj_scale_inv``; a compressed-tensors fused layer ``gate_up_proj_scale``, [E, 2I], or
[E] per-tensor); and per expert, ``{e}.gate_proj.weight`` with its ``weight_scale_inv`` (Qwen's block FP8) or
``weight_scale`` (compressed-tensors: [N, 1] per channel, or a scalar per tensor, expanded at load), ``up_proj``,
``down_proj``, loaded into views of the stacked tensors (``checkpoint_parts``).

Tensor parallelism: each rank holds its slice [i0, i1) of every expert's intermediate dimension; block scales shard
with their blocks, so the slice must be whole blocks: ``n`` a multiple of ``bn`` (each expert's gate and up rows
then own their blocks) and ``i0`` of ``bk`` (refused when the layer is built otherwise, as vLLM does). Expert
parallelism: whole experts, scales with them. Static (per-tensor) input scales are refused for these gated experts
(Nemotron 3's ungated experts take them: ``hyserve.layers.sigmoid_moe``, ``experts_method_of(static_inputs=True)``).
Online FP8 quantizes each expert's rows per output channel as it loads (over the whole checkpoint row).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch import nn

from hyserve.kernels.fp8 import FP8_DTYPE
from hyserve.kernels.moe import ExpertScales
from hyserve.layers.quantization.base import UNQUANTIZED, LinearMethod, QuantizationConfig
from hyserve.layers.quantization.fp8 import (
    SCALAR_SHAPES,
    SCALE_DTYPES,
    UNQUANTIZED_DTYPES,
    Fp8LinearMethod,
    Fp8Scheme,
    fill_rows,
    quantize_rows_into,
)
from hyserve.layers.sharding import LoadSpec, Shard, set_load_spec, set_shard, shard_of

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
STACKED = ("gate_up_proj", "down_proj")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ExpertsLayer(Protocol):
    """What an ``ExpertsMethod`` uses of ``hyserve.layers.moe.Experts``: the global shape (``num_experts``,
    ``hidden``, ``intermediate_full``), this rank's part (``e_range``, ``i_range``, ``intermediate`` = n), whether
    it holds whole experts (``ep``) or slices of them (``tp_sharded``), and its name (``prefix``)."""

    prefix: str
    num_experts: int
    hidden: int
    intermediate_full: int
    intermediate: int
    e_range: tuple[int, int]
    i_range: tuple[int, int]
    ep: bool
    tp_sharded: bool
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None: ...

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None: ...


def _stacked_shard(layer: ExpertsLayer, full: tuple[int, ...], dim: int,
                   ranges: tuple[tuple[int, int], ...] | None) -> Shard | None:
    """A stacked tensor's shard: its experts (expert parallel), or ``ranges`` along ``dim`` (tensor parallel;
    ``None``: replicated)."""
    if layer.ep:
        return Shard(full, 0, (layer.e_range,))
    if layer.tp_sharded and ranges is not None:
        return Shard(full, dim, ranges)
    return None


def _gate_up_ranges(layer: ExpertsLayer, step: int = 1) -> tuple[tuple[int, int], ...]:
    """This rank's rows of a fused ``[2I, ...]`` tensor (gate slice, up slice), in units of ``step`` rows."""
    (i0, i1), full = layer.i_range, layer.intermediate_full
    return ((i0 // step, i1 // step), ((full + i0) // step, (full + i1) // step))


class ExpertsMethod(ABC):
    """How the experts keep their weights; subclasses are frozen dataclasses (equal methods compute alike)."""

    quantized: bool = False

    @property
    def weight_dtype(self) -> torch.dtype | None:
        return None

    def create_weights(self, layer: ExpertsLayer) -> None:
        """Register ``gate_up_proj``, ``down_proj`` (with their shards) and what else the method keeps."""
        local, n, h, full = layer.e_range[1] - layer.e_range[0], layer.intermediate, layer.hidden, \
            layer.intermediate_full
        e = layer.num_experts
        layer.gate_up_proj = nn.Parameter(torch.empty(local, 2 * n, h, dtype=self.weight_dtype), requires_grad=False)
        layer.down_proj = nn.Parameter(torch.empty(local, h, n, dtype=self.weight_dtype), requires_grad=False)
        w13 = _stacked_shard(layer, (e, 2 * full, h), 1, _gate_up_ranges(layer))
        w2 = _stacked_shard(layer, (e, h, full), 2, (layer.i_range,))
        for param, shard in ((layer.gate_up_proj, w13), (layer.down_proj, w2)):
            if shard is not None:
                set_shard(param, shard)

    def checkpoint_parts(self, layer: ExpertsLayer) -> dict[str, tuple[str, torch.Tensor]]:
        """The per-expert layout: ``{e}.gate_proj.weight`` (and ``up_proj``, ``down_proj``, and their scales) ->
        (the stacked tensor it is a part of, its view there, carrying this rank's shard of the expert's tensor);
        this rank's experts only."""
        n, (i0, i1), full, h = layer.intermediate, layer.i_range, layer.intermediate_full, layer.hidden
        e0, e1 = layer.e_range
        out: dict[str, tuple[str, torch.Tensor]] = {}
        for e in range(e0, e1):
            j = e - e0
            views = {"gate_proj": (layer.gate_up_proj.data[j, :n], Shard((full, h), 0, ((i0, i1),))),
                     "up_proj": (layer.gate_up_proj.data[j, n:], Shard((full, h), 0, ((i0, i1),))),
                     "down_proj": (layer.down_proj.data[j], Shard((h, full), 1, ((i0, i1),)))}
            for name, (view, shard) in views.items():
                whole = "down_proj" if name == "down_proj" else "gate_up_proj"
                if layer.tp_sharded:
                    set_shard(view, shard)
                out[f"{e}.{name}.weight"] = (whole, view)
                for suffix, (stacked, scale) in self.expert_scale_parts(layer, j, name, view, shard).items():
                    out[f"{e}.{name}.{suffix}"] = (stacked, scale)
        return out

    def expert_scale_parts(self, layer: ExpertsLayer, j: int, name: str, weight: torch.Tensor,
                           shard: Shard) -> dict[str, tuple[str, torch.Tensor]]:
        """Local expert ``j``'s projection ``name``: its scale tensors (checkpoint suffix -> (stacked tensor,
        view)); ``weight`` is its weight's view, ``shard`` its tensor-parallel shard."""
        return {}

    def piece_suffixes(self) -> tuple[str, ...]:
        """The tensors each projection of each expert has in the per-expert layout."""
        return ("weight",)

    def scales(self, layer: ExpertsLayer) -> ExpertScales | None:
        """What :func:`hyserve.kernels.moe.fused_experts` reads besides the weights."""
        return None

    @abstractmethod
    def describe(self) -> str: ...


@dataclass(frozen=True, slots=True)
class UnquantizedExpertsMethod(ExpertsMethod):
    """The weights in the model dtype."""

    def describe(self) -> str:
        return "unquantized"


UNQUANTIZED_EXPERTS = UnquantizedExpertsMethod()


@dataclass(frozen=True, slots=True)
class Fp8ExpertsMethod(ExpertsMethod):
    """FP8 W8A8 experts: per-channel scales (``scheme.weight`` ``channel``, or ``tensor`` expanded to channels;
    activations per token) or block scales (activations per token and ``bk``-group)."""

    scheme: Fp8Scheme

    quantized = True

    @property
    def weight_dtype(self) -> torch.dtype | None:
        return FP8_DTYPE

    @property
    def scale_names(self) -> tuple[str, str]:
        """The stacked scales' names (the fused layout's checkpoint names)."""
        suffix = "scale_inv" if self.scheme.scale_name == "weight_scale_inv" else "scale"
        return f"gate_up_proj_{suffix}", f"down_proj_{suffix}"

    def describe(self) -> str:
        return f"FP8 ({self.scheme.describe()})"

    def piece_suffixes(self) -> tuple[str, ...]:
        return ("weight",) if self.scheme.online else ("weight", self.scheme.scale_name)

    def scales(self, layer: ExpertsLayer) -> ExpertScales:
        s13, s2 = (cast(torch.Tensor, getattr(layer, name)) for name in self.scale_names)
        return ExpertScales(s13, s2, self.scheme.block)

    # ------------------------------------------------------------------ stacked tensors

    def create_weights(self, layer: ExpertsLayer) -> None:
        s = self.scheme
        if s.block is not None:
            self._check_block_shards(layer)
        ExpertsMethod.create_weights(self, layer)
        local, n, h = layer.e_range[1] - layer.e_range[0], layer.intermediate, layer.hidden
        e, full = layer.num_experts, layer.intermediate_full
        names = self.scale_names
        shapes: tuple[tuple[int, ...], tuple[int, ...]]
        if s.block is not None:
            bn, bk = s.block
            shapes = ((local, _cdiv(2 * n, bn), _cdiv(h, bk)), (local, _cdiv(h, bn), _cdiv(n, bk)))
            shards = (_stacked_shard(layer, (e, _cdiv(2 * full, bn), _cdiv(h, bk)), 1, _gate_up_ranges(layer, bn)),
                      _stacked_shard(layer, (e, _cdiv(h, bn), _cdiv(full, bk)), 2,
                                     ((layer.i_range[0] // bk, _cdiv(layer.i_range[1], bk)),)))
        else:
            shapes = ((local, 2 * n), (local, h))
            shards = (_stacked_shard(layer, (e, 2 * full), 1, _gate_up_ranges(layer)),
                      _stacked_shard(layer, (e, h), 1, None))
        weights = (layer.gate_up_proj, layer.down_proj)
        for name, shape, shard, weight in zip(names, shapes, shards, weights, strict=True):
            scale = torch.empty(shape, dtype=torch.float32)
            if s.online:  # computed at load, not a checkpoint tensor: outside the state dict
                layer.register_buffer(name, scale, persistent=False)
                set_load_spec(weight, LoadSpec(UNQUANTIZED_DTYPES, load=quantize_rows_into(scale, shard_of(weight))))
                continue
            param = nn.Parameter(scale, requires_grad=False)
            layer.register_parameter(name, param)
            if s.weight == "tensor":  # one scale per expert and projection: [E] (or [E, 1]) on disk
                set_load_spec(param, LoadSpec(SCALE_DTYPES, ((e,), (e, 1)), load=_expert_scalars(layer.e_range)))
                continue
            if shard is not None:
                set_shard(param, shard)
            full_shape = shard.full_shape if shard is not None else tuple(shape)
            # per channel also [E, N, 1]: llm-compressor's fused (Granite-4) experts keep the Linear's (N, 1) form
            accepted = None if s.block is not None else (full_shape, (*full_shape, 1))
            set_load_spec(param, LoadSpec(SCALE_DTYPES, accepted))

    def _check_block_shards(self, layer: ExpertsLayer) -> None:
        """Each expert's gate and up rows own their blocks, and a tensor-parallel slice is whole blocks."""
        assert self.scheme.block is not None
        bn, bk = self.scheme.block
        n, (i0, _) = layer.intermediate, layer.i_range
        if n % bn or (layer.tp_sharded and i0 % bk):
            hint = (f"; use a --tensor-parallel-size that splits moe_intermediate_size on {bn}-row boundaries, or "
                    "--enable-expert-parallel (whole experts)") if layer.tp_sharded else ""
            raise ValueError(
                f"{layer.prefix}: block FP8 experts need each rank's slice of the intermediate size "
                f"{layer.intermediate_full} to be whole {bn}x{bk} blocks (each expert's gate and up rows own their "
                f"blocks); this rank's slice is [{i0}, {i0 + n}){hint}")

    # ------------------------------------------------------------------ per-expert layout

    def expert_scale_parts(self, layer: ExpertsLayer, j: int, name: str, weight: torch.Tensor,
                           shard: Shard) -> dict[str, tuple[str, torch.Tensor]]:
        s = self.scheme
        n = layer.intermediate
        s13_name, s2_name = self.scale_names
        s13, s2 = (cast(torch.Tensor, getattr(layer, k)).data for k in self.scale_names)
        stacked = s2_name if name == "down_proj" else s13_name
        sharded = layer.tp_sharded
        if s.online:
            scale = s2[j] if name == "down_proj" else s13[j, :n] if name == "gate_proj" else s13[j, n:]
            set_load_spec(weight, LoadSpec(UNQUANTIZED_DTYPES, load=quantize_rows_into(
                scale, shard if sharded else None)))
            return {}
        if s.block is not None:
            bn, bk = s.block
            h, full, (i0, i1) = layer.hidden, layer.intermediate_full, layer.i_range
            if name == "down_proj":
                view = s2[j]
                block_shard = Shard((_cdiv(h, bn), _cdiv(full, bk)), 1, ((i0 // bk, _cdiv(i1, bk)),))
            else:
                start = 0 if name == "gate_proj" else n // bn
                view = s13[j, start : start + n // bn]
                block_shard = Shard((_cdiv(full, bn), _cdiv(h, bk)), 0, ((i0 // bn, i1 // bn),))
            if sharded:
                set_shard(view, block_shard)
            set_load_spec(view, LoadSpec(SCALE_DTYPES))
            return {s.scale_name: (stacked, view)}
        view = (s2[j] if name == "down_proj" else s13[j, :n] if name == "gate_proj" else s13[j, n:]).unsqueeze(-1)
        if s.weight == "tensor":
            set_load_spec(view, LoadSpec(SCALE_DTYPES, SCALAR_SHAPES, load=fill_rows))
        else:
            if sharded and name != "down_proj":
                set_shard(view, Shard((shard.full_shape[0], 1), 0, shard.ranges))
            set_load_spec(view, LoadSpec(SCALE_DTYPES))
        return {s.scale_name: (stacked, view)}


def _expert_scalars(e_range: tuple[int, int]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """The load of a fused per-tensor scale ([E] or [E, 1]: one per expert) into per-channel rows [L, N]."""

    def load(target: torch.Tensor, full: torch.Tensor) -> None:
        mine = full.reshape(-1)[e_range[0] : e_range[1]].to(device=target.device, dtype=target.dtype)
        target.copy_(mine.unsqueeze(-1).expand(target.shape))

    return load


def experts_method_of(linear: LinearMethod, prefix: str, static_inputs: bool = False) -> ExpertsMethod:
    """The experts' method from the linear method their projections get; FP8 with static per-tensor input scales
    only for experts that take them (``static_inputs``)."""
    if linear == UNQUANTIZED:
        return UNQUANTIZED_EXPERTS
    if isinstance(linear, Fp8LinearMethod):
        if linear.scheme.activation == "tensor" and not static_inputs:
            raise ValueError(f"{prefix}: FP8 experts with static per-tensor input scales (compressed-tensors "
                             "input_activations strategy 'tensor', ModelOpt FP8) are not supported for these "
                             "experts (only Nemotron 3's take them); supported: dynamic activations (per token, or "
                             "per token and group), or the experts kept in the model dtype (named in the config's "
                             "ignore / exclude_modules)")
        return Fp8ExpertsMethod(linear.scheme)
    raise ValueError(f"{prefix}: the experts cannot take the linear method {linear.describe()}")


def uniform_experts_method(methods: dict[str, LinearMethod], prefix: str,
                           static_inputs: bool = False) -> ExpertsMethod:
    """The one experts method of projections ``methods`` (name -> linear method): they must agree (the stacked
    experts run one scheme); ``static_inputs``: as ``experts_method_of``."""
    distinct = set(methods.values())
    if len(distinct) > 1:
        by_method: dict[LinearMethod, str] = {}
        for name, m in methods.items():
            by_method.setdefault(m, name)
        (ma, a), (mb, b) = list(by_method.items())[:2]
        raise ValueError(f"{prefix}: the experts' projections are quantized differently ({a}: {ma.describe()}; "
                         f"{b}: {mb.describe()}); supported: every expert and projection of a layer alike (list the "
                         "whole layer's experts in the ignore list, or none)")
    return experts_method_of(next(iter(distinct)), prefix, static_inputs)


def experts_method_for(quant: QuantizationConfig | None, prefix: str, num_experts: int) -> ExpertsMethod:
    """The method of the stacked experts ``prefix`` (``model.layers.0.mlp.experts``): the one their projections
    (``{prefix}.{e}.gate_proj``, ``up_proj``, ``down_proj``, as the per-expert layout names them) get from
    ``quant``, which must be the same for all of them. A config with a rule of its own for experts (the checkpoint
    check of ``hyserve.layers.quantization``) has an ``experts_method(prefix, num_experts)``."""
    if quant is None:
        return UNQUANTIZED_EXPERTS
    own = getattr(quant, "experts_method", None)
    if own is not None:
        return cast(ExpertsMethod, own(prefix, num_experts))
    names = [f"{prefix}.{e}.{p}" for e in range(num_experts) for p in PROJECTIONS]
    return uniform_experts_method({n: quant.linear_method(n) for n in names}, prefix)
