"""Online FP8 (``quantization="fp8"`` / ``--quantization fp8`` on a bf16 or fp32 checkpoint).

As vLLM's online FP8 does, every linear layer is quantized (the projections of attention, Gated DeltaNet, the MLP
and the MTP head), each weight per output channel as it loads, with activations quantized dynamically per token;
what is not a linear layer stays in the model dtype: the embedding, the LM head (tied or not), the norms, the GDN
conv and gates.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyserve.layers.quantization.base import LinearMethod, QuantizationConfig
from hyserve.layers.quantization.fp8 import Fp8LinearMethod, Fp8Scheme

FLAG = "fp8"
_METHOD = Fp8LinearMethod(Fp8Scheme("channel", "token", online=True))


@dataclass(frozen=True, slots=True)
class OnlineFp8Config(QuantizationConfig):
    method_name = FLAG

    def linear_method(self, name: str) -> LinearMethod:
        return _METHOD

    def describe(self) -> str:
        return f"online FP8 ({_METHOD.scheme.describe()})"

    @property
    def quantizes_at_load(self) -> bool:
        return True
