"""One timed window of steady decode, shared by the benchmarks that measure decode tokens/s.

``batch`` requests of ``prompt_len`` random tokens are added and stepped until every row decodes; then ``steps``
engine steps run back to back, with no synchronization between them (async scheduling may overlap them), and the
requests are aborted and drained. Uses only the engine's public surface, so it also measures older trees.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from hyserve import SamplingParams


def decode_window(eng: Any, batch: int, steps: int, g: torch.Generator, prompt_len: int = 512,
                  on_start: Callable[[], None] | None = None) -> tuple[float, int]:
    """(wall seconds, output tokens) of ``steps`` decode steps at ``batch`` rows; ``on_start`` runs as timing starts."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    vocab = eng.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    ids = [f"dec{batch}-{i}-{time.perf_counter_ns()}" for i in range(batch)]
    for rid in ids:
        eng.add_request(rid, {"prompt_token_ids": torch.randint(0, vocab, (prompt_len,), generator=g).tolist()},
                        params)
    while eng.scheduler.waiting or any(r.num_output_tokens < 3 for r in eng.scheduler.running):
        eng.step()
    before = sum(r.num_output_tokens for r in eng.scheduler.running)
    sync()
    if on_start is not None:
        on_start()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync()
    wall = time.perf_counter() - t0
    tokens = sum(r.num_output_tokens for r in eng.scheduler.running) - before
    eng.abort_request(ids)
    while eng.has_unfinished_requests():
        eng.step()
    return wall, tokens
