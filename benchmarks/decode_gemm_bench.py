# ruff: noqa: B023 (every closure over the loop variables is benchmarked before the loop moves on)
"""The decode GEMM with its input's norm or SwiGLU in its prologue (``hyserve.kernels.gemv``, ``HYSERVE_DECODE_GEMM``)
against what the default runs (the norm's or SwiGLU's launch, then cuBLAS), per projection of a layer, and its tile
choices swept.

    python benchmarks/decode_gemm_bench.py --out $OUT                 # the 9B shape, rows 1 / 8 / 16, sweep at 1
    python benchmarks/decode_gemm_bench.py --shapes 2b,9b --budget-s 200 --out $OUT

Why: on an H100 the 9B decode ran 0.68x its default at batch 1 with the switch on (``results/h100/
issue34_2026-12-05``), where it was to save the norm and SwiGLU launches. Per projection (``fp8_gemm_bench``'s
shapes, each with the input a decode step gives it: the residual add + norm before the GDN ``in_proj``, the attention
q/k/v and ``gate_up_proj``; the SwiGLU before ``down_proj``; none before the two output projections) and row count:

* ``default_us``: the producer's launch (``add_rms_norm`` / ``silu_mul``, none for the output projections) and
  ``F.linear``;
* ``gemv_us``: ``decode_linear_triton`` at the shipped tiles (``decode_gemm_config``), and at row count 1 the best of
  a sweep over ``(block_n, block_k, split_k, num_warps, num_stages)`` (``best_us``, ``best_config``).

Each time is a CUDA-graph replay cycling over enough copies of the weight to miss the L2 cache (``fp8_gemm_bench``'s
``bench``). Every Triton output is compared with the default's (max relative difference; the prologue's arithmetic
is the producer's to the order of a sum).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from fp8_gemm_bench import L2_BYTES, SHAPES, bench, copy_bandwidth, layer_shapes  # benchmarks/ is on the path

from hyserve.kernels.gemv import DecodeGemmConfig, NormedInput, SwigluInput, decode_gemm_config, decode_linear_triton
from hyserve.kernels.norm import add_rms_norm, silu_mul

# The input each projection takes at a decode step: "add_norm" (the residual add + the layer's norm), "swiglu" (the
# gate/up product) or "plain".
PROLOGUES = {"gdn_in_proj": "add_norm", "attn_qkv": "add_norm", "mlp_gate_up": "add_norm", "mlp_down": "swiglu",
             "gdn_out_proj": "plain", "attn_o_proj": "plain"}
ROWS = (1, 8, 16)


def sweep(n: int, k: int, sms: int) -> list[DecodeGemmConfig]:
    shipped = decode_gemm_config(n, k, sms)
    out = []
    for bn in (32, 64, 128):
        for bk in (128, 256):
            base = decode_gemm_config(n, k, sms)._replace(block_n=bn, block_k=bk)
            tiles, k_tiles = -(-n // bn), -(-k // bk)
            for per_sm in (1, 2, 4):
                split = max(1, min(k_tiles // 2, -(-per_sm * sms // tiles)))
                for warps, stages in ((4, 3), (4, 4)):
                    cfg = base._replace(split_k=split, num_warps=warps, num_stages=stages)
                    if cfg != shipped and cfg not in out:
                        out.append(cfg)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="9b")
    ap.add_argument("--budget-s", type=float, default=400, help="no more sweeping once this many seconds have passed")
    ap.add_argument("--out", default=None, help="a directory for decode_gemm_bench.json")
    ap.add_argument("--check", action="store_true",
                    help="a reduced 2B shape on the CPU under TRITON_INTERPRET=1, one timing each: checks the script")
    args = ap.parse_args()
    timing, copy_rate, shapes, l2 = bench, copy_bandwidth, SHAPES, L2_BYTES
    if args.check:
        from hyserve.testing.triton_interpreter import patch_triton_interpreter

        assert os.environ.get("TRITON_INTERPRET") == "1", "--check runs the kernels under TRITON_INTERPRET=1"
        patch_triton_interpreter()
        shapes = {"2b": dict(SHAPES["2b"], hidden_size=64, intermediate_size=96, linear_num_key_heads=2,
                             linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16)}
        args.shapes, args.budget_s, l2 = "2b", 0.0, 1

        def timing(fn: Any, copies: int) -> float:
            t = time.perf_counter()
            fn(0)
            return (time.perf_counter() - t) * 1e6

        def copy_rate() -> float:
            return 0.0
    dev = torch.device("cpu" if args.check else "cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
    gen = torch.Generator(device=dev).manual_seed(0)
    start, rows = time.monotonic(), []
    bw = copy_rate()
    for shape in args.shapes.split(","):
        for layer, (n, k, count) in layer_shapes(shapes[shape]).items():
            kind = PROLOGUES[layer]
            copies = max(2, -(-l2 // (2 * n * k)))
            w = [torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
            norm_w = torch.randn(k, device=dev, generator=gen, dtype=torch.bfloat16) * 0.1
            for m in ROWS:
                x, d = (torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(2))
                res = torch.empty_like(x)
                gu = torch.randn(m, 2 * k, device=dev, generator=gen, dtype=torch.bfloat16)
                gate, up = gu[:, :k], gu[:, k:]
                if kind == "add_norm":
                    def deferred() -> Any:
                        return NormedInput(x, norm_w, 1e-6, d, res)

                    def produced() -> Any:
                        return add_rms_norm(x, d, norm_w, 1e-6)[1]
                elif kind == "swiglu":
                    def deferred() -> Any:
                        return SwigluInput(gate, up)

                    def produced() -> Any:
                        return silu_mul(gate, up)
                else:
                    def deferred() -> Any:
                        return x

                    def produced() -> Any:
                        return x
                want = F.linear(produced(), w[0]).float()
                got = decode_linear_triton(deferred(), w[0]).float()
                row: dict[str, Any] = dict(shape=shape, layer=layer, n=n, k=k, layers=count, m=m, prologue=kind,
                                           rel_diff=float((got - want).abs().max() / want.abs().max()))
                row["default_us"] = timing(lambda i: F.linear(produced(), w[i]), copies)
                row["gemv_us"] = timing(lambda i: decode_linear_triton(deferred(), w[i]), copies)
                row["config"] = list(decode_gemm_config(n, k, sms))
                row["weights_tb_s_default"] = 2 * n * k / row["default_us"] / 1e6
                if m == 1 and time.monotonic() - start < args.budget_s:
                    best = (row["gemv_us"], row["config"])
                    for cfg in sweep(n, k, sms):
                        try:
                            t = timing(lambda i, cfg=cfg: decode_linear_triton(deferred(), w[i], cfg), copies)
                        except Exception as e:  # a tile that does not fit shared memory: record and go on
                            row.setdefault("sweep_errors", []).append(f"{list(cfg)}: {type(e).__name__}")
                            continue
                        if t < best[0]:
                            best = (t, list(cfg))
                    row["best_us"], row["best_config"] = best
                rows.append(row)
                print(json.dumps(row), flush=True)
    bad = [f"{r['layer']} M={r['m']}" for r in rows if not r["rel_diff"] <= 2e-2]
    print(f"\ncopy rate {bw / 1e12:.2f} TB/s\n{'shape':>5} {'layer':>13} {'M':>3} {'default':>8} {'gemv':>8} "
          f"{'best':>8}  best config (block_n, block_k, split_k, warps, stages)")
    for r in rows:
        print(f"{r['shape']:>5} {r['layer']:>13} {r['m']:>3} {r['default_us']:>8.2f} {r['gemv_us']:>8.2f} "
              f"{r.get('best_us', float('nan')):>8.2f}  {r.get('best_config', '')}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_gemm_bench.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                       "torch": torch.__version__, "copy_bytes_s": bw, "rows": rows}, f, indent=1)
    if bad:
        print(f"the Triton GEMM's output differs from the default's by more than 2e-2 (relative): {bad}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
