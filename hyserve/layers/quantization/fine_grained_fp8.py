"""Block FP8 as Qwen publishes it (``quant_method: "fp8"``, the "fine-grained FP8" of DeepSeek-V3).

Fields (docs/fp8_facts.md sections 1 and 6): ``fmt: "e4m3"``, ``activation_scheme: "dynamic"``,
``weight_block_size: [bn, bk]``, and the layers kept in bf16 in ``modules_to_not_convert`` and/or ``ignored_layers``
(both honoured: a layer in either stays unquantized). A quantized layer stores ``weight`` in float8_e4m3fn and
``weight_scale_inv`` of shape ``(ceil(out / bn), ceil(in / bk))``, which despite its name multiplies on dequantization;
activations are quantized dynamically per token and ``bk``-wide group of the input.

List entries are module names, matched exactly (as vLLM's ``is_layer_skipped`` does), in either Qwen3.5 form
(``hyserve.layers.quantization.matching``). transformers' config also writes ``dequantize`` (load-time conversion to
bf16, refused when set) and ``scale_fmt`` (``"ue8m0"`` rounds activation scales to powers of two, refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyserve.layers.quantization.base import UNQUANTIZED, LinearMethod, QuantizationConfig
from hyserve.layers.quantization.fp8 import Fp8LinearMethod, Fp8Scheme
from hyserve.layers.quantization.matching import CheckpointNames, check_entries, matches

QUANT_METHOD = "fp8"
SCALE_NAME = "weight_scale_inv"
_KEYS = ("quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert", "ignored_layers",
         "dequantize", "scale_fmt")


@dataclass(frozen=True, slots=True)
class FineGrainedFp8Config(QuantizationConfig):
    scheme: Fp8Scheme
    not_converted: tuple[str, ...]
    names: CheckpointNames

    method_name = QUANT_METHOD

    def linear_method(self, name: str) -> LinearMethod:
        forms = self.names.forms(name)
        if any(matches(e, forms, regex=False, classes=False) for e in self.not_converted):
            return UNQUANTIZED
        return Fp8LinearMethod(self.scheme)

    def describe(self) -> str:
        return f"block FP8 ({self.scheme.describe()})"


def parse_fine_grained_fp8(qc: dict[str, Any], names: CheckpointNames) -> FineGrainedFp8Config:
    unknown = sorted(set(qc) - set(_KEYS))
    if unknown:
        raise ValueError(f"quantization_config (quant_method 'fp8'): unsupported field(s) "
                         f"{', '.join(map(repr, unknown))} (supported fields: {', '.join(_KEYS)})")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quant_method 'fp8': fmt {qc['fmt']!r} is not supported; supported: 'e4m3'")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quant_method 'fp8': activation_scheme {scheme!r} is not supported; supported: 'dynamic'")
    block = qc.get("weight_block_size")
    if block is None:
        raise ValueError("quant_method 'fp8' without weight_block_size (per-tensor FP8) is not supported; supported: "
                         "block FP8 (weight_block_size [128, 128]), or compressed-tensors FP8")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(v, int) and v > 0 for v in block)):
        raise ValueError(f"quant_method 'fp8': weight_block_size must be two positive integers (got {block!r})")
    if qc.get("dequantize") not in (None, False):
        raise ValueError("quant_method 'fp8': dequantize true (convert to bf16 at load) is not supported; supported: "
                         "false (load a bf16 checkpoint instead)")
    if qc.get("scale_fmt") not in (None, "float"):
        raise ValueError(f"quant_method 'fp8': scale_fmt {qc['scale_fmt']!r} is not supported; supported: 'float'")
    lists: list[str] = []
    for key in ("modules_to_not_convert", "ignored_layers"):
        entries = qc.get(key) or []
        if not isinstance(entries, list):
            raise ValueError(f"quantization_config.{key} must be a list (got {entries!r})")
        check_entries(entries, key, regex=False)
        lists.extend(entries)
    fp8 = Fp8Scheme("block", "group", (block[0], block[1]), SCALE_NAME)
    return FineGrainedFp8Config(fp8, tuple(dict.fromkeys(lists)), names)
