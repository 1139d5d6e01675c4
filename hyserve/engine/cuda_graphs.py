"""CUDA graphs for decode steps: one graph per padded batch size, replayed over the runner's persistent buffers.

A step qualifies when every row feeds exactly one token and none verifies drafts (pure decode, or one-token chunks).
Its R rows are padded to the next captured size B; the graph runs the whole model plus ``lm_head`` for B rows and
yields ``(B, V)`` float32 logits. Sampling stays outside the graph.

What the graph reads is fixed at capture (invariant 7): views of the runner's device buffers (input ids, positions,
KV slot mapping, row offsets, context lengths, state slots, block tables at their full width), which ``prepare``
refills every step; the caches and the state pool, allocated before capture and never reallocated. Host-side
choices that the kernels take from ints are fixed to values that hold for every step: ``max_query_len = 1`` and
``max_seq_len = max_model_len`` (the decode attention kernel bounds each row by its own context length, so
splits past a short context do no work).

Padded rows must be harmless and must not touch anybody's state: each is a one-token row at position 0 whose
recurrent state is the pool's ``pad_slot`` (invariant 3 of ``state_pool``), whose KV write is skipped
(``slot_mapping = -1``) and whose attention reads the null block (block 0, never handed out).

``EMULATE`` (tests on machines without CUDA) runs the same padded static forward eagerly instead of replaying a
graph, so the CPU suite covers the padding, the pad slot, the full-width block tables and the logits selection;
only capture and replay themselves need a GPU.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from hyserve.model.metadata import StepMetadata

if TYPE_CHECKING:
    from hyserve.engine.model_runner import ModelRunner

logger = logging.getLogger("hyserve")

# Decode batch sizes captured by default (those <= max_num_seqs, plus max_num_seqs itself when it is below the
# largest). Padding wastes at most a third of a step above 32 rows; larger batches run eagerly.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)

# Tests only: run the padded static forward eagerly where there is no GPU to capture on.
EMULATE = False


def capture_sizes(max_num_seqs: int, sizes: list[int] | None) -> list[int]:
    if sizes is not None:
        bad = [s for s in sizes if not isinstance(s, int) or s < 1]
        if bad:
            raise ValueError(f"cuda_graph_sizes must be positive ints (got {bad})")
        return sorted({s for s in sizes if s <= max_num_seqs})
    out = {s for s in DEFAULT_CAPTURE_SIZES if s <= max_num_seqs}
    if max_num_seqs < DEFAULT_CAPTURE_SIZES[-1]:
        out.add(max_num_seqs)
    return sorted(out)


def graph_memory_estimate(runner: ModelRunner, max_size: int) -> int:
    """Bytes a graph pool for batches up to ``max_size`` takes: the logits (model dtype, then float32) dominate."""
    cfg = runner.model_config
    elem = torch.finfo(runner.dtype).bits // 8
    width = max(cfg.hidden_size, cfg.intermediate_size, cfg.conv_dim + cfg.linear_value_dim,
                2 * cfg.num_attention_heads * cfg.head_dim)
    return max_size * (cfg.vocab_size * (4 + elem) + 16 * width * elem) + 64 * 2**20


class DecodeGraphs:
    """Captured decode forwards keyed by padded batch size; see the module docstring."""

    def __init__(self, runner: ModelRunner, sizes: list[int], emulate: bool = False) -> None:
        self.runner = runner
        self.sizes = sizes
        self.emulate = emulate
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.metas: dict[int, StepMetadata] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool: Any = None  # the graph memory pool handle, shared by every size
        self.num_replays = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def padded_size(self, num_rows: int) -> int | None:
        for s in self.sizes:
            if s >= num_rows:
                return s
        return None

    def _static_meta(self, size: int) -> StepMetadata:
        d = self.runner.dev_bufs
        return StepMetadata(
            positions=d["positions"][:size], query_start_loc=d["query_start_loc"][: size + 1],
            seq_lens=d["seq_lens"][:size], state_slots=d["state_slots"][:size],
            block_tables=d["block_tables"][:size], slot_mapping=d["slot_mapping"][:size],
            max_query_len=1, max_seq_len=self.runner.max_model_len,
        )

    def _forward(self, size: int) -> torch.Tensor:
        model = self.runner.model
        hidden = model(self.runner.dev_bufs["input_ids"][:size], self.metas[size])
        return model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Build each size's static metadata and, on CUDA, warm up and capture its graph (largest first, one pool)."""
        t0 = time.perf_counter()
        runner = self.runner
        for size in self.sizes:
            self.metas[size] = self._static_meta(size)
        if self.emulate:
            return
        device = runner.device
        before = torch.cuda.memory_allocated(device)
        runner.prepare([], pad_to=self.max_size)  # every row a pad row
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):  # compile every kernel specialisation before any capture
                self._forward(size)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[size] = self._forward(size)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(device)
        logger.info("CUDA graphs: captured decode batch sizes %s in %.1f s (%.0f MiB)", self.sizes,
                    time.perf_counter() - t0, (torch.cuda.memory_allocated(device) - before) / 2**20)

    def run(self, size: int) -> torch.Tensor:
        """Run the decode forward for ``size`` padded rows over the buffers ``prepare`` just filled; ``(size, V)``."""
        self.num_replays += 1
        if self.emulate:
            return self._forward(size)
        self.graphs[size].replay()
        return self.logits[size]
