"""CUDA graphs for the steps whose shape is fixed: decode, verify, commit, and MTP drafting.

Each kind is captured once per padded row count B (largest first, in one memory pool):

- ``decode``: every row feeds one token (pure decode, or one-token chunks). The whole model plus ``lm_head`` for B
  rows; B rows of float32 logits.
- ``verify`` (speculative decoding): every row is a verify row [last token + up to k drafts], laid out in ``k + 1``
  tokens (a row with fewer drafts is followed by masked tokens: no KV write, outputs never read). The model with
  the recurrent layers' verify path (candidates into scratch, live state read only) plus ``lm_head`` over all
  ``B * (k + 1)`` positions; the hidden states too (the MTP head consumes them).
- ``mtp``: one MTP pass with one token per row (multi-step drafting): the MTP layer, ``lm_head`` and the greedy
  draft token of every row, on the device.
- ``commit`` (speculative decoding): every recurrent layer's commit of the accepted candidates of a verify graph's
  rows (slots and accepted counts from persistent buffers; -1 rows, pads included, untouched).
- ``draft`` (MTP): the whole drafting of a verify step: the MTP layer over each row's k + 1 positions (masked
  tails), then k - 1 one-token passes fed the previous pass's greedy token and output on the device.
- ``verify<i>`` (a pipeline stage before the last): the stage's verify forward writing scratch set ``i``.
- ``snapshot``, ``draft_fill``, ``behind``, ``accept``: a verify step's candidate snapshots, the draft graph's inputs
  from the accepted counts on the device, the starts of rows behind rows in flight, greedy acceptance.
- ``verify@j``, ``accept@j``, ``behind@j`` (a speculation length chosen per step, ``spec_kind``): the same laid out in
  j + 1 tokens per row, for each j < k the engine may choose; a step at k_step = j replays these. ``draft@j``: the
  drafting of j tokens (the first pass and j - 1 chained), after a step at k_step = j (j >= 1; 1 after k_step 0).

This module captures and replays; it knows no kind's body. The room that owns a kind registers its body
(``GraphBody``: the forward, and how to lay out pad rows for capture): the runner ``decode`` and ``verify``,
``StateOps`` ``commit`` and ``snapshot``, ``MTPDrafter`` ``mtp``, ``draft`` and ``draft_fill``, ``Verifier``
``behind`` and ``accept`` (docs/worker.md).

With pipeline parallelism a later stage's graphs read the previous stage's output from a persistent input buffer
the runner receives into before the replay, and a stage before the last returns its (residual, pending MLP output)
instead of logits.

Sampling and acceptance run after the graph. Steps that fit no captured shape (prefill chunks, mixed steps,
larger batches, rows within k + 1 tokens of ``max_model_len``) run eagerly.

What a graph reads is fixed at capture (docs/design.md invariant 7): views of the runner's persistent device
buffers (input ids, positions, KV slot mapping, row offsets, context lengths, state slots, block tables at their full
width; for MTP its own set and a hidden-state input buffer), which the runner refills every step; the caches, the
state pool and the verify scratch, allocated before capture and never reallocated. Its outputs are views of
persistent buffers too (the logits of every kind share one pair of buffers), so no graph holds memory of its own past
capture beyond small activations. Host-side choices that kernels take from ints are fixed to values that hold for
every step: ``max_query_len`` = 1 or k + 1, ``max_seq_len = max_model_len`` (attention bounds each row by its own
context length, so work past a short context is skipped).

Padded rows must be harmless and must not touch anybody's state: each is a row at positions 0.. (one token, or
k + 1 <= block_size tokens) whose recurrent state is the pool's ``pad_slot`` (invariant 11), whose
verify candidates go to scratch rows no request owns in that step, whose KV writes are skipped
(``slot_mapping = -1``) and whose attention reads the null block (block 0, never handed out).

``EMULATE`` (tests on machines without CUDA) runs the same padded static forwards eagerly instead of replaying, so
the CPU suite covers the padding, the pad slot, the static metadata and the output selection; only capture and
replay themselves need a GPU.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from hyserve.layers.linear import ParallelLMHead
from hyserve.model.base import CausalLM

logger = logging.getLogger("hyserve")

# Batch sizes captured by default (those <= the limit, plus the limit itself when it is below the largest).
# Padding wastes at most a third of a step above 32 rows; larger batches run eagerly.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# Verify graphs: at most this many tokens (rows * (k + 1)) per graph, which bounds the logits buffer.
MAX_VERIFY_GRAPH_TOKENS = 512

# Tests only: run the padded static forwards eagerly where there is no GPU to capture on (worker processes read it
# from the environment: a monkeypatch does not reach them).
EMULATE = os.environ.get("HYSERVE_EMULATE_CUDA_GRAPHS") == "1"


def capture_sizes(limit: int, sizes: list[int] | None) -> list[int]:
    """The padded batch sizes to capture for at most ``limit`` rows (``sizes``: the user's list, else the default)."""
    if sizes is not None:
        bad = [s for s in sizes if not isinstance(s, int) or s < 1]
        if bad:
            raise ValueError(f"cuda_graph_sizes must be positive ints (got {bad})")
        return sorted({s for s in sizes if s <= limit})
    out = {s for s in DEFAULT_CAPTURE_SIZES if s <= limit}
    if 0 < limit < DEFAULT_CAPTURE_SIZES[-1]:
        out.add(limit)
    return sorted(out)


Forward = Callable[[int], tuple[torch.Tensor, ...]]

def spec_kind(kind: str, k_step: int, k: int) -> str:
    """The name of graph kind ``kind`` (``verify``, ``accept``, ``behind``: rows of k_step + 1 tokens; ``draft``:
    k_step drafts) captured once more for a speculation length shorter than k (hyserve.speculative.adaptive):
    ``verify@1`` lays every row out in 2 tokens, ``verify@0`` in one; the kind itself for k."""
    return kind if k_step == k else f"{kind}@{k_step}"


def weak_forward(method: Callable[..., tuple[torch.Tensor, ...]], *args: int) -> Forward:
    """``method(*args, size)`` called through a weak reference to its object: the graph sets are owned, through the
    runner, by the objects whose bodies they run, and a bound method held there would make a cycle that keeps the
    runner (weights, caches, graph pool) alive after its last reference is dropped, until a gc pass."""
    ref = weakref.WeakMethod(method)

    def forward(size: int) -> tuple[torch.Tensor, ...]:
        bound = ref()
        if bound is None:
            raise RuntimeError("the owner of this graph was released")
        return bound(*args, size)

    return forward


@dataclass(slots=True)
class GraphBody:
    """What a feature registers for one graph kind: its ``forward`` (reading persistent buffers only; made with
    ``weak_forward``) and ``fill_pads(size)``, which lays out ``size`` pad rows before capture (None: the step's
    own buffers as pad rows of the kind's layout, which the runner fills)."""

    forward: Forward
    fill_pads: Callable[[int], object] | None = None


class GraphSet:
    """One kind of captured forward, keyed by padded row count. ``forward(size)`` must read only persistent buffers
    and return views of persistent buffers (or tensors it allocates, which then live in the graph pool)."""

    def __init__(self, name: str, sizes: list[int], forward: Forward, emulate: bool) -> None:
        self.name = name
        self.sizes = sizes
        self.forward = forward
        self.emulate = emulate
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.num_replays = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def padded_size(self, num_rows: int) -> int | None:
        for s in self.sizes:
            if s >= num_rows:
                return s
        return None

    def capture(self, device: torch.device, pool: object | None, fill_pads: Callable[[int], object]) -> object | None:
        """Warm up every size (Triton compiles each specialisation), then capture, largest first; returns the pool."""
        if self.emulate or not self.sizes:
            return pool
        fill_pads(self.max_size)  # every row a pad row: harmless by construction
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self.forward(size)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):  # type: ignore[arg-type]
                self.outputs[size] = self.forward(size)
            if pool is None:
                pool = graph.pool()
            self.graphs[size] = graph
        return pool

    def run(self, size: int) -> tuple[torch.Tensor, ...]:
        """Run the forward for ``size`` padded rows over the buffers the runner just filled."""
        self.num_replays += 1
        if self.emulate:
            return self.forward(size)
        self.graphs[size].replay()
        return self.outputs[size]


class StepGraphs:
    """The runner's graph sets (``decode``, ``verify``, ``mtp``, ...; each may be absent) and their shared pool."""

    def __init__(self, sets: dict[str, GraphSet] | None = None) -> None:
        self.sets = {name: s for name, s in (sets or {}).items() if s.sizes}
        self.pool: object | None = None

    def add(self, graph_set: GraphSet) -> None:
        if graph_set.sizes:
            self.sets[graph_set.name] = graph_set

    def get(self, name: str) -> GraphSet | None:
        return self.sets.get(name)

    def fitting(self, kind: str, num_rows: int, fits: Callable[[], bool]) -> tuple[GraphSet, int] | None:
        """The captured graphs of ``kind`` and the padded size for ``num_rows`` rows, if the step ``fits`` them."""
        graphs = self.sets.get(kind)
        if graphs is None or not num_rows or not fits():
            return None
        size = graphs.padded_size(num_rows)
        return None if size is None else (graphs, size)

    @property
    def num_replays(self) -> int:
        return sum(s.num_replays for s in self.sets.values())

    @torch.inference_mode()
    def capture(self, device: torch.device, fill_pads: Mapping[str, Callable[[int], object]]) -> None:
        if not self.sets or all(s.emulate for s in self.sets.values()):
            return
        t0 = time.perf_counter()
        before = torch.cuda.memory_allocated(device)
        for name, graph_set in self.sets.items():
            self.pool = graph_set.capture(device, self.pool, fill_pads[name])
        torch.cuda.synchronize(device)
        logger.info("CUDA graphs: captured %s in %.1f s (%.0f MiB)",
                    "; ".join(f"{n} batch sizes {s.sizes}" for n, s in self.sets.items()),
                    time.perf_counter() - t0, (torch.cuda.memory_allocated(device) - before) / 2**20)


class GraphLogits:
    """The two buffers every graph writes its logits into (a prefix of each): the LM head's output in the model
    dtype, then in float32, which sampling and acceptance read."""

    def __init__(self, model: CausalLM, rows: int, vocab_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model = model
        self.lowp = torch.empty(rows, vocab_size, dtype=dtype, device=device)
        self.f32 = torch.empty(rows, vocab_size, dtype=torch.float32, device=device)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of ``hidden``'s rows, into the buffers; returns the float32 view."""
        n = hidden.shape[0]
        lowp = self.lowp[:n]
        head = self.model.lm_head
        hidden = self.model.head_input(hidden)
        if isinstance(head, ParallelLMHead) and head.sharded:  # TP: this rank's vocabulary, then all ranks'
            lowp.copy_(head.gather(torch.mm(hidden, head.weight.t())))
        else:
            torch.mm(hidden, head.weight.t(), out=lowp)
        out = self.f32[:n]
        out.copy_(lowp)
        return out
