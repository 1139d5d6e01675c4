"""hyserve: an inference engine for hybrid recurrent/attention LLMs (Qwen3.5 Gated DeltaNet + full attention)."""

from hyserve.llm import LLM
from hyserve.outputs import CompletionOutput, RequestOutput
from hyserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams",
           "__version__"]
