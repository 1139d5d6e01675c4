"""The Gated DeltaNet mixer's decode step on one GPU: the fused kernel (``hyserve.kernels.gdn.decode``, one launch)
against today's four launches (conv, gates, recurrent delta rule, gated norm), per layer, at the Qwen3.5 shapes.

    python benchmarks/gdn_decode_bench.py --out $OUT                 # 2B, 9B, 27B heads; batch 1, 8, 32, 64
    python benchmarks/gdn_decode_bench.py --shapes 9b --block-v 16 32 64 --state-dtype bfloat16
    python benchmarks/gdn_decode_bench.py --launch 32x4 64x4 64x8 128x8 128x16 --out $OUT   # value block x warps
    python benchmarks/gdn_decode_bench.py --launch 32x4 32x1s 32x2s 32x4s 64x4s --out $OUT  # s: heads split
    python benchmarks/gdn_decode_bench.py --launch 32x2s 32x2se 64x4s 64x4se --out $OUT    # e: state tile first
    python benchmarks/gdn_decode_bench.py --launch 64x4s 64x4s1 64x4se1 --out $OUT         # 1: output in one pass
    python benchmarks/gdn_decode_bench.py --launch 32x2s 64x4s --state-layout k v --out $OUT  # value-major pools
    python benchmarks/gdn_decode_bench.py --launch 128x4 128x4u 128x8u --state-layout v --out $OUT  # u: loads first
    python benchmarks/gdn_decode_bench.py --launch 128x4u 128x4p3 128x4p2 --state-layout v --out $OUT  # p: persistent

Each variant is captured in a CUDA graph of 20 calls (as the decode graph runs them: no host launch cost) and
replayed; the median time per call of 10 replays is reported with the bandwidth it reaches on the SSM state it reads
and writes (``2 * B * Hv * Dk * Dv`` elements of the state dtype), and the fused output is compared with the unfused
one (max abs difference). ``--launch BVxW`` times the fused kernel at value block ``BV`` and ``W`` warps (the shipped
launch: ``launch_config``'s block, 4 warps): one program per (row, value head) walks the head's state in ``BV``-wide
tiles, so the tile and the warps set how much of the state a program has in flight; at batch 32 and 64 the shipped
launch reached about 2.5 TB/s of state traffic on an H100 (2026-12-05), short of the card's copy rate. A launch
``BVxWs`` splits each head over its ``Dv / BV`` value blocks, one program each (``split=True``): ``Dv / BV`` times
the programs, one tile each in flight, the head's norm done by its last program; ``BVxWse`` the same with each
program's state tile loaded before its q / k prologue (``early_state``); a trailing ``1`` (``BVxWs1``,
``BVxWse1``) takes the output from the state before its update (``one_pass``); ``BVxWu`` is the walk with the head's
whole state one tile (``BV`` at least ``Dv``), every load that waits only on the slot issued before the q / k
prologue and the gated norm taken from registers (``upfront``); ``BVxWpN`` is that walk as the persistent launch (a
fixed grid of two programs an SM looping over the (row, head) pairs in a loop Triton pipelines over ``N`` stages, the
windows rolled in a second launch; ``persist``), ``BVxWp1r`` the same at one stage rolling the windows in its loop
(``roll_inside``, no second launch). ``--state-layout v`` stores the pool
value-major (each head's ``(Dk, Dv)`` state as its transpose in memory, the layout fla's ``state_v_first`` prefill
writes) and hands the kernels the same logical view with swapped strides: the kernels take every state stride, so
only the access pattern changes (each launch's ``max_diff`` is against the key-major pool's unfused output).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hyserve.kernels.conv import causal_conv1d_varlen_triton
from hyserve.kernels.gating import gdn_gating_triton
from hyserve.kernels.gdn import gdn_recurrent_triton
from hyserve.kernels.gdn.decode import arrivals_for, as_value_major, gdn_decode_fused_triton, head_counters_for
from hyserve.kernels.norm import gated_rms_norm_triton

# (key heads, value heads) of this rank, Dk = Dv = 128, conv width 4 (benchmarks/shapes.py; 27B: Qwen3.5-27B's config).
HEADS = {"2b": (16, 16), "9b": (16, 32), "27b": (16, 48)}
D = 128
K = 4


def problem(batch: int, hk: int, hv: int, dtype: torch.dtype, state_dtype: torch.dtype,
            layout: str = "k") -> dict[str, Any]:
    """One decode token per row, rows on shuffled slots of a pool with room for 8 more; ``layout`` ``"v"``: the pool
    stored value-major (``as_value_major``)."""
    g = torch.Generator(device="cuda").manual_seed(batch * 131 + hv)
    conv_dim = 2 * hk * D + hv * D
    wide = torch.randn(batch, conv_dim + hv * D + 2 * hv, device="cuda", generator=g).to(dtype)
    c = conv_dim + hv * D
    pool = batch + 8
    p = dict(x=wide[:, :conv_dim], z=wide[:, conv_dim:c], b=wide[:, c : c + hv], a=wide[:, c + hv :],
            conv_weight=(torch.randn(conv_dim, K, device="cuda", generator=g) * 0.5).to(dtype),
            a_log=torch.rand(hv, device="cuda", generator=g).log1p(),
            dt_bias=torch.rand(hv, device="cuda", generator=g) + 0.5,
            norm_weight=torch.ones(D, device="cuda", dtype=dtype), eps=1e-6,
            conv_state=torch.randn(pool, conv_dim, K - 1, device="cuda", generator=g).to(dtype),
            ssm_state=(torch.randn(pool, hv, D, D, device="cuda", generator=g) * 0.3).to(state_dtype),
            state_slots=torch.randperm(pool, device="cuda", generator=g)[:batch],
            query_start_loc=torch.arange(batch + 1, device="cuda", dtype=torch.int32), num_k_heads=hk)
    if layout == "v":
        p["ssm_state"] = as_value_major(p["ssm_state"])
    return p


def unfused(p: dict[str, Any]) -> torch.Tensor:
    x, hk = p["x"], p["num_k_heads"]
    t, hv = x.shape[0], p["ssm_state"].shape[1]
    mixed = causal_conv1d_varlen_triton(x, p["conv_weight"], p["conv_state"], p["state_slots"],
                                        p["query_start_loc"], 1)
    q, k, v = torch.split(mixed, [hk * D, hk * D, hv * D], dim=-1)
    g, beta = gdn_gating_triton(p["a"], p["b"], p["a_log"], p["dt_bias"])
    o = gdn_recurrent_triton(q.reshape(t, hk, D), k.reshape(t, hk, D), v.reshape(t, hv, D), g, beta,
                             p["ssm_state"], p["state_slots"], p["query_start_loc"])
    return gated_rms_norm_triton(o.reshape(-1, D), p["z"].reshape(-1, D), p["norm_weight"], p["eps"]).reshape(t, -1)


def graph_time(fn: Callable[[], torch.Tensor], calls: int = 20) -> float:
    """Median microseconds per call over 10 replays of a graph of ``calls`` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


class Launch(NamedTuple):
    """One fused launch to time: value block, warps, and its form (``gdn_decode_fused_triton``'s arguments)."""

    bv: int
    warps: int
    split: bool = False
    early: bool = False
    one: bool = False
    upfront: bool = False
    persist: int = 0  # the persistent launch's pipeline stages; 0: not persistent
    roll: bool = False  # the persistent launch at one stage rolling the windows in its loop

    def kwargs(self) -> dict[str, Any]:
        return dict(block_v=self.bv, num_warps=self.warps, split=self.split, early_state=self.early,
                    one_pass=self.one, upfront=self.upfront, persist=self.persist > 0, stages=self.persist or 3,
                    roll_inside=self.roll)


def parse_launch(text: str) -> Launch:
    """``"BVxW"`` as ``(BV, W, False, False, False, False)``: a power-of-two value block and warps; ``"BVxWs"`` the
    same launch split, one program per (row, value head, value block): ``(BV, W, True, False, False, False)``;
    ``"BVxWse"`` split with the state tile loaded first: ``(BV, W, True, True, False, False)``; a trailing ``1`` on a
    split launch (``"BVxWs1"``, ``"BVxWse1"``) the output in one pass: ``(..., True, False)``; ``"BVxWu"`` the walk
    with every independent load issued first and the norm from registers (``BV`` the head's whole width):
    ``(BV, W, False, False, False, True)``; ``"BVxWpN"`` that walk as the persistent launch pipelined over ``N``
    stages (``"BVxWp"``: 3): ``(BV, W, False, False, False, False, N)``; ``"BVxWp1r"`` at one stage with the
    windows rolled in its loop: ``(BV, W, False, False, False, False, 1, True)``."""
    roll = text.endswith("r")
    text = text.removesuffix("r")
    body, p, stages = text.rpartition("p")
    persist = 0
    if p and "x" in body and (stages == "" or stages.isdigit()):
        persist, text = int(stages or 3), body
        if persist < 1:
            raise SystemExit(f"--launch {text!r}p{stages}: at least one stage")
    upfront = text.endswith("u")
    text = text.removesuffix("u")
    one = text.endswith(("s1", "se1"))
    text = text.removesuffix("1") if one else text
    early = text.endswith("se")
    split = early or text.endswith("s")
    bv, _, w = text.removesuffix("e" if early else "").removesuffix("s").partition("x")
    try:
        launch = (int(bv), int(w or 4))
    except ValueError:
        raise SystemExit(f"--launch {text!r}: BVxW, BVxWs, BVxWse, BVxWs(e)1 or BVxWu (e.g. 64x8, 32x1s, 64x4se1, "
                         "128x4u)") from None
    if any(v <= 0 or v & (v - 1) for v in launch):
        raise SystemExit(f"--launch {text!r}: BVxW, both powers of two (e.g. 64x8)")
    if (upfront or persist) and (split or early or one):
        raise SystemExit(f"--launch {text!r}: u and p are forms of the walk, not of a split launch")
    if upfront and persist:
        raise SystemExit(f"--launch {text!r}: p is already the UPFRONT walk (BVxWpN, not BVxWupN)")
    if roll and persist != 1:
        raise SystemExit(f"--launch {text!r}r: r rolls the windows in the persistent loop at one stage (BVxWp1r)")
    return Launch(*launch, split, early, one, upfront, persist, roll)


def name(bv: int, warps: int, split: bool = False, early: bool = False, one: bool = False,
         upfront: bool = False, persist: int = 0, roll: bool = False) -> str:
    """A launch's key in the results: ``bv32`` at the shipped 4 warps (the older files' key), else ``bv64w8``;
    ``bv32w1s`` split, ``bv32w1se`` split with the state tile first, ``bv32w1s1`` with the output in one pass,
    ``bv128u`` / ``bv128w8u`` the walk with its loads up front, ``bv128p3`` its persistent launch at 3 stages,
    ``bv128p1r`` at one stage rolling the windows in its loop."""
    return (f"bv{bv}" if warps == 4 and not split else f"bv{bv}w{warps}") + ("s" if split else "") + (
        "e" if early else "") + ("1" if one else "") + ("u" if upfront else "") + (
        f"p{persist}" if persist else "") + ("r" if roll else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(HEADS), choices=list(HEADS))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--block-v", nargs="+", type=int, default=[32], help="the fused kernel's value blocks to time")
    ap.add_argument("--launch", nargs="+", default=[], metavar="BVxW",
                    help="the fused kernel's value block and warps to time, in place of --block-v (e.g. 128x8)")
    ap.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--state-layout", nargs="+", default=["k"], choices=["k", "v"],
                    help="the pool's memory order: k key-major (hyserve's), v value-major (swapped strides)")
    ap.add_argument("--out", default=None, help="a directory for gdn_decode_bench.json")
    args = ap.parse_args()
    launches = [parse_launch(x) for x in args.launch] or [Launch(bv, 4) for bv in args.block_v]
    dtype, state_dtype = torch.bfloat16, getattr(torch, args.state_dtype)
    rows = []
    for shape in args.shapes:
        hk, hv = HEADS[shape]
        for batch, layout in ((b, lay) for b in args.batch for lay in args.state_layout):
            p = problem(batch, hk, hv, dtype, state_dtype, layout)
            arrivals = arrivals_for(p["ssm_state"].shape[0], hk, hv, p["x"].device, split=True)
            heads = head_counters_for(p["ssm_state"].shape[0], hv, p["x"].device)
            state_bytes = 2 * batch * hv * D * D * p["ssm_state"].element_size()
            pools = {"conv_state": p["conv_state"].clone(), "ssm_state": p["ssm_state"].clone()}  # before any run
            ref = unfused(problem(batch, hk, hv, dtype, state_dtype))  # the key-major pool's, whatever the layout
            row: dict[str, Any] = {"shape": shape, "batch": batch, "layout": layout}
            for launch in launches:
                got = gdn_decode_fused_triton(**{**p, **{n: t.clone() for n, t in pools.items()}}, arrivals=arrivals,
                                              head_counts=heads, **launch.kwargs())
                row[f"max_diff_{name(*launch)}"] = float((got.float() - ref.float()).abs().max())
            row["unfused_us"] = graph_time(lambda p=p: unfused(p))
            for launch in launches:
                row[f"fused_{name(*launch)}_us"] = graph_time(
                    lambda p=p, launch=launch, arr=arrivals, hc=heads: gdn_decode_fused_triton(
                        **p, arrivals=arr, head_counts=hc, **launch.kwargs()))
            best = min(row[f"fused_{name(*launch)}_us"] for launch in launches)
            row["state_GBps_unfused"] = state_bytes / row["unfused_us"] / 1e3
            row["state_GBps_fused"] = state_bytes / best / 1e3
            assert not arrivals.any() and not heads.any(), "the counters must be back at zero"
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'shape':>6} {'batch':>5} {'lay':>3} {'unfused us':>10} " + " ".join(f"{name(*launch) + ' us':>12}"
                                                                   for launch in launches) + "  best TB/s")
    for row in rows:
        print(f"{row['shape']:>6} {row['batch']:>5} {row['layout']:>3} {row['unfused_us']:>10.2f} "
              + " ".join(f"{row[f'fused_{name(*launch)}_us']:>12.2f}" for launch in launches)
              + f"  {row['state_GBps_fused'] / 1e3:9.2f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gdn_decode_bench.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "state_dtype": args.state_dtype, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
