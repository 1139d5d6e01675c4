"""The two abstractions of quantized linear layers: a ``QuantizationConfig`` (a checkpoint's ``quantization_config``,
or the ``quantization`` flag) says which ``LinearMethod`` each linear layer gets, by the layer's name; the method
creates the layer's parameters (with what the loader needs to fill them: shards, accepted checkpoint forms) and
computes ``x W^T``.

A layer here is one GEMM: its output rows are one or more checkpoint projections (``LinearPart``s), each with this
rank's rows of the checkpoint tensor. A method sees its layer as a ``GemmLayer``, what it needs of one (the layers of
``hyserve.layers.linear`` are such modules), so that the methods know nothing of the layer classes. Methods compare
equal when they compute the same way, so a merged projection puts consecutive parts with equal methods into one GEMM.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from hyserve.layers.sharding import Shard, set_shard


@dataclass(frozen=True, slots=True)
class LinearPart:
    """One checkpoint projection among a GEMM's output rows: its checkpoint module name relative to the merged
    layer's parent (``None`` for a layer that is a checkpoint module itself), this rank's row count, and which part
    of the checkpoint's ``(out, in)`` weight this rank holds (``Shard`` along dim 0 for a column-parallel part,
    dim 1 for a row-parallel layer; ``None`` when replicated)."""

    name: str | None
    size: int
    shard: Shard | None = None


class GemmLayer(Protocol):
    """What a ``LinearMethod`` uses of its layer: an ``nn.Module`` computing ``x W^T`` for ``parts`` (its output rows,
    ``out_features`` in all) over ``in_features`` input columns, on which the method registers its parameters."""

    in_features: int
    out_features: int
    parts: tuple[LinearPart, ...]
    weight: torch.Tensor

    def part_name(self, part: LinearPart) -> str:
        """The model-side module name of ``part``."""
        ...

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None: ...

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None: ...


class LinearMethod(ABC):
    """How a GEMM keeps its weight and computes ``x W^T`` (the bias, and a row-parallel layer's sum over ranks, are
    the layer's). Subclasses are frozen dataclasses: equal methods compute the same way."""

    #: Rows of the weight one scale covers (a block-scaled weight's block height): a part whose row count is not a
    #: multiple of it ends its GEMM in a merged projection, and tensor-parallel shards must start on it.
    row_alignment: int = 1
    quantized: bool = False

    def takes_fp8_activation(self) -> bool:
        """Whether :meth:`apply` takes an activation its producer quantized per token already
        (``hyserve.kernels.fp8.Fp8Activation``): the producer's launch then writes the FP8 values and scales, and
        the GEMM has no quantization launch of its own."""
        return False

    @abstractmethod
    def create_weights(self, layer: GemmLayer) -> None:
        """Register the layer's parameters (``weight`` and what else the method keeps), on the current default
        device; a layer whose single part has no name gets the loader's attributes on the parameters themselves."""

    @abstractmethod
    def part_tensors(self, layer: GemmLayer, index: int, row_offset: int) -> dict[str, torch.Tensor]:
        """Part ``index`` (rows ``[row_offset, row_offset + size)``) of a merged layer: its checkpoint tensors by
        parameter name (``weight``, ...), views of the layer's parameters carrying the loader's attributes."""

    @abstractmethod
    def apply(self, layer: GemmLayer, x: torch.Tensor) -> torch.Tensor:
        """``x W^T`` over the last dimension of ``x``, in ``x.dtype``."""

    def process_weights_after_loading(self, layer: GemmLayer) -> None:  # noqa: B027 (most methods need nothing)
        """Derive what the forward reads from the loaded tensors (called once, after every tensor is in)."""

    def describe(self) -> str:
        return "unquantized"


@dataclass(frozen=True, slots=True)
class UnquantizedLinearMethod(LinearMethod):
    """The weight in the model dtype; ``F.linear``."""

    def create_weights(self, layer: GemmLayer) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features), requires_grad=False)
        part = layer.parts[0]
        if part.name is None and part.shard is not None:
            set_shard(layer.weight, part.shard)

    def part_tensors(self, layer: GemmLayer, index: int, row_offset: int) -> dict[str, torch.Tensor]:
        part = layer.parts[index]
        view = layer.weight[row_offset : row_offset + part.size]
        if part.shard is not None:
            set_shard(view, part.shard)
        return {"weight": view}

    def apply(self, layer: GemmLayer, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight)

    def process_weights_after_loading(self, layer: GemmLayer) -> None:
        """With the decode GEMM on (``hyserve.kernels.gemv``), its split-K locks exist before any graph capture."""
        from hyserve.kernels.gemv import decode_gemm_enabled

        if layer.weight.is_cuda and decode_gemm_enabled():
            from hyserve.kernels.fp8 import prepare_device

            prepare_device(layer.weight.device)


UNQUANTIZED = UnquantizedLinearMethod()


class QuantizationConfig(ABC):
    """Which method each linear layer gets (and, by the names of their projections, the stacked experts of a MoE
    block: ``hyserve.layers.quantization.experts.experts_method_for``). ``name`` is a model-side module name
    (``model.layers.0.mlp.down_proj``, ``mtp.fc``); configs match it against the checkpoint's own names
    (``hyserve.layers.quantization.matching``)."""

    #: The ``quant_method`` (or flag) this config comes from, for messages.
    method_name: str = ""

    @abstractmethod
    def linear_method(self, name: str) -> LinearMethod:
        """The method of linear layer ``name`` (``UNQUANTIZED`` for a layer the config leaves in the model dtype)."""

    @abstractmethod
    def describe(self) -> str:
        """One line for the startup log: the format and its schemes."""

    @property
    def quantizes_at_load(self) -> bool:
        """Whether weights arrive unquantized and are quantized as they load (online FP8)."""
        return False
