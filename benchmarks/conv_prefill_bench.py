"""The causal conv's prefill launch on one GPU (``hyserve.kernels.conv``, GDN's short convolution and Mamba2's), at
the conv widths of the Qwen3.5 2B / 9B / 27B shapes and Nemotron-H-8B's (with its bias), against the card's copy
bandwidth and against the launch every block ran before 2026-12-05 (ninth session).

    python benchmarks/conv_prefill_bench.py --out $OUT                  # 8 rows x 2048 tokens (the default step)
    python benchmarks/conv_prefill_bench.py --rows 32 --row-len 512 --shapes 9b

What is timed, per shape (median of 20 launches after 3 warm-ups, CUDA events):

- ``now``: ``causal_conv1d_varlen_triton`` as the layers call it (``x`` a strided view of the input projection's
  output, as GDN's ``in_proj`` split gives it; rows on shuffled slots);
- ``before``: the same launch with every token block taking the row-start path (taps read through the window's
  masks) in 16-token blocks: what every block ran before 2026-12-05 (the kernel's source, mutated by
  :func:`hyserve.testing.triton_interpreter.mutated_module`; only the grid's order, channel blocks fastest, and the
  early exit of blocks past a row's end differ), so the gain is measured in one process on one card;
- ``copy``: ``torch.Tensor.copy_`` of the same ``(T, D)`` bytes (read and written once): the bound this pass can
  reach, measured on the card.

The outputs of ``now`` and ``before`` are compared (max abs difference; 0 expected: the same float32 sums).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hyserve.kernels.conv import causal_conv1d_varlen_triton
from hyserve.testing.triton_interpreter import mutated_module

conv_triton = importlib.import_module("hyserve.kernels.conv._triton")  # the kernel the launcher reads at each call

# (conv width D, the input projection's row width the conv's x is a view of, bias): Qwen3.5's GDN (key heads 16,
# value heads 16 / 32 / 48, 128 dims: D = 2 * 16 * 128 + Hv * 128; in_proj adds z (Hv * 128), b and a (Hv each));
# Nemotron-H-8B's Mamba2 (d_inner 8192 + 2 * 8 groups * 128 states; in_proj adds z and the time steps).
SHAPES = {"2b": (6144, 6144 + 2048 + 32, False), "9b": (8192, 8192 + 4096 + 64, False),
          "27b": (10240, 10240 + 6144 + 96, False), "n8b": (10240, 10240 + 8192 + 128, True)}
K = 4


def problem(d: int, width: int, bias: bool, rows: int, row_len: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(d + rows)
    t = rows * row_len
    pool = rows + 8
    wide = torch.randn(t, width, device="cuda", generator=g).bfloat16()
    return dict(x=wide[:, :d], weight=(torch.randn(d, K, device="cuda", generator=g) * 0.5).bfloat16(),
                conv_state=torch.randn(pool, d, K - 1, device="cuda", generator=g).bfloat16(),
                state_slots=torch.randperm(pool, device="cuda", generator=g)[:rows],
                query_start_loc=torch.arange(0, t + 1, row_len, device="cuda", dtype=torch.int32),
                max_query_len=row_len,
                bias=torch.randn(d, device="cuda", generator=g).bfloat16() if bias else None)


def event_time(fn: Callable[[], Any], reps: int = 20) -> float:
    """Median microseconds of ``fn`` over ``reps`` launches after 3 warm-ups."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return sorted(times)[len(times) // 2]


def before_kernel() -> Any:
    """The forward kernel with the row-start path taken by every token block (as before this change)."""
    return mutated_module(conv_triton.__name__, [("if tb * BLOCK_T >= K - 1:", "if tb * BLOCK_T < 0:")]
                          )._conv1d_fwd_kernel


def run(args: argparse.Namespace) -> dict[str, Any]:
    new = conv_triton._conv1d_fwd_kernel
    old = before_kernel()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "rows": args.rows, "row_len": args.row_len, "results": []}
    for name in args.shapes:
        d, width, bias = SHAPES[name]
        p = problem(d, width, bias, args.rows, args.row_len)
        t = p["x"].shape[0]
        state0 = p["conv_state"].clone()
        row: dict[str, Any] = {"shape": name, "D": d, "tokens": t, "bias": bias}

        def launch(p: dict[str, Any] = p, block_t: int | None = None) -> torch.Tensor:
            return causal_conv1d_varlen_triton(**p, block_t=block_t)

        row["now_us"] = event_time(launch)
        p["conv_state"].copy_(state0)
        y_now = launch()
        conv_triton._conv1d_fwd_kernel = old
        try:
            row["before_us"] = event_time(lambda: launch(block_t=16))
            p["conv_state"].copy_(state0)
            y_before = launch(block_t=16)
        finally:
            conv_triton._conv1d_fwd_kernel = new
        src = p["x"].contiguous()
        dst = torch.empty_like(src)
        row["copy_us"] = event_time(lambda src=src, dst=dst: dst.copy_(src))
        row["max_abs_diff"] = float((y_now.float() - y_before.float()).abs().max())
        gb = 2 * t * d * 2 / 1e9
        row["now_tb_s"] = gb / row["now_us"] * 1e6 / 1000
        row["copy_tb_s"] = gb / row["copy_us"] * 1e6 / 1000
        row["now_vs_before"] = row["before_us"] / row["now_us"]
        row["now_vs_copy"] = row["copy_us"] / row["now_us"]
        out["results"].append(row)
        print(f"{name}: D={d} T={t} now {row['now_us']:.1f} us ({row['now_tb_s']:.2f} TB/s), before "
              f"{row['before_us']:.1f} us ({row['now_vs_before']:.2f}x), copy {row['copy_us']:.1f} us "
              f"({row['now_vs_copy']:.2f} of the copy's rate), max diff {row['max_abs_diff']:.3g}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--row-len", type=int, default=2048)
    ap.add_argument("--out", default=None, help="directory for conv_prefill_bench.json")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    result = run(args)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "conv_prefill_bench.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
