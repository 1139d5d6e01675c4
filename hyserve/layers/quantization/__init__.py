"""Quantized linear layers: FP8 checkpoints in two formats, and bf16 checkpoints quantized as they load.

* compressed-tensors FP8 (``quant_method: "compressed-tensors"``, ``format: "float-quantized"``):
  :mod:`.compressed_tensors`;
* block FP8 as Qwen publishes it (``quant_method: "fp8"``, ``weight_block_size``): :mod:`.fine_grained_fp8`;
* NVIDIA ModelOpt FP8 (``quant_method: "modelopt"``, ``quant_algo: "FP8"``; per-tensor weight and static input
  scales, ``exclude_modules`` wildcards): :mod:`.modelopt`;
* online FP8 (``quantization="fp8"`` on an unquantized checkpoint): :mod:`.online_fp8`.

A checkpoint's ``quantization_config`` is read at config time (:func:`parse_quantization_config`, refusing what is
not supported, naming it); each linear layer asks the config for its method by name (``hyserve.layers.linear``),
and the FP8 method (:mod:`.fp8`) creates the FP8 weight and scales. What stays in the model dtype: everything that is
not a linear layer (the embedding, the LM head, norms, the GDN conv and gates: real checkpoints keep these in bf16,
docs/fp8_facts.md section 7, and a checkpoint that stored one in FP8 is refused at load) and the linear layers a
config leaves out (``ignore``, ``modules_to_not_convert``, untargeted).

The MTP head's layers (:func:`draft_head_quantization`) follow their checkpoint tensors: quantized with the config's
scheme where the checkpoint holds FP8 weights, unquantized where it holds bf16 (quantizers that never loaded the
head, such as llm-compressor for Qwen3.5, leave it bf16 even when a target such as ``Linear`` would name it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hyserve.kernels.fp8 import FP8_DTYPE
from hyserve.layers.quantization.base import UNQUANTIZED, LinearMethod, QuantizationConfig
from hyserve.layers.quantization.compressed_tensors import QUANT_METHOD as COMPRESSED_TENSORS
from hyserve.layers.quantization.compressed_tensors import parse_compressed_tensors
from hyserve.layers.quantization.experts import UNQUANTIZED_EXPERTS, ExpertsMethod, experts_method_for
from hyserve.layers.quantization.fine_grained_fp8 import QUANT_METHOD as FINE_GRAINED_FP8
from hyserve.layers.quantization.fine_grained_fp8 import parse_fine_grained_fp8
from hyserve.layers.quantization.matching import TEXT_PREFIX, VLM_TEXT_PREFIX, CheckpointNames
from hyserve.layers.quantization.modelopt import QUANT_METHOD as MODELOPT
from hyserve.layers.quantization.modelopt import parse_modelopt
from hyserve.layers.quantization.online_fp8 import FLAG as ONLINE_FP8
from hyserve.layers.quantization.online_fp8 import OnlineFp8Config

__all__ = ["QUANTIZATION_CHOICES", "ExpertsMethod", "LinearMethod", "QuantizationConfig", "draft_head_quantization",
           "parse_quantization_config", "quantization_summary"]

# Values of the ``quantization`` engine argument (``--quantization``).
QUANTIZATION_CHOICES = (ONLINE_FP8,)
_SUPPORTED_TEXT = ("compressed-tensors (FP8, format float-quantized), fp8 (block FP8 with weight_block_size), "
                   "modelopt (quant_algo FP8)")


def parse_quantization_config(raw: dict[str, Any], architecture: str,
                              quantization: str | None = None) -> QuantizationConfig | None:
    """The quantization of the checkpoint whose config.json is ``raw`` (its ``quantization_config``, at the top level
    or in ``text_config``), with the ``quantization`` engine argument applied: ``"fp8"`` quantizes an unquantized
    checkpoint at load and agrees with an ``fp8`` one; ``None`` when nothing is quantized."""
    if quantization not in (None, *QUANTIZATION_CHOICES):
        raise ValueError(f"quantization={quantization!r} is not supported; supported: {', '.join(QUANTIZATION_CHOICES)}"
                         " (FP8 checkpoints load without it: their config.json says how they are quantized)")
    qc = raw.get("quantization_config")
    if qc is None:
        qc = (raw.get("text_config") or {}).get("quantization_config")
    if qc is None:
        return OnlineFp8Config() if quantization == ONLINE_FP8 else None
    if not isinstance(qc, dict):
        raise ValueError(f"config.json: quantization_config must be an object (got {qc!r})")
    method = qc.get("quant_method")
    names = CheckpointNames(VLM_TEXT_PREFIX if architecture.endswith("ForConditionalGeneration") else TEXT_PREFIX)
    if method == COMPRESSED_TENSORS:
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} does not match the checkpoint, which is quantized with "
                             f"{COMPRESSED_TENSORS}; leave --quantization unset (FP8 checkpoints load without it)")
        return parse_compressed_tensors(qc, names)
    if method == FINE_GRAINED_FP8:
        return parse_fine_grained_fp8(qc, names)
    if method == MODELOPT:
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} does not match the checkpoint, which is quantized with "
                             f"{MODELOPT}; leave --quantization unset (FP8 checkpoints load without it)")
        return parse_modelopt(qc, names)
    raise ValueError(f"unsupported quant_method {method!r} in config.json's quantization_config; supported: "
                     f"{_SUPPORTED_TEXT}")


@dataclass(frozen=True, slots=True)
class DraftHeadQuantization(QuantizationConfig):
    """The draft head's quantization: ``base``'s method for the layers whose checkpoint weight is FP8
    (``fp8_modules``), unquantized for the others; an online config quantizes every layer."""

    base: QuantizationConfig
    fp8_modules: frozenset[str]

    @property
    def method_name(self) -> str:  # type: ignore[override]
        return self.base.method_name

    def linear_method(self, name: str) -> LinearMethod:
        method = self.base.linear_method(name)
        if self.base.quantizes_at_load:
            return method
        if name not in self.fp8_modules:
            return UNQUANTIZED
        if not method.quantized:
            raise ValueError(f"{name}.weight is FP8 in the checkpoint, but its quantization_config "
                             f"({self.base.method_name}) leaves that layer unquantized (ignore / "
                             "modules_to_not_convert / targets)")
        return method

    def experts_method(self, prefix: str, num_experts: int) -> ExpertsMethod:
        method = experts_method_for(self.base, prefix, num_experts)
        if self.base.quantizes_at_load:
            return method
        if f"{prefix}.gate_up_proj" not in self.fp8_modules and f"{prefix}.0.gate_proj" not in self.fp8_modules:
            return UNQUANTIZED_EXPERTS
        if not method.quantized:
            raise ValueError(f"{prefix} are FP8 in the checkpoint, but its quantization_config "
                             f"({self.base.method_name}) leaves them unquantized (ignore / modules_to_not_convert / "
                             "targets)")
        return method

    def describe(self) -> str:
        return self.base.describe()

    @property
    def quantizes_at_load(self) -> bool:
        return self.base.quantizes_at_load


def draft_head_quantization(quant: QuantizationConfig | None,
                            weights: dict[str, torch.Tensor]) -> QuantizationConfig | None:
    """The quantization of the draft head whose checkpoint tensors are ``weights`` (names as stored: ``mtp.*``;
    FP8 modules by name, and fused experts' FP8 tensors such as ``mtp.layers.0.mlp.experts.gate_up_proj``)."""
    if quant is None:
        return None
    fp8 = frozenset(n.removesuffix(".weight") for n, t in weights.items() if t.dtype == FP8_DTYPE)
    return DraftHeadQuantization(quant, fp8)


def quantization_summary(model: nn.Module, quant: QuantizationConfig | None, dtype: torch.dtype) -> str | None:
    """One line for the startup log: the scheme, how many linear layers (checkpoint projections) are FP8 and how
    many stayed in ``dtype``, how many MoE layers' experts are FP8, and the bytes of the FP8 weights and their
    scales. ``None`` when nothing is quantized."""
    from hyserve.layers.linear import LinearBase

    if quant is None:
        return None
    fp8 = kept = experts = 0
    fp8_bytes = scale_bytes = 0
    for m in model.modules():
        experts_method = getattr(m, "method", None)
        if isinstance(m, LinearBase):
            if not m.method.quantized:
                kept += len(m.parts)
                continue
            fp8 += len(m.parts)
        elif isinstance(experts_method, ExpertsMethod) and experts_method.quantized:
            experts += 1
        else:
            continue
        for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            if t.dtype == FP8_DTYPE:
                fp8_bytes += t.numel()
            elif name != "bias":
                scale_bytes += t.numel() * t.element_size()
    dtype_name = str(dtype).removeprefix("torch.")
    moe = f", the experts of {experts} MoE layers in FP8" if experts else ""
    return (f"quantization: {quant.describe()}: {fp8} linear layers in FP8, {kept} kept in {dtype_name} (and the "
            f"embedding, LM head and norms){moe}; FP8 weights {fp8_bytes / 2**20:.2f} MiB + scales "
            f"{scale_bytes / 2**20:.2f} MiB")
