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

``--sweep`` also times the launch as the layers make it (GDN: ``causal_conv1d_split_triton``, q and k apart from v
and l2-normed per 128-channel head; Mamba2: the plain launch with its bias) at the shipped token block and warps and
at each ``(block_t, num_warps)`` of :data:`SWEEP` (``sweep`` in the JSON: microseconds, TB/s, the best), each
output compared with the shipped launch's (0 expected).
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

from hyserve.kernels.conv import causal_conv1d_split_triton, causal_conv1d_varlen_triton
from hyserve.testing.triton_interpreter import mutated_module

conv_triton = importlib.import_module("hyserve.kernels.conv._triton")  # the kernel the launcher reads at each call

# (conv width D, the input projection's row width the conv's x is a view of, bias): Qwen3.5's GDN (key heads 16,
# value heads 16 / 32 / 48, 128 dims: D = 2 * 16 * 128 + Hv * 128; in_proj adds z (Hv * 128), b and a (Hv each));
# Nemotron-H-8B's Mamba2 (d_inner 8192 + 2 * 8 groups * 128 states; in_proj adds z and the time steps).
SHAPES = {"2b": (6144, 6144 + 2048 + 32, False), "9b": (8192, 8192 + 4096 + 64, False),
          "27b": (10240, 10240 + 6144 + 96, False), "n8b": (10240, 10240 + 8192 + 128, True)}
K = 4
SWEEP = [(32, 4), (32, 8), (64, 4), (64, 8), (128, 4), (128, 8), (256, 8)]
QK = {"2b": 2 * 16 * 128, "9b": 2 * 16 * 128, "27b": 2 * 16 * 128}  # GDN's q and k channels (16 key heads of 128)


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
        if args.sweep:
            row["sweep"] = sweep(name, p, state0)
        out["results"].append(row)
        print(f"{name}: D={d} T={t} now {row['now_us']:.1f} us ({row['now_tb_s']:.2f} TB/s), before "
              f"{row['before_us']:.1f} us ({row['now_vs_before']:.2f}x), copy {row['copy_us']:.1f} us "
              f"({row['now_vs_copy']:.2f} of the copy's rate), max diff {row['max_abs_diff']:.3g}", flush=True)
    return out


def sweep(name: str, p: dict[str, Any], state0: torch.Tensor) -> list[dict[str, Any]]:
    """The layers' own launch (GDN's split and normed form; Mamba2's plain one) per ``(block_t, num_warps)``."""
    def launch(block_t: int | None = None, num_warps: int = 4) -> Any:
        p["conv_state"].copy_(state0)
        if name in QK:
            return causal_conv1d_split_triton(p["x"], p["weight"], p["conv_state"], p["state_slots"],
                                              p["query_start_loc"], QK[name], p["max_query_len"], norm_dim=128,
                                              block_t=block_t, num_warps=num_warps)
        return causal_conv1d_varlen_triton(**p, block_t=block_t, num_warps=num_warps)

    def flat(y: Any) -> torch.Tensor:
        return torch.cat([t.float().flatten() for t in y]) if isinstance(y, tuple) else y.float().flatten()

    want = flat(launch())
    gb = 2 * p["x"].shape[0] * p["x"].shape[1] * 2 / 1e9
    rows: list[dict[str, Any]] = [{"block_t": None, "num_warps": 4, "us": event_time(launch)}]
    for block_t, warps in SWEEP:
        got = flat(launch(block_t, warps))
        rows.append({"block_t": block_t, "num_warps": warps, "max_abs_diff": float((got - want).abs().max()),
                     "us": event_time(lambda b=block_t, w=warps: launch(b, w))})
    for r in rows:
        r["tb_s"] = gb / r["us"] * 1e3
    best = min(rows, key=lambda r: r["us"])
    print(f"  {name} as the layers launch it: shipped {rows[0]['us']:.1f} us ({rows[0]['tb_s']:.2f} TB/s), best "
          f"block_t={best['block_t']} warps={best['num_warps']} {best['us']:.1f} us ({best['tb_s']:.2f} TB/s); "
          f"largest diff {max(r.get('max_abs_diff', 0.0) for r in rows):.3g}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--row-len", type=int, default=2048)
    ap.add_argument("--out", default=None, help="directory for conv_prefill_bench.json")
    ap.add_argument("--sweep", action="store_true", help="the layers' own launch per token block and warps")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    result = run(args)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "conv_prefill_bench.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
