"""A Mamba2 layer's verify step on one GPU: the verify kernel over k + 1 tokens a row (n-gram drafts) and the commit
that rebuilds the accepted state (``mamba2_replay``, every draft accepted: the longest replay), against a plain
decode step's recurrent kernel over one token a row, at the Nemotron shapes.

    python benchmarks/mamba2_verify_bench.py --out $OUT     # 8B and Nano heads; batch 1, 8, 32, 64; k 0-3

What it shows: the SSM state traffic of a verify step (4.2 MB a row on the 8B: 128 float32 heads of 64 x 128). A
plain decode step reads and writes each row's state once (2 passes); the verify and its commit read it twice and
write it once (3 passes), whatever k (a position's stashed inputs are 37 KB). Keeping every candidate state instead,
as hyserve did until 2026-12-05, wrote k + 1 states and copied one back: 4 + k passes. The table gives the measured
time of each, the bandwidth on those passes, and the ratio verify / plain beside the passes' ratio 3 / 2.

Each variant is captured in a CUDA graph of 20 calls and replayed; the median time per call of 10 replays.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from gdn_decode_bench import graph_time  # benchmarks/ is on the path (above)
from gdn_verify_bench import report

from hyserve.kernels.mamba2 import mamba2_recurrent_triton, mamba2_stash_shapes
from hyserve.kernels.mamba2.verify import mamba2_replay_triton, mamba2_verify_triton

# (heads, head_dim, groups, state size): benchmarks/shapes.py's Nemotron-H-8B and Nemotron 3 Nano 30B-A3B
SHAPES = {"n8b": (128, 64, 8, 128), "n30": (64, 64, 8, 128)}


def problem(batch: int, q: int, shape: tuple[int, int, int, int], state_dtype: torch.dtype) -> dict[str, Any]:
    """Rows of ``q`` tokens on shuffled slots of a pool with room for 8 more; x, B, C views of one conv output."""
    h, p, g, n = shape
    gen = torch.Generator(device="cuda").manual_seed(batch * 131 + h + q)
    t = batch * q
    mixed = torch.randn(t, h * p + 2 * g * n, device="cuda", generator=gen).to(torch.bfloat16)
    xs, bs, cs = mixed.split([h * p, g * n, g * n], dim=-1)
    pool = batch + 8
    return dict(x=xs.reshape(t, h, p), dt=torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16),
                A_log=torch.zeros(h, device="cuda"), B=bs.reshape(t, g, n), C=cs.reshape(t, g, n),
                D=torch.ones(h, device="cuda"), dt_bias=torch.zeros(h, device="cuda"), dt_limit=(0.0, float("inf")),
                ssm_state=(torch.randn(pool, h, p, n, device="cuda", generator=gen) * 0.3).to(state_dtype),
                state_slots=torch.randperm(pool, device="cuda", generator=gen)[:batch],
                query_start_loc=torch.arange(batch + 1, device="cuda", dtype=torch.int32) * q)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--k", nargs="+", type=int, default=[0, 1, 2, 3])
    ap.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=None, help="a directory for mamba2_verify_bench.json")
    args = ap.parse_args()
    state_dtype = getattr(torch, args.state_dtype)
    rows = []
    for name in args.shapes:
        shape = SHAPES[name]
        h, p, g, n = shape
        for batch in args.batch:
            plain = problem(batch, 1, shape, state_dtype)
            plain_us = graph_time(lambda pl=plain: mamba2_recurrent_triton(**pl))
            state_pass = batch * h * p * n * plain["ssm_state"].element_size()
            for k in args.k:
                pr = problem(batch, k + 1, shape, state_dtype)
                stash = {nm: torch.empty((batch, k + 1, *s), device="cuda", dtype=torch.float32)
                         for nm, s in mamba2_stash_shapes(h, p, g, n).items()}
                counts = torch.full((batch,), k, device="cuda", dtype=torch.long)
                slots = pr["state_slots"]

                def step(pr: dict[str, Any] = pr, stash: dict[str, torch.Tensor] = stash,
                         counts: torch.Tensor = counts, slots: torch.Tensor = slots) -> torch.Tensor:
                    out = mamba2_verify_triton(**pr, stash=stash)
                    mamba2_replay_triton(pr["ssm_state"], pr["A_log"], stash, None, slots, slots, counts)
                    return out

                verify_us = graph_time(step)
                row = {"shape": name, "batch": batch, "k": k, "plain_us": plain_us, "verify_commit_us": verify_us,
                       "ratio": verify_us / plain_us, "passes_ratio": 1.5, "passes_ratio_candidates": (4 + k) / 2,
                       "plain_GBps": 2 * state_pass / plain_us / 1e3, "verify_GBps": 3 * state_pass / verify_us / 1e3}
                rows.append(row)
                print(json.dumps(row), flush=True)
    report(rows, args.out, "mamba2_verify_bench.json", args.state_dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
