"""Host time of one engine step with the model taken out: what a GPU would wait on between graph replays.

The graphs are emulated on the CPU (``hyserve.worker.cuda_graphs.EMULATE``) and each graph kind's replay returns
outputs cached from its first run, so a step costs only the host work around the model: scheduling, filling the
step buffers, sampling or acceptance, commit, MTP bookkeeping, outputs and detokenization. Eager work that is not
in a graph (the CPU references of the commit kernels, eager MTP passes) still runs. Tiny random checkpoint with the
2B shape's layer pattern (24 layers), bf16, prefix caching on.

    python benchmarks/host_overhead.py [--batches 1,32] [--steps 50]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch

from hyserve import LLM, SamplingParams
from hyserve.testing import write_tiny_checkpoint
from hyserve.worker import cuda_graphs


def _stub_replays(llm: LLM) -> None:
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None
    for graph_set in graphs.sets.values():
        cached: dict[int, tuple[torch.Tensor, ...]] = {}
        run = graph_set.run

        def stub(size: int, _run: Any = run, _cached: dict[int, tuple[torch.Tensor, ...]] = cached) -> Any:
            if size not in _cached:
                _cached[size] = tuple(t.clone() for t in _run(size))
            return _cached[size]

        graph_set.run = stub  # type: ignore[method-assign]


def host_ms_per_step(path: str, batch: int, steps: int, spec: dict[str, Any] | None,
                     async_scheduling: bool = False) -> float:
    llm = LLM(model=path, device="cpu", dtype="bfloat16", max_num_seqs=max(batch, 8), speculative_config=spec,
              async_scheduling=async_scheduling)
    eng = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=4 * steps + 64, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"r{i}", {"prompt_token_ids": list(range(1 + i, 40 + i))}, params)
    for _ in range(3):  # prefill, then decode with every graph size in use captured
        eng.step()
    _stub_replays(llm)
    for _ in range(3):
        eng.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3  # the median: robust to the machine's noise and to GC pauses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cuda_graphs.EMULATE = True
    pattern = (["linear_attention"] * 3 + ["full_attention"]) * 6
    path = write_tiny_checkpoint(tempfile.mkdtemp(), layer_types=pattern, dtype=torch.bfloat16,
                                 tie_word_embeddings=True, with_mtp=True)
    print("| step | batch | host ms per step (median) |\n| --- | ---: | ---: |")
    mtp = {"method": "mtp", "num_speculative_tokens": 3}
    for name, spec, behind in (("decode", None, False), ("speculative, MTP k = 3", mtp, False),
                               ("speculative, MTP k = 3, async (rows behind)", mtp, True)):
        for batch in (int(b) for b in args.batches.split(",")):
            ms = host_ms_per_step(path, batch, args.steps, spec, async_scheduling=behind)
            print(f"| {name} | {batch} | {ms:.2f} |", flush=True)


if __name__ == "__main__":
    main()
