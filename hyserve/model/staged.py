"""The causal LM around a decoder stack split into pipeline stages, as the Mamba2 families (Nemotron-H, Granite-4.0-H,
Falcon-H1) lay it out: what the loader asks of a stage (``holds``), the tied or untied vocabulary-parallel LM head,
its logits and the input embedding. Each family names its stack, embedding and final norm as its checkpoints do.

Each block of these stacks returns its output as a delta still to be added to the residual stream, and the next
block's first norm adds it (``ScaledRMSNorm.add``: the add fused into the norm's launch); ``stage_output`` adds the
last one into the final norm, or, on a stage before the last, into the residual stream it hands over."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hyserve.layers.linear import ParallelLMHead
from hyserve.layers.norm import ScaledRMSNorm
from hyserve.model.base import CausalLM
from hyserve.model.metadata import StepMetadata
from hyserve.model.qwen3_5 import Intermediate


def stage_output(x: torch.Tensor, pending: torch.Tensor | None, norm: ScaledRMSNorm | None,
                 scale: float = 1.0) -> torch.Tensor | Intermediate:
    """The end of a stage whose last block left ``pending`` (its output, or None) to add to the residual stream
    ``x`` as ``x + pending * scale``: the last stage's final ``norm`` of the sum, the add fused in; a stage before
    the last (``norm`` None) hands the next the whole residual stream, the add made as the next block's norm would
    make it (the same roundings)."""
    if norm is not None:
        return norm(x) if pending is None else norm.add(x, pending, scale)[1]
    if pending is not None:
        x = x + pending if scale == 1.0 else x + pending * scale
    return (x,)


class StagedCausalLM(CausalLM):
    """``self.<STACK>`` holds the layers ``[start, end)`` of this pipeline stage (``is_first`` / ``is_last``), its
    input embedding ``<EMBED>`` (None where the stage does not read it) and, on the last stage, the final norm
    ``<NORM>``; the last stage also holds ``lm_head`` (``make_head``)."""

    STACK = "model"
    EMBED = "embed_tokens"
    NORM = "norm"

    def stack(self) -> Any:
        return getattr(self, self.STACK)

    def make_head(self, hidden_size: int, vocab_size: int, tie: bool) -> None:
        """The last stage's LM head, its weight the input embedding's when ``tie`` (the stage then holds both)."""
        if self.stack().is_last:
            self.lm_head = ParallelLMHead(hidden_size, vocab_size)
            if tie:
                self.lm_head.weight = self.input_embeddings().weight

    def forward(self, input_ids: torch.Tensor, meta: StepMetadata,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        return self.stack()(input_ids, meta, intermediate)  # type: ignore[no-any-return]

    def holds(self, name: str) -> bool:
        s, p = self.stack(), self.STACK
        if name.startswith(f"{p}.layers."):
            return bool(s.start <= int(name.split(".")[2]) < s.end)
        if name.startswith(f"{p}.{self.EMBED}."):
            return getattr(s, self.EMBED) is not None
        if name.startswith((f"{p}.{self.NORM}.", "lm_head.")):
            return bool(s.is_last)
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        logits = head(self.head_input(hidden))
        return (head.gather(logits) if isinstance(head, ParallelLMHead) else logits).float()

    def input_embeddings(self) -> nn.Embedding:
        embed = getattr(self.stack(), self.EMBED)
        assert embed is not None, "this pipeline stage holds no embedding"
        return embed  # type: ignore[no-any-return]
