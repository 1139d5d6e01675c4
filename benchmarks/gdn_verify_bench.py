"""A Gated DeltaNet layer's verify step on one GPU: the verify kernel over k + 1 tokens a row and the commit that
rebuilds the accepted state (``gdn_replay``, every draft accepted: the longest replay), against a plain decode step's
recurrent kernel over one token a row, at the Qwen3.5 shapes.

    python benchmarks/gdn_verify_bench.py --out $OUT                 # 2B, 9B, 27B heads; batch 1, 8, 32, 64; k 0-3

What it shows: the SSM state traffic of a verify step. A plain decode step reads and writes each row's state once
(2 passes); the verify and its commit read it twice and write it once (3 passes), whatever k (the stash of a
position's inputs is kilobytes). Keeping every candidate state instead, as hyserve did until 2026-12-05, wrote k + 1
states and copied one back: 4 + k passes. The table gives the measured time of each, the bandwidth on those passes,
and the ratio verify / plain beside the passes' ratio 3 / 2.

Each variant is captured in a CUDA graph of 20 calls and replayed; the median time per call of 10 replays.

    python benchmarks/gdn_verify_bench.py --fused --shapes 27b --batch 8 16 32 --k 2 --layout v --out $OUT

``--fused``: the engine's own launches instead, the mixer between its projections (conv, gates, delta rule, gated
norm) in one launch each: the fused verify over k + 1 tokens a row against the fused decode over one
(``gdn_verify_fused_triton`` / ``gdn_decode_fused_triton``, as the engine chooses its decode launch), on the pool
layout of ``--layout`` (``v``: value-major, the engine's default). Each reads a row's state once; the table gives
that read's rate. On the seed's trace (27B heads, about 18 rows of 3 tokens, value-major float32 state) the fused
verify took 117 us a layer in the engine's decode steps where reading the rows' states takes about 23 us at
2.5 TB/s: one program a (row, value head), 864 programs at 18 rows (``results/h100/seed_2026-12-07b``); this bench
gave it 106 us at 16 rows of 3 tokens against 55 us for the decode, which reads and writes the states
(``results/h100/seed_2026-12-07c``). Each row also times the verify's split launch (``split=True``: one program a
(row, value head, value block)) at the value blocks and warps of ``SPLIT_CONFIGS``: ``split_best_us``,
``split_speedup`` (the walk's time over the best split's).
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

from gdn_decode_bench import HEADS, D, K, graph_time  # benchmarks/ is on the path (above)

from hyserve.kernels.gdn import gdn_recurrent_triton
from hyserve.kernels.gdn.decode import arrivals_for, gdn_decode_fused_triton, head_counters_for
from hyserve.kernels.gdn.verify import gdn_replay_triton, gdn_stash_shapes, gdn_verify_fused_triton, gdn_verify_triton


def problem(batch: int, q: int, hk: int, hv: int, state_dtype: torch.dtype) -> dict[str, Any]:
    """Rows of ``q`` tokens on shuffled slots of a pool with room for 8 more; a stash of ``q`` positions."""
    g = torch.Generator(device="cuda").manual_seed(batch * 131 + hv + q)
    t = batch * q
    qkv = torch.randn(t, 2 * hk * D + hv * D, device="cuda", generator=g).to(torch.bfloat16)
    pool = batch + 8
    return dict(q=qkv[:, : hk * D].reshape(t, hk, D), k=qkv[:, hk * D : 2 * hk * D].reshape(t, hk, D),
                v=qkv[:, 2 * hk * D :].reshape(t, hv, D),
                g=-torch.nn.functional.softplus(torch.randn(t, hv, device="cuda", generator=g)) * 0.1,
                beta=torch.rand(t, hv, device="cuda", generator=g).to(torch.bfloat16),
                ssm_state=(torch.randn(pool, hv, D, D, device="cuda", generator=g) * 0.3).to(state_dtype),
                state_slots=torch.randperm(pool, device="cuda", generator=g)[:batch],
                query_start_loc=torch.arange(batch + 1, device="cuda", dtype=torch.int32) * q)


# The split verify launch's (value block, warps) tried at each point of --fused.
SPLIT_CONFIGS = [(32, 2), (32, 4), (16, 2), (64, 4)]


def fused_rows(shapes: list[str], batches: list[int], ks: list[int], state_dtype: torch.dtype, layout: str
               ) -> list[dict[str, Any]]:
    """The fused verify (k + 1 tokens a row) against the fused decode (one), each one launch of the whole mixer; the
    verify's split launch (``split=True``: each value head over its value blocks) at each of ``SPLIT_CONFIGS``."""
    from gdn_decode_bench import problem as decode_problem

    rows = []
    for shape in shapes:
        hk, hv = HEADS[shape]
        for batch in batches:
            plain = decode_problem(batch, hk, hv, torch.bfloat16, state_dtype, layout)
            pool = plain["ssm_state"].shape[0]
            arrivals = arrivals_for(pool, hk, hv, plain["ssm_state"].device, split=True)
            heads = head_counters_for(pool, hv, plain["ssm_state"].device)
            plain_us = graph_time(lambda p=plain, arr=arrivals, hc=heads: gdn_decode_fused_triton(
                **p, arrivals=arr, head_counts=hc))
            state_read = batch * hv * D * D * plain["ssm_state"].element_size()
            for k in ks:
                q = k + 1
                p = decode_problem(batch * q, hk, hv, torch.bfloat16, state_dtype, layout)  # batch * q tokens
                p["ssm_state"] = p["ssm_state"][: batch + 8]
                p["conv_state"] = p["conv_state"][: batch + 8]
                p["state_slots"] = torch.randperm(batch + 8, device="cuda")[:batch]
                p["query_start_loc"] = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * q
                conv_dim = p["x"].shape[1]
                scratch = torch.empty((batch, q, conv_dim, K - 1), device="cuda", dtype=torch.bfloat16)
                stash = {n: torch.empty((batch, q, *s), device="cuda", dtype=torch.float32)
                         for n, s in gdn_stash_shapes(hk, D, hv, D).items()}
                verify_us = graph_time(lambda p=p, sc=scratch, st=stash: gdn_verify_fused_triton(
                    **p, conv_scratch=sc, stash=st))
                row = {"shape": shape, "batch": batch, "k": k, "layout": layout, "decode_us": plain_us,
                       "verify_us": verify_us, "ratio": verify_us / plain_us,
                       "decode_state_read_GBps": state_read / plain_us / 1e3,
                       "verify_state_read_GBps": state_read / verify_us / 1e3}
                # the split launch (one program a (row, value head, value block)) at each value block and warps
                for bv, warps in SPLIT_CONFIGS:
                    split_us = graph_time(lambda p=p, sc=scratch, st=stash, hc=heads, bv=bv, w=warps:
                                          gdn_verify_fused_triton(**p, conv_scratch=sc, stash=st, split=True,
                                                                  head_counts=hc, block_v=bv, num_warps=w))
                    row[f"split_{bv}x{warps}_us"] = split_us
                best = min((row[f"split_{bv}x{w}_us"], f"{bv}x{w}") for bv, w in SPLIT_CONFIGS)
                row["split_best_us"], row["split_best"] = best
                row["split_speedup"] = verify_us / best[0]
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def report(rows: list[dict[str, Any]], out: str | None, filename: str, state_dtype: str) -> None:
    """The rows' table on stdout, and ``{device, state_dtype, rows}`` as ``out/filename`` when ``out`` is given
    (this script's and ``mamba2_verify_bench.py``'s)."""
    print(f"\n{'shape':>6} {'batch':>5} {'k':>2} {'plain us':>9} {'verify+commit us':>16} {'ratio':>6} "
          f"{'(passes 1.5; candidates)':>24}")
    for r in rows:
        print(f"{r['shape']:>6} {r['batch']:>5} {r['k']:>2} {r['plain_us']:>9.2f} {r['verify_commit_us']:>16.2f} "
              f"{r['ratio']:>6.2f} {r['passes_ratio_candidates']:>24.1f}")
    save(rows, out, filename, state_dtype)


def save(rows: list[dict[str, Any]], out: str | None, filename: str, state_dtype: str) -> None:
    """``{device, state_dtype, rows}`` as ``out/filename`` when ``out`` is given."""
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, filename), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "state_dtype": state_dtype, "rows": rows}, f,
                      indent=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(HEADS), choices=list(HEADS))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--k", nargs="+", type=int, default=[0, 1, 2, 3])
    ap.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=None, help="a directory for gdn_verify_bench.json")
    ap.add_argument("--fused", action="store_true", help="the engine's fused verify and decode launches")
    ap.add_argument("--layout", default="v", choices=["k", "v"], help="--fused: the pool's layout (v: value-major)")
    args = ap.parse_args()
    state_dtype = getattr(torch, args.state_dtype)
    if args.fused:
        rows = fused_rows(args.shapes, args.batch, args.k, state_dtype, args.layout)
        print(f"\n{'shape':>6} {'batch':>5} {'k':>2} {'decode us':>10} {'verify us':>10} {'ratio':>6} "
              f"{'decode GB/s':>12} {'verify GB/s':>12} {'split us':>9} {'(BVxW)':>7} {'speedup':>8}")
        for r in rows:
            print(f"{r['shape']:>6} {r['batch']:>5} {r['k']:>2} {r['decode_us']:>10.2f} {r['verify_us']:>10.2f} "
                  f"{r['ratio']:>6.2f} {r['decode_state_read_GBps']:>12.0f} {r['verify_state_read_GBps']:>12.0f} "
                  f"{r['split_best_us']:>9.2f} {r['split_best']:>7} {r['split_speedup']:>8.2f}")
        save(rows, args.out, "gdn_verify_fused_bench.json", args.state_dtype)
        return 0
    rows = []
    for shape in args.shapes:
        hk, hv = HEADS[shape]
        for batch in args.batch:
            plain = problem(batch, 1, hk, hv, state_dtype)
            plain_us = graph_time(lambda p=plain: gdn_recurrent_triton(**p))
            state_pass = batch * hv * D * D * plain["ssm_state"].element_size()
            for k in args.k:
                p = problem(batch, k + 1, hk, hv, state_dtype)
                stash = {n: torch.empty((batch, k + 1, *s), device="cuda", dtype=torch.float32)
                         for n, s in gdn_stash_shapes(hk, D, hv, D).items()}
                counts = torch.full((batch,), k, device="cuda", dtype=torch.long)
                slots = p["state_slots"]

                def step(p: dict[str, Any] = p, stash: dict[str, torch.Tensor] = stash,
                         counts: torch.Tensor = counts, slots: torch.Tensor = slots) -> torch.Tensor:
                    out = gdn_verify_triton(**p, stash=stash)
                    gdn_replay_triton(p["ssm_state"], stash, None, slots, slots, counts)
                    return out

                verify_us = graph_time(step)
                row = {"shape": shape, "batch": batch, "k": k, "plain_us": plain_us, "verify_commit_us": verify_us,
                       "ratio": verify_us / plain_us, "passes_ratio": 1.5, "passes_ratio_candidates": (4 + k) / 2,
                       "plain_GBps": 2 * state_pass / plain_us / 1e3, "verify_GBps": 3 * state_pass / verify_us / 1e3}
                rows.append(row)
                print(json.dumps(row), flush=True)
    report(rows, args.out, "gdn_verify_bench.json", args.state_dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
