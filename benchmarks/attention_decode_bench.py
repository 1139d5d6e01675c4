"""The paged decode attention of one layer on one GPU (``paged_attention_triton``, rows of one token) at the Qwen3.5
heads, against the card's copy rate over the same key and value bytes.

    python benchmarks/attention_decode_bench.py --out $OUT       # 2B, 9B, 27B heads; batch 1-64; context 512-8192
    TRITON_INTERPRET=1 python benchmarks/attention_decode_bench.py --check     # the comparison alone, on the CPU

Why: the 9B decode trails vLLM most at batch 64 (0.86x on an H100, 2026-12-05), and its step grows by 3.4 ms from
batch 1 to 64 where vLLM's grows by 2.2. Attention's key and value reads grow with the batch and the context: this
says whether the split-context kernel reads them near the copy rate.

Every row attends to ``--context`` cached positions plus its own token (blocks of ``--block-size`` on shuffled
pages). ``max_seq_len`` is either the rows' own length (an eager step) or ``--model-len`` (a CUDA graph sizes the
launch for the model's length); the split count follows the rows and heads (``decode_splits``, capped by the key
tiles of ``max_seq_len``) and each row divides its own context over it. Each launch is captured in a
CUDA graph of 20 calls and replayed; the median time per call of 10 replays is reported with the rate it reaches
over the key and value bytes it must read, beside a copy of as many bytes (the bound).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from gdn_decode_bench import graph_time  # benchmarks/ is the script's own folder: the same CUDA-graph timing

from hyserve.kernels.attention import paged_attention_triton
from hyserve.kernels.attention.reference import paged_attention_ref

# (query heads, KV heads) of one rank, head dim 256 (benchmarks/shapes.py; 27B: Qwen3.5-27B's config).
HEADS = {"2b": (8, 2), "9b": (16, 4), "27b": (24, 4)}
D = 256


def problem(batch: int, context: int, hq: int, hkv: int, block_size: int, device: str, dtype: torch.dtype,
            max_seq_len: int | None, query_len: int = 1) -> dict[str, Any]:
    """``query_len`` tokens a row (1: decode; k + 1: a verify row) after ``context`` cached positions, its pages
    shuffled over the cache."""
    g = torch.Generator(device=device).manual_seed(batch * 7 + context)
    seq = context + query_len
    per_row = -(-seq // block_size)
    blocks = batch * per_row + 1
    return dict(
        q=torch.randn(batch * query_len, hq, D, device=device, generator=g).to(dtype),
        k_cache=torch.randn(blocks, block_size, hkv, D, device=device, generator=g).to(dtype),
        v_cache=torch.randn(blocks, block_size, hkv, D, device=device, generator=g).to(dtype),
        block_tables=torch.randperm(blocks, device=device, generator=g)[: batch * per_row].view(batch, per_row)
        .to(torch.int32),
        query_start_loc=torch.arange(batch + 1, device=device, dtype=torch.int32) * query_len,
        seq_lens=torch.full((batch,), seq, device=device, dtype=torch.int32),
        scale=D**-0.5, max_query_len=query_len, max_seq_len=max_seq_len or seq,
    )


def check() -> int:
    """The kernel's output against the reference at a small size, both ``max_seq_len`` forms (two splits, all
    live; four, two past the rows' context) and rows of 3 tokens in the second, under the interpreter on the CPU: 0
    when they agree."""
    bad = []
    for query_len, model_len in ((1, None), (1, 2000), (3, 2000)):  # rows of 3: a verify step in a graph
        p = problem(2, 600, 4, 2, 16, "cpu", torch.float32, model_len, query_len)
        got = paged_attention_triton(**p)
        err = float((got - paged_attention_ref(**p)).abs().max())
        print(f"{query_len} tokens a row, max_seq_len {p['max_seq_len']}: max abs difference {err:.3g}")
        if not err <= 1e-5:
            bad.append((query_len, model_len))
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(HEADS), choices=list(HEADS))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--context", nargs="+", type=int, default=[512, 2048, 8192])
    ap.add_argument("--model-len", type=int, default=8192,
                    help="the max_seq_len a decode graph gives every launch (the engine's max_model_len)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--query-len", type=int, default=1,
                    help="tokens a row (3: the verify rows of MTP k = 2); above 1 the prefill kernel is timed too")
    ap.add_argument("--out", default=None, help="a directory for attention_decode_bench.json")
    ap.add_argument("--check", action="store_true", help="the comparison alone, on the CPU (interpreter)")
    args = ap.parse_args()
    if args.check:
        from hyserve.testing.triton_interpreter import patch_triton_interpreter

        patch_triton_interpreter()
        return check()
    rows = []
    for shape in args.shapes:
        hq, hkv = HEADS[shape]
        for context in args.context:
            for batch in args.batch:
                row: dict[str, Any] = {"shape": shape, "batch": batch, "context": context,
                                       "query_len": args.query_len}
                kv_bytes = 2 * batch * (context + args.query_len) * hkv * D * 2
                src = torch.empty(kv_bytes // 2, device="cuda", dtype=torch.bfloat16)
                dst = torch.empty_like(src)
                row["copy_us"] = graph_time(lambda s=src, d=dst: d.copy_(s))  # reads and writes: twice the bytes
                runs: list[tuple[str, int | None, bool]] = [
                    ("eager", None, True), ("graph", max(args.model_len, context + args.query_len), True)]
                if args.query_len > 1:  # the rows through the prefill kernel (one program a row and query head)
                    runs.append(("prefill", None, False))
                for label, model_len, short in runs:
                    p = problem(batch, context, hq, hkv, args.block_size, "cuda", torch.bfloat16, model_len,
                                args.query_len)
                    row[f"{label}_us"] = graph_time(lambda p=p, s=short: paged_attention_triton(**p, short_rows=s))
                    row[f"{label}_TBps"] = kv_bytes / row[f"{label}_us"] / 1e6
                row["copy_TBps"] = 2 * kv_bytes / row["copy_us"] / 1e6
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'shape':>5} {'batch':>5} {'context':>7} {'eager us':>9} {'graph us':>9} {'eager TB/s':>10} "
          f"{'graph TB/s':>10} {'copy TB/s':>9} {'prefill us':>10}")
    for r in rows:
        print(f"{r['shape']:>5} {r['batch']:>5} {r['context']:>7} {r['eager_us']:>9.2f} {r['graph_us']:>9.2f} "
              f"{r['eager_TBps']:>10.2f} {r['graph_TBps']:>10.2f} {r['copy_TBps']:>9.2f} "
              f"{r.get('prefill_us', float('nan')):>10.2f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = "attention_decode_bench.json" if args.query_len == 1 else f"attention_verify_q{args.query_len}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "model_len": args.model_len,
                       "query_len": args.query_len, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
