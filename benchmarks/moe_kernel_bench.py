"""The fused MoE kernels (hyserve/kernels/moe) at the MoE shapes of issue 31: time, the expert weights' bandwidth,
and the tile tables stored in the repository.

``bench``: for each shape (``35b-a3b``: 256 experts top-8, hidden 2048, expert width 512; ``next-80b``: 512 top-10;
``nano-30b``: Nemotron 3 Nano's 128 ungated squared-ReLU experts top-6, hidden 2688, width 1856),
dtype (bf16, FP8 channel, FP8 128x128 block) and token count, the time of one layer's routed experts
(``fused_experts``, alignment included), replayed from a CUDA graph that runs the layer over ``COPIES`` routings
that together touch every expert (so the weights come from HBM, not the L2 cache, as in a decode step). Bandwidth:
the bytes of the experts the routing chose (each read once) over the time, beside the copy bandwidth measured in the
same run.

``tune``: for each token count, the fastest tiles of a sweep (the gate/up GEMM first with the default down tiles,
then the down GEMM with the chosen gate/up tiles), written as the table ``fused_experts`` reads
(``hyserve/kernels/moe/configs/E=..,H=..,I=..,dtype=..,device=...json``) under ``--out``. Copy the tables into the
repository after a run. Run on the GPU machine:

    python benchmarks/moe_kernel_bench.py bench --out $OUT/moe_kernels.json
    python benchmarks/moe_kernel_bench.py tune --out $OUT/moe_configs
    python benchmarks/moe_kernel_bench.py tune --shapes nano-30b --dtypes bf16 --out $OUT/moe_configs
    python benchmarks/moe_kernel_bench.py shared --tokens 1 8 32 64 --out $OUT/moe_shared.json

``shared``: one whole MoE block at decode sizes with its shared expert stacked in the experts' kernels, against the
same block with the shared expert apart (``moe_blocks``, ``shared``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hyserve.kernels import moe
from hyserve.kernels.fp8.reference import FP8_DTYPE
from hyserve.kernels.moe import ExpertScales, MoeConfig, MoePlan, fused_experts

SHAPES: dict[str, dict[str, Any]] = {
    "35b-a3b": dict(num_experts=256, top_k=8, hidden=2048, inter=512),
    "next-80b": dict(num_experts=512, top_k=10, hidden=2048, inter=512),
    # Nemotron 3 Nano 30B-A3B: ungated squared-ReLU experts (w13 the up weight alone), its table a file of its own
    "nano-30b": dict(num_experts=128, top_k=6, hidden=2688, inter=1856, activation="relu2"),
}
TOKENS = (1, 8, 32, 64, 256, 1024, 4096)
DTYPES = ("bf16", "fp8_channel", "fp8_block")
BLOCKS = 8  # ``shared``: distinct blocks a replay walks (8 x 0.8 GB of 35B-A3B experts: no L2 reuse)


def activation(shape: dict[str, Any]) -> str:
    return str(shape.get("activation", "silu"))


def make_experts(shape: dict[str, Any], dtype: str) -> tuple[torch.Tensor, torch.Tensor, ExpertScales | None]:
    e, h, i = shape["num_experts"], shape["hidden"], shape["inter"]
    rows = i if activation(shape) == "relu2" else 2 * i  # relu2: the up weight alone
    w13 = torch.randn(e, rows, h, device="cuda", dtype=torch.bfloat16) / h**0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) / i**0.5
    if dtype == "bf16":
        return w13, w2, None
    if dtype == "fp8_channel":
        s13, s2 = w13.float().abs().amax(-1) / 448, w2.float().abs().amax(-1) / 448
        return ((w13 / s13[..., None]).to(FP8_DTYPE), (w2 / s2[..., None]).to(FP8_DTYPE), ExpertScales(s13, s2))
    s13 = torch.full((e, -(-rows // 128), -(-h // 128)), 1 / 448 / h**0.5 * 4, device="cuda")
    s2 = torch.full((e, -(-h // 128), -(-i // 128)), 1 / 448 / i**0.5 * 4, device="cuda")
    return (w13.clamp(-448, 448).to(FP8_DTYPE), w2.clamp(-448, 448).to(FP8_DTYPE), ExpertScales(s13, s2, (128, 128)))


def routings(shape: dict[str, Any], tokens: int, copies: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``copies`` routings; at one token they walk disjoint experts, so that the replay touches all of them."""
    g = torch.Generator().manual_seed(seed)
    e, k = shape["num_experts"], shape["top_k"]
    out = []
    perm = torch.randperm(e, generator=g)
    for c in range(copies):
        if tokens == 1:
            ids = perm.roll(-c * k)[:k].view(1, k)
        else:
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
        w = torch.softmax(torch.randn(tokens, k, generator=g), -1)
        out.append((w.cuda(), ids.cuda()))
    return out


def time_layer(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales | None,
               routes: list[tuple[torch.Tensor, torch.Tensor]], plan: MoePlan | None, act: str = "silu") -> float:
    """Microseconds per call, from a CUDA graph replaying the calls over every routing."""
    import triton

    def all_calls() -> None:
        for w, ids in routes:
            fused_experts(x, w13, w2, w, ids, 0, scales, plan, activation=act)

    all_calls()
    ms = triton.testing.do_bench_cudagraph(all_calls, rep=40)
    return ms * 1e3 / len(routes)


def expert_bytes(shape: dict[str, Any], dtype: str, ids: torch.Tensor) -> int:
    mats = 2 if activation(shape) == "relu2" else 3
    per = mats * shape["inter"] * shape["hidden"] * (2 if dtype == "bf16" else 1)
    return int(ids.unique().numel()) * per


def copy_bandwidth() -> float:
    """Device-to-device copy bytes/s, read + write (a 1 GiB buffer, the median of 10 timed with events), as
    ``peer_bench.copy_bandwidth`` measures it."""
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2 * a.numel() / sorted(times)[5]


def bench(args: argparse.Namespace) -> None:
    bw = copy_bandwidth()
    rows: list[dict[str, Any]] = []
    for name in args.shapes:
        shape = SHAPES[name]
        for dtype in args.dtypes:
            w13, w2, scales = make_experts(shape, dtype)
            for t in args.tokens:
                copies = max(1, min(32, shape["num_experts"] // shape["top_k"])) if t == 1 else (8 if t <= 64 else 2)
                routes = routings(shape, t, copies)
                x = torch.randn(t, shape["hidden"], device="cuda", dtype=torch.bfloat16)
                us = time_layer(x, w13, w2, scales, routes, None, activation(shape))
                nbytes = sum(expert_bytes(shape, dtype, ids) for _, ids in routes) / len(routes)
                row = dict(shape=name, dtype=dtype, tokens=t, us=round(us, 2), expert_bytes=int(nbytes),
                           bandwidth_gb_s=round(nbytes / us / 1e3, 1),
                           share_of_copy=round(nbytes / (us * 1e-6) / bw, 3),
                           plan=[list(c) for c in moe.select_config(t, w13, w2, scales,
                                                                   activation=activation(shape))])
                print(json.dumps(row), flush=True)
                rows.append(row)
            del w13, w2, scales
            torch.cuda.empty_cache()
    meta = dict(card=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
                copy_bandwidth_gb_s=round(bw / 1e9, 1), commit=os.environ.get("GIT_COMMIT", "?"),
                when=time.strftime("%Y-%m-%d %H:%M:%S"))
    import triton

    meta["triton"] = triton.__version__
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


def moe_blocks(shape: dict[str, int], n: int) -> list[Any]:
    """``n`` bf16 ``SparseMoeBlock``s of the shape on the card (a shared expert as wide as an expert: stacked),
    random weights: distinct blocks, so that a replay over them reads every block's weights from HBM, as the layers
    of a decode step do."""
    from hyserve.testing.qwen3_5_moe import build_moe_block

    blocks = [build_moe_block(shape["hidden"], shape["num_experts"], shape["top_k"], shape["inter"], shape["inter"],
                              device="cuda", dtype=torch.bfloat16, prefix=f"layers.{i}.mlp") for i in range(n)]
    with torch.no_grad():
        for b in blocks:
            for p in b.parameters():
                p.normal_(0.0, 0.02)
            b.router_weight.normal_(0.0, 0.05)
    return blocks


def shared(args: argparse.Namespace) -> None:
    """One MoE block (router GEMM, routing, routed and shared experts) at decode sizes, the shared expert stacked in
    the experts' kernels against the same block with it apart (its own GEMMs, gated in the combine): microseconds
    per block, replayed from a CUDA graph over ``BLOCKS`` distinct blocks."""
    import triton

    rows: list[dict[str, Any]] = []
    for name in args.shapes:
        shape = SHAPES[name]
        if activation(shape) != "silu":
            raise SystemExit(f"shared: {name}'s experts are not the gated SparseMoeBlock's")
        blocks = moe_blocks(shape, BLOCKS)
        for t in [t for t in args.tokens if t <= 64]:
            pairs = [(b, torch.randn(t, shape["hidden"], device="cuda", dtype=torch.bfloat16)) for b in blocks]

            def step(pairs: list[tuple[Any, torch.Tensor]] = pairs) -> None:
                for b, x in pairs:
                    b(x)

            row: dict[str, Any] = dict(shape=name, tokens=t)
            stacked = [b.experts.stacked for b in blocks]
            for mode in ("stacked", "apart"):
                for b, st in zip(blocks, stacked, strict=True):
                    b.experts.stacked = st if mode == "stacked" else None
                with torch.no_grad():
                    step()
                    row[f"{mode}_us"] = round(triton.testing.do_bench_cudagraph(step, rep=40) * 1e3 / len(blocks), 2)
            for b, st in zip(blocks, stacked, strict=True):
                b.experts.stacked = st
            print(json.dumps(row), flush=True)
            rows.append(row)
        blocks.clear()
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(card=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


def candidates(tokens: int, block_k_max: int) -> tuple[list[int], list[tuple[int, int, int, int]]]:
    """(block_m choices, (block_n, block_k, warps, stages) choices) swept at ``tokens``."""
    if tokens <= 64:
        bks = [b for b in (128, 256) if b <= block_k_max]
        return [16], [(bn, bk, w, s) for bn, bk, w, s in itertools.product((32, 64, 128), bks, (4,), (3, 4))]
    return [32, 64, 128], [(bn, bk, w, s) for bn, bk, w, s in itertools.product((64, 128), (64, 128), (4, 8), (3,))]


def tune(args: argparse.Namespace) -> None:
    os.makedirs(args.out, exist_ok=True)
    for name in args.shapes:
        shape = SHAPES[name]
        for dtype in args.dtypes:
            w13, w2, scales = make_experts(shape, dtype)
            bk_max = 128 if dtype == "fp8_block" else 256
            table: dict[str, dict[str, list[int]]] = {}
            dt = {"bf16": "bfloat16", "fp8_channel": "fp8_channel", "fp8_block": "fp8_block128x128"}[dtype]
            act = activation(shape)
            path = os.path.join(args.out, moe.config_path(shape["num_experts"], shape["hidden"], shape["inter"], dt,
                                                          torch.cuda.get_device_name(), act).name)
            for t in sorted(args.tokens):
                routes = routings(shape, t, 8 if t <= 64 else 2)
                x = torch.randn(t, shape["hidden"], device="cuda", dtype=torch.bfloat16)
                bms, rest = candidates(t, bk_max)
                best: tuple[float, MoePlan] | None = None
                for bm in bms:
                    base = moe.default_config(t, 128 if dtype == "fp8_block" else None).down._replace(block_m=bm)
                    scored = []
                    for bn, bk, w, s in rest:
                        plan = MoePlan(MoeConfig(bm, bn, bk, w, s), base)
                        try:
                            scored.append((time_layer(x, w13, w2, scales, routes, plan, act), plan))
                        except Exception as exc:  # a tile the card cannot hold (shared memory): skipped
                            print(f"skip {plan}: {type(exc).__name__}", flush=True)
                    gate_up = min(scored)[1].gate_up
                    scored = []
                    for bn, bk, w, s in rest:
                        plan = MoePlan(gate_up, MoeConfig(bm, bn, bk, w, s))
                        try:
                            scored.append((time_layer(x, w13, w2, scales, routes, plan, act), plan))
                        except Exception as exc:
                            print(f"skip {plan}: {type(exc).__name__}", flush=True)
                    cand = min(scored)
                    if best is None or cand[0] < best[0]:
                        best = cand
                assert best is not None
                default_us = time_layer(x, w13, w2, scales, routes, None, act)
                print(json.dumps(dict(shape=name, dtype=dtype, tokens=t, best_us=round(best[0], 2),
                                      default_us=round(default_us, 2), plan=[list(c) for c in best[1]])), flush=True)
                table[str(t)] = {"gate_up": list(best[1].gate_up), "down": list(best[1].down)}
                # written after every token count (ascending): a run cut short leaves a table that covers the
                # counts up to there (select_config takes the defaults past a table's largest count)
                with open(path, "w") as f:
                    json.dump({"tuned_by": "benchmarks/moe_kernel_bench.py tune", "torch": torch.__version__,
                               "configs": table}, f, indent=1)
            del w13, w2, scales
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("bench", "tune", "shared"):
        p = sub.add_parser(cmd)
        p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["35b-a3b"])
        p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
        p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
        p.add_argument("--out", required=True)
    args = ap.parse_args()
    {"bench": bench, "tune": tune, "shared": shared}[args.cmd](args)


if __name__ == "__main__":
    main()
